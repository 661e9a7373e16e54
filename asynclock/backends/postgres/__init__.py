"""``postgresql://user:password@host:5432/dbname``: session advisory locks, one holding
connection per ttl.

How a lock is held
    A held lock is a session-level advisory lock (``pg_advisory_lock(bigint)``). Its 64-bit key
    is derived from the schema and the full name (:func:`lock_key`), so only a hash collision
    can make two names share one lock, and sharing is safe: they exclude each other, nothing
    more. A session has one idle timer, so every lock a client takes with one ttl lives on one
    holding connection (a lane, ``_lease.py``) whose ``idle_session_timeout`` is that ttl; its
    statements run one at a time in a task of the backend's own, never interrupted by a
    caller's cancellation (closing the connection would lose every lock on it). Session advisory
    locks are re-entrant, so the lane refuses a second take of a key it holds, and a pooled
    connection (pools run ``pg_advisory_unlock_all()``) is never used. Idle connections are
    kept for reuse (``max_idle``); an idle one holds no advisory lock.

Waiting
    The first ``max_waiting`` waiters of a client that have an idle connection at hand wait in
    the server's lock queue (``pg_advisory_lock`` on a connection of their own, which then holds
    the lock), granted in the order they asked; the others in a queue table, FIFO with the
    server's queue and without a connection each (``_queue.py``, ``_table.py``). A client's
    waiters of a lock take their places one at a time, in the order they asked.

Interrupted statements and dead connections
    A connection whose statement was cancelled or failed half-way (a cancelled wait, a take
    that timed out) is never used again: asyncpg's protocol state is then unknown (reusing it
    gave "cannot switch to state 12; another operation (2) is in progress"). It is closed at
    once, without an await, and its server session is ended with ``pg_terminate_backend`` from
    another connection before the take returns, since a session blocked in the lock queue does
    not read its socket (``Sessions.end_session`` in ``_wire.py``, which survives any number of
    cancellations). ``client_connection_check_interval`` is a backstop for waiters of processes
    that died. A connection found dead when used (a pooled one the server or a proxy closed
    while it was idle, or a waiter's session that the server's idle timer ended while this
    process was paused) is replaced and the take starts again; only a new connection that fails
    too is an outage. A release never fails: unlocking keeps the connection, closing it ends the
    session, and either frees the lock.

The lease
    An advisory lock lives exactly as long as its session, so the lease is the session: a
    holding connection runs with ``idle_session_timeout = ttl`` (PostgreSQL 14+), and the server
    closes a connection that sends nothing for ``ttl`` seconds, which frees its locks. A renewal
    is one tiny query per holding connection (all run at once), which restarts the server's
    timer.
    A paused or cut-off client therefore loses the lock ``ttl`` after its last renewal, and its
    local deadline ends the body before that.

Tokens
    ``nextval()`` of one sequence, ``asynclock_token_seq`` in the configured schema (created on
    first use, ``CACHE 1``), called right after the lock is granted, in the statement that takes
    it or waits for it. Sequence values increase
    across every session, so each acquisition of a name gets a larger token than the one before
    it; they are not consecutive per name. ``nextval`` is durable (with ``synchronous_commit=on``,
    which our connections set) and never rolled back, so tokens keep increasing across crashes
    and restarts of the server.

Other kinds of hold
    Shared holds are ``pg_advisory_lock_shared`` on the same connections and queues (the
    server's lock queue gives writer preference). A semaphore's permit is an advisory lock on
    one of ``N`` slot keys, on a connection of its own, with ``N`` in a shared two-int4 lock
    that ``pg_locks`` shows (``_semaphores.py``). An election is an exclusive lock in a key space
    of its own. Shared holds, permits and leaders keep a row (owner, token, value) in the
    holders' table for ``inspect()``, which reads only rows whose session holds the key now
    (``_kinds.py``, ``_inspect.py``); ``wait_for_change`` waits for a NOTIFY on the client's
    listening connection.

Loss
    The connection closing (``pg_terminate_backend``, a server restart, the idle timeout, a
    reset) is reported at once through asyncpg's termination listener; a renewal that finds the
    connection closed, or talking to another server session, reports it too.

Through a connection pooler
    ``?pooler=session``: as above, with checks that the pooler keeps sessions apart.
    ``?pooler=transaction``: every lock a transaction-level advisory lock in a transaction of its
    own, its lease ``idle_in_transaction_session_timeout``; exclusive locks only
    (``_transactions.py``).

Files (imports go down this list, never up)
    ``backend.py`` the Backend class; ``_transactions.py`` holds in transactions of their own
    (transaction pooling); ``_inspect.py`` inspect() and wait_for_change();
    ``_semaphores.py`` semaphores; ``_queue.py`` take and wait in order: which queue a waiter
    joins, its wait in the server's queue; ``_table.py`` the queue table; ``_lanes.py`` takes, renewals and releases on the holding
    connections; ``_server.py`` what open() checks and creates; ``_wire.py`` the connections
    (connecting, the idle pool, ending an interrupted session) and the ``Wire`` every part
    shares; ``_lease.py`` the grant, one holding connection (a lane) and its task, the renewals
    of the connections that hold a lock after a wait; ``_kinds.py`` each kind of hold's
    statements and key space; ``_errors.py`` asyncpg's errors into asynclock's; ``_urls.py``
    the URL and options; ``_sql.py`` every statement and :func:`lock_key`; ``_xact_lock.py`` a
    lock for one transaction, the driver's half of ``transaction_lock`` (which lives in
    :mod:`asynclock.extras.postgres`).
"""

from ._sql import lock_key
from ._xact_lock import xact_lock
from .backend import PostgresBackend, PostgresGrant

__all__ = ("PostgresBackend", "PostgresGrant", "lock_key", "xact_lock")
