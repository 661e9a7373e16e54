"""Take and wait in order: our waiters in the server's lock queue (:class:`Waits`), each on a
dedicated connection that then holds the lock, and beyond them places in a table of the
database (:class:`Queue`) that hold no connection, in FIFO order with the server's own queue.

A client keeps up to ``max_waiting`` waiters in the server's lock queue (``pg_advisory_lock`` on
a dedicated connection: the hand-over is the server's, at once). Beyond that, and whenever the
table already has a place for the key (so that nobody overtakes it), a waiter takes a place in
the table (``asynclock_waiters``): a ticket from the token sequence, which only increases. Only
the head of the table (the smallest live ticket of the key) goes on, into the server's queue,
behind whoever entered it before the table had places; a take on a lane is refused while the
table has places (``_sql.LANE_TAKE``). So the order is the order of arrival across both queues.

The head leaves the table once the server granted it the lock, and tells every client with a
NOTIFY on the schema's channel; each client's listener (one connection per client) wakes its
first waiter of that key, which checks whether it is the head now. A missed NOTIFY, or a head
whose client stopped, is caught by that first waiter's poll (``POLL``). A place lasts
``lease`` (the ttl, between 1 and 5 s) after its client last refreshed it (one statement per
client every third of that): a dead or paused client's waiters drop out of the order by
themselves, and a waiter whose place expired while its process was paused queues again at
the end.
"""

from __future__ import annotations

import bisect
import logging
import uuid
from collections.abc import Awaitable, Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import anyio

from .._kit import LockRequest, now, permits_mismatch, translate
from ._errors import connection_broken
from ._lanes import Lanes
from ._lease import FRESH_WAIT, QUERY, Lane, Op, PostgresGrant
from ._sql import (
    ENQUEUE,
    ENQUEUE_SEMAPHORE,
    HEAD,
    LEAVE,
    REFRESH,
    RELEASE,
    RENEW,
    REQUEUE,
    SWEEP_PLACES,
)
from ._wire import Replacements, Wire

logger = logging.getLogger("asynclock")

#: How long after a renewal was sent a release waits for its reply before closing the connection
#: instead (a statement in flight: the connection cannot be unlocked and kept before it ends).
_RENEWAL_WAIT = 0.05
#: How often a client's first waiter of a key checks whether it is the head without a NOTIFY.
POLL = 0.25
#: A place's lease: the waiter's ttl, within these bounds (seconds).
LEASE_MIN, LEASE_MAX = 1.0, 5.0
#: How often places long expired are deleted (by any client that has waiters).
SWEEP_EVERY = 30.0


class Waits:
    """Our waiters in the server's queue (at most ``max_waiting``, plus the queue table's heads)."""

    def __init__(self, wire: Wire) -> None:
        self._wire = wire
        self._sessions = wire.sessions
        self.waiting = 0

    async def wait(
        self,
        request: LockRequest,
        key: int,
        ttl_ms: int,
        *,
        head: bool,
        sql: str,
        args: tuple[object, ...] = (),
        release: tuple[str, tuple[object, ...]] = (RELEASE, ()),
        shared: bool = False,
        kept: bool = False,
        bound: float | None = None,
        sent: Callable[[], object] | None = None,
    ) -> PostgresGrant | None:
        """Wait in the server's queue on a dedicated connection, which then holds the lock;
        unless the queue table has places for the key (None: wait there, ``_queue.py``), or
        ``head``: this waiter is the table's head (None: its connection died; it checks its
        place again before it comes back, which may have expired meanwhile).

        A statement that fails or is cancelled half-way leaves its connection in a state nobody
        knows (asyncpg's protocol may still expect the reply), so that connection is closed, never
        reused, and its server session is ended before this returns (``Sessions.end_session``): a
        cancelled wait leaves the server's queue, a lock granted at the last moment is free
        again. A connection that turns out to be dead (a pooled one the server or a proxy closed
        while it was idle, or a waiter's session the server ended while this process was paused)
        is replaced and the wait starts again: that is no outage. Only a new connection that
        fails as well is reported. ``sent`` is called as the statement is sent.
        """
        # Counted before the first await: waiters that start together see each other.
        self.waiting += 1
        try:
            replacements = Replacements()
            while True:
                connection, reused = await self._sessions.take()
                try:
                    with (
                        translate(self._wire.errors, f"waiting for {request.name!r}"),
                        # A try (that does not wait) is bounded by op_timeout; a wait by the
                        # caller's cancel scope only (no scope of its own: one per acquire).
                        nullcontext() if bound is None else anyio.fail_after(bound),
                    ):
                        # Queue in the server; the caller's cancel scope bounds the wait.
                        sent_at = now()
                        if sent is not None:
                            sent()
                        row = await connection.fetchrow(
                            sql, key, self._wire.sequence, str(ttl_ms), *args
                        )
                        if row is None:
                            self._sessions.give_back(connection)
                            return None
                        if now() - sent_at > ttl_ms * FRESH_WAIT / 1000.0:
                            # Its send time would leave little of the lease: restart the timer.
                            sent_at = now()
                            await connection.fetchval(RENEW, timeout=self._wire.op_timeout)
                except BaseException as exc:
                    doing = "" if head else "waiting for"
                    if not await self._sessions.interrupted(
                        connection, request.name, exc, replacements, reused=reused, doing=doing
                    ):
                        raise
                    if head:
                        return None
                    continue
                return self._wire.hold(
                    request,
                    key,
                    connection,
                    token=row[0],
                    pid=row[1],
                    sent_at=sent_at,
                    shared=shared,
                    kept_key=key if kept else None,
                    release_sql=release[0],
                    release_args=release[1],
                    waited=row[2] is True,
                )
        finally:
            self.waiting -= 1

    async def release(self, grant: PostgresGrant) -> None:
        """Release a dedicated connection's lock (``PostgresBackend.release``): unlock and keep
        the connection, or close it (either frees the lock)."""
        connection = grant.connection
        self._wire.held.pop(connection, None)
        if connection.is_closed():
            self._sessions.all.discard(connection)
            return
        try:
            renewal = grant.renewal
            if renewal is not None:
                # Its statement is in flight. A renewal just sent on a healthy server is back
                # within milliseconds; one that has not come back by now (a hung server, often
                # why the lease was lost) is not waited for: closing frees the lock just the same.
                left = renewal.sent_at + _RENEWAL_WAIT - now()
                if left <= 0 or not await renewal.finished(left):
                    self._sessions.discard(connection)
                    return
            if grant.in_transaction and not connection.is_in_transaction():
                # Nothing to roll back: whatever ended the transaction ended the lock, and the
                # lease should have been reported lost before this. Said, never ignored.
                logger.warning(
                    "asynclock: releasing %r on %s: its transaction had ended already, and "
                    "the lock with it",
                    grant.name,
                    self._wire.errors.server,
                )
                self._sessions.discard(connection)
                return
            await connection.execute(
                grant.release_sql or RELEASE, *grant.release_args, timeout=self._wire.op_timeout
            )
        except BaseException as exc:
            # Closed at once, never reused: whatever state the statement left, the session
            # ends with the connection, and the lock with it.
            gone = connection_broken(connection, exc)
            self._sessions.discard(connection)
            if not isinstance(exc, Exception):
                raise
            if not gone:
                logger.warning(
                    "asynclock: unlocking %r on %s failed (%r); closed its connection "
                    "instead, so the server frees the lock when it reads the close, at the "
                    "latest %g s after the last renewal it received",
                    grant.name,
                    self._wire.errors.server,
                    exc,
                    grant.ttl,
                )
            return
        self._sessions.give_back(connection)


@dataclass(eq=False)
class _Entry:
    key: int
    waiter: str
    ttl_ms: int
    lease_ms: int
    ticket: int = 0
    wake: anyio.Event = field(default_factory=anyio.Event)

    def __lt__(self, other: _Entry) -> bool:
        return self.ticket < other.ticket


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
    ) -> PostgresGrant:
        """Take a place, wait until it is the head, then wait in the server's queue.

        ``permits``: a semaphore's waiter (its permits class and number, ``_semaphores.py``):
        its place records the number, refused when the holders' or waiters' differs; its head
        tries to take a permit, and waits for a release (a NOTIFY, or the poll) when none is
        free."""
        lease_ms = int(min(max(ttl_ms / 1000.0, LEASE_MIN), LEASE_MAX) * 1000)
        waiter = uuid.uuid4().hex + ("" if permits is None else f" permits={permits[1]}")
        entry = _Entry(key, waiter, ttl_ms, lease_ms)
        self._start_helpers()
        what = f"waiting for {request.name!r} in the queue table"
        granted: PostgresGrant | None = None
        try:
            await self._enqueue(entry, what, request.name, permits)
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
        bisect.insort(self.entries.setdefault(entry.key, []), entry)

    def _leave(self, entry: _Entry, ttl_ms: int) -> Op | None:
        """Give the place up (granted, or the wait ended otherwise) without an await: the
        statement runs in the lane's task; the next waiter of the key checks its turn."""
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
