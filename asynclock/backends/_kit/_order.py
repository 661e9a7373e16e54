"""Requests that take a place in a server's queue, sent in the order their callers asked.

Acquires of one client that ask in the same moment (a burst, or an event loop catching up after
a stall) send their queueing requests together; whatever lets one of them out first (a pooled
connection that frees up, a server that serves concurrent requests of one connection in any
order: etcd) then decides their places, not the order of the calls. :class:`CallOrder` lets one
queueing request of a name out at a time, in the order they asked, each once the one before it
was answered (or, where the answer is the grant itself, sent: :meth:`CallOrder.take`). Its cost
is a round trip per waiter of a burst, none for a waiter alone.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Hashable
from contextlib import asynccontextmanager

__all__ = ("CallOrder", "Turn")


class CallOrder:
    """One FIFO turn per key (a lock's name), made when first asked for and forgotten when
    nobody holds or waits for it. A free turn costs a dict entry: no lock, no future (it is
    taken on every acquire)."""

    __slots__ = ("_turns",)

    def __init__(self) -> None:
        #: The callers waiting for each key's turn, while somebody holds it.
        self._turns: dict[Hashable, deque[asyncio.Future[None]]] = {}

    async def take(self, key: Hashable) -> Turn:
        """The turn of ``key``, once the callers that asked before have given theirs up. It
        must be the first await of the caller's acquire: a free turn is taken without a yield,
        and a taken one queued for in the order asked. Give it up (``Turn.give``) at the latest
        in a ``finally``."""
        waiting = self._turns.get(key)
        if waiting is None:
            self._turns[key] = deque()
            return Turn(self, key)
        ticket: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiting.append(ticket)
        try:
            await ticket
        except BaseException:
            # Cancelled (natively or by anyio, once or again) while waiting: the ticket is
            # cancelled and skipped when its turn comes. Cancelled just after the turn was
            # handed over: it is ours, and goes on to the next caller.
            if ticket.done() and not ticket.cancelled():
                self._pass(key)
            else:
                ticket.cancel()
            raise
        return Turn(self, key)

    @asynccontextmanager
    async def turn(self, key: Hashable) -> AsyncIterator[None]:
        """Hold the turn of ``key`` for the block (see :meth:`take`)."""
        turn = await self.take(key)
        try:
            yield
        finally:
            turn.give()

    def _pass(self, key: Hashable) -> None:
        """Hand the turn of ``key`` to the first caller still waiting, or forget it."""
        waiting = self._turns[key]
        while waiting:
            ticket = waiting.popleft()
            if not ticket.done():
                ticket.set_result(None)
                return
        del self._turns[key]


class Turn:
    """One caller's turn of a key; :meth:`give` lets the next caller out."""

    __slots__ = ("_key", "_order")

    def __init__(self, order: CallOrder, key: Hashable) -> None:
        self._order: CallOrder | None = order
        self._key = key

    @property
    def given(self) -> bool:
        return self._order is None

    @property
    def wanted(self) -> bool:
        """Whether another caller waits for this turn (a burst)."""
        return self._order is not None and bool(self._order._turns.get(self._key))

    def give(self) -> None:
        """Give the turn up (no await: from a callback as a request is sent). Idempotent."""
        order, self._order = self._order, None
        if order is not None:
            order._pass(self._key)
