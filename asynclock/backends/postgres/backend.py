"""The PostgresBackend: takes on the holding connections, waits in the server's queue or the queue
table, renewals and releases."""

from __future__ import annotations

import logging
import ssl
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Self

import anyio

from .._kit import (
    Backend,
    Capabilities,
    InvalidArgument,
    Kind,
    LockInfo,
    LockRequest,
    RenewOutcome,
    TaskHost,
    now,
    redact,
    translate,
)
from ._lane import PostgresGrant
from ._lanes import Lanes
from ._queue import Queue
from ._renewals import Renewals
from ._server import check_version, ensure_queue, ensure_sequence, probe_check_interval
from ._sessions import Sessions
from ._sql import (
    CREATE,
    CREATE_QUEUE,
    INSPECT,
    INSPECT_QUEUE,
    MAX_TIMEOUT_MS,
    RELEASE,
    WAIT,
    creates,
    lock_key,
    marker_key,
    queue_name,
    sequence_name,
    timeout_ms,
)
from ._translate import CHECKING, Errors, connection_broken
from ._urls import Settings, read_url
from ._waits import Waits

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
#: How long after a renewal was sent a release waits for its reply before closing the connection
#: instead (a statement in flight: the connection cannot be unlocked and kept before it ends).
_RENEWAL_WAIT = 0.05


class PostgresBackend(Backend[PostgresGrant]):
    driver = "asyncpg"
    #: idle_session_timeout counts in milliseconds, and a ttl is renewed every ttl / 3 with one
    #: round trip per held connection, which must be back before the local deadline (about
    #: 0.89 ttl): 0.1 s leaves some 55 ms for it. On a shared 2-core machine with a local
    #: server, 2 s holds (20 ttls) at ttl 0.1 s kept their leases (tests/backends/test_postgres.py).
    min_ttl = 0.1
    capabilities = Capabilities(
        fencing=True, fifo=True, loss_detection=True, quorum=False, cross_process=True
    )

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
    ) -> None:
        self._dsn = dsn
        self.schema = schema
        self.application_name = application_name
        self.op_timeout = op_timeout
        self.connect_timeout = connect_timeout
        self.max_idle = max_idle
        self.max_waiting = max_waiting
        self._ssl = ssl_context
        #: The token sequence, as a quoted, schema-qualified name.
        self.sequence = sequence_name(schema)
        self._described = redact(dsn.split("?", 1)[0])
        self.queue = queue_name(schema)
        self._inspect_queue = INSPECT_QUEUE.format(queue=self.queue)
        self._translator = Errors(
            self._described,
            connect_timeout,
            schema,
            self.sequence,
            creates(self.sequence, self.queue),
        )
        #: The grant each holding connection holds.
        self._held: dict[Any, PostgresGrant] = {}
        #: How many of our acquires wait in the server's queue, by key.
        self._waiting: dict[int, int] = {}
        self._server_version: str | None = None
        #: Settings of every connection opened after open() (see _server.CHECK_INTERVAL_MS).
        self._server_settings = {**_SERVER_SETTINGS, "application_name": application_name}
        self._host = TaskHost()
        self._renewals = Renewals(self._host, self._described, op_timeout)
        settings = Settings(
            dsn, schema, application_name, op_timeout, connect_timeout, max_idle, ssl_context
        )
        self._sessions = Sessions(
            settings,
            self._server_settings,
            self._translator,
            self._host,
            on_closed=self._connection_closed,
            busy=self._renewing,
        )
        self._lanes = Lanes(
            self._host,
            self._translator,
            self.sequence,
            self.queue,
            op_timeout,
            connect=self._sessions.connect_lane,
            close=self._sessions.close,
        )
        self._waits = Waits(
            self._sessions,
            self._translator,
            self.sequence,
            WAIT.format(queue=self.queue),
            op_timeout,
            self._held,
            on_closed=self._connection_closed,
        )
        self._queue = Queue(
            host=self._host,
            sessions=self._sessions,
            lanes=self._lanes,
            errors=self._translator,
            sequence=self.sequence,
            queue=self.queue,
            channel=f"asynclock {schema}",
        )
        self._state = "new"

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_url(cls, url: str, options: Mapping[str, object]) -> Self:
        settings = read_url(url, options)
        return cls(
            settings.dsn,
            schema=settings.schema,
            application_name=settings.application_name,
            op_timeout=settings.op_timeout,
            connect_timeout=settings.connect_timeout,
            max_idle=settings.max_idle,
            ssl_context=settings.ssl_context,
            max_waiting=settings.max_waiting,
        )

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
            connection, _ = await self._sessions.take()
            try:
                with self._errors(CHECKING), anyio.fail_after(self.op_timeout):
                    self._server_version = check_version(connection, self._described)
                    await ensure_sequence(
                        connection,
                        sequence=self.sequence,
                        schema=self.schema,
                        create=CREATE.format(sequence=self.sequence),
                        server=self._described,
                    )
                    await ensure_queue(
                        connection,
                        queue=self.queue,
                        schema=self.schema,
                        create=CREATE_QUEUE.format(queue=self.queue),
                    )
                    await probe_check_interval(connection, self._server_settings)
            except BaseException:
                self._sessions.discard(connection)
                raise
            self._sessions.give_back(connection)
        except BaseException:
            # Not in a shield scope: the task host's group, entered above, is left in there
            # (the steps of aclose() that must finish are shielded one by one).
            await self.aclose()
            raise

    async def aclose(self) -> None:
        if self._state == "closed":
            return
        self._state = "closed"
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
        in the server's queue on a dedicated connection."""
        key = lock_key(request.name, self.schema)
        ttl_ms = timeout_ms(request.ttl)
        waiting = self._waiting.get(key, 0)
        if not (wait and waiting):  # others of ours wait for it: it is busy, queue behind
            grant = await self._lanes.take(request, key, ttl_ms)
            if grant is not None or not wait:
                return grant
        self._waiting[key] = self._waiting.get(key, 0) + 1
        try:
            if self._waits.waiting < self.max_waiting:
                grant = await self._waits.wait(request, key, ttl_ms, head=False)
                if grant is not None:
                    return grant
            return await self._queue.wait(
                request, key, ttl_ms, lambda: self._waits.wait(request, key, ttl_ms, head=True)
            )
        finally:
            left = self._waiting[key] - 1
            if left:
                self._waiting[key] = left
            else:
                del self._waiting[key]

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
            return
        connection = grant.connection
        self._held.pop(connection, None)
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
            await connection.execute(RELEASE, timeout=self.op_timeout)
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
                    self.describe(),
                    exc,
                    grant.ttl,
                )
            return
        self._sessions.give_back(connection)

    async def inspect(self, name: str, kind: Kind = "lock") -> LockInfo:
        signed = lock_key(name, self.schema)
        key = signed & 0xFFFFFFFFFFFFFFFF
        while True:
            connection, reused = await self._sessions.take()
            try:
                with self._errors(f"inspecting lock {name!r}"), anyio.fail_after(self.op_timeout):
                    rows = await connection.fetch(INSPECT, key >> 32, key & 0xFFFFFFFF)
                    marker = marker_key(signed) & 0xFFFFFFFFFFFFFFFF
                    queued = await connection.fetchval(
                        self._inspect_queue,
                        signed,
                        key >> 32,
                        key & 0xFFFFFFFF,
                        marker >> 32,
                        marker & 0xFFFFFFFF,
                    )
            except BaseException as exc:
                broken = connection_broken(connection, exc)
                self._sessions.discard(connection)  # holds no lock: closing it is all
                if reused and broken and isinstance(exc, Exception):
                    continue  # died in the pool: ask on another connection
                raise
            break
        self._sessions.give_back(connection)
        holders = [row for row in rows if row["granted"]]
        # In the server's queue, and in the queue table (its head, in both, once).
        waiters = len(rows) - len(holders) + int(queued)
        if not holders:
            return LockInfo(name, held=False, waiters=waiters)
        holder = holders[0]
        # The token lives in the holder's session only, and the server's idle timer is not
        # exposed to other sessions: neither is shown.
        return LockInfo(
            name,
            held=True,
            waiters=waiters,
            holder=f"{holder['application_name'] or '?'} (backend pid {holder['pid']})",
        )

    # -- loss --------------------------------------------------------------------------------

    def _connection_closed(self, connection: Any) -> None:
        """The connection closed, for whatever reason (asyncpg's termination listener)."""
        self._sessions.all.discard(connection)
        if self._lanes.closed(connection) or self._queue.closed(connection):
            return
        grant = self._held.pop(connection, None)
        if grant is not None and not grant.released:
            grant.on_lost(
                f"the connection holding the advisory lock on {self._described} closed (server "
                "restart, pg_terminate_backend, idle_session_timeout or a network failure); "
                "the lock ends with the session"
            )

    def _errors(self, what: str) -> AbstractContextManager[None]:
        return translate(self._translator, what)
