"""The PostgresBackend: takes on the holding connections, waits in the server's queue or the queue
table, renewals and releases."""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any, Self

import anyio

from .._kit import (
    DEFAULT_TTL,
    Backend,
    Capabilities,
    InvalidArgument,
    Kind,
    LockInfo,
    LockRequest,
    RenewOutcome,
    TaskHost,
    Turn,
    redact,
    translate,
)
from ._errors import CHECKING, Errors
from ._inspect import Inspector
from ._kinds import kind_key, modes, no_holders_table
from ._lanes import Lanes
from ._lease import PostgresGrant
from ._queue import Answer, Waiting, Waits
from ._renewals import Renewals
from ._semaphores import Semaphores
from ._server import check_pooler, check_server
from ._sql import (
    CREATE_HOLDERS,
    MAX_TIMEOUT_MS,
    SWEEP_SESSION,
    creates,
    holders_name,
    queue_name,
    sequence_name,
    timeout_ms,
)
from ._table import Queue
from ._transactions import TRANSACTION_CAPABILITIES, TRANSACTION_LIMITS, TransactionHolds
from ._urls import Settings, read_url
from ._wire import Sessions, Wire

__all__ = ("PostgresBackend", "PostgresGrant")

logger = logging.getLogger("asynclock")

# Session settings of every dedicated connection: our waits are bounded by the caller, not by a
# server default; tokens must survive a crash; the idle timeout is set per lease.
_SERVER_SETTINGS = {
    "lock_timeout": "0",
    "statement_timeout": "0",
    "idle_session_timeout": "0",
    "idle_in_transaction_session_timeout": "0",
    "synchronous_commit": "on",
}


class PostgresBackend(Backend[PostgresGrant]):
    driver = "asyncpg"
    client_keywords = frozenset({"connect_timeout"})
    #: A ttl is renewed every ttl / 3 with one round trip per held connection, which must be
    #: back before the local deadline (about 0.89 ttl). At 0.1 s that left some 55 ms, and 2 s
    #: holds were lost on a busy 2-core host (the fresh-clone runs, more than once): an event
    #: loop stalled a few tens of milliseconds is enough. 0.5 s leaves some 280 ms.
    min_ttl = 0.5
    #: Whether the holders' table is there for shared locks, semaphores, elections (open()).
    _holders_ready = False
    capabilities = Capabilities.every(quorum=False, ttl_change=False)
    #: ``acquire`` tries first (a lane's take, a permit's or a transaction's try) and says so
    #: (``answered``) before it waits: a timed acquire costs no try of the core's before it.
    acquire_tries_first = True

    def __init__(
        self,
        dsn: str,
        *,
        schema: str = "public",
        application_name: str = "asynclock",
        op_timeout: float = 5.0,
        connect_timeout: float = 5.0,
        max_idle: int = 4,
        ssl_context: ssl.SSLContext | None = None,
        max_waiting: int = 8,
        pooler: str | None = None,
        statement_cache_size: int = 16,
    ) -> None:
        self._dsn = dsn
        self.schema = schema
        self.application_name = application_name
        self.op_timeout = op_timeout
        self.connect_timeout = connect_timeout
        self.max_idle = max_idle
        self.max_waiting = max_waiting
        self.pooler = pooler
        self._ssl = ssl_context
        self.sequence = sequence_name(schema)
        self._described = redact(dsn.split("?", 1)[0])
        self.queue = queue_name(schema)
        self.holders = holders_name(schema)
        self._modes = modes(self.queue, self.holders)
        self._channel = f"asynclock {schema}"
        self._translator = Errors(
            self._described,
            connect_timeout,
            schema,
            self.sequence,
            creates(self.sequence, self.queue, CREATE_HOLDERS.format(holders=self.holders)),
        )
        #: The grant of each dedicated holding connection; our waiters in the server's queue.
        self._held: dict[Any, PostgresGrant] = {}
        self._server_version: str | None = None
        #: Settings of every connection opened after open() (see _server.CHECK_INTERVAL_MS).
        self._server_settings = {**_SERVER_SETTINGS, "application_name": application_name}
        self._host = TaskHost()
        self._renewals = Renewals(self._host, self._described, op_timeout)
        settings = Settings(
            dsn,
            schema,
            application_name,
            op_timeout,
            connect_timeout,
            max_idle,
            ssl_context,
            pooler=pooler,
            statement_cache_size=statement_cache_size,
        )
        self._assemble(settings)
        self._state = "new"

    def _assemble(self, settings: Settings) -> None:
        """The parts that run statements, built on the one Wire they share."""
        self._sessions = Sessions(
            settings,
            self._server_settings,
            self._translator,
            self._host,
            on_closed=self._connection_closed,
            busy=self._renewing,
        )
        self._wire = wire = Wire(
            host=self._host,
            sessions=self._sessions,
            errors=self._translator,
            schema=settings.schema,
            sequence=self.sequence,
            queue=self.queue,
            holders=self.holders,
            channel=self._channel,
            op_timeout=settings.op_timeout,
            held=self._held,
        )
        self._lanes = Lanes(wire)
        self._waits = Waits(wire)
        self._queue = Queue(wire, self._lanes)
        self._semaphores = Semaphores(wire, self._queue)
        if settings.statement_cache_size:  # (none: the user turned named statements off)
            lock = self._modes["lock", False]
            self._lanes.statements = (lock.lane_take, lock.unlock, *self._queue.lane_statements)
        self._waiter = Waiting(
            self._waits, self._queue, self._host, self.max_waiting, self._channel
        )
        self._inspector = Inspector(wire, self._queue, poll_interval=self.poll_interval)
        #: Every hold in a transaction of its own (``_transactions.py``), or None: locks on lanes.
        self._transactions: TransactionHolds | None = None
        if settings.pooler == "transaction":
            self.capabilities, self.limits = TRANSACTION_CAPABILITIES, TRANSACTION_LIMITS
            self._translator.transactions = self._queue.polls = True
            self._transactions = TransactionHolds(wire)

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_url(cls, url: str, options: Mapping[str, object]) -> Self:
        settings = read_url(url, options)
        # Each field of Settings is an argument of the same name (not asdict(): it deep-copies,
        # and an SSLContext cannot be copied).
        return cls(**{field.name: getattr(settings, field.name) for field in fields(settings)})

    def describe(self) -> str:
        return self._described

    def extra_info(self) -> Mapping[str, Any]:
        return {
            "server_version": self._server_version,
            "schema": self.schema,
            "sequence": self.sequence,
            "application_name": self.application_name,
            "op_timeout": self.op_timeout,
            "max_idle": self.max_idle,
            "max_waiting": self.max_waiting,
            "pooler": self.pooler,
            "pooler_found": self._sessions.pooled,
            "waiting_in_queue_table": self._queue.waiting,
            "connections": len(self._sessions.all),
            "holding_connections": len(self._lanes.by_ttl),
            "idle_connections": self._sessions.pool.idle,
        }

    def check_ttl(self, ttl: float) -> None:
        if ttl * 1000.0 > MAX_TIMEOUT_MS:
            raise InvalidArgument(
                f"ttl {ttl:g} s is longer than PostgreSQL's idle_session_timeout allows "
                f"({MAX_TIMEOUT_MS / 1000:g} s)"
            )

    # -- lifecycle ---------------------------------------------------------------------------

    async def open(self) -> None:
        if self._state != "new":
            raise RuntimeError("a PostgresBackend can be opened once")
        self._state = "open"
        await self._host.open()
        self._sessions.open = True
        try:
            async with self._sessions.pool.connection() as connection:
                await check_pooler(self._wire, self.pooler)
                local = self._transactions is not None
                with translate(self._translator, CHECKING), anyio.fail_after(self.op_timeout):
                    found = await check_server(connection, self._wire, local=local)
            self._server_version, self._holders_ready, checks = found
            if self._holders_ready and self._transactions is None:
                self._sessions.sweep_sql = SWEEP_SESSION.format(holders=self.holders)
            self._server_settings.update(checks)
            if self._transactions is not None:
                self._transactions.settings.update(checks)
            elif self.pooler is None and not self._sessions.pooled:
                # The holding connection of the default ttl connects now: a first acquire
                # would open it (a connection and its setup: 11-12 ms of a first lock() here,
                # 3-5.5 ms with it). Unused, it closes after half its ttl, as any lane. Not
                # through a pooler: there a connection nobody uses may be the one a full pool
                # lacks. One that fails to connect is left to the first acquire, which reports
                # its error.
                lane = self._lanes.lane(timeout_ms(DEFAULT_TTL))
                with anyio.move_on_after(self.connect_timeout + 1.0):
                    await lane.settled.wait()
        except BaseException:
            # Not in a shield scope: the task host's group, entered above, is left in there
            # (the steps of aclose() that must finish are shielded one by one).
            await self.aclose()
            raise

    async def aclose(self) -> None:
        if self._state == "closed":
            return
        self._state = "closed"
        self._queue.wake_observers()
        interrupted: BaseException | None = None
        try:
            await self._lanes.drain(min(self.op_timeout, 0.25))
        except BaseException as exc:  # a native cancel through the shield: close all the same
            interrupted = exc
        await self._sessions.aclose()
        self._lanes.close_all()  # the connected ones closed with the sessions
        # Their connections are closed, so every renewal query has ended or ends now.
        await self._renewals.wait_all(self.op_timeout)
        await self._host.aclose()
        if interrupted is not None:
            raise interrupted

    # -- the contract ------------------------------------------------------------------------

    async def try_acquire(self, request: LockRequest) -> PostgresGrant | None:
        return await self._take(request, wait=False)

    async def acquire(self, request: LockRequest) -> PostgresGrant:
        grant = await self._take(request, wait=True)
        assert grant is not None
        return grant

    async def _take(self, request: LockRequest, *, wait: bool) -> PostgresGrant | None:
        """Try on the lane of the request's ttl; if the lock is busy and ``wait``, wait for it
        in the server's queue on a dedicated connection (or in the queue table behind it).
        Semaphores take and wait their own way (``_semaphores.py``)."""
        if self._transactions is not None:
            # The client refuses the other kinds (TRANSACTION_CAPABILITIES).
            key = kind_key(request.name, request.kind, self.schema)
            return await self._transactions.take(request, key, timeout_ms(request.ttl), wait=wait)
        if (request.shared or request.kind != "lock") and not self._holders_ready:
            raise no_holders_table(request, self._described, self.holders)
        if request.kind == "semaphore":
            return await self._semaphores.take(request, wait=wait)
        key = kind_key(request.name, request.kind, self.schema)
        if not wait:
            return await self._place(request, key, None)
        # Waiters of one key take their places (the server's queue, the queue table) in the
        # order they asked: the turn passes on as this one's statement is sent (the server's
        # queue), its place is made (the table) or its try took the lock.
        turn = await self._waiter.placing.take(key)
        try:
            return await self._place(request, key, turn)
        finally:
            turn.give()

    async def _place(
        self, request: LockRequest, key: int, turn: Turn | None
    ) -> PostgresGrant | None:
        wait = turn is not None
        mode = self._modes[request.kind, request.shared and request.kind == "lock"]
        ttl_ms = timeout_ms(request.ttl)
        waiting = self._waiter.waiting.get(key, 0)
        # An exclusive lock this client last found busy: its acquire goes straight to the
        # server's queue, whose one statement takes it if it is free (on a dedicated connection,
        # when one is idle: else the lane's try takes a free lock without one).
        direct = wait and not waiting and key in self._waiter.contended and self._waits.at_hand
        if not (direct or (wait and waiting)):  # others of ours wait for it: it is busy
            if mode.shared and self._lanes.holds_shared(ttl_ms, key, mode):
                # The lane holds it shared already: a second hold there would be re-entrant
                # (past a waiting writer too), so this one tries on a connection of its own.
                grant = await self._waits.wait(
                    request,
                    key,
                    ttl_ms,
                    mode,
                    head=False,
                    sql=mode.try_dedicated,
                    args=(request.owner, request.value),
                    bound=self.op_timeout,
                )
            else:
                grant = await self._lanes.take(request, key, ttl_ms, mode, self._channel)
            if grant is not None or not wait:
                return grant
        answer = Answer(request)
        if not direct:
            # Busy (the try said so, or others of ours wait for it): the caller's timeout
            # applies from here; one already past ends the acquire before anything is queued.
            await answer.now()
        assert turn is not None
        return await self._waiter.wait(request, key, ttl_ms, mode, answer, turn)

    async def renew(self, grants: Sequence[PostgresGrant]) -> Sequence[RenewOutcome]:
        # One statement per lane, one per dedicated connection, all at the same time.
        return await self._lanes.renew_all(grants, self._renewals.renew)

    def _renewing(self, connection: Any) -> bool:
        lane = self._lanes.by_connection.get(connection)
        if lane is not None:
            return lane.busy
        grant = self._held.get(connection)
        return grant is not None and grant.renewal is not None

    async def release(self, grant: PostgresGrant) -> None:
        """Unlock, and keep the connection for reuse; or close it, which ends the session.

        Either frees the lock: an advisory lock ends with its session. So this never leaves
        work for a retry. A session already gone (revoked, restarted, ended by the server's
        idle timeout while this process was paused) took the lock with it: nothing to say. A
        connection that does not answer is closed instead: the server frees the lock when it
        reads the close (at once when it is reachable), at the latest ``ttl`` after the last
        renewal it received.
        """
        if grant.released:
            return
        grant.released = True
        if grant.lane is not None:
            await self._lanes.release(grant, grant.lane)
            gone = grant.lane.dead is not None
        else:
            await self._waits.release(grant)
            gone = grant.connection.is_closed()
        if grant.kept_key is not None and gone:
            # The session ended without deleting the hold's row: once it has (inspect never
            # shows the row meanwhile), so does this.
            await self._inspector.sweep(grant.kept_key, grant.pid)
        if grant.leaving is not None:
            # The queue place it came through is gone too when this returns (a statement
            # already queued on a lane; its error, if any, was dropped: a place of a dead
            # session expires). Last, after the unlock was queued: a native cancel here
            # costs no unlock. Waited for, not awaited: it must not cancel the statement.
            await asyncio.wait((grant.leaving.future,))

    async def inspect(self, name: str, kind: Kind = "lock") -> LockInfo:
        return await self._inspector.inspect(name, kind)

    async def wait_for_change(self, name: str, kind: Kind, seen: LockInfo, timeout: float) -> None:
        await self._inspector.wait_for_change(name, kind, seen, timeout)

    # -- loss --------------------------------------------------------------------------------

    def _connection_closed(self, connection: Any) -> None:
        """The connection closed, for whatever reason (``Sessions.closed_by_driver``)."""
        if self._lanes.closed(connection) or self._queue.closed(connection):
            return
        grant = self._held.pop(connection, None)
        if grant is not None and not grant.released:
            grant.on_lost(
                f"the connection holding the advisory lock on {self._described} closed (server "
                "restart, pg_terminate_backend, idle_session_timeout or a network failure); "
                "the lock ends with the session"
            )
