"""``redis+sentinel://s1:26379,s2:26379,s3:26379/<service>/<db>``: locks on the master that
Redis Sentinel names, followed across failovers.

Everything but where the master is comes from :class:`~.backend.RedisBackend` (the scripts, the
fair queue, the tokens, cleanup after cancellation). Its connections ask the sentinels where the
master is (:mod:`._sentinel`), check ``ROLE`` on it, and ask again when it fails or is demoted.
Its restart watcher then finds a server with a new run id, and the leases whose keys the new
master does not have (a lock acknowledged by the old master and not replicated before it failed)
are reported lost at once. Until that report, the old holder may still believe it holds the
lock while another client takes it on the new master: fencing tokens keep that safe (a token is
never below the server's clock in microseconds, so the new master's tokens are above the old
one's), and ``wait_replicas`` narrows the window (see ``docs/backends/redis-sentinel-cluster.md``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any, Final, Self

from .._kit import HostPort, InvalidURL, Options, parse_hosts
from ._replicas import ReplicaWait, topology_options
from ._sentinel import MasterLocator, SentinelSettings
from ._urls import common_settings, split_url
from .backend import RedisBackend

__all__ = ("RedisSentinelBackend",)

_EXAMPLE: Final = "redis+sentinel://127.0.0.1:26379,127.0.0.1:26380,127.0.0.1:26381/mymaster/0"
_SCHEMES: Final = ("redis+sentinel",)
#: Sentinel's own port, when a URL names none.
SENTINEL_PORT: Final = 26379
_OWN_OPTIONS: Final = ("sentinel_username", "sentinel_password")


class RedisSentinelBackend(RedisBackend):
    """:class:`RedisBackend` on the master of a Sentinel-monitored service."""

    def __init__(
        self,
        sentinels: tuple[HostPort, ...],
        settings: SentinelSettings,
        locator: MasterLocator,
        *,
        replica_wait: ReplicaWait | None = None,
        **kwargs: Any,
    ) -> None:
        # The address is only a placeholder: every connection asks the locator.
        super().__init__(sentinels[0], settings, **kwargs)
        self.sentinels = sentinels
        self.locator = locator
        self.replica_wait = replica_wait or ReplicaWait()

    @classmethod
    def from_url(cls, url: str, options: Mapping[str, object]) -> Self:
        parts = split_url(url, schemes=_SCHEMES, example=_EXAMPLE, service=True)
        if not parts.hosts:
            raise InvalidURL(f"{url.partition('?')[0]!r} lists no sentinel; e.g. {_EXAMPLE}")
        sentinels = parse_hosts(parts.hosts, default_port=SENTINEL_PORT, url=url, example=_EXAMPLE)
        source = "redis+sentinel://"
        opts = Options(options, source)
        base = common_settings(opts, source=source, url=parts, tls=False)
        assert parts.service is not None
        locator = MasterLocator(
            sentinels,
            parts.service,
            op_timeout=base.op_timeout,
            username=opts.optional_text("sentinel_username"),
            password=opts.optional_text("sentinel_password"),
        )
        settings = SentinelSettings(
            **{field.name: getattr(base, field.name) for field in fields(base)}, locator=locator
        )
        kwargs = topology_options(opts, source, base.op_timeout, _OWN_OPTIONS)
        return cls(sentinels, settings, locator, **kwargs)

    def describe(self) -> str:
        user = f"{self.settings.username}@" if self.settings.username else ""
        hosts = ",".join(str(sentinel) for sentinel in self.sentinels)
        return f"redis+sentinel://{user}{hosts}/{self.locator.service}/{self.settings.db}"

    async def open(self) -> None:
        await super().open()
        self.replica_wait.install(self._connected())
        self._host.start_soon(
            self.locator.watch, name=f"asynclock: failovers told by {self.describe()}"
        )

    def extra_info(self) -> Mapping[str, Any]:
        master = self.locator.current
        return {
            **super().extra_info(),
            **self.replica_wait.info(),
            "service": self.locator.service,
            "master": str(master) if master is not None else None,
        }
