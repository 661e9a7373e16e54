"""What the ``redis://`` backend learns about its server: version, durability, restarts."""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Awaitable, Callable, Mapping
from typing import Final

import anyio
import redis.asyncio
import redis.exceptions

from .._kit import RetryPolicy, UnsupportedFeature
from ._lane import Lane
from ._resp import pack
from ._scripts import as_text

logger = logging.getLogger("asynclock")

#: Oldest server with what the scripts need (TIME in scripts, fractional BLPOP timeouts).
MIN_VERSION: Final = (6, 0)
#: Pauses of the restart watcher between two connections.
_RECONNECT: Final = RetryPolicy(first=0.05, cap=0.5, factor=2.0, jitter=0.2)


class RedisDurabilityWarning(UserWarning):
    """The Redis server may lose held locks (eviction, or no AOF).

    A restart without the append-only file forgets every held lock (their holders are told at
    once, but another client may take the lock first), and an eviction policy other than
    ``noeviction`` (with ``maxmemory`` set) may drop locks that are still held. Tokens stay safe
    either way: no token is below the server's clock in microseconds. Silence it with the option
    ``durability_warning=false`` once you have decided that this is acceptable.
    """


def _run_id(info: str) -> str | None:
    for line in info.splitlines():
        if line.startswith("run_id:"):
            return line.partition(":")[2].strip()
    return None


async def check_server(
    lane: Lane, describe: str, *, durability_warning: bool
) -> tuple[str | None, dict[str, str]]:
    """Check the version, and warn when the server can lose counters or held locks.

    Returns the server's run id (None if INFO may not be read) and what ``extra_info`` shows.
    """
    server_info: dict[str, str] = {}
    try:
        info = as_text(await lane.call("INFO", "server"))
    except redis.exceptions.ResponseError:
        info = ""  # INFO disabled by ACL or rename-command: nothing to check
    for line in info.splitlines():
        key, _, value = line.partition(":")
        if key == "redis_version":
            server_info["redis_version"] = value.strip()
            numbers = tuple(int(part) for part in value.split(".")[:2] if part.isdigit())
            if numbers < MIN_VERSION:
                raise UnsupportedFeature(
                    f"{describe} runs Redis {value.strip()}; asynclock needs Redis "
                    f"{'.'.join(map(str, MIN_VERSION))} or newer"
                )
    settings: dict[str, str] = {}
    try:
        for key in ("appendonly", "appendfsync", "maxmemory", "maxmemory-policy"):
            reply = await lane.call("CONFIG", "GET", key)
            # A map (RESP3, or redis-py's parser) or a flat list of names and values.
            items = (
                list(reply.items())
                if isinstance(reply, dict)
                else list(zip(reply[::2], reply[1::2], strict=True))
            )
            settings.update(
                (as_text(name).lower(), as_text(value).lower()) for name, value in items
            )
    except redis.exceptions.ResponseError as exc:
        # CONFIG is often disabled on managed services: not knowing is not an error.
        logger.info(
            "asynclock: cannot read the persistence settings of %s (%s); the durability "
            "check is skipped",
            describe,
            exc,
        )
        return _run_id(info), server_info
    server_info.update(settings)
    problems = durability_problems(settings) if durability_warning else []
    if problems:
        warnings.warn(
            RedisDurabilityWarning(
                f"{describe} can lose what the locks rely on: "
                + "; ".join(problems)
                + ". Pass durability_warning=false if that is acceptable (for example "
                "for efficiency locks)"
            ),
            stacklevel=3,
        )
    return _run_id(info), server_info


def durability_problems(settings: Mapping[str, str]) -> list[str]:
    """What in ``CONFIG GET appendonly appendfsync maxmemory maxmemory-policy`` (lowercased)
    can lose fencing counters or held locks; empty when nothing can."""
    problems = []
    if settings.get("appendonly") == "no":
        problems.append(
            "appendonly is 'no', so a restart loses every held lock (another client can take a "
            "lock while its holder, told at once, is still stopping); set 'appendonly yes'"
        )
    elif settings.get("appendfsync") == "no":
        problems.append(
            "appendfsync is 'no', so a crash of the machine can lose the last ~30 s of writes, "
            "locks taken then among them; set 'appendfsync everysec' or 'always'"
        )
    policy = settings.get("maxmemory-policy", "noeviction")
    if settings.get("maxmemory", "0") not in ("0", "") and policy != "noeviction":
        what = "held locks and fencing counters" if policy.startswith("allkeys") else "held locks"
        problems.append(
            f"maxmemory-policy is {policy!r}, so under memory pressure Redis may evict {what}; "
            "set 'maxmemory-policy noeviction'"
        )
    return problems


class RestartWatcher:
    """Holds one idle connection and learns at once when it ends: the server went away
    (restart, kill) or dropped it. After a restart (a new run id, or no run id to compare)
    ``on_restart()`` runs, so that leases whose keys are gone are reported lost now, not at
    their next renewal. Runs in the backend's task host until it closes."""

    def __init__(
        self,
        pool: redis.asyncio.ConnectionPool,
        op_timeout: float,
        describe: str,
        run_id: str | None,
        on_restart: Callable[[], Awaitable[None]],
    ) -> None:
        self._pool = pool
        self._op_timeout = op_timeout
        self._describe = describe
        self.run_id = run_id
        self._on_restart = on_restart

    async def run(self) -> None:
        first = True
        backoff = _RECONNECT.backoff()
        while True:
            conn = self._pool.make_connection()  # type: ignore[no-untyped-call]
            try:
                with anyio.fail_after(self._op_timeout):
                    await conn.connect()
                    await conn.send_packed_command(pack(("INFO", "server")), False)
                    try:
                        info = as_text(await conn.read_response(timeout=math.inf))
                    except redis.exceptions.ResponseError:
                        info = ""  # INFO refused (ACL): every reconnect is then checked
                run_id = _run_id(info)
                restarted = not first and (run_id is None or run_id != self.run_id)
                if run_id is not None and run_id != self.run_id:
                    restarted = restarted or self.run_id is not None
                    self.run_id = run_id
                first = False
                backoff.reset()
                if restarted:
                    await self._on_restart()
                # Nothing is ever sent on this connection again: this read ends only when the
                # connection does.
                await conn.read_response(timeout=math.inf, disconnect_on_error=False)
            except Exception as exc:
                logger.debug("asynclock: restart watcher of %s: %r", self._describe, exc)
            finally:
                if conn._writer is not None:
                    conn._writer.close()
                conn._reader = conn._writer = None
            await anyio.sleep(backoff.next_delay())
