"""``redis+cluster://h1:7000,h2:7001,h3:7002``: locks on a Redis Cluster.

Everything but where a call goes comes from :class:`~.backend.RedisBackend`: the scripts, the
fair queue, the hand-over, the tokens, cleanup after cancellation. Every key of one lock name
carries the name as a hash tag, so the lock, its token counter and its queue live in one slot,
and each script runs on the master of that slot (:mod:`._cluster`). Wakes are Pub/Sub
messages, which a cluster delivers to subscribers on every node, so one subscribed connection
per client (to the first node of the URL that answers) serves the waiters of every slot.

A master's failover in the cluster has the same caveat as under Sentinel: a lock the failed
master acknowledged and had not replicated can be granted again by the promoted replica.
Fencing tokens keep that safe; ``wait_replicas`` narrows the window.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import fields
from typing import Any, Final, Self

from .._kit import HostPort, InvalidURL, Options, WaiterRegistry, parse_hosts, redact
from . import _scripts as lua
from ._cluster import ClusterLane, ClusterSettings
from ._records import RedisWaiters
from ._replicas import ReplicaWait, topology_options
from ._urls import DEFAULT_PORT, common_settings, split_url
from .backend import RedisBackend

__all__ = ("RedisClusterBackend",)

_EXAMPLE: Final = "redis+cluster://127.0.0.1:7000,127.0.0.1:7001,127.0.0.1:7002"
_SCHEMES: Final = ("redis+cluster", "rediss+cluster")


class RedisClusterBackend(RedisBackend):
    """:class:`RedisBackend` over the masters of a Redis Cluster, routed by hash slot."""

    def __init__(
        self,
        seeds: tuple[HostPort, ...],
        settings: Any,
        *,
        replica_wait: ReplicaWait | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(seeds[0], settings, **kwargs)
        self.seeds = seeds
        self._lane_type = functools.partial(ClusterLane, seeds, settings)
        self.replica_wait = replica_wait or ReplicaWait()

    @classmethod
    def from_url(cls, url: str, options: Mapping[str, object]) -> Self:
        parts = split_url(url, schemes=_SCHEMES, example=_EXAMPLE)
        if not parts.hosts:
            raise InvalidURL(f"{redact(url)!r} lists no node of the cluster; e.g. {_EXAMPLE}")
        if parts.db != 0:
            raise InvalidURL(
                f"{redact(url)!r} names database {parts.db}: a Redis Cluster has only "
                f"database 0; e.g. {_EXAMPLE}"
            )
        seeds = parse_hosts(parts.hosts, default_port=DEFAULT_PORT, url=url, example=_EXAMPLE)
        source = f"{parts.scheme}://"
        opts = Options(options, source)
        tls = parts.scheme == "rediss+cluster"
        base = common_settings(opts, source=source, url=parts, tls=tls)
        settings = ClusterSettings(
            **{field.name: getattr(base, field.name) for field in fields(base)}, nodes=seeds
        )
        return cls(seeds, settings, **topology_options(opts, source, base.op_timeout))

    def describe(self) -> str:
        scheme = "rediss+cluster" if self.settings.tls else "redis+cluster"
        user = f"{self.settings.username}@" if self.settings.username else ""
        return f"{scheme}://{user}{','.join(str(seed) for seed in self.seeds)}"

    async def open(self) -> None:
        await super().open()
        self.replica_wait.install(self._connected())

    @property
    def cluster(self) -> ClusterLane:
        """The routing lane (tests and tools read the slot map from it)."""
        lane = self._connected()
        assert isinstance(lane, ClusterLane)
        return lane

    def check_ttl(self, ttl: float) -> None:
        lua.check_ttl_ms(ttl, "redis+cluster://")

    def waiter_registry(self) -> WaiterRegistry:
        # Deadlock detection's two keys in one slot: a hash tag of their own.
        return RedisWaiters(self._script, f"{self.settings.prefix}{{deadlock}}:")

    def extra_info(self) -> Mapping[str, Any]:
        lane = self._lane
        masters = lane.masters if isinstance(lane, ClusterLane) else []
        return {
            **super().extra_info(),
            **self.replica_wait.info(),
            "masters": [str(master) for master in masters],
        }
