"""Requests that take a place in a server's queue, sent in the order their callers asked.

Acquires of one client that ask in the same moment (a burst, or an event loop catching up after
a stall) send their queueing requests together; whatever lets one of them out first (a pooled
connection that frees up, a server that serves concurrent requests of one connection in any
order: etcd) then decides their places, not the order of the calls. :class:`CallOrder` lets one
queueing request of a name out at a time, in the order they asked, each once the one before it
was answered. Its cost is a round trip per waiter of a burst, none for a waiter alone.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Hashable
from contextlib import asynccontextmanager

import anyio

__all__ = ("CallOrder",)


class CallOrder:
    """One FIFO turn per key (a lock's name), made when first asked for and forgotten when
    nobody holds or waits for it."""

    __slots__ = ("_turns",)

    def __init__(self) -> None:
        self._turns: dict[Hashable, anyio.Lock] = {}

    @asynccontextmanager
    async def turn(self, key: Hashable) -> AsyncIterator[None]:
        """Hold the turn of ``key`` for the block. It must be the first await of the caller's
        acquire: a free turn is taken without a yield, and a taken one queued for in the order
        asked."""
        lock = self._turns.get(key)
        if lock is None:
            lock = self._turns[key] = anyio.Lock(fast_acquire=True)
        try:
            async with lock:
                yield
        finally:
            if not lock.locked() and not lock.statistics().tasks_waiting:
                self._turns.pop(key, None)
