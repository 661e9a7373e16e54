"""asyncpg's errors into asynclock's, in one translator (``kit.translate(errors, context)``).

What the user can do about an error depends on what was being done: a refused login at connect
wants the password checked, a missing schema while checking the server wants ``?schema=``. So
the translator reads the context's kind (:data:`CONNECTING`, :data:`CHECKING`, or any other
text: a statement) and finds the first matching row of its table; anything else of the driver
becomes a BackendUnavailable (a BackendTimeout when it timed out) naming what was being done.
"""

from __future__ import annotations

import ssl
from dataclasses import asdict, dataclass

import asyncpg

from .._kit import BackendTimeout, BackendUnavailable, LockError

#: The context of a connect, and of the checks after it (the token sequence).
CONNECTING = "connecting"
CHECKING = "checking the server"
#: SQLSTATE classes of errors that end the session: 08 connection exception, 57P operator
#: intervention (pg_terminate_backend, shutdown, idle_session_timeout).
SESSION_ENDED = ("08", "57P")
DRIVER_ERRORS = (
    TimeoutError,
    OSError,
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
)

# (context, errors, class, message); fields: {server}, {error}, {kind}, {connect_timeout},
# {schema}, {sequence}, {create}.
_TABLE: tuple[tuple[str, tuple[type[BaseException], ...], type[LockError], str], ...] = (
    (
        CONNECTING,
        (TimeoutError,),
        BackendTimeout,
        "cannot connect to {server} within {connect_timeout:g} s: check that PostgreSQL runs "
        "and is reachable there (behind a connection pooler: that its pool has a server "
        "connection free), or raise ?connect_timeout=",
    ),
    (
        CONNECTING,
        (asyncpg.TooManyConnectionsError,),
        BackendUnavailable,
        "{server} refused a new connection: {error}. A client uses one connection per ttl for "
        "the locks it holds, one per waiter in the server's queue (at most ?max_waiting=, 8 by "
        "default; the others wait in the queue table without one) and up to ?max_idle= idle "
        "ones: raise max_connections on the server, or lower max_waiting",
    ),
    (
        CONNECTING,
        (asyncpg.InvalidAuthorizationSpecificationError, asyncpg.InvalidPasswordError),
        BackendUnavailable,
        "{server} refused the login: {error}. Check the user and password and the server's "
        "pg_hba.conf",
    ),
    (
        CONNECTING,
        (asyncpg.InvalidCatalogNameError,),
        BackendUnavailable,
        "{server}: {error}; check the database name",
    ),
    (
        CONNECTING,
        (ssl.SSLError,),
        BackendUnavailable,
        "cannot connect to {server}: TLS failed: {error}. Check sslmode and sslrootcert (the CA "
        "that signed the server's certificate), or the ssl context",
    ),
    (
        CONNECTING,
        (FileNotFoundError,),
        BackendUnavailable,
        "cannot connect to {server}: {error}: a file named in the options (sslrootcert, "
        "sslcert, sslkey, passfile) does not exist",
    ),
    (
        CONNECTING,
        DRIVER_ERRORS,
        BackendUnavailable,
        "cannot connect to {server}: {kind}: {error}. Check that PostgreSQL runs there and "
        "accepts TCP connections (listen_addresses, port, pg_hba.conf)",
    ),
    (
        CHECKING,
        (asyncpg.InvalidSchemaNameError,),
        BackendUnavailable,
        "the schema {schema!r} does not exist on {server}: create it (CREATE SCHEMA ...) or "
        "choose another with ?schema=...",
    ),
    (
        CHECKING,
        (asyncpg.InsufficientPrivilegeError,),
        BackendUnavailable,
        "the user of {server} may not create the token sequence or the waiters' queue table: "
        "create them once as their owner with {create}, and GRANT USAGE ON SEQUENCE {sequence} "
        "and GRANT SELECT, INSERT, UPDATE, DELETE ON the table TO the lock users",
    ),
)


@dataclass(slots=True)
class Errors:
    """The translator of one backend (it knows the server and the options to name)."""

    server: str
    connect_timeout: float
    schema: str
    sequence: str
    create: str
    #: A connection pooler was found in front of the server (``Sessions``).
    pooled: bool = False
    #: Every hold is a transaction of its own (``?pooler=transaction``).
    transactions: bool = False

    def __call__(self, error: Exception, context: str) -> LockError | None:
        for kind, sources, target, message in _TABLE:
            if kind == context and isinstance(error, sources):
                # The message's fields are this translator's, with the error and its kind.
                fields = asdict(self)
                text = message.format(error=error, kind=type(error).__name__, **fields)
                return target(text + self._pool_hint(target))
        if not isinstance(error, DRIVER_ERRORS):
            return None
        if not isinstance(error, TimeoutError):
            return BackendUnavailable(
                f"{context} on {self.server}: {type(error).__name__}: {error}"
            )
        detail = str(error) or "the server did not answer in time"
        return BackendTimeout(
            f"{context} on {self.server}: TimeoutError ({detail})" + self._pool_hint(BackendTimeout)
        )

    def _pool_hint(self, target: type[LockError]) -> str:
        if not (self.pooled and issubclass(target, BackendTimeout)):
            return ""
        # PgBouncer answers the login itself and queues the statements of a client for whom
        # no server connection is free: a full pool is a timeout, not a refusal.
        if self.transactions:
            return (
                "; through a connection pooler this is also what a full pool looks like: in "
                "transaction pooling each held lock and each waiter keeps a server connection "
                "for as long as it holds or waits, across all clients: raise the pool size"
            )
        return (
            "; through a connection pooler this is also what a full pool looks like: a client "
            "needs a server connection per ttl in use, per waiter up to max_waiting, per lock "
            "held after a wait, per semaphore permit, and up to max_idle idle ones: raise the "
            "pool size, or lower max_waiting and max_idle"
        )


def unmapped(error: BaseException) -> BaseException:
    """The driver's error behind one of ours (see :func:`translate`), or ``error`` itself."""
    cause = error.__cause__
    return cause if isinstance(error, LockError) and cause is not None else error


def connection_broken(connection: asyncpg.Connection, error: BaseException) -> bool:
    """Whether ``error`` of a statement on ``connection`` says the connection itself is gone or
    unusable (closed by the server or the network, or asyncpg's protocol state confused), as
    opposed to the server not answering (a timeout) or refusing the statement (an SQL error)."""
    error = unmapped(error)
    if isinstance(error, TimeoutError):
        return False
    if connection.is_closed():
        return True
    if isinstance(error, asyncpg.InterfaceError | asyncpg.InternalClientError | OSError):
        return True
    sqlstate = getattr(error, "sqlstate", None) or ""
    return isinstance(error, asyncpg.PostgresError) and sqlstate.startswith(SESSION_ENDED)
