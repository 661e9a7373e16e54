"""A client's connection state, made from its own traffic: every backend gets it for free.

The core reports each call that reached the server or failed for a reason that proves nothing
(unreachable, timed out), and each lease that reached its local deadline. From those:

- CONNECTED -> SUSPENDED: a call failed; held leases are still inside their deadlines.
- SUSPENDED -> LOST: a held lease reached its deadline while calls kept failing.
- SUSPENDED or LOST -> RECONNECTED: a call reached the server again.

A client that makes no calls (it holds nothing and acquires nothing) learns of an outage with
its next call: a client holding a lease renews it every ttl/3, so it learns within that.
"""

from __future__ import annotations

import collections
import weakref
from typing import Self

import anyio

from ._events import ConnectionState, Events, StateChange


class StateTracker:
    """Holds one client's :class:`ConnectionState` and tells every listener of its changes."""

    __slots__ = ("_events", "_listeners", "state")

    def __init__(self, events: Events) -> None:
        self._events = events
        self.state = ConnectionState.CONNECTED
        self._listeners: weakref.WeakSet[StateChanges] = weakref.WeakSet()

    def reached(self, ok: bool, error: BaseException | None = None) -> None:
        if ok:
            if self.state in (ConnectionState.SUSPENDED, ConnectionState.LOST):
                self._change(ConnectionState.RECONNECTED, "a call reached the server again")
        elif self.state in (ConnectionState.CONNECTED, ConnectionState.RECONNECTED):
            self._change(ConnectionState.SUSPENDED, f"a call to the server failed: {error!r}")

    def deadline_passed(self, name: str) -> None:
        if self.state is ConnectionState.SUSPENDED:
            self._change(
                ConnectionState.LOST,
                f"the lease on {name!r} reached its deadline while the server was unreachable",
            )

    def closed(self) -> None:
        if self.state is not ConnectionState.CLOSED:
            self._change(ConnectionState.CLOSED, "the client was closed")

    def changes(self) -> StateChanges:
        listener = StateChanges(self.state is ConnectionState.CLOSED)
        self._listeners.add(listener)
        return listener

    def _change(self, state: ConnectionState, reason: str) -> None:
        try:
            now = anyio.current_time()
        except Exception:  # closed outside any event loop
            now = 0.0
        change = StateChange(self.state, state, reason, now)
        self.state = state
        for listener in tuple(self._listeners):
            listener._push(change)
        if self._events.active:
            self._events.emit("state_changed", change)


class StateChanges:
    """``async for change in locks.state_changes():`` each :class:`StateChange` from now on,
    until the client closes. Changes are kept until read: a slow reader misses none."""

    __slots__ = ("__weakref__", "_closed", "_pending", "_wakeup")

    def __init__(self, closed: bool) -> None:
        self._pending: collections.deque[StateChange] = collections.deque()
        self._wakeup: anyio.Event | None = None
        self._closed = closed

    def _push(self, change: StateChange) -> None:
        self._pending.append(change)
        if change.state is ConnectionState.CLOSED:
            self._closed = True
        if self._wakeup is not None:
            self._wakeup.set()

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> StateChange:
        while not self._pending:
            if self._closed:
                raise StopAsyncIteration
            self._wakeup = anyio.Event()
            await self._wakeup.wait()
        return self._pending.popleft()
