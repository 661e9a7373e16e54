"""The statements: take, wait, token, renew, release, ending a session; and the lock key."""

from __future__ import annotations

import functools
import hashlib
import math

__all__ = ("lock_key",)

SEQUENCE = "asynclock_token_seq"
#: The waiters' queue (beyond the ones a client keeps in the server's queue), see _queue.py.
QUEUE_TABLE = "asynclock_waiters"
#: ``idle_session_timeout`` is an int of milliseconds.
MAX_TIMEOUT_MS = 2**31 - 1

# A lane's release: only its key (the others on the connection stay held).
UNLOCK = "SELECT pg_advisory_unlock($1)"
RENEW = "SELECT pg_backend_pid()"
#: Run once on every new connection: its session settings (``$1`` names, ``$2`` values, sent
#: as SQL, not as startup parameters, which connection poolers refuse or drop), and the server
#: process it reached, and the mark a connection of ours left on that server session before
#: (read before this one's own mark is set, in ``$1``/``$2`` too): a mark there means the
#: session's state came from another client connection, which only a pooler that does not
#: reset sessions (transaction or statement pooling) does.
SETUP = """
WITH session AS MATERIALIZED (
    SELECT pg_backend_pid() AS pid, current_setting('asynclock.connection', true) AS mark
)
SELECT pid, mark, (
    SELECT count(set_config(name, value, false))
    FROM unnest($1::text[], $2::text[]) AS setting(name, value)
) FROM session
"""
#: The custom setting that marks a server session as one of our connections' (``SETUP``).
MARK = "asynclock.connection"
# The connection is dedicated, so "all" is exactly our lock (with any re-entrant count).
RELEASE = "SELECT pg_advisory_unlock_all(), set_config('idle_session_timeout', '0', false)"
CREATE = "CREATE SEQUENCE IF NOT EXISTS {sequence} AS bigint NO CYCLE CACHE 1"
# Unlogged: a crash ends every session, and with them every waiter.
CREATE_QUEUE = """
CREATE UNLOGGED TABLE IF NOT EXISTS {queue} (
    key bigint NOT NULL,
    ticket bigint NOT NULL,
    waiter text NOT NULL,
    client text NOT NULL,
    lease_ms integer NOT NULL,
    expires_at timestamptz NOT NULL,
    PRIMARY KEY (key, ticket)
)
"""
# -- the queue table (_queue.py) ---------------------------------------------------------------
# A waiter's place: a ticket from the token sequence (it only increases), kept for lease_ms
# after the client last refreshed it.
ENQUEUE = """
INSERT INTO {queue} (key, ticket, waiter, client, lease_ms, expires_at)
VALUES ($1, nextval($2::regclass), $3, $4, $5::int, clock_timestamp() + $5::int * interval '1 ms')
RETURNING ticket
"""
# (head, alive) of one waiter; no row: its place is gone.
HEAD = """
SELECT ticket = (SELECT min(ticket) FROM {queue} WHERE key = $1 AND expires_at > now()),
       expires_at > now()
FROM {queue} WHERE key = $1 AND waiter = $2
"""
# A waiter whose place expired (its client paused) queues again at the end.
REQUEUE = """
UPDATE {queue} SET ticket = nextval($3::regclass),
    expires_at = clock_timestamp() + lease_ms * interval '1 ms'
WHERE key = $1 AND waiter = $2
RETURNING ticket
"""
# Leave (granted, or given up), and tell every client that the head may have changed.
LEAVE = """
WITH gone AS (DELETE FROM {queue} WHERE key = $1 AND waiter = $2 RETURNING 1)
SELECT pg_notify($3, $1::text)
"""
REFRESH = """
UPDATE {queue} SET expires_at = clock_timestamp() + lease_ms * interval '1 ms' WHERE client = $1
"""
# Places of clients that stopped refreshing them long ago.
SWEEP = "DELETE FROM {queue} WHERE expires_at < now() - interval '1 minute'"
# The live places of a key ($1), less the heads that wait in the server's queue (those hold the
# key's marker $4, $5 and wait for the key $2, $3): they show among the server's waiters.
INSPECT_QUEUE = """
SELECT (SELECT count(*) FROM {queue} WHERE key = $1 AND expires_at > now()) - (
    SELECT count(*) FROM pg_locks AS m JOIN pg_locks AS w ON w.pid = m.pid
    WHERE m.locktype = 'advisory' AND m.objsubid = 1 AND m.granted
      AND m.classid = $4 AND m.objid = $5
      AND w.locktype = 'advisory' AND w.objsubid = 1 AND NOT w.granted
      AND w.classid = $2 AND w.objid = $3
)
"""
# Make sure a session of ours has ended: the server process of a connection we closed while it
# had a statement in flight (a cancelled or failed wait, take or token). It may still be blocked
# in the lock queue, which does not read the socket: pg_terminate_backend ends it. Repeated until
# the process no longer shows, which it does until after it has released its locks (they go in
# a before_shmem_exit callback, its pg_stat_activity entry in a later on_shmem_exit one).
# (pg_terminate_backend's own wait polls in steps of 100 ms: far too slow for this.)
END_SESSION = """
SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
WHERE pid = $1 AND usename = current_user AND application_name = $2
"""

#: The server process of a connection's session (asyncpg's ``get_server_pid()`` is the pooler's
#: number behind a pooler).
PID = "SELECT pg_backend_pid()"
# The same, for a hold in a transaction of its own (``_transactions.py``): through transaction
# pooling the server process serves other clients as soon as our transaction ends, so only the
# transaction that began at $2 on process $1 is ended (xact_start is the transaction's now()).
END_TRANSACTION = """
SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE pid = $1 AND xact_start = $2
"""

# -- the transaction-scoped variant (asynclock.extras.postgres, _transactions.py) -------------

# Wait for the transaction-level lock, then draw the token: the outer SELECT needs the CTE's
# row, so the lock is granted before nextval runs.
XACT_WAIT = """
WITH granted AS MATERIALIZED (SELECT pg_advisory_xact_lock($1))
SELECT nextval($2::regclass) FROM granted
"""
XACT_TRY = """
WITH attempt AS MATERIALIZED (SELECT pg_try_advisory_xact_lock($1) AS taken)
SELECT nextval($2::regclass) FROM attempt WHERE attempt.taken
"""
# A hold's try in its transaction: whether it took the lock, the server process and the
# transaction's start (to end exactly this transaction if a wait is interrupted), the token.
XACT_TAKE = """
WITH attempt AS MATERIALIZED (SELECT pg_try_advisory_xact_lock($1) AS taken)
SELECT taken, pg_backend_pid(), now(), CASE WHEN taken THEN nextval($2::regclass) END FROM attempt
"""
RESET = "SELECT pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *; RESET ALL; DISCARD TEMP"


@functools.lru_cache(maxsize=4096)  # hashed on every take; names repeat
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


def marker_key(key: int) -> int:
    """The key of the lock that marks a queue table head waiting in the server's queue for
    ``key`` (another 64 bits of the same hash space: a collision is as unlikely as any)."""
    mixed = ((key & 0xFFFFFFFFFFFFFFFF) ^ 0x9E3779B97F4A7C15) * 0xBF58476D1CE4E5B9
    mixed &= 0xFFFFFFFFFFFFFFFF
    return mixed - (1 << 64) if mixed >= 1 << 63 else mixed


def quote_ident(identifier: str) -> str:
    return '"' + identifier.replace('"', '""') + '"'


def creates(sequence: str, queue: str, *more: str) -> str:
    """What open() creates, on one line (for a message to the owner of the schema)."""
    statements = (CREATE.format(sequence=sequence), CREATE_QUEUE.format(queue=queue), *more)
    return " ".join("; ".join(statements).split())


def queue_name(schema: str) -> str:
    """The queue table of ``schema``, as a quoted, schema-qualified name."""
    return f"{quote_ident(schema)}.{quote_ident(QUEUE_TABLE)}"


def sequence_name(schema: str) -> str:
    """The token sequence of ``schema``, as a quoted, schema-qualified name."""
    return f"{quote_ident(schema)}.{quote_ident(SEQUENCE)}"


def timeout_ms(seconds: float) -> int:
    # Rounded up: the server must never expire the lease before the client's ttl.
    return max(1, math.ceil(seconds * 1000.0))
