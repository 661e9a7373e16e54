"""The queue table (``asynclock_waiters``): the places of waiters beyond those a client keeps
in the server's lock queue (``_queue.py``). They hold no connection.

A place's ticket comes from the token sequence, which only increases; the head of a key (its
smallest live ticket) goes on into the server's queue. The head leaves the table once the server
granted it the lock, and tells every client with a NOTIFY on the schema's channel; each client's
listener (one connection per client) wakes its first waiter of that key, which checks whether it
is the head now. A missed NOTIFY, or a head whose client stopped, is caught by that first
waiter's poll (``POLL``). A place lasts ``lease`` (the ttl, between 1 and 5 s) after its client
last refreshed it (one statement per client every third of that): a dead or paused client's
waiters drop out of the order by themselves, and a waiter whose place expired while its process
was paused queues again at the end.
"""

from __future__ import annotations

import bisect
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio

from .._kit import LockRequest, permits_mismatch, translate
from ._kinds import split
from ._lanes import Lanes
from ._lease import QUERY, Lane, Op, PostgresGrant
from ._sql import ENQUEUE, ENQUEUE_SEMAPHORE, ENTERED, HEAD, LEAVE, REFRESH, REQUEUE, SWEEP_PLACES
from ._wire import Wire

logger = logging.getLogger("asynclock")

#: How often a client's first waiter of a key checks whether it is the head without a NOTIFY.
POLL = 0.25
#: A place's lease: the waiter's ttl, within these bounds (seconds).
LEASE_MIN, LEASE_MAX = 1.0, 5.0
#: How often places long expired are deleted (by any client that has waiters).
SWEEP_EVERY = 30.0


@dataclass(eq=False)
class _Entry:
    key: int
    waiter: str
    ttl_ms: int
    lease_ms: int
    ticket: int = 0
    wake: anyio.Event = field(default_factory=anyio.Event)


class Queue:
    """The places of one client's waiters in the queue table, its listener and its refresher."""

    def __init__(self, wire: Wire, lanes: Lanes) -> None:
        self._wire = wire
        self._sessions = wire.sessions
        self._lanes = lanes
        self._sql = {
            name: sql.format(queue=wire.queue)
            for name, sql in (
                ("enqueue", ENQUEUE),
                ("head", HEAD),
                ("requeue", REQUEUE),
                ("leave", LEAVE),
                ("refresh", REFRESH),
                ("sweep", SWEEP_PLACES),
                ("enqueue_semaphore", ENQUEUE_SEMAPHORE),
                ("entered", ENTERED),
            )
        }
        self.client = uuid.uuid4().hex
        #: This client's waiters in the table, by key, in ticket order.
        self.entries: dict[int, list[_Entry]] = {}
        self.listener: Any = None
        #: Who waits for a change of a key (``wait_for_change``); a NOTIFY of it sets theirs.
        self.observers: dict[int, set[anyio.Event]] = {}
        self._listening = False
        #: Never listen (transaction pooling: a LISTEN stays on a server session that serves
        #: other clients, and hears nothing once ours left it); wait_for_change polls.
        self.polls = False
        self._refreshing = False

    @property
    def lane_statements(self) -> tuple[str, ...]:
        """What runs on a lane for an exclusive lock's waiters: their places, the refresher's
        and the sweeper's statements."""
        names = ("enqueue", "head", "leave", "entered", "requeue", "refresh", "sweep")
        return tuple(self._sql[name] for name in names)

    @property
    def waiting(self) -> int:
        return sum(len(entries) for entries in self.entries.values())

    async def wait(
        self,
        request: LockRequest,
        key: int,
        ttl_ms: int,
        enter_server_queue: Callable[[], Awaitable[PostgresGrant | None]],
        *,
        permits: tuple[int, int] | None = None,
        placed: Callable[[], object] | None = None,
    ) -> PostgresGrant:
        """Take a place, wait until it is the head, then wait in the server's queue.

        ``permits``: a semaphore's waiter (its permits class and number, ``_semaphores.py``):
        its place records the number, refused when the holders' or waiters' differs; its head
        tries to take a permit, and waits for a release (a NOTIFY, or the poll) when none is
        free. ``placed`` is called once the place is made."""
        lease_ms = int(min(max(ttl_ms / 1000.0, LEASE_MIN), LEASE_MAX) * 1000)
        waiter = uuid.uuid4().hex + ("" if permits is None else f" permits={permits[1]}")
        entry = _Entry(key, waiter, ttl_ms, lease_ms)
        self._start_helpers()
        what = f"waiting for {request.name!r} in the queue table"
        granted: PostgresGrant | None = None
        try:
            await self._enqueue(entry, what, request.name, permits)
            if placed is not None:
                placed()
            while True:
                wake = entry.wake = anyio.Event()  # before the check: a NOTIFY during it counts
                entries = self.entries[key]
                first = entries[0] is entry
                if first:
                    row = await self._query(ttl_ms, what, "head", key, entry.waiter)
                    if row is None or not row[1]:
                        # Gone or expired (this process was paused): to the end of the queue.
                        entries.remove(entry)
                        if row is None:
                            await self._enqueue(entry, what, request.name, permits)
                        else:
                            row = await self._query(
                                ttl_ms, what, "requeue", key, entry.waiter, self._wire.sequence
                            )
                            self._place(entry, row[0])
                        continue
                    if row[0]:
                        granted = await enter_server_queue()
                        if granted is not None:
                            return granted
                        if permits is None:
                            continue  # its connection died (a pause?): is it still the head?
                with anyio.move_on_after(POLL if first else None):
                    await wake.wait()
        finally:
            leaving = self._leave(entry, ttl_ms)
            if granted is not None:
                granted.leaving = leaving

    async def _enqueue(
        self, entry: _Entry, what: str, name: str, permits: tuple[int, int] | None
    ) -> None:
        args = (entry.key, self._wire.sequence, entry.waiter, self.client, entry.lease_ms)
        if permits is None:
            row = await self._query(entry.ttl_ms, what, "enqueue", *args)
        else:
            row = await self._query(entry.ttl_ms, what, "enqueue_semaphore", *args, *permits)
            if row[0] is None:
                raise permits_mismatch(name, int(row[1]), permits[1])
        self._place(entry, row[0])

    def _place(self, entry: _Entry, ticket: int) -> None:
        entry.ticket = ticket
        bisect.insort(self.entries.setdefault(entry.key, []), entry, key=lambda e: e.ticket)

    def _leave(self, entry: _Entry, ttl_ms: int) -> Op | None:
        """Give the place up (granted, or the wait ended otherwise) without an await: the
        statement runs on the lane; the next waiter of the key checks its turn."""
        entries = self.entries.get(entry.key, [])
        if entry in entries:
            entries.remove(entry)
        if not entries:
            self.entries.pop(entry.key, None)
        else:
            entries[0].wake.set()
        if not self._wire.host.running:
            return None  # closing: the place expires on its own
        lane = self._lanes.lane(ttl_ms)
        return lane.detach(
            lane.submit(QUERY, 0, self._sql["leave"], entry.key, entry.waiter, self._wire.channel)
        )

    async def entered(self, ttl_ms: int, pid: int, key: int) -> bool:
        """Whether server process ``pid`` is in the server's queue of ``key`` (or holds it)."""
        row = await self._query(ttl_ms, "checking a wait", "entered", pid, *split(key))
        return bool(row[0])

    async def _query(self, ttl_ms: int, what: str, name: str, *args: object) -> Any:
        """One statement on the lane of ``ttl_ms``, never interrupted (``_lease.Lane``); a lane
        that died is replaced once."""
        for attempt in range(2):
            lane: Lane = self._lanes.lane(ttl_ms)
            op = lane.submit(QUERY, 0, self._sql[name], *args)
            try:
                with translate(self._wire.errors, what):
                    return await op.future
            except Exception:
                if attempt or lane.dead is None or lane.connection is None:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    # -- the listener and the refresher --------------------------------------------------------

    def notified(self, connection: Any, pid: int, channel: str, payload: str) -> None:
        """A NOTIFY: the head of a key may have changed; its first waiter here checks."""
        try:
            key = int(payload)
        except ValueError:
            return
        entries = self.entries.get(key)
        if entries:
            entries[0].wake.set()
        for event in self.observers.get(key, ()):
            event.set()

    def wake_observers(self) -> None:
        """The client closes: every ``wait_for_change`` returns now."""
        for events in self.observers.values():
            for event in events:
                event.set()

    async def listen(self) -> bool:
        """Make sure the listener listens (for ``wait_for_change``), and say whether it does."""
        if self.polls:
            return False
        if self.listener is None:
            if not self._listening:
                self._listening = True
                self._wire.host.start_soon(self._listen, name="asynclock: postgres listener")
            with anyio.move_on_after(self._wire.errors.connect_timeout + 1.0):
                while self._listening:  # noqa: ASYNC110
                    await anyio.sleep(0.005)
        return self.listener is not None

    def closed(self, connection: Any) -> bool:
        if connection is not self.listener:
            return False
        self.listener = None  # the next waiter listens again; polls meanwhile
        return True

    def _start_helpers(self) -> None:
        if self.listener is None and not self._listening:
            self._listening = True
            self._wire.host.start_soon(self._listen, name="asynclock: postgres listener")
        if not self._refreshing:
            self._refreshing = True
            self._wire.host.start_soon(self._refresh, name="asynclock: postgres queue refresh")

    async def _listen(self) -> None:
        try:
            connection, _ = await self._sessions.take()
            try:
                with anyio.fail_after(self._wire.errors.connect_timeout):
                    await connection.add_listener(self._wire.channel, self.notified)
            except BaseException:
                self._sessions.discard(connection)
                raise
            self.listener = connection
        except Exception as exc:
            logger.info(
                "asynclock: cannot listen on %s (%r); polling", self._wire.errors.server, exc
            )
        finally:
            self._listening = False

    async def _refresh(self) -> None:
        """Keep this client's places alive while it has any."""
        swept_at = 0.0
        try:
            while self.entries:
                lease = min(entry.lease_ms for e in self.entries.values() for entry in e)
                await anyio.sleep(lease / 3000.0)
                if not self.entries:
                    break
                ttl_ms = next(iter(self.entries.values()))[0].ttl_ms
                try:
                    await self._query(ttl_ms, "refreshing the queue table", "refresh", self.client)
                    if anyio.current_time() - swept_at > SWEEP_EVERY:
                        swept_at = anyio.current_time()
                        await self._query(ttl_ms, "sweeping the queue table", "sweep")
                except Exception as exc:
                    logger.info("asynclock: refreshing waiters' places failed: %r", exc)
        finally:
            self._refreshing = False
