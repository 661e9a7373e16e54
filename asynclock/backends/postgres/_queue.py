"""Take and wait in order: which queue a waiter joins (:class:`Waiting`), and our waiters in the
server's lock queue (:class:`Waits`), each on a dedicated connection that then holds the lock;
beyond them, places in a table of the database that hold no connection (``_table.py``), in FIFO
order with the server's own queue.

A client keeps up to ``max_waiting`` waiters in the server's lock queue (``pg_advisory_lock`` on
a dedicated connection: the hand-over is the server's, at once), on connections it has at hand.
Beyond that, without an idle connection (one still to be opened would join the server's queue
when it is open, behind waiters that asked later), and whenever the table already has a place
for the key (so that nobody overtakes it), a waiter takes a place in the table. Only the head of
the table goes on, into the server's queue, behind whoever entered it before the table had
places; a take on a lane is refused while the table has places (``_sql.LANE_TAKE``). So the
order is the order of arrival across both queues; a client's waiters of a key arrive in the
order they asked (``Waiting.placing``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from contextlib import nullcontext

import anyio

from .._kit import CallOrder, LockRequest, TaskHost, Turn, now, translate
from ._errors import connection_broken
from ._kinds import Mode
from ._lease import FRESH_WAIT, PostgresGrant
from ._sql import RELEASE, marker_key, renew
from ._table import Queue
from ._wire import Replacements, Wire

logger = logging.getLogger("asynclock")

#: How long after a renewal was sent a release waits for its reply before closing the connection
#: instead (a statement in flight: the connection cannot be unlocked and kept before it ends).
_RENEWAL_WAIT = 0.05
#: How long after a direct acquire's statement was sent its timeout starts to apply.
DIRECT_GRACE = 0.01
#: How often a burst's waiter checks that the one before it entered the server's queue.
ENTERED_POLL = 0.001
#: Keys a client remembers as contended (forgotten all at once beyond this).
_CONTENDED_KEYS = 1024
#: Direct acquires in a row that found a contended lock free before the next one tries on the
#: lane again. Not one: between two clients that take turns, the next statement of the one that
#: just released often reaches the server before the other's, which was not waiting yet; with
#: one, six acquires in ten then paid a try on the lane before their wait, a statement more
#: (2 processes: 16 gave 13-16 % more acquisitions/s, 14-16 % less client CPU each).
FREE_BEFORE_LANE = 16


class Waits:
    """Our waiters in the server's queue (at most ``max_waiting``, plus the queue table's heads)."""

    def __init__(self, wire: Wire) -> None:
        self._wire = wire
        self._sessions = wire.sessions
        self.waiting = 0

    @property
    def at_hand(self) -> bool:
        """Whether a connection is idle (a wait need not open one first)."""
        return self._sessions.pool.idle > 0

    async def wait(
        self,
        request: LockRequest,
        key: int,
        ttl_ms: int,
        mode: Mode,
        *,
        head: bool,
        sql: str,
        args: tuple[object, ...] = (),
        bound: float | None = None,
        sent: Callable[[int | None], object] | None = None,
    ) -> PostgresGrant | None:
        """Wait in the server's queue on a dedicated connection, which then holds the lock;
        unless the queue table has places for the key (None: wait there, ``_table.py``), or
        ``head``: this waiter is the table's head (None: its connection died; it checks its
        place again before it comes back, which may have expired meanwhile). The statement is
        ``sql`` (``mode.wait``, or ``mode.try_dedicated``) with ``args`` after the key, the
        sequence and the ttl; the hold is released with ``mode``'s statement.

        A statement that fails or is cancelled half-way leaves its connection in a state nobody
        knows (asyncpg's protocol may still expect the reply), so that connection is closed, never
        reused, and its server session is ended before this returns (``Sessions.end_session``): a
        cancelled wait leaves the server's queue, a lock granted at the last moment is free
        again. A connection that turns out to be dead (a pooled one the server or a proxy closed
        while it was idle, or a waiter's session the server ended while this process was paused)
        is replaced and the wait starts again: that is no outage. Only a new connection that
        fails as well is reported. ``sent(server process)`` is called as the statement is sent.
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
                            sent(self._sessions.pid(connection))
                        row = await connection.fetchrow(
                            sql, key, self._wire.sequence, str(ttl_ms), *args
                        )
                        if row is None:
                            self._sessions.give_back(connection)
                            return None
                        if now() - sent_at > ttl_ms * FRESH_WAIT / 1000.0:
                            # Its send time would leave little of the lease: restart the timer.
                            sent_at = now()
                            await connection.execute(renew(row[1]), timeout=self._wire.op_timeout)
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
                    kept_key=key if mode.kept else None,
                    release_sql=mode.release,
                    release_args=mode.release_args(key, self._wire.channel),
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


class Answer:
    """``request.answered`` of one acquire: now (after a try), or with ``DIRECT_GRACE`` as a
    direct acquire's statement is sent (no answer comes before its grant)."""

    __slots__ = ("_answered", "_grace_until", "given")

    def __init__(self, request: LockRequest) -> None:
        self._answered = request.answered
        self.given = self._answered is None
        #: While the grace of a direct send lasts, a send again (on a new connection) or a move
        #: to the queue table gives it again, as if it had not been given.
        self._grace_until = -math.inf

    def _open(self) -> bool:
        return not self.given or now() < self._grace_until

    async def now(self) -> None:
        """Give it, and end the acquire here if its timeout is past already."""
        if self._open():
            assert self._answered is not None
            self.given, self._grace_until = True, -math.inf
            self._answered()
            await anyio.lowlevel.checkpoint_if_cancelled()

    def later(self) -> None:
        """The direct acquire's statement is sent now: its timeout applies ``DIRECT_GRACE``
        from now at the earliest (one deadline for the caller's scope; no timer of ours)."""
        if self._open():
            assert self._answered is not None
            self.given, self._grace_until = True, now() + DIRECT_GRACE
            self._answered(DIRECT_GRACE)


class Waiting:
    """A backend's waits for exclusive, shared and election locks (``PostgresBackend._take``),
    in the server's queue or the queue table, and the locks it found contended."""

    def __init__(
        self, waits: Waits, queue: Queue, host: TaskHost, max_waiting: int, channel: str
    ) -> None:
        self._waits = waits
        self._host = host
        self._queue = queue
        self.max_waiting = max_waiting
        self.channel = channel
        #: Our waiters of each key.
        self.waiting: dict[int, int] = {}
        #: Exclusive locks an acquire here waited for, and how many direct acquires in a row
        #: found each free since (``remember``).
        self.contended: dict[int, int] = {}
        #: Who places a waiter of a key next (``PostgresBackend._take``).
        self.placing = CallOrder()

    async def wait(
        self, request: LockRequest, key: int, ttl_ms: int, mode: Mode, answer: Answer, turn: Turn
    ) -> PostgresGrant:
        """Wait in the server's queue on a dedicated connection, or in the queue table behind
        it. A direct acquire (``answer`` not given yet) has not tried first: its statement takes
        a free lock at once, and a timed one's timeout applies from ``DIRECT_GRACE`` after it
        was sent (a free lock's answer is back well before), or from its answer."""
        self.waiting[key] = self.waiting.get(key, 0) + 1
        try:
            extra = mode.take_args(request.owner, request.value, self.channel)

            def server_queue(
                head: bool, own: str = "", sent: Callable[[int | None], object] | None = None
            ) -> Awaitable[PostgresGrant | None]:
                return self._waits.wait(
                    request,
                    key,
                    ttl_ms,
                    mode,
                    head=head,
                    sql=mode.wait,
                    args=(head, marker_key(key), own, *extra),
                    sent=sent,
                )

            direct = not answer.given

            def sent(pid: int | None) -> None:
                if direct:
                    answer.later()
                if pid is None or not turn.wanted:
                    turn.give()
                else:
                    # A burst: the next of ours goes once this one is in the server's queue
                    # (statements sent together on two connections reach it in any order).
                    self._host.start_soon(
                        self._give_when_entered,
                        turn,
                        ttl_ms,
                        pid,
                        key,
                        name="asynclock: postgres placing",
                    )

            # Only on a connection at hand: one still to be opened would reach the server's
            # queue when it is open, behind waiters that asked later (here or in other
            # clients), or be refused there once the table has places; the table's place is
            # made on the lane, as asked. And only while no waiter of ours has a place of the
            # key (ours that asked earlier are all placed: this one holds the turn); places of
            # ours made after it asked, before its statement arrived, do not refuse it.
            queue = self._queue
            if (
                self._waits.waiting < self.max_waiting
                and self._waits.at_hand
                and not queue.entries.get(key)
            ):
                grant = await server_queue(False, queue.client, sent)
                if grant is not None:
                    self.remember(request, key, grant.waited, direct)
                    return grant
            await answer.now()
            grant = await queue.wait(
                request, key, ttl_ms, lambda: server_queue(True), placed=turn.give
            )
            self.remember(request, key, True, direct)
            return grant
        finally:
            left = self.waiting[key] - 1
            if left:
                self.waiting[key] = left
            else:
                del self.waiting[key]

    async def _give_when_entered(self, turn: Turn, ttl_ms: int, pid: int, key: int) -> None:
        """Give ``turn`` up once server process ``pid`` waits for ``key`` (or holds it), or
        its waiter gave it up first (it went to the table, or its wait ended)."""
        try:
            while not turn.given and not await self._queue.entered(ttl_ms, pid, key):  # noqa: ASYNC110
                await anyio.sleep(ENTERED_POLL)
        except Exception as exc:
            logger.info("asynclock: cannot check a wait's place (%r); the next one goes", exc)
        finally:
            turn.give()

    def remember(self, request: LockRequest, key: int, waited: bool, direct: bool) -> None:
        """Whether the next acquire of an exclusive lock goes straight to the server's queue:
        this one waited for it, or fewer than ``FREE_BEFORE_LANE`` direct ones in a row found
        it free since; or it tries on the lane first."""
        if request.kind != "lock" or request.shared:
            return
        if waited:
            if len(self.contended) >= _CONTENDED_KEYS:
                self.contended.clear()
            self.contended[key] = 0
        elif direct:
            free = self.contended.get(key)
            if free is None:
                return
            if free + 1 >= FREE_BEFORE_LANE:
                del self.contended[key]
            else:
                self.contended[key] = free + 1
