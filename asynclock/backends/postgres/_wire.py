"""The connections to the server: connecting, the idle pool, and ending the session of an
interrupted one (:class:`Sessions`); and :class:`Wire`, what every part of a backend that runs
statements shares.

A connection whose statement was cancelled or failed half-way is never used again (asyncpg's
protocol state is then unknown: reusing it gave "cannot switch to state 12; another operation
(2) is in progress"). It is closed at once, without an await, and its server session is ended
with ``pg_terminate_backend`` from another connection (:meth:`Sessions.end_session`), since a
session blocked in the lock queue does not read its socket. An idle connection found dead (the
server's or a proxy's idle timeout) is replaced by the pool, not reported.
"""

from __future__ import annotations

import functools
import logging
import secrets
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import asyncpg

from .._kit import (
    BackendUnavailable,
    IdlePool,
    LockRequest,
    RetryPolicy,
    TaskHost,
    UnsupportedFeature,
    finish,
    translate,
)
from ._errors import CONNECTING, Errors, connection_broken, unmapped
from ._lease import PostgresGrant
from ._sql import END_SESSION, END_TRANSACTION, MARK, PID, SETUP, timeout_ms
from ._urls import Settings

logger = logging.getLogger("asynclock")

#: Pauses between two looks at a session that is ending (it ends within milliseconds), and the
#: longest it is waited for.
END_POLL = RetryPolicy(first=0.002, cap=0.01, factor=1.5, jitter=0.5)
END_TIMEOUT = 1.0


@dataclass(eq=False, slots=True)
class _Connect:
    """One connect in flight, in a task of the backend's own."""

    done: anyio.Event = field(default_factory=anyio.Event)
    connection: Any = None
    error: Exception | None = None
    #: The caller stopped waiting: the connection, if one comes, goes to the idle pool.
    abandoned: bool = False
    #: Made with settings of its own (a lane's idle timer): never pooled.
    special: bool = False
    #: Keeps every cancellation but its own out (``Sessions._run_connect``).
    scope: anyio.CancelScope = field(default_factory=lambda: anyio.CancelScope(shield=True))


class Replacements:
    """Dead connections replaced during one take: a pooled one (it may have died idle) any
    number of times, a new one once (then the server is reported as it is)."""

    __slots__ = ("fresh_failures",)

    def __init__(self) -> None:
        self.fresh_failures = 0

    def again(self, error: BaseException, *, broken: bool, reused: bool) -> bool:
        """Whether to take again on another connection after ``error``."""
        if not isinstance(error, Exception) or not broken:
            return False
        if not reused:
            self.fresh_failures += 1
            if self.fresh_failures >= 2:
                return False
        return True


class Sessions:
    """Every connection of one backend: idle, waiting or holding."""

    def __init__(
        self,
        settings: Settings,
        server_settings: dict[str, str],
        errors: Errors,
        host: TaskHost,
        *,
        on_closed: Callable[[Any], None],
        busy: Callable[[Any], bool],
    ) -> None:
        self._settings = settings
        #: Settings of every new connection (open() may add to them).
        self.server_settings = server_settings
        self._op_timeout = settings.op_timeout
        self._errors = errors
        self._host = host
        self._on_closed = on_closed
        #: Whether a connection has a statement in flight that its close must not wait for.
        self._busy = busy
        self.pool: IdlePool[Any] = IdlePool(
            connect=self._connect,
            alive=lambda connection: not connection.is_closed(),
            abort=self.discard,
            close=self.close,
            keep=settings.max_idle,
        )
        self.all: set[Any] = set()
        #: The server process of each connection, as the server reports it: a pooler reports
        #: another number at connect (asyncpg's ``get_server_pid()``).
        self._pids: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        #: Whether a connection pooler stands between us and the server (known once a
        #: connection was made).
        self.pooled = False
        self._connecting: set[_Connect] = set()
        self._connects = 0
        self.open = False
        #: Every hold is a transaction of its own (``?pooler=transaction``): a connection keeps
        #: no session state, since the next transaction may run on another server session.
        self.transactions = settings.pooler == "transaction"
        #: Deletes the holders' rows of an ended session ($1: its pid), once open() found the
        #: table (``_sql.SWEEP_SESSION``).
        self.sweep_sql: str | None = None

    # -- taking and giving back --------------------------------------------------------------

    async def take(self) -> tuple[Any, bool]:
        """A connection that holds nothing, and whether it comes from the idle pool (it may
        have died there without asyncpg having noticed yet)."""
        connects = self._connects
        connection = await self.pool.take()
        return connection, self._connects == connects

    def pid(self, connection: Any) -> int | None:
        """The server process of ``connection``'s session, as the server reported it."""
        return self._pids.get(connection)

    def give_back(self, connection: Any) -> None:
        """Keep a connection that holds no lock for reuse, or close it."""
        self.pool.give_back(connection, reusable=True)

    def discard(self, connection: Any) -> None:
        """Close at once, without an await (nothing can interrupt it)."""
        self.all.discard(connection)
        connection.terminate()

    async def close(self, connection: Any) -> None:
        if connection.is_closed():
            self.all.discard(connection)
        elif self._busy(connection):
            connection.terminate()  # a statement in flight: asyncpg's close would cancel it
        else:
            try:
                await connection.close(timeout=self._op_timeout)
            except Exception:
                connection.terminate()

    # -- connecting --------------------------------------------------------------------------

    async def connect_lane(self, ttl_ms: int) -> tuple[Any, int]:
        """A new holding connection whose server session ends ``ttl_ms`` after its last
        message (``idle_session_timeout``): a lane (``_lanes.py``); and its server process."""
        settings = {**self.server_settings, "idle_session_timeout": str(ttl_ms)}
        connection = await self._connect(settings)
        return connection, self._pids[connection]

    async def _connect(self, settings: dict[str, str] | None = None) -> Any:
        """A new dedicated connection, bounded by ``connect_timeout``.

        The connect runs in a task of the backend's own that our caller waits for but never
        cancels: asyncpg leaves an exception that nobody retrieves (logged as an error by
        asyncio) when a connect is cancelled inside its TLS negotiation (sslmode=prefer, the
        default; see MagicStack/asyncpg#1211 and #1310). A caller that is cancelled stops
        waiting at once; the connect then ends on its own (within ``connect_timeout``) and its
        connection joins the idle pool.
        """
        self._connects += 1
        if not self.open:
            raise self._closed()
        pending = _Connect(special=settings is not None)
        self._connecting.add(pending)
        self._host.start_soon(
            self._run_connect,
            pending,
            settings or self.server_settings,
            name="asynclock: postgres connect",
        )
        try:
            await pending.done.wait()
        except BaseException:
            pending.abandoned = True
            if pending.done.is_set():
                self._adopt_abandoned(pending)
            raise
        if pending.error is not None:
            raise pending.error
        connection = pending.connection
        if connection is None:  # cancelled by aclose()
            raise self._closed()
        if not self.open:
            connection.terminate()
            raise self._closed()
        self._adopt(connection)
        return connection

    async def _run_connect(self, pending: _Connect, settings: dict[str, str]) -> None:
        try:
            # Shielded: a connect cancelled half-way leaves asyncpg's socket open or its error
            # unretrieved (see _connect), and the task group this runs in is cancelled with
            # the scope it sits in (a start() cancelled while it opens the backend). Only
            # aclose() cancels it, after giving it a moment to finish.
            with pending.scope, translate(self._errors, CONNECTING):
                # asyncpg's own timeout bounds each attempt; ours bounds the whole call.
                with anyio.fail_after(self._settings.connect_timeout + 1.0):
                    connection = pending.connection = await asyncpg.connect(
                        self._settings.dsn,
                        ssl=self._settings.ssl_context,
                        timeout=self._settings.connect_timeout,
                        statement_cache_size=self._settings.statement_cache_size,
                        # The only startup parameter every pooler passes on; the others go
                        # as SQL (SETUP).
                        server_settings={"application_name": settings["application_name"]},
                    )
                    await self._set_up(connection, settings)
            if pending.scope.cancelled_caught and pending.connection is not None:
                pending.connection.terminate()  # given up by aclose(): nobody takes it
                pending.connection = None
        except Exception as exc:
            if pending.connection is not None:
                pending.connection.terminate()
                pending.connection = None
            pending.error = exc
        finally:
            self._connecting.discard(pending)
            pending.done.set()
            if pending.abandoned:
                self._adopt_abandoned(pending)

    async def _set_up(self, connection: Any, settings: dict[str, str]) -> None:
        """Apply ``settings`` to a new connection's session, learn its server process, and
        refuse a server session that another connection of ours set up before (``SETUP``).
        In transaction pooling the session is not ours: only learn whether a pooler is there
        (each hold sets its settings for its own transaction)."""
        if self.transactions:
            if connection.get_server_pid() != await connection.fetchval(PID):
                self.pooled = self._errors.pooled = True
            return
        names = [name for name in settings if name != "application_name"]
        values = [settings[name] for name in names]
        pid, mark, _ = await connection.fetchrow(
            SETUP, [*names, MARK], [*values, secrets.token_hex(8)]
        )
        self._pids[connection] = pid
        if connection.get_server_pid() != pid:
            self.pooled = self._errors.pooled = True
        if mark:
            raise UnsupportedFeature(
                f"{self._errors.server}: a new connection reached a server session (process "
                f"{pid}) that another client connection had set up, not reset by the pooler: "
                "a connection pooler in transaction or statement pooling mode, where a "
                "session lock is held for whoever gets that session next. Use pool_mode = "
                "session (with its default server_reset_query, DISCARD ALL), or connect to "
                "PostgreSQL directly"
            )

    def _adopt(self, connection: Any) -> None:
        self.all.add(connection)
        connection.add_termination_listener(self.closed_by_driver)

    def _adopt_abandoned(self, pending: _Connect) -> None:
        """Take over the connection of a connect whose caller stopped waiting for it."""
        connection, pending.connection = pending.connection, None
        if connection is None:
            return
        if self.open and not pending.special:
            self._adopt(connection)
            self.give_back(connection)
        else:
            connection.terminate()

    def closed_by_driver(self, connection: Any) -> None:
        """asyncpg's termination listener: the connection closed, for whatever reason."""
        self.all.discard(connection)
        self._on_closed(connection)

    def _closed(self) -> BackendUnavailable:
        return BackendUnavailable(f"the lock client for {self._errors.server} is closed")

    # -- ending the session of an interrupted statement --------------------------------------

    async def interrupted(
        self,
        connection: Any,
        name: str,
        error: BaseException,
        replacements: Replacements,
        *,
        reused: bool,
        transaction: tuple[int, object] | None = None,
        doing: str = "",
    ) -> bool:
        """A statement on ``connection`` failed or was cancelled half-way: end its session
        (:meth:`end_session`), and say whether to try again on another connection (it was
        dead, see :class:`Replacements`); if so, and ``doing`` says what it was doing, log it."""
        broken = connection_broken(connection, error)
        await self.end_session(connection, name, unmapped(error), transaction=transaction)
        if not replacements.again(error, broken=broken, reused=reused):
            return False
        if doing:
            logger.info(
                "asynclock: a connection to %s died while %s %r (%r); again on another one",
                self._errors.server,
                doing,
                name,
                unmapped(error),
            )
        return True

    async def end_session(
        self,
        connection: Any,
        name: str,
        error: BaseException | None,
        *,
        transaction: tuple[int, object] | None = None,
    ) -> None:
        """Close ``connection`` at once, and make sure its server session has ended too.

        The close alone ends a session that is idle or finishing a short statement within
        milliseconds, but not one blocked in the lock queue, which does not read its socket:
        so ``pg_terminate_backend`` from another connection ends it, and this returns once the
        server process is gone (a few milliseconds). Survives any cancellation (``finish``) and
        is bounded by ``min(op_timeout, 1 s)``: a server that does not answer gets the close,
        and the check of its connections, instead. Skipped after a timeout (``error``), which
        only a short statement can have.

        In transaction pooling the server session is the pooler's, and may serve another
        client a moment after ours left it: only the hold's own ``transaction`` (its server
        process and ``xact_start``) is ended, and none before it is known (the statements
        before the wait do not block, so the close ends them).
        """
        pid = self._pids.get(connection)
        if self.transactions:
            pid = None if transaction is None else transaction[0]
        self.discard(connection)  # no await before: nothing can cancel the close
        if pid is None or isinstance(error, TimeoutError):
            return  # the server did not answer: another connection would wait as long

        def unfinished() -> None:
            logger.info(
                "asynclock: %s did not answer while ending session %d of an interrupted take "
                "of %r; it ends when the server reads the close",
                self._errors.server,
                pid,
                name,
            )

        started = None if transaction is None else transaction[1]
        await finish(
            functools.partial(self._terminate_session, pid, name, started),
            timeout=min(self._op_timeout, END_TIMEOUT),
            what=f"ending the server session {pid} of an interrupted take of {name!r}",
            unfinished=unfinished,
        )

    async def _terminate_session(self, pid: int, name: str, started: object) -> None:
        # Idempotent (finish() may run it again from the start): ending an ended session is a
        # no-op, and a connection whose statement was interrupted is closed, not reused (the
        # pool's connection() closes the helper unless the block completed).
        polls = END_POLL.backoff()
        args: tuple[object, ...]
        if started is None:
            sql, args = END_SESSION, (pid, self._settings.application_name)
        else:
            sql, args = END_TRANSACTION, (pid, started)
        try:
            async with self.pool.connection() as helper:
                while await helper.fetchval(sql, *args, timeout=self._op_timeout):
                    await polls.pause()
                if self.sweep_sql is not None:
                    # A take whose commit was in flight left the row of a hold that ended
                    # with it.
                    await helper.execute(self.sweep_sql, pid, timeout=self._op_timeout)
        except Exception as exc:
            logger.info("asynclock: cannot end the session %d of %r: %r", pid, name, exc)

    # -- closing -----------------------------------------------------------------------------

    async def aclose(self) -> None:
        self.open = False
        with anyio.CancelScope(shield=True):
            # Cancelling a connect that a healthy server is about to complete can make asyncpg
            # log an error (see _connect), so give those a moment; one stuck on a server that
            # does not answer is waiting for a reply, where cancelling it is clean. Nothing
            # else cancels them (_run_connect).
            with anyio.move_on_after(min(self._settings.connect_timeout, 0.5)):
                for pending in list(self._connecting):
                    await pending.done.wait()
            for pending in list(self._connecting):
                pending.scope.cancel()
                await pending.done.wait()
            connections = list(self.all)
            self.all.clear()
            await self.pool.aclose()  # the idle ones, in order: nothing is in flight on them
            # The others are in use, maybe with a statement in flight: asyncpg's close() would
            # send a CancelRequest, and the statement's own error path then drops the
            # connection, which aborts that request half-way. PgBouncer before 1.20 (Debian 12
            # ships 1.18) exits on such a request (pgbouncer/pgbouncer#801): no request at all.
            for connection in connections:
                if not connection.is_closed():
                    connection.terminate()


@dataclass(frozen=True, eq=False, slots=True)
class Wire:
    """What the parts of one backend that run statements share, built once: its task host, its
    connections and translator, the names of its objects in the schema, and the grant of each
    dedicated connection that holds a lock on its own."""

    host: TaskHost
    sessions: Sessions
    errors: Errors
    schema: str
    sequence: str
    #: The queue table and the holders' table.
    queue: str
    holders: str
    #: The NOTIFY channel of the schema.
    channel: str
    op_timeout: float
    held: dict[Any, PostgresGrant]

    def hold(
        self,
        request: LockRequest,
        key: int,
        connection: Any,
        *,
        token: int,
        pid: int,
        sent_at: float,
        **more: Any,
    ) -> PostgresGrant:
        """The grant of a lock ``connection`` holds on its own (after a wait in the server's
        queue, a semaphore's permit, or in a transaction of its own), registered in ``held``;
        ``more``: PostgresGrant's fields."""
        grant = PostgresGrant(
            name=request.name,
            owner=request.owner,
            token=int(token),
            valid_from=sent_at,
            ttl=timeout_ms(request.ttl) / 1000.0,
            key=key,
            pid=int(pid),
            connection=connection,
            on_lost=request.on_lost,
            space=request.kind,
            **more,
        )
        self.held[connection] = grant
        if connection.is_closed():
            # Closed between the reply and now: the listener may have run already.
            self.sessions.closed_by_driver(connection)
        return grant
