"""The grant, the lease it lives on, and its renewal.

An advisory lock lives as long as the session that took it, so the lease is the session. A
session has one idle timer (``idle_session_timeout``), so every lock taken with one ttl can live
on one connection whose timer is that ttl: a lane (:class:`Lane`). One tiny statement renews all
of them; a release unlocks its key only. A lock taken after a wait in the server's queue holds a
dedicated connection of its own, renewed by ``_renewals.Renewals``.

Nothing a caller does may interrupt a statement on a lane: a statement cancelled half-way leaves
an asyncpg connection unusable, and closing the lane would lose every lock on it. So a lane's
statements run one at a time (asyncpg runs one per connection anyway), each driven by the lane
itself, never by a caller's task: the caller's call sends it at once when the lane is idle, and
the replies resume it through callbacks (``Lane._step``). Callers wait for their results on
futures. A caller that stops waiting (cancelled, timed out) leaves its statement to run; a take
that succeeded behind an abandoned caller is undone by an unlock queued right behind it, so no
cancellation strands a lock. (Each statement used to run in the lane's task: two more passes of
the event loop per statement, about a tenth of an uncontended cycle.)

Session advisory locks are re-entrant: a second take of a key the lane holds would succeed on
the server, in either mode (a shared take even past a waiting writer). ``Lane.keys`` keeps the
keys a lane holds or is taking, in any mode, and a take of one of them is refused here, as the
server refuses another session.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio

from .._kit import (
    BackendUnavailable,
    Grant,
    now,
)
from ._errors import connection_broken
from ._sql import RENEWED, UNLOCK, renew

logger = logging.getLogger("asynclock")

#: A wait that lasted longer than this share of the ttl restarts the idle timer before it is
#: handed over (its own send time is the lease's start otherwise).
FRESH_WAIT = 0.05


@dataclass(eq=False, slots=True)
class Renewal:
    """The renewal query of one grant in flight."""

    sent_at: float
    done: anyio.Event = field(default_factory=anyio.Event)
    #: Whether the session that holds the lock answered (``_sql.renew``).
    same: bool = False
    error: Exception | None = None
    cancelled: bool = False

    async def finished(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for the reply, without cancelling the query."""
        if not self.done.is_set():
            with anyio.move_on_after(timeout):
                await self.done.wait()
        return self.done.is_set()


@dataclass(eq=False, slots=True)
class PostgresGrant(Grant):
    """A held advisory lock: its key, and the connection that holds it (a lane's, shared with
    the other locks of its ttl, or a dedicated one after a wait in the server's queue)."""

    key: int
    #: The server process of the session that holds the lock (checked on every renewal).
    pid: int
    connection: Any = field(repr=False)
    on_lost: Callable[[str], None] = field(repr=False)
    #: The renewal query in flight, if any (dedicated connections only).
    renewal: Renewal | None = field(default=None, repr=False)
    released: bool = False
    #: The lane that holds it; None: a dedicated connection of its own.
    lane: Lane | None = field(default=None, repr=False)
    #: The name's key in the holders' table, for a hold that keeps a row there (all but
    #: exclusive locks): a release that finds the session gone deletes the row it left.
    kept_key: int | None = None
    #: What releases it on a dedicated connection (the connection holds only this lock).
    release_sql: str = field(default="", repr=False)
    release_args: tuple[object, ...] = field(default=(), repr=False)
    #: Held in a transaction of its own (transaction pooling, ``_transactions.py``): the
    #: transaction ending, whatever ended it, ends the lock.
    in_transaction: bool = False
    #: The DELETE of the queue-table place the hold came through, queued without an await as
    #: it was granted: its release waits for it, so that no place outlives the hold (a later
    #: take counted the permits of a waiter that was gone).
    leaving: Op | None = field(default=None, repr=False)
    #: Granted after a wait in the server's queue (its statement found the lock busy).
    waited: bool = False


class Owner(Protocol):
    """What a lane needs of the backend's lanes (``_lanes.Lanes``)."""

    server: str
    sequence: str
    op_timeout: float
    by_connection: dict[Any, Lane]
    #: The statements a new lane prepares as it connects (``Lane._prepare``).
    statements: tuple[str, ...]

    def forget(self, lane: Lane) -> None: ...

    def close(self, connection: Any) -> Awaitable[None]: ...


TAKE, UNLOCK_KEY, RENEWAL, QUERY = 0, 1, 2, 3
#: An empty lane is closed after this share of its ttl without locks (before the server's idle
#: timer, at one ttl, would end the session), checked every half of it.
LINGER = 0.5


@dataclass(eq=False, slots=True)
class Op:
    """One statement for a lane, and the future its caller waits on (done early: abandoned)."""

    kind: int
    key: int
    future: asyncio.Future[Any]
    queued_at: float
    #: When the statement was sent (set by the lane).
    sent_at: float = 0.0
    #: A QUERY's statement and arguments (its row is the result).
    sql: str = ""
    args: tuple[object, ...] = ()


def _drop(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


class Lane:
    """One holding connection, the locks on it, and the statements it runs (one at a time)."""

    def __init__(self, lanes: Owner, ttl_ms: int) -> None:
        self._lanes = lanes
        self.ttl_ms, self.ttl = ttl_ms, ttl_ms / 1000.0
        self.connection: Any = None
        self.pid = 0
        #: Keys this lane holds or is taking (a queued unlock removes its key).
        self.keys: set[int] = set()
        #: The grant of each key held here.
        self.grants: dict[int, PostgresGrant] = {}
        #: The unlock statement and its arguments (after the key) of each key held or taken
        #: here with a statement of its own (shared, election); the others: ``UNLOCK``.
        self.unlocks: dict[int, tuple[str, tuple[object, ...]]] = {}
        self._ops: deque[Op] = deque()
        self._wakeup: asyncio.Future[None] | None = None
        #: A statement is in flight (closing must not wait for it).
        self.busy = False
        #: Connected and prepared: statements start as they come (``_pump``).
        self._ready = False
        self._pumping = False
        #: The context the replies' callbacks run in (the lane's own, not a caller's).
        self._context = contextvars.Context()
        #: Why the lane ended; nothing runs on it any more.
        self.dead: BaseException | None = None
        self.renewal: Op | None = None
        #: Renewal statements sent (one renews every lock on the lane).
        self.renewals = 0
        self._empty_since: float | None = now()
        self._closing = False
        self._tick_handle: asyncio.TimerHandle | None = None
        #: The watchdog's timer (armed while statements are pending); the statement in flight.
        self._watch: asyncio.TimerHandle | None = None
        self._current: Op | None = None
        #: Set once the lane is connected, or dead (``PostgresBackend.open`` waits for it).
        self.settled = anyio.Event()
        #: Server-side prepared statements by their SQL (``_prepare``).
        self._prepared: dict[str, Any] = {}

    @property
    def pending(self) -> bool:
        """Statements are queued or in flight."""
        return self.dead is None and (self.busy or bool(self._ops))

    # -- callers ----------------------------------------------------------------------------

    def submit(
        self, kind: int, key: int = 0, sql: str = "", *args: object, first: bool = False
    ) -> Op:
        """Queue a statement (``first``: before everything queued); its result (or error) comes
        on ``op.future``. An idle lane sends it now, before this returns."""
        loop = asyncio.get_running_loop()
        op = Op(kind, key, loop.create_future(), now(), sql=sql, args=args)
        if self.dead is not None:
            op.future.set_exception(self.dead)
            return op
        if first:
            self._ops.appendleft(op)
        else:
            self._ops.append(op)
        if self._watch is None:
            self._watch = loop.call_at(op.queued_at + self._lanes.op_timeout, self._watchdog)
        self._empty_since = None
        self._closing = False
        self._pump()
        return op

    def _watchdog(self) -> None:
        """Callers wait ``op_timeout`` at most: their futures get a TimeoutError then, and the
        statements still run (a take is undone behind its caller). One timer per lane, not per
        statement: it fires once per ``op_timeout`` while statements come and go."""
        self._watch = None
        pending = [op for op in (self._current, *self._ops) if op is not None]
        bound = now() - self._lanes.op_timeout
        oldest: float | None = None
        for op in pending:
            if op.future.done():
                continue
            if op.queued_at <= bound:
                op.future.set_exception(TimeoutError())
            elif oldest is None or op.queued_at < oldest:
                oldest = op.queued_at
        if oldest is not None and self.dead is None:
            self._watch = asyncio.get_running_loop().call_at(
                oldest + self._lanes.op_timeout, self._watchdog
            )

    @staticmethod
    def detach(op: Op) -> Op:
        """Nobody waits for ``op``: its error, if any, is dropped (the statement is cleanup)."""
        op.future.add_done_callback(_drop)
        return op

    def unlock_behind(self, key: int, *, first: bool = False, awaited: bool = False) -> Op | None:
        """Queue the unlock of ``key`` (no await: nothing can interrupt it); ``first``: before
        everything queued (the undo of a take whose caller is gone); ``awaited``: the caller
        waits for it (a release), else nobody does."""
        self.keys.discard(key)
        self.grants.pop(key, None)
        sql, args = self.unlocks.pop(key, (UNLOCK, ()))
        if self.dead is not None:
            return None
        op = self.submit(UNLOCK_KEY, key, sql, *args, first=first)
        if not awaited:
            self.detach(op)
        return op

    # -- the lane's task: connecting and closing --------------------------------------------

    async def run(self, connect: Callable[[int], Any]) -> None:
        try:
            self.connection, self.pid = await connect(self.ttl_ms)
            await self._prepare()
        except Exception as exc:
            self.die(exc)
            return
        except BaseException:
            self.die(BackendUnavailable(f"the lock client for {self._lanes.server} is closed"))
            raise
        self._lanes.by_connection[self.connection] = self
        self.settled.set()
        if self.dead is not None:  # closed by aclose() meanwhile
            self.connection.terminate()
            return
        loop = asyncio.get_running_loop()
        self._tick_handle = loop.call_later(self.ttl * LINGER / 2, self._tick)
        self._ready = True
        self._pump()  # what was queued while it connected
        try:
            # The statements run without this task (``_pump``): it only closes the lane once
            # it has been empty for a while (``_tick``), or ends with it (``die``).
            while self.dead is None:
                if self._closing and not self.keys and not self.pending:
                    self._lanes.forget(self)
                    self.dead = BackendUnavailable("the lane was closed")
                    await self._lanes.close(self.connection)
                    return
                self._wakeup = loop.create_future()
                await self._wakeup
                self._wakeup = None
        finally:
            if self._tick_handle is not None:
                self._tick_handle.cancel()

    async def _prepare(self) -> None:
        """Prepare the statements the lane runs, before it takes anything.

        The first run of a statement costs a round trip more (parse and describe): a client's
        first waiters would pay it as they start, and take their places in the queue table
        behind other processes' waiters that asked after them. And asyncpg ends that round trip
        with a Flush, not a Sync: until the statement's Sync the server does not count the
        session idle, so its idle timer (the lease) is off. Here that gap falls before the
        lane holds a lock, and it ends with the renewal, a simple query (it ends in a Sync).
        One that cannot be prepared is left to asyncpg's statement cache (a failed parse ends
        with a Sync)."""
        connection = self.connection
        self.busy = True  # closing terminates the connection, never waits for this
        try:
            for sql in self._lanes.statements:
                try:
                    self._prepared[sql] = await connection.prepare(sql)
                except Exception as exc:
                    if connection_broken(connection, exc):
                        raise
                    logger.debug("asynclock: cannot prepare a lane's statement (%r)", exc)
            if self._prepared:
                await connection.execute(renew(self.pid))
        finally:
            self.busy = False

    def _tick(self) -> None:
        """Close the lane once it has been empty for ``LINGER`` of its ttl."""
        if self.dead is not None:
            return
        if not self.keys and not self._ops:
            since = self._empty_since
            if since is None:
                self._empty_since = now()
            elif now() - since >= self.ttl * LINGER:
                self._closing = True
                if self._wakeup is not None and not self._wakeup.done():
                    self._wakeup.set_result(None)
        else:
            self._empty_since = None
        self._tick_handle = asyncio.get_running_loop().call_later(self.ttl * LINGER / 2, self._tick)

    # -- running the statements -------------------------------------------------------------

    def _pump(self) -> None:
        """Start the next queued statement if none is in flight; each one that ends starts the
        next (``_end``). Never re-entered: a statement that ends at once returns here."""
        if self._pumping:
            return
        self._pumping = True
        try:
            while self._ready and not self.busy and self._ops and self.dead is None:
                op = self._ops.popleft()
                try:
                    self._start(op)
                except Exception as exc:
                    self._broke(exc, op)
        finally:
            self._pumping = False

    def _start(self, op: Op) -> None:
        if op.kind == TAKE and op.future.done():
            self.keys.discard(op.key)  # abandoned before it was sent: nothing to undo
            self.unlocks.pop(op.key, None)
            return
        if op.kind == QUERY and op.future.cancelled():
            # Its caller was cancelled before it was sent (the lane was still connecting, or
            # busy): nobody wants its row. A queue-table place it would make now, after its
            # waiter returned, would hold every take of the key up (a semaphore's place is made
            # under the key's transaction lock) until the leave queued behind it removed it.
            return
        self.busy = True
        self._current = op
        op.sent_at = now()
        try:
            call = self._call(op)
        except Exception as exc:
            self._end(op, None, exc)
            return
        self._step(call, op)

    def _call(self, op: Op) -> Coroutine[Any, Any, Any]:
        """The driver's call that runs ``op``'s statement (not started yet)."""
        connection = self.connection
        if op.kind == TAKE:
            args: tuple[object, ...] = (op.key, self._lanes.sequence, *op.args)
            sql = op.sql
        elif op.kind == QUERY:
            args, sql = op.args, op.sql
        elif op.kind == UNLOCK_KEY:
            args, sql = (op.key, *op.args), op.sql or UNLOCK
        else:
            self.renewals += 1
            return connection.execute(renew(self.pid))  # type: ignore[no-any-return]
        statement = self._prepared.get(sql)
        if op.kind == QUERY:
            if statement is None:
                return connection.fetchrow(sql, *args)  # type: ignore[no-any-return]
            return statement.fetchrow(*args)  # type: ignore[no-any-return]
        if statement is None:
            return connection.fetchval(sql, *args)  # type: ignore[no-any-return]
        return statement.fetchval(*args)  # type: ignore[no-any-return]

    def _step(self, call: Coroutine[Any, Any, Any], op: Op, _: object = None) -> None:
        """Run ``call`` up to its next wait for the server; called again (a future's callback)
        when that wait ends. The first step runs within ``submit`` (no await there), the others
        in callbacks: no caller's task awaits the call, so no caller's cancellation can reach
        it. Only the connection's end stops it (asyncpg fails its wait then)."""
        result: Any = None
        error: BaseException | None = None
        try:
            waiting = call.send(None)
        except StopIteration as stop:
            result = stop.value == RENEWED if op.kind == RENEWAL else stop.value
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # asyncpg's error; a CancelledError only if it cancelled
            error = exc
        else:
            resume = functools.partial(self._step, call, op)
            if waiting is None:  # a bare yield (sleep(0)): go on at the next pass of the loop
                asyncio.get_running_loop().call_soon(resume, context=self._context)
            else:  # a future, as a task would take it from an await
                waiting._asyncio_future_blocking = False
                waiting.add_done_callback(resume, context=self._context)
            return
        try:
            self._end(op, result, error)
        except Exception as exc:
            self._broke(exc, op)
            return
        self._pump()

    def _end(self, op: Op, result: Any, error: BaseException | None) -> None:
        """``op``'s statement ended: hand its result (or error) to its caller, undo a take its
        caller gave up, or end the lane with the connection."""
        self.busy = False
        self._current = None
        if op is self.renewal:
            self.renewal = None
        if error is not None:
            if not isinstance(error, Exception) or connection_broken(self.connection, error):
                # A CancelledError out of the driver is not the caller's: it gets an error.
                ended = error if isinstance(error, Exception) else BackendUnavailable(repr(error))
                if not op.future.done():
                    op.future.set_exception(ended)
                self.die(ended)
                return
            if op.kind == TAKE:
                # A session lock outlives the statement that failed after taking it.
                self.unlock_behind(op.key)
            if not op.future.done():
                op.future.set_exception(error)
            return
        if op.kind == TAKE:
            if result is None:
                self.keys.discard(op.key)
                self.unlocks.pop(op.key, None)
            elif op.future.done():
                self.unlock_behind(op.key, first=True)  # its caller is gone: undone now
        if not op.future.done():
            op.future.set_result(result)

    def _broke(self, exc: Exception, op: Op) -> None:
        """A bug in the lane's own handling of ``op``: it ends as on a broken connection, not
        left busy (from a reply's callback, the error would reach only the loop's handler)."""
        logger.error("asynclock: a lane to %s failed (%r)", self._lanes.server, exc, exc_info=exc)
        error = BackendUnavailable(f"a holding connection failed: {exc!r}")
        self.busy, self._current = False, None
        if not op.future.done():
            op.future.set_exception(error)
        self.die(error)

    def die(self, error: BaseException) -> None:
        """The connection closed or failed: every lock on it ended with the session."""
        if self.dead is not None:
            return
        self.dead = error
        self.settled.set()
        self._lanes.forget(self)
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        ops, self._ops = self._ops, deque()
        for op in ops:
            if not op.future.done():
                op.future.set_exception(error)
        grants = list(self.grants.values())
        self.grants.clear()
        self.keys.clear()
        self.unlocks.clear()
        if self.connection is not None and not self.connection.is_closed():
            self.connection.terminate()
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)
        for grant in grants:
            if not grant.released:
                grant.on_lost(
                    f"the connection holding the advisory lock on {self._lanes.server} closed "
                    f"({type(error).__name__}: server restart, pg_terminate_backend, "
                    "idle_session_timeout or a network failure); the lock ends with the session"
                )
