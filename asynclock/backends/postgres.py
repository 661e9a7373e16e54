"""``postgresql://user:password@host:5432/dbname``: session advisory locks on dedicated connections.

How a lock is held
    A held lock is a session-level advisory lock (``pg_advisory_lock(bigint)``) on a connection
    of its own. Its 64-bit key is derived from the schema and the full name (:func:`lock_key`),
    so only a hash collision can make two names share one lock, and sharing is safe: they
    exclude each other, nothing more. Session advisory locks are re-entrant and counted, which is
    why two leases never share a connection, and why a pooled connection is never used (pools
    run ``pg_advisory_unlock_all()`` on release). Idle dedicated connections are kept for reuse
    (``max_idle``); an idle one holds no advisory lock.

Waiting
    In the server: ``pg_advisory_lock`` blocks in PostgreSQL's lock queue, which grants the lock
    in the order the waiters asked.

Interrupted statements and dead connections
    A connection whose statement was cancelled or failed half-way (a cancelled wait, a take
    that timed out) is never used again: asyncpg's protocol state is then unknown (reusing it
    gave "cannot switch to state 12; another operation (2) is in progress"). It is closed at
    once, without an await, and its server session is ended with ``pg_terminate_backend`` from
    another connection before the take returns, since a session blocked in the lock queue does
    not read its socket (:meth:`PostgresBackend._end_session`, which survives any number of
    cancellations). ``client_connection_check_interval`` is a backstop for waiters of processes
    that died. A connection found dead when used (a pooled one the server or a proxy closed
    while it was idle, or a waiter's session that the server's idle timer ended while this
    process was paused) is replaced and the take starts again; only a new connection that fails
    too is an outage. A release never fails: unlocking keeps the connection, closing it ends the
    session, and either frees the lock.

The lease
    An advisory lock lives exactly as long as its session, so the lease is the session: a
    holder's connection runs with ``idle_session_timeout = ttl`` (PostgreSQL 14+), and the server
    closes a connection that sends nothing for ``ttl`` seconds, which frees the lock. A renewal
    is one tiny query per held connection (all run at once), which restarts the server's timer.
    A paused or cut-off client therefore loses the lock ``ttl`` after its last renewal, and its
    local deadline ends the body before that.

Tokens
    ``nextval()`` of one sequence, ``asynclock_token_seq`` in the configured schema (created on
    first use, ``CACHE 1``), called right after the lock is granted: in the same statement as the
    take when the lock is free, as the next statement after a wait. Sequence values increase
    across every session, so each acquisition of a name gets a larger token than the one before
    it; they are not consecutive per name. ``nextval`` is durable (with ``synchronous_commit=on``,
    which our connections set) and never rolled back, so tokens keep increasing across crashes
    and restarts of the server.

Loss
    The connection closing (``pg_terminate_backend``, a server restart, the idle timeout, a
    reset) is reported at once through asyncpg's termination listener; a renewal that finds the
    connection closed, or talking to another server session, reports it too.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import math
import ssl
import weakref
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Self
from urllib.parse import parse_qsl, quote, urlencode, urlsplit

import anyio
import asyncpg

from .._errors import (
    AcquireTimeout,
    BackendTimeout,
    BackendUnavailable,
    InvalidArgument,
    InvalidURL,
    map_exceptions,
)
from .._registry import redact
from .._shield import finish
from .._validate import Options, lock_name
from .._validate import timeout as check_timeout
from ..abc import (
    Backend,
    Capabilities,
    Grant,
    LockInfo,
    LockRequest,
    Lost,
    Renewed,
    RenewOutcome,
    Unknown,
)

__all__ = ("PostgresBackend", "PostgresGrant", "TransactionLock", "lock_key", "transaction_lock")

logger = logging.getLogger("asynclock")

_SCHEMES = ("postgresql", "postgres")
_EXAMPLE = "postgresql://user:password@127.0.0.1:5432/dbname?sslmode=require"
SEQUENCE = "asynclock_token_seq"
#: PostgreSQL truncates identifiers and application names to NAMEDATALEN - 1 bytes.
_NAME_MAX = 63
#: ``idle_session_timeout`` is an int of milliseconds.
_MAX_TIMEOUT_MS = 2**31 - 1
_SSLMODES = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")
#: libpq connection parameters handed to asyncpg as they are.
_LIBPQ_OPTIONS = (
    "host",
    "port",
    "user",
    "password",
    "dbname",
    "database",
    "service",
    "passfile",
    "sslmode",
    "sslrootcert",
    "sslcert",
    "sslkey",
    "sslpassword",
    "sslcrl",
    "sslnegotiation",
    "ssl_min_protocol_version",
    "ssl_max_protocol_version",
    "target_session_attrs",
    "krbsrvname",
    "gsslib",
)
_OWN_OPTIONS = ("schema", "application_name", "op_timeout", "connect_timeout", "max_idle", "ssl")

# Session settings of every dedicated connection: our waits are bounded by the caller, not by a
# server default; tokens must survive a crash; the idle timeout is set per lease.
_SERVER_SETTINGS = {
    "lock_timeout": "0",
    "statement_timeout": "0",
    "idle_session_timeout": "0",
    "idle_in_transaction_session_timeout": "0",
    "synchronous_commit": "on",
}

# Take the lock if it is free, arm the server's idle timer and draw the token: one round trip.
# No row comes back when the lock is busy. A row proves that the WHERE clause ran to its end,
# so the timer is armed whenever the lock was taken; set_config runs only after the lock was
# taken (AND evaluates left to right and stops at false), so a busy attempt leaves the timer
# at 0, which is what every connection in the idle pool has.
_TAKE = """
WITH attempt AS MATERIALIZED (SELECT pg_try_advisory_lock($1) AS taken)
SELECT nextval($2::regclass), pg_backend_pid() FROM attempt
WHERE attempt.taken AND set_config('idle_session_timeout', $3, false) IS NOT NULL
"""
# Wait in the server's lock queue. The idle timer is armed once granted, so a client that
# vanishes right after the grant still loses the lock after ttl.
_WAIT = "SELECT pg_advisory_lock($1), set_config('idle_session_timeout', $2, false)"
# After the wait: draw the token (under the lock) and restart the idle timer, which starts
# after this statement was sent: that send time is the lease's valid_from.
_TOKEN = "SELECT nextval($1::regclass), pg_backend_pid()"
_RENEW = "SELECT pg_backend_pid()"
# The connection is dedicated, so "all" is exactly our lock (with any re-entrant count).
_RELEASE = "SELECT pg_advisory_unlock_all(), set_config('idle_session_timeout', '0', false)"
_CREATE = "CREATE SEQUENCE IF NOT EXISTS {sequence} AS bigint NO CYCLE CACHE 1"
#: How long after a renewal was sent a release waits for its reply before closing the connection
#: instead (a statement in flight: the connection cannot be unlocked and kept before it ends).
_RENEWAL_WAIT = 0.05

# Make sure a session of ours has ended: the server process of a connection we closed while it
# had a statement in flight (a cancelled or failed wait, take or token). It may still be blocked
# in the lock queue, which does not read the socket: pg_terminate_backend ends it. Repeated until
# the process no longer shows, which it does until after it has released its locks (they go in
# a before_shmem_exit callback, its pg_stat_activity entry in a later on_shmem_exit one).
# (pg_terminate_backend's own wait polls in steps of 100 ms: far too slow for this.)
_END_SESSION = """
SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
WHERE pid = $1 AND usename = current_user AND application_name = $2
"""
#: Pause between two looks at a session that is ending, and the longest it is waited for.
_END_POLL = 0.002
_END_TIMEOUT = 1.0
#: How often a server process running one of our statements (a wait) checks that the client is
#: still there; a backstop for waits whose session we could not end ourselves (a killed
#: process). Probed at open: servers on platforms without the check refuse the setting.
_CHECK_INTERVAL_MS = "1000"
#: SQLSTATE classes of errors that end the session: 08 connection exception, 57P operator
#: intervention (pg_terminate_backend, shutdown, idle_session_timeout).
_SESSION_ENDED = ("08", "57P")

_ERRORS: dict[type[BaseException], type[BackendUnavailable]] = {
    TimeoutError: BackendTimeout,
    asyncpg.PostgresError: BackendUnavailable,
    asyncpg.InterfaceError: BackendUnavailable,
    asyncpg.InternalClientError: BackendUnavailable,
    OSError: BackendUnavailable,
}


def _connection_broken(connection: Any, error: BaseException) -> bool:
    """Whether ``error`` of a statement on ``connection`` says the connection itself is gone or
    unusable (closed by the server or the network, or asyncpg's protocol state confused), as
    opposed to the server not answering (a timeout) or refusing the statement (an SQL error)."""
    if isinstance(error, TimeoutError):
        return False
    if connection.is_closed():
        return True
    if isinstance(error, asyncpg.InterfaceError | asyncpg.InternalClientError | OSError):
        return True
    sqlstate = getattr(error, "sqlstate", None) or ""
    return isinstance(error, asyncpg.PostgresError) and sqlstate.startswith(_SESSION_ENDED)


def lock_key(name: str, schema: str = "public") -> int:
    """The advisory lock key (a signed 64-bit int) of lock ``name`` with tokens in ``schema``.

    The first 8 bytes of a BLAKE2b hash of the schema and the full UTF-8 name, so the key does
    not depend on the server's version or collation. In ``pg_locks`` the lock shows as
    ``locktype = 'advisory' AND objsubid = 1 AND classid = (key >> 32) & 0xFFFFFFFF AND
    objid = key & 0xFFFFFFFF``.
    """
    encoded_schema = schema.encode("utf-8")
    data = len(encoded_schema).to_bytes(2, "big") + encoded_schema + name.encode("utf-8")
    digest = hashlib.blake2b(data, digest_size=8, person=b"asynclock.pg").digest()
    return int.from_bytes(digest, "big", signed=True)


def _quote_ident(identifier: str) -> str:
    return '"' + identifier.replace('"', '""') + '"'


def _timeout_ms(seconds: float) -> int:
    # Rounded up: the server must never expire the lease before the client's ttl.
    return max(1, math.ceil(seconds * 1000.0))


@dataclass(eq=False, slots=True)
class PostgresGrant(Grant):
    """A held advisory lock: its key, and the dedicated connection that holds it."""

    key: int
    #: The server process of the session that holds the lock (checked on every renewal).
    pid: int
    connection: Any = field(repr=False)
    on_lost: Callable[[str], None] = field(repr=False)
    #: The renewal query in flight, if any, and when it was sent.
    renewal: asyncio.Task[Any] | None = field(default=None, repr=False)
    renewal_sent_at: float = 0.0
    released: bool = False


class TransactionLock(NamedTuple):
    """What :func:`transaction_lock` yields: the connection in its transaction, and the token."""

    connection: Any
    token: int


class PostgresBackend(Backend[PostgresGrant]):
    schemes = _SCHEMES
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
    ) -> None:
        self._dsn = dsn
        self.schema = schema
        self.application_name = application_name
        self.op_timeout = op_timeout
        self.connect_timeout = connect_timeout
        self.max_idle = max_idle
        self._ssl = ssl_context
        #: The token sequence, as a quoted, schema-qualified name.
        self.sequence = f"{_quote_ident(schema)}.{_quote_ident(SEQUENCE)}"
        #: Connections with no lock and no statement running, most recently used last.
        self._idle: list[Any] = []
        #: Every open connection of ours: idle, waiting or holding.
        self._connections: set[Any] = set()
        #: The grant each holding connection holds.
        self._held: dict[Any, PostgresGrant] = {}
        #: The server process of each connection (asyncpg forgets it once it aborted one).
        self._pids: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self._described = redact(dsn.split("?", 1)[0])
        #: Renewal queries in flight (see _renew_one); each ends with its query or connection.
        self._renewals: set[asyncio.Task[Any]] = set()
        #: Connects in flight (see _connect), and those whose caller stopped waiting.
        self._connecting: set[asyncio.Task[Any]] = set()
        self._abandoned: set[asyncio.Task[Any]] = set()
        self._server_version: str | None = None
        #: Settings of every connection opened after open() (see _CHECK_INTERVAL_MS).
        self._server_settings = {**_SERVER_SETTINGS, "application_name": application_name}
        self._state = "new"

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_url(cls, url: str, options: Mapping[str, object]) -> Self:
        if not isinstance(url, str):
            raise InvalidURL(f"the PostgreSQL URL must be a str, for example {_EXAMPLE}")
        base, _, query = url.partition("?")
        try:
            parts = urlsplit(base)
            query_options = dict(
                parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
            )
        except ValueError as exc:
            raise InvalidURL(
                f"malformed PostgreSQL URL {redact(url)!r}: {exc}; expected {_EXAMPLE}"
            ) from None
        if parts.scheme.lower() not in _SCHEMES:
            raise InvalidURL(f"{redact(url)!r} is not a PostgreSQL URL; expected {_EXAMPLE}")
        if parts.fragment:
            raise InvalidURL(
                f"a PostgreSQL URL has no #fragment: {redact(url)!r}; expected {_EXAMPLE}"
            )
        _check_hosts(parts.netloc, url)
        if "/" in parts.path[1:]:
            raise InvalidURL(
                f"the path of {redact(url)!r} must be one database name; expected {_EXAMPLE}"
            )
        opts = Options({**query_options, **options}, "postgresql://")
        schema = opts.text("schema", "public")
        if not schema or len(schema.encode("utf-8")) > _NAME_MAX or "\x00" in schema:
            raise InvalidArgument(
                f"option 'schema' of postgresql:// must be a schema name of 1 to {_NAME_MAX} "
                f"bytes, got {schema!r}"
            )
        application_name = opts.text("application_name", "asynclock")
        if len(application_name) > _NAME_MAX or not all(
            " " <= char <= "~" for char in application_name
        ):
            raise InvalidArgument(
                "option 'application_name' of postgresql:// must be printable ASCII of at most "
                f"{_NAME_MAX} characters (pg_stat_activity shows it), got {application_name!r}"
            )
        op_timeout = opts.number("op_timeout", 5.0, minimum=0.001)
        connect_timeout = opts.number("connect_timeout", 5.0, minimum=0.001)
        max_idle = opts.whole("max_idle", 4, minimum=0)
        ssl_context = opts.pop_raw("ssl")
        if ssl_context is not None and not isinstance(ssl_context, ssl.SSLContext):
            raise InvalidArgument(
                "option 'ssl' of postgresql:// must be an ssl.SSLContext (or put sslmode=... "
                f"and sslrootcert=... in the URL), got {type(ssl_context).__name__}"
            )
        passed: dict[str, str] = {}
        for key in _LIBPQ_OPTIONS:
            value = opts.optional_text(key)
            if value is not None:
                passed[key] = value
        sslmode = passed.get("sslmode")
        if sslmode is not None and sslmode not in _SSLMODES:
            raise InvalidArgument(
                f"option 'sslmode' of postgresql:// must be one of {', '.join(_SSLMODES)}, "
                f"got {sslmode!r}"
            )
        opts.finish((*_OWN_OPTIONS, *_LIBPQ_OPTIONS))
        dsn = parts._replace(query=urlencode(passed, quote_via=quote)).geturl()
        return cls(
            dsn,
            schema=schema,
            application_name=application_name,
            op_timeout=op_timeout,
            connect_timeout=connect_timeout,
            max_idle=max_idle,
            ssl_context=ssl_context,
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
            "connections": len(self._connections),
            "idle_connections": len(self._idle),
        }

    def check_ttl(self, ttl: float) -> None:
        if ttl * 1000.0 > _MAX_TIMEOUT_MS:
            raise InvalidArgument(
                f"ttl {ttl:g} s is longer than PostgreSQL's idle_session_timeout allows "
                f"({_MAX_TIMEOUT_MS / 1000:g} s)"
            )

    # -- lifecycle ---------------------------------------------------------------------------

    async def open(self) -> None:
        if self._state != "new":
            raise RuntimeError("a PostgresBackend can be opened once")
        self._state = "open"
        connection = await self._connect()
        try:
            with self._errors("checking the server"), anyio.fail_after(self.op_timeout):
                self._check_version(connection)
                await self._ensure_sequence(connection)
                await self._probe_check_interval(connection)
        except BaseException:
            self._discard(connection)
            raise
        self._idle.append(connection)

    async def _probe_check_interval(self, connection: Any) -> None:
        try:
            await connection.execute(f"SET client_connection_check_interval = {_CHECK_INTERVAL_MS}")
        except asyncpg.PostgresError:
            return  # a server platform without the check: the backstop is simply absent
        self._server_settings["client_connection_check_interval"] = _CHECK_INTERVAL_MS

    def _check_version(self, connection: Any) -> None:
        version = connection.get_server_version()
        self._server_version = f"{version.major}.{version.minor}"
        if version.major < 14:
            raise BackendUnavailable(
                f"{self.describe()} runs PostgreSQL {self._server_version}; asynclock needs 14 "
                "or later (it relies on idle_session_timeout to expire the lease of a client "
                "that stopped renewing)"
            )

    async def _ensure_sequence(self, connection: Any) -> None:
        create = _CREATE.format(sequence=self.sequence)
        try:
            if await connection.fetchval("SELECT to_regclass($1)", self.sequence) is None:
                async with connection.transaction():
                    # Concurrent CREATE ... IF NOT EXISTS can still collide on the catalog's
                    # unique index: one creator at a time.
                    await connection.execute(
                        "SELECT pg_advisory_xact_lock($1)", lock_key("create sequence", self.schema)
                    )
                    await connection.execute(create)
            cache = await connection.fetchval(
                "SELECT seqcache FROM pg_sequence WHERE seqrelid = to_regclass($1)", self.sequence
            )
        except asyncpg.InvalidSchemaNameError:
            raise BackendUnavailable(
                f"the schema {self.schema!r} does not exist on {self.describe()}: create it "
                "(CREATE SCHEMA ...) or choose another with ?schema=..."
            ) from None
        except asyncpg.InsufficientPrivilegeError:
            raise BackendUnavailable(
                f"the user of {self.describe()} may not create the token sequence: create it once "
                f"as its owner with {create}, and GRANT USAGE ON SEQUENCE {self.sequence} TO "
                "the lock users"
            ) from None
        if cache is None:
            raise BackendUnavailable(
                f"{self.sequence} on {self.describe()} is not a sequence; drop it or choose "
                "another ?schema=..."
            )
        if cache != 1:
            # Sessions would draw from private caches: a later holder could get a smaller token.
            raise BackendUnavailable(
                f"the token sequence {self.sequence} has CACHE {cache}, so tokens would not "
                f"increase across sessions: ALTER SEQUENCE {self.sequence} CACHE 1"
            )

    async def aclose(self) -> None:
        if self._state == "closed":
            return
        self._state = "closed"
        with anyio.CancelScope(shield=True):
            # Cancelling a connect that a healthy server is about to complete can make asyncpg
            # log an error (see _connect), so give those a moment; one stuck on a server that
            # does not answer is waiting for a reply, where cancelling it is clean.
            if self._connecting:
                await asyncio.wait(self._connecting, timeout=min(self.connect_timeout, 0.5))
                for task in list(self._connecting):
                    task.cancel()
            connections = list(self._connections)
            self._connections.clear()
            self._idle.clear()
            async with anyio.create_task_group() as task_group:
                for connection in connections:
                    task_group.start_soon(self._close, connection)
            # Their connections are closed, so every renewal query has ended or ends now.
            if self._renewals:
                await asyncio.wait(self._renewals, timeout=self.op_timeout)

    # -- the contract ------------------------------------------------------------------------

    async def try_acquire(self, request: LockRequest) -> PostgresGrant | None:
        return await self._take(request, wait=False)

    async def acquire(self, request: LockRequest) -> PostgresGrant:
        grant = await self._take(request, wait=True)
        assert grant is not None
        return grant

    async def _take(self, request: LockRequest, *, wait: bool) -> PostgresGrant | None:
        """Take the lock (``wait``: in the server's queue until it is ours) on a connection that
        holds nothing, with its token.

        A statement that fails or is cancelled half-way leaves its connection in a state nobody
        knows (asyncpg's protocol may still expect the reply), so that connection is closed, never
        reused, and its server session is ended before this returns (:meth:`_end_session`): a
        cancelled wait leaves the server's queue, a lock granted at the last moment is free
        again. A connection that turns out to be dead (a pooled one the server or a proxy closed
        while it was idle, or a waiter's session the server ended while this process was paused)
        is replaced and the take starts again: that is no outage. Only a new connection that
        fails as well is reported.
        """
        key = lock_key(request.name, self.schema)
        ttl_ms = str(_timeout_ms(request.ttl))
        fresh_failures = 0
        while True:
            connection, reused = await self._checkout_reporting()
            try:
                with self._errors(f"taking {request.name!r}"):
                    sent_at = anyio.current_time()
                    row = await connection.fetchrow(
                        _TAKE, key, self.sequence, ttl_ms, timeout=self.op_timeout
                    )
                    if row is None and not wait:
                        self._checkin(connection)
                        return None
                    if row is None:
                        fresh_failures = 0  # the connection works: a later death is its own
                        # Queue in the server; the caller's cancel scope bounds the wait.
                        await connection.execute(_WAIT, key, ttl_ms)
                        sent_at = anyio.current_time()
                        row = await connection.fetchrow(
                            _TOKEN, self.sequence, timeout=self.op_timeout
                        )
            except BaseException as exc:
                broken = _connection_broken(connection, _unmapped(exc))
                await self._end_session(connection, request.name, _unmapped(exc))
                if not isinstance(exc, Exception) or not broken:
                    raise
                if not reused:
                    fresh_failures += 1
                    if fresh_failures >= 2:
                        raise
                logger.info(
                    "asynclock: a connection to %s died while taking %r (%r); taking it on "
                    "another one",
                    self.describe(),
                    request.name,
                    _unmapped(exc),
                )
                continue
            return self._grant(request, key, connection, row, sent_at)

    async def renew(self, grants: Sequence[PostgresGrant]) -> Sequence[RenewOutcome]:
        if len(grants) == 1:
            return [await self._renew_one(grants[0])]
        outcomes: list[RenewOutcome] = [Unknown(RuntimeError("not renewed"))] * len(grants)

        async def renew_one(index: int, grant: PostgresGrant) -> None:
            outcomes[index] = await self._renew_one(grant)

        # One round trip per connection is unavoidable (each has its own idle timer); they all
        # run at the same time.
        async with anyio.create_task_group() as task_group:
            for index, grant in enumerate(grants):
                task_group.start_soon(renew_one, index, grant)
        return outcomes

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
        connection = grant.connection
        self._held.pop(connection, None)
        if connection.is_closed():
            self._forget(connection)
            return
        try:
            renewal = grant.renewal
            if renewal is not None:
                # Its statement is in flight. A renewal just sent on a healthy server is back
                # within milliseconds; one that has not come back by now (a hung server, often
                # why the lease was lost) is not waited for: closing frees the lock just the same.
                left = grant.renewal_sent_at + _RENEWAL_WAIT - anyio.current_time()
                if left <= 0 or not await _finished(renewal, left):
                    self._discard(connection)
                    return
            await connection.execute(_RELEASE, timeout=self.op_timeout)
        except BaseException as exc:
            # Closed at once, never reused: whatever state the statement left, the session
            # ends with the connection, and the lock with it.
            gone = _connection_broken(connection, exc)
            self._discard(connection)
            if isinstance(exc, Exception) and not gone:
                logger.warning(
                    "asynclock: unlocking %r on %s failed (%r); closed its connection "
                    "instead, so the server frees the lock when it reads the close, at the "
                    "latest %g s after the last renewal it received",
                    grant.name,
                    self.describe(),
                    exc,
                    grant.ttl,
                )
            if not isinstance(exc, Exception):
                raise
            return
        self._checkin(connection)

    async def _end_session(
        self, connection: Any, name: str, error: BaseException | None = None
    ) -> None:
        """Close ``connection`` at once, and make sure its server session has ended too.

        The close alone ends a session that is idle or finishing a short statement within
        milliseconds, but not one blocked in the lock queue, which does not read its socket:
        so ``pg_terminate_backend`` from another connection ends it, and this returns once the
        server process is gone (a few milliseconds). Survives any cancellation
        (``asynclock._shield.finish``) and is bounded by ``min(op_timeout, 1 s)``: a server
        that does not answer gets the close, and the check of its connections, instead.
        Skipped after a timeout (``error``), which only a short statement can have.
        """
        pid = self._pids.get(connection)
        self._discard(connection)  # no await before: nothing can cancel the close
        if pid is None or isinstance(error, TimeoutError):
            return  # the server did not answer: another connection would wait as long

        def unfinished() -> None:
            logger.info(
                "asynclock: %s did not answer while ending session %d of an interrupted take "
                "of %r; it ends when the server reads the close",
                self.describe(),
                pid,
                name,
            )

        await finish(
            functools.partial(self._terminate_session, pid, name),
            timeout=min(self.op_timeout, _END_TIMEOUT),
            what=f"ending the server session {pid} of an interrupted take of {name!r}",
            unfinished=unfinished,
        )

    async def _terminate_session(self, pid: int, name: str) -> None:
        # Idempotent (finish() may run it again from the start): ending an ended session is a
        # no-op, and a connection whose statement was interrupted is closed, not reused.
        try:
            helper = await self._checkout()
        except Exception as exc:
            logger.info("asynclock: cannot end the session %d of %r: %r", pid, name, exc)
            return
        try:
            while True:
                if not await helper.fetchval(
                    _END_SESSION, pid, self.application_name, timeout=self.op_timeout
                ):
                    break
                await anyio.sleep(_END_POLL)
        except BaseException as exc:
            self._discard(helper)
            if not isinstance(exc, Exception):
                raise
            logger.info("asynclock: cannot end the session %d of %r: %r", pid, name, exc)
            return
        self._checkin(helper)

    # -- connections -------------------------------------------------------------------------

    async def _connect(self) -> Any:
        """A new dedicated connection, bounded by ``connect_timeout``.

        The connect runs in a task of its own that our caller waits for but never cancels:
        asyncpg leaves an exception that nobody retrieves (logged as an error by asyncio) when a
        connect is cancelled inside its TLS negotiation (sslmode=prefer, the default; see
        MagicStack/asyncpg#1211 and #1310). A caller that is cancelled stops waiting at once;
        the connect then ends on its own (within ``connect_timeout``) and its connection joins
        the idle pool.
        """
        if self._state != "open":
            raise BackendUnavailable(f"the lock client for {self.describe()} is closed")
        task = asyncio.ensure_future(self._open_connection())
        self._connecting.add(task)
        task.add_done_callback(self._connect_done)
        try:
            await asyncio.wait((task,))
        except BaseException:
            if task.done():
                self._adopt(task)
            else:
                self._abandoned.add(task)
            raise
        if task.cancelled():  # by aclose()
            raise BackendUnavailable(f"the lock client for {self.describe()} is closed")
        connection = task.result()
        if self._state != "open":
            connection.terminate()
            raise BackendUnavailable(f"the lock client for {self.describe()} is closed")
        self._adopted(connection)
        return connection

    def _adopted(self, connection: Any) -> None:
        self._connections.add(connection)
        self._pids[connection] = connection.get_server_pid()
        connection.add_termination_listener(self._connection_closed)

    def _connection_closed(self, connection: Any) -> None:
        """asyncpg's termination listener: the connection closed, for whatever reason."""
        self._forget(connection)
        grant = self._held.pop(connection, None)
        if grant is not None and not grant.released:
            grant.on_lost(
                f"the connection holding the advisory lock on {self._described} closed (server "
                "restart, pg_terminate_backend, idle_session_timeout or a network failure); "
                "the lock ends with the session"
            )

    def _connect_done(self, task: asyncio.Task[Any]) -> None:
        self._connecting.discard(task)
        if task in self._abandoned:
            self._abandoned.discard(task)
            self._adopt(task)

    def _adopt(self, task: asyncio.Task[Any]) -> None:
        """Take over the result of a connect whose caller stopped waiting for it."""
        if task.cancelled() or task.exception() is not None:
            return
        connection = task.result()
        if self._state == "open":
            self._adopted(connection)
            self._checkin(connection)
        else:
            connection.terminate()

    async def _open_connection(self) -> Any:
        try:
            # asyncpg's own timeout bounds each attempt; ours bounds the whole call.
            with anyio.fail_after(self.connect_timeout + 1.0):
                return await asyncpg.connect(
                    self._dsn,
                    ssl=self._ssl,
                    timeout=self.connect_timeout,
                    statement_cache_size=16,
                    server_settings=self._server_settings,
                )
        except TimeoutError as exc:
            raise BackendTimeout(
                f"cannot connect to {self.describe()} within {self.connect_timeout:g} s: check "
                "that PostgreSQL runs and is reachable there, or raise ?connect_timeout="
            ) from exc
        except asyncpg.TooManyConnectionsError as exc:
            raise BackendUnavailable(
                f"{self.describe()} refused a new connection: {exc}. Each held or waiting lock "
                "uses a connection of its own: raise max_connections on the server"
            ) from exc
        except (
            asyncpg.InvalidAuthorizationSpecificationError,
            asyncpg.InvalidPasswordError,
        ) as exc:
            raise BackendUnavailable(
                f"{self.describe()} refused the login: {exc}. Check the user and password and "
                "the server's pg_hba.conf"
            ) from exc
        except asyncpg.InvalidCatalogNameError as exc:
            raise BackendUnavailable(f"{self.describe()}: {exc}; check the database name") from exc
        except ssl.SSLError as exc:
            raise BackendUnavailable(
                f"cannot connect to {self.describe()}: TLS failed: {exc}. Check sslmode and "
                "sslrootcert (the CA that signed the server's certificate), or the ssl context"
            ) from exc
        except FileNotFoundError as exc:
            raise BackendUnavailable(
                f"cannot connect to {self.describe()}: {exc}: a file named in the options "
                "(sslrootcert, sslcert, sslkey, passfile) does not exist"
            ) from exc
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            raise BackendUnavailable(
                f"cannot connect to {self.describe()}: {type(exc).__name__}: {exc}. Check that "
                "PostgreSQL runs there and accepts TCP connections (listen_addresses, port, "
                "pg_hba.conf)"
            ) from exc

    async def inspect(self, name: str) -> LockInfo:
        key = lock_key(name, self.schema) & 0xFFFFFFFFFFFFFFFF
        while True:
            connection, reused = await self._checkout_reporting()
            try:
                with map_exceptions(_ERRORS, f"inspecting lock {name!r} on {self.describe()}"):
                    with anyio.fail_after(self.op_timeout):
                        rows = await connection.fetch(
                            "SELECT l.granted, l.pid, a.application_name "
                            "FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
                            "WHERE l.locktype = 'advisory' AND l.objsubid = 1 "
                            "AND l.classid = $1 AND l.objid = $2",
                            key >> 32,
                            key & 0xFFFFFFFF,
                        )
            except BaseException as exc:
                broken = _connection_broken(connection, _unmapped(exc))
                self._discard(connection)  # holds no lock: closing it is all the clean-up
                if reused and broken and isinstance(exc, Exception):
                    continue  # died in the pool: ask on another connection
                raise
            break
        self._checkin(connection)
        holders = [row for row in rows if row["granted"]]
        waiters = len(rows) - len(holders)
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

    async def _checkout(self) -> Any:
        connection, _ = await self._checkout_reporting()
        return connection

    async def _checkout_reporting(self) -> tuple[Any, bool]:
        """A connection that holds nothing, and whether it comes from the idle pool (it may
        have died there without asyncpg having noticed yet)."""
        while self._idle:
            connection = self._idle.pop()
            if not connection.is_closed():
                return connection, True
            self._forget(connection)
        return await self._connect(), False

    def _checkin(self, connection: Any) -> None:
        """Keep a connection that holds no lock for reuse, or close it."""
        if self._state == "open" and len(self._idle) < self.max_idle and not connection.is_closed():
            self._idle.append(connection)
        else:
            self._discard(connection)

    def _discard(self, connection: Any) -> None:
        self._forget(connection)
        connection.terminate()

    def _forget(self, connection: Any) -> None:
        self._connections.discard(connection)

    async def _close(self, connection: Any) -> None:
        grant = self._held.get(connection)
        if grant is not None and grant.renewal is not None:
            connection.terminate()  # a statement in flight: asyncpg's close would cancel it
            return
        try:
            await connection.close(timeout=self.op_timeout)
        except Exception:
            connection.terminate()

    # -- grants and renewals -----------------------------------------------------------------

    def _grant(
        self, request: LockRequest, key: int, connection: Any, row: Any, sent_at: float
    ) -> PostgresGrant:
        grant = PostgresGrant(
            name=request.name,
            owner=request.owner,
            token=int(row[0]),
            valid_from=sent_at,
            ttl=_timeout_ms(request.ttl) / 1000.0,
            key=key,
            pid=int(row[1]),
            connection=connection,
            on_lost=request.on_lost,
        )
        self._held[connection] = grant
        if connection.is_closed():
            # Closed between the reply and now: the listener may have run already.
            self._connection_closed(connection)
        return grant

    async def _renew_one(self, grant: PostgresGrant) -> RenewOutcome:
        """Restart the server's idle timer of one held connection.

        The query is never cancelled: a renewal that is slow (a network blip) still restarts
        the timer when it reaches the server, and its late reply is a valid renewal from its send
        time. Cancelling it would make asyncpg send a CancelRequest and, if that cannot get
        through either, close the connection at the next query, losing a lease that the blip
        alone would not have cost. So the query runs in a task of the grant's own, at most one
        at a time; it ends with the query or with the connection (release and aclose close
        connections they cannot use), and this call waits for it up to ``op_timeout``.
        """
        connection = grant.connection
        if grant.released:
            return Lost("the lock was released")
        if connection.is_closed():
            return Lost(
                "the connection holding the advisory lock closed; the lock ends with the session"
            )
        renewal = grant.renewal
        if renewal is None:
            grant.renewal_sent_at = anyio.current_time()
            renewal = grant.renewal = asyncio.ensure_future(connection.fetchval(_RENEW))
            self._renewals.add(renewal)
            renewal.add_done_callback(self._renewal_done(grant))
        sent_at = grant.renewal_sent_at
        if not await _finished(renewal, self.op_timeout) or renewal.cancelled():
            return Unknown(
                BackendTimeout(
                    f"renewing {grant.name!r} on {self.describe()}: no answer for "
                    f"{anyio.current_time() - sent_at:.3g} s"
                )
            )
        error = renewal.exception()
        if error is not None:
            if connection.is_closed():
                return Lost(
                    f"the connection holding the advisory lock closed ({type(error).__name__}); "
                    "the lock ends with the session"
                )
            return Unknown(error)
        pid = renewal.result()
        if pid != grant.pid:
            return Lost(
                f"the connection now reaches server process {pid}, not {grant.pid} which held "
                "the lock (a connection pooler in between?); the lock ended with that session"
            )
        return Renewed(sent_at, grant.ttl)

    def _renewal_done(self, grant: PostgresGrant) -> Callable[[asyncio.Task[Any]], None]:
        def done(task: asyncio.Task[Any]) -> None:
            self._renewals.discard(task)
            if grant.renewal is task:
                grant.renewal = None
            if not task.cancelled():
                task.exception()  # retrieved: asyncio must not log it as forgotten

        return done

    def _errors(self, what: str) -> Any:
        return map_exceptions(_ERRORS, f"{what} on {self.describe()}")


def _unmapped(error: BaseException) -> BaseException:
    """The driver's error behind one of ours (see map_exceptions), or ``error`` itself."""
    cause = error.__cause__
    return cause if isinstance(error, BackendUnavailable) and cause is not None else error


async def _finished(task: asyncio.Task[Any], timeout: float) -> bool:
    """Wait up to ``timeout`` for ``task`` without cancelling it; whether it has finished."""
    if not task.done():
        with anyio.move_on_after(timeout):
            await asyncio.wait((task,))
    return task.done()


def _check_hosts(netloc: str, url: str) -> None:
    hosts = netloc.rpartition("@")[2]
    if not hosts:
        return
    for entry in hosts.split(","):
        host, port = entry, ""
        if entry.startswith("["):
            closing = entry.find("]")
            rest = entry[closing + 1 :] if closing >= 0 else ""
            if closing < 0 or (rest and not rest.startswith(":")):
                raise InvalidURL(f"bad host {entry!r} in {redact(url)!r}; expected {_EXAMPLE}")
            host, port = entry[: closing + 1], rest[1:]
        elif ":" in entry:
            host, _, port = entry.partition(":")
        if not host and len(hosts.split(",")) > 1:
            raise InvalidURL(f"an empty host in {redact(url)!r}; expected {_EXAMPLE}")
        if (port or entry.endswith(":")) and not (port.isdigit() and 0 < int(port) < 65536):
            raise InvalidURL(
                f"the port {port!r} in {redact(url)!r} is not a number from 1 to 65535; "
                f"expected {_EXAMPLE}"
            )


# -- the transaction-scoped variant ---------------------------------------------------------

# Wait for the transaction-level lock, then draw the token: the outer SELECT needs the CTE's
# row, so the lock is granted before nextval runs.
_XACT_WAIT = """
WITH granted AS MATERIALIZED (SELECT pg_advisory_xact_lock($1))
SELECT nextval($2::regclass) FROM granted
"""
_RESET = "SELECT pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *; RESET ALL; DISCARD TEMP"
_XACT_TRY = """
WITH attempt AS MATERIALIZED (SELECT pg_try_advisory_xact_lock($1) AS taken)
SELECT nextval($2::regclass) FROM attempt WHERE attempt.taken
"""


@asynccontextmanager
async def transaction_lock(
    target: Any,
    name: str,
    *,
    timeout: float | None = None,
    idle_timeout: float | None = 30.0,
    isolation: str | None = None,
    schema: str = "public",
) -> AsyncIterator[TransactionLock]:
    """Hold lock ``name`` for one database transaction; yields ``(connection, token)``.

    For critical sections that are writes to this same database: the lock
    (``pg_advisory_xact_lock``) and the writes commit or roll back together, so a client that
    stalls or loses its connection loses its uncommitted writes along with the lock. The body
    runs inside the transaction on ``connection``; leaving the block normally commits, an
    exception rolls back. The lock excludes holders of ``locks.lock(name)`` (same name and
    schema) and the other way round.

    ``target`` is a :class:`asynclock.LockClient` on ``postgresql://`` or a
    :class:`PostgresBackend` (a dedicated connection is borrowed from it), a ``postgresql://``
    URL (a connection is opened for this block), or an asyncpg connection of yours (used as it
    is; inside a transaction of yours this one is a savepoint and the lock lasts until your
    outermost transaction ends). ``schema`` only applies to an asyncpg connection; the others
    use their own ``schema`` option.

    ``timeout``: ``None`` waits (in the server's FIFO queue), 0 tries once, a positive number
    bounds the wait; past it, :class:`asynclock.AcquireTimeout`. ``idle_timeout`` (seconds, or
    None to keep the session's setting) sets ``idle_in_transaction_session_timeout`` for the
    transaction: a client that stalls that long between two statements is disconnected by the
    server, its transaction rolled back and the lock freed. ``isolation`` is asyncpg's
    (``"serializable"``, ``"repeatable_read"``, ``"read_committed"``).

    The token comes from the same sequence as ``locks.lock()``'s and is never reused, also when
    the transaction rolls back.
    """
    name = lock_name(name)
    timeout = check_timeout(timeout)
    if idle_timeout is not None and (
        isinstance(idle_timeout, bool)
        or not isinstance(idle_timeout, int | float)
        or not 0 < idle_timeout * 1000 <= _MAX_TIMEOUT_MS
    ):
        raise InvalidArgument(
            f"idle_timeout must be a number of seconds > 0 (at most {_MAX_TIMEOUT_MS // 1000}) "
            f"or None, got {idle_timeout!r}"
        )
    if isinstance(target, str):
        opened = _backend_from_url(target)
        async with opened:
            async with _on_backend(opened, name, timeout, idle_timeout, isolation) as held:
                yield held
        return
    borrowed = _backend_of(target)
    if borrowed is not None:
        async with _on_backend(borrowed, name, timeout, idle_timeout, isolation) as held:
            yield held
        return
    if not isinstance(target, asyncpg.Connection | asyncpg.pool.PoolConnectionProxy):
        raise InvalidArgument(
            "transaction_lock needs a LockClient or PostgresBackend on postgresql://, a "
            f"postgresql:// URL or an asyncpg connection, not {type(target).__name__}"
        )
    sequence = f"{_quote_ident(schema)}.{_quote_ident(SEQUENCE)}"
    async with _transaction(
        target, name, lock_key(name, schema), sequence, timeout, idle_timeout, isolation, 5.0
    ) as held:
        yield held


def _backend_from_url(url: str) -> PostgresBackend:
    from .._registry import make_backend

    backend = make_backend(url, {"max_idle": 1})
    if not isinstance(backend, PostgresBackend):
        raise InvalidArgument(f"transaction_lock needs a postgresql:// URL, got {redact(url)!r}")
    return backend


def _backend_of(target: object) -> PostgresBackend | None:
    from .._client import LockClient

    if isinstance(target, PostgresBackend):
        return target
    if isinstance(target, LockClient):
        backend = target._backend
        if not isinstance(backend, PostgresBackend):
            raise InvalidArgument(
                f"transaction_lock needs a lock client on postgresql://, not on "
                f"{backend.describe()}"
            )
        return backend
    return None


@asynccontextmanager
async def _on_backend(
    backend: PostgresBackend,
    name: str,
    timeout: float | None,
    idle_timeout: float | None,
    isolation: str | None,
) -> AsyncIterator[TransactionLock]:
    fresh_failures = 0
    while True:
        connection, reused = await backend._checkout_reporting()
        body_ran = False
        try:
            async with _transaction(
                connection,
                name,
                lock_key(name, backend.schema),
                backend.sequence,
                timeout,
                idle_timeout,
                isolation,
                backend.op_timeout,
            ) as held:
                body_ran = True
                yield held
            # The body may have changed the session (SET, LISTEN, temporary tables, a session
            # advisory lock): undo it before the connection is used for a lease. RESET ALL
            # returns to the settings the connection was opened with, which are ours.
            await connection.execute(_RESET, timeout=backend.op_timeout)
        except BaseException as exc:
            broken = _connection_broken(connection, _unmapped(exc))
            # Reused only after a clean refusal (timeout 0: the try ran to its end and was
            # rolled back). A body may have left anything behind: closed. An interrupted take
            # leaves the connection in a state nobody knows, and its session perhaps in the
            # lock queue: closed, and the session ended (as for a session lock's take).
            refused = isinstance(exc, AcquireTimeout) and timeout == 0
            if body_ran:
                backend._discard(connection)
                raise
            if refused and not connection.is_closed() and not connection.is_in_transaction():
                backend._checkin(connection)
                raise
            await backend._end_session(connection, name, _unmapped(exc))
            if not isinstance(exc, Exception) or not broken:
                raise
            if not reused:
                fresh_failures += 1
                if fresh_failures >= 2:
                    raise
            continue  # a dead connection (pooled, or ended while waiting): take it on another
        backend._checkin(connection)
        return


@asynccontextmanager
async def _transaction(
    connection: Any,
    name: str,
    key: int,
    sequence: str,
    timeout: float | None,
    idle_timeout: float | None,
    isolation: str | None,
    op_timeout: float,
) -> AsyncIterator[TransactionLock]:
    transaction = connection.transaction(isolation=isolation)
    context = f"taking {name!r} for a transaction"
    with map_exceptions(_ERRORS, context), anyio.fail_after(op_timeout):
        await transaction.start()
    try:
        with map_exceptions(_ERRORS, context):
            token = await _take_in_transaction(
                connection, name, key, sequence, timeout, idle_timeout, op_timeout
            )
        yield TransactionLock(connection, token)
    except BaseException:
        with anyio.CancelScope(shield=True), anyio.move_on_after(op_timeout):
            try:
                await transaction.rollback()
            except Exception as exc:
                logger.warning(
                    "asynclock: rolling back the transaction of %r failed: %r", name, exc
                )
        raise
    with map_exceptions(_ERRORS, f"committing the transaction of {name!r}"):
        await transaction.commit()


async def _take_in_transaction(
    connection: Any,
    name: str,
    key: int,
    sequence: str,
    timeout: float | None,
    idle_timeout: float | None,
    op_timeout: float,
) -> int:
    if idle_timeout is not None:
        await connection.execute(
            "SELECT set_config('idle_in_transaction_session_timeout', $1, true)",
            str(_timeout_ms(idle_timeout)),
            timeout=op_timeout,
        )
    if timeout == 0:
        token = await connection.fetchval(_XACT_TRY, key, sequence, timeout=op_timeout)
        if token is None:
            raise AcquireTimeout(name, 0.0)
        return int(token)
    # At the timeout asyncpg cancels the wait in the server; the caller's rollback frees the
    # lock if it was granted at that very moment.
    with anyio.move_on_after(math.inf if timeout is None else timeout) as scope:
        token = await connection.fetchval(_XACT_WAIT, key, sequence)
    if scope.cancelled_caught:
        raise AcquireTimeout(name, timeout or 0.0)
    return int(token)
