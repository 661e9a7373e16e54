"""Deadlock detection's wait-for records on the ``redis://`` server (see ``asynclock._deadlock``)."""

from __future__ import annotations

from .._kit import WaiterRegistry
from ._scripts import (
    PUBLISH_WAITER,
    SCAN_WAITERS,
    WAITERS_KEY,
    WAITERS_TTL_KEY,
    WITHDRAW_WAITER,
    Run,
    as_text,
    ttl_ms,
)


class RedisWaiters(WaiterRegistry):
    """Deadlock detection's records on the same server as the locks (see ``asynclock._deadlock``)."""

    def __init__(self, script: Run, prefix: str) -> None:
        self._run = script
        self._keys = [f"{prefix}{WAITERS_KEY}", f"{prefix}{WAITERS_TTL_KEY}"]

    async def publish(self, key: str, value: str, ttl: float) -> None:
        ms = max(1, ttl_ms(ttl))
        await self._run(PUBLISH_WAITER, self._keys, [key, value, ms], "publishing a wait record")

    async def withdraw(self, key: str) -> None:
        await self._run(WITHDRAW_WAITER, self._keys, [key], "withdrawing a wait record")

    async def scan(self) -> list[str]:
        values = await self._run(SCAN_WAITERS, self._keys, [], "reading the wait records")
        return [as_text(value) for value in values]
