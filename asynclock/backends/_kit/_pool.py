"""Idle connections kept for reuse, written once for every backend that pools them.

Two rules make a pool safe for locks: a connection that had a request in flight when its caller
was cancelled or timed out is never reused (its protocol state is unknown: a reply may still
come, a transaction may be open), and one that died while it sat idle (the server's idle
timeout, a terminated session, a reset) is replaced, not reported as an outage.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import anyio

__all__ = ("IdlePool",)

C = TypeVar("C")


@dataclass(kw_only=True, eq=False)
class IdlePool(Generic[C]):
    """Connections made by ``connect()``, kept idle (most recently used first) up to ``keep``.

    ``alive(c)`` says whether an idle connection may still be used (it must not do I/O);
    ``abort(c)`` drops one at once without awaiting (closes its socket); ``close(c)`` closes one
    in order, at :meth:`aclose`.
    """

    connect: Callable[[], Awaitable[C]]
    alive: Callable[[C], bool]
    abort: Callable[[C], None]
    close: Callable[[C], Awaitable[None]]
    keep: int = 4
    _idle: list[C] = field(default_factory=list, init=False, repr=False)
    _closed: bool = field(default=False, init=False, repr=False)

    @property
    def idle(self) -> int:
        return len(self._idle)

    async def take(self) -> C:
        """An idle connection that is still alive, or a new one."""
        while self._idle:
            connection = self._idle.pop()
            if self.alive(connection):
                return connection
            self.abort(connection)
        return await self.connect()

    def give_back(self, connection: C, *, reusable: bool) -> None:
        """Return ``connection``; unless ``reusable`` (its last request completed) it is dropped."""
        if reusable and not self._closed and len(self._idle) < self.keep and self.alive(connection):
            self._idle.append(connection)
        else:
            self.abort(connection)

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[C]:
        """A connection for the block; reused only if the block completed (no error, no
        cancellation)."""
        connection = await self.take()
        reusable = False
        try:
            yield connection
            reusable = True
        finally:
            self.give_back(connection, reusable=reusable)

    async def aclose(self) -> None:
        """Close every idle connection, all at once (a hung server costs one close, not one per
        connection). Idempotent."""
        self._closed = True
        idle, self._idle = self._idle, []
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as group:
                for connection in idle:
                    group.start_soon(self._close_one, connection)

    async def _close_one(self, connection: C) -> None:
        try:
            await self.close(connection)
        except Exception:
            self.abort(connection)
