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
    not read its socket (``Sessions.end_session`` in ``_sessions.py``, which survives any number of
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

Files (imports go down this list, never up)
    ``backend.py`` the Backend class (take, wait, renew, release, inspect); ``_sessions.py``
    connections: connecting, the idle pool, ending an interrupted session; ``_translate.py``
    asyncpg's errors into asynclock's; ``_urls.py`` the URL and options; ``_sql.py`` the
    statements and :func:`lock_key`. ``transaction_lock`` lives in
    :mod:`asynclock.extras.postgres`.
"""

from typing import Any

from ._sql import lock_key
from .backend import PostgresBackend, PostgresGrant

__all__ = ("PostgresBackend", "PostgresGrant", "TransactionLock", "lock_key", "transaction_lock")


def __getattr__(name: str) -> Any:
    # Kept for compatibility: transaction_lock needs the client, so it lives above the
    # backends, in asynclock.extras.postgres; imported only when asked for.
    if name in ("transaction_lock", "TransactionLock"):
        from ...extras import postgres

        return getattr(postgres, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
