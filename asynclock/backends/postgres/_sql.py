"""Every statement of the backend (sessions, the queue table, the holders' table and each kind of
hold, semaphores, transaction holds), the lock key, and the names of the schema's objects."""

from __future__ import annotations

import functools
import hashlib
import math

__all__ = ("lock_key",)

SEQUENCE = "asynclock_token_seq"
#: The waiters' queue (beyond the ones a client keeps in the server's queue), see _table.py.
QUEUE_TABLE = "asynclock_waiters"
#: ``idle_session_timeout`` is an int of milliseconds.
MAX_TIMEOUT_MS = 2**31 - 1

# A lane's release: only its key (the others on the connection stay held).
UNLOCK = "SELECT pg_advisory_unlock($1)"


def renew(pid: int) -> str:
    """The renewal of the locks of server process ``pid``'s session: a statement that restarts
    its idle timer (the lease), whose command tag says whether the connection still reaches
    that session (``RENEWED``; "SELECT 0" from another one).

    Sent by the simple query protocol (asyncpg's ``execute()`` without arguments): one message
    that ends in a Sync. A statement with arguments is parsed first in a round trip that ends
    in a Flush, and until its Sync the server does not count the session idle: its idle timer
    is off. Without a statement cache (``pooler=transaction``) every run of it is such a parse.
    """
    return f"SELECT WHERE pg_backend_pid() = {int(pid)}"


#: ``renew()``'s command tag when the session is still the lock's.
RENEWED = "SELECT 1"
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
# -- the queue table (_table.py) ---------------------------------------------------------------
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
SWEEP_PLACES = "DELETE FROM {queue} WHERE expires_at < now() - interval '1 minute'"
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

# Whether server process $1 holds or waits for the advisory lock ($2, $3: classid, objid).
ENTERED = """
SELECT EXISTS (
    SELECT 1 FROM pg_locks
    WHERE pid = $1 AND locktype = 'advisory' AND objsubid = 1 AND classid = $2 AND objid = $3
)
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


# -- the holders' table and the statements of each kind of hold (_kinds.py) -------------------

#: Who holds what, for inspect(): a row per shared hold, permit and leader (exclusive locks
#: have none: a row would cost their takes a write), written in the statement that takes the
#: advisory lock ``held`` and deleted by the one that unlocks it. ``key`` is the name's key in
#: its kind's space (``held`` itself, or a semaphore's key for a permit's slot). A row whose pid
#: no longer holds ``held`` is a crashed holder's: inspect never reads it (it joins pg_locks by
#: pid) and deletes it. Unlogged: a crash ends every session, and with them every hold.
HOLDERS_TABLE = "asynclock_holders"
CREATE_HOLDERS = """
CREATE UNLOGGED TABLE IF NOT EXISTS {holders} (
    held bigint NOT NULL,
    pid integer NOT NULL,
    key bigint NOT NULL,
    token bigint NOT NULL,
    owner text NOT NULL,
    shared boolean NOT NULL,
    value bytea NOT NULL,
    application_name text NOT NULL,
    PRIMARY KEY (held, pid)
)
"""
# The row of a hold, once the CTE ``token`` (the hold's token) has a row: $1 the key held.
KEEP = """
kept AS (
    INSERT INTO {holders} (held, pid, key, token, owner, shared, value, application_name)
    SELECT $1, pg_backend_pid(), $1, token, ${owner}, {shared}, ${value},
        current_setting('application_name')
    FROM token
    ON CONFLICT (held, pid) DO UPDATE SET key = excluded.key, token = excluded.token,
        owner = excluded.owner, shared = excluded.shared, value = excluded.value,
        application_name = excluded.application_name
)"""
# Rows a take deletes, once it holds the key (the CTE ``token`` has a row): a leader holds its
# key alone, so another session's row of it is a crashed leader's; a reader deletes the rows of
# the name whose sessions are gone (no activity entry: a session shows there a moment longer
# than its locks, so a row can outlive this; inspect() and open() check pg_locks instead).
SWEPT_ALONE = """,
swept AS (
    DELETE FROM {holders} WHERE held = $1 AND pid <> pg_backend_pid()
        AND EXISTS (SELECT 1 FROM token)
)"""
SWEPT_SHARED = """,
swept AS (
    DELETE FROM {holders} AS h WHERE h.key = $1 AND h.pid <> pg_backend_pid()
        AND NOT EXISTS (SELECT 1 FROM pg_stat_get_activity(h.pid))
        AND EXISTS (SELECT 1 FROM token)
)"""
# A take on a lane (a holding connection shared by the locks of one ttl, whose idle timer is
# set once, when it connects): try-lock and token in one round trip, no row when busy.
# Only when nobody waits in the queue table: its head may be between two steps (see _table.py).
# $1 key, $2 sequence; kept: $3 owner, $4 value; an election's NOTIFY: $5 channel.
LANE_TAKE = """
WITH attempt AS MATERIALIZED (
    SELECT {lock}($1) AS taken
    WHERE NOT EXISTS (SELECT 1 FROM {queue} WHERE key = $1 AND expires_at > now())
),
token AS MATERIALIZED (SELECT nextval($2::regclass) AS token FROM attempt WHERE attempt.taken)
{keep}
SELECT token{notify} FROM token
"""
# Wait in the server's lock queue, then (the CTE is evaluated first) arm the idle timer and
# draw the token under the lock: one round trip. The timer starts when this statement ends, so
# its send time is a safe valid_from; after a long wait the lease is restarted by RENEW.
# Unless $4 (the head of the queue table goes to the server's queue): only when the table is
# empty, which the statement checks before it queues (no row comes back otherwise), but for the
# places of client $6: its waiters that asked later than this one (a place made while this
# statement was on its way; '' when that client had a place of the key already).
# The head first takes the key's marker ($5, shared, released with the lock): inspect counts it
# once, not in both queues. The lock is tried before it is waited for (CASE evaluates its ELSE
# only when the try failed), so the row says whether the statement waited: a free lock is taken
# at once either way.
# $1 key, $2 sequence, $3 ttl ms, $4 head, $5 marker, $6 client; kept: $7 owner, $8 value;
# NOTIFY: $9 channel. Returns (token, pid, waited, ...).
WAIT = """
WITH empty AS MATERIALIZED (
    SELECT 1 WHERE $4 OR NOT EXISTS (
        SELECT 1 FROM {queue} WHERE key = $1 AND expires_at > now() AND client <> $6::text
    )
),
marked AS MATERIALIZED (SELECT pg_advisory_lock_shared($5) FROM empty WHERE $4),
granted AS MATERIALIZED (
    SELECT CASE WHEN {try_lock}($1) THEN false ELSE {lock}($1)::text IS NOT NULL END AS waited
    FROM empty CROSS JOIN (SELECT count(*) FROM marked) AS heads
),
token AS MATERIALIZED (SELECT nextval($2::regclass) AS token, waited FROM granted)
{keep}
SELECT token, pg_backend_pid(), waited, set_config('idle_session_timeout', $3, false){notify}
FROM token
"""
# One try on a dedicated connection (a shared hold while the lane holds the key shared already:
# the lane refuses a re-entrant take, as the server would let it jump a waiting writer):
# LANE_TAKE with this tail of its row. $1 key, $2 sequence, $3 ttl ms, $4 owner, $5 value.
# Returns (token, pid, false, ...) as WAIT.
TRY_DEDICATED_TAIL = ", pg_backend_pid(), false, set_config('idle_session_timeout', $3, false)"
# A lane's unlock of one key ($1; NOTIFY: $2 channel), and its row with it (ours only).
UNLOCK_KEPT = """
WITH gone AS (DELETE FROM {holders} WHERE held = $1 AND pid = pg_backend_pid())
SELECT {unlock}($1){notify}
"""
# The dedicated connection holds exactly this lock ($1 key; NOTIFY: $2 channel).
RELEASE_KEPT = """
WITH gone AS (DELETE FROM {holders} WHERE pid = pg_backend_pid())
SELECT pg_advisory_unlock_all(), set_config('idle_session_timeout', '0', false){notify}
"""
# $1 is the key: cast to bigint first, or a statement that uses $1 nowhere else (RELEASE_KEPT)
# makes asyncpg type it as text and refuse the int key.
NOTIFY = ", pg_notify(${channel}, $1::bigint::text)"

# Rows of holds whose session ended without deleting them (terminated, killed, timed out):
# their pid no longer holds ``held``. A row is written after its lock is granted, so no live
# hold's row matches (a take that overwrites a stale row meanwhile makes the DELETE re-check
# the new row, whose pid holds the key). Returns whether the row of session $2 is left (it
# has not ended yet). $1 the name's key; NULL: every key (open()).
SWEEP = """
WITH gone AS (
    DELETE FROM {holders} AS h WHERE ($1::bigint IS NULL OR h.key = $1) AND NOT EXISTS (
        SELECT 1 FROM pg_locks AS l
        WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted AND l.pid = h.pid
          AND ((l.classid::bigint << 32) | l.objid::bigint) = h.held
    )
    RETURNING pid
)
SELECT EXISTS (SELECT 1 FROM {holders} WHERE key = $1 AND pid = $2)
    AND NOT EXISTS (SELECT 1 FROM gone WHERE pid = $2)
"""
# The same for the rows of one ended session ($1: its pid), after an interrupted take.
SWEEP_SESSION = """
DELETE FROM {holders} AS h WHERE h.pid = $1 AND NOT EXISTS (
    SELECT 1 FROM pg_locks AS l
    WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted AND l.pid = h.pid
      AND ((l.classid::bigint << 32) | l.objid::bigint) = h.held
)
"""
# Holders and waiters of one key ($1, $2: classid, objid), and the rows of the sessions that
# hold it now ($3: the key).
INSPECT_HOLDS = """
SELECT l.granted, l.pid, l.mode, a.application_name, h.token, h.owner, h.value
FROM pg_locks AS l JOIN pg_stat_activity AS a ON a.pid = l.pid
LEFT JOIN {holders} AS h ON h.held = $3 AND h.pid = l.pid AND l.granted
WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.classid = $1 AND l.objid = $2
ORDER BY h.token NULLS LAST, l.pid
"""

# -- semaphores (_semaphores.py) --------------------------------------------------------------
# The statements of semaphores (``_semaphores.py``).
#
# A permit is an exclusive advisory lock on one of the semaphore's ``N`` slot keys, held by a
# dedicated connection (its idle timer is the permit's ttl), together with a shared two-int4
# advisory lock ``(permits class, N)``, so that ``pg_locks`` tells every client the ``N`` of the
# holders. Waiters are places in the queue table under the semaphore's key; a place records its
# ``N`` in its waiter id (``"<id> permits=<N>"``). Takes and places of one semaphore are
# serialised by a transaction lock on its key, held for one statement: the check of ``N`` and the
# take are one step. Everything is an advisory lock or a place: it ends with the session, or
# expires with the place, and nothing of a released semaphore stays on the server.

# Another N among the holders (the permits locks of the class, $6) or the live places of the
# key ($1), than this request's ($7). Under the transaction lock of the key (``serial``).
_OTHER = """
other AS MATERIALIZED (
    SELECT l.objid::bigint AS n FROM serial, pg_locks AS l
    WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.classid = $6::int::oid
      AND l.objid::bigint <> $7::bigint
    UNION ALL
    SELECT substring(q.waiter FROM ' permits=([0-9]+)$')::bigint FROM serial, {queue} AS q
    WHERE q.key = $1 AND q.expires_at > now()
      AND substring(q.waiter FROM ' permits=([0-9]+)$')::bigint <> $7::bigint
)"""

# The transaction of a take serialises it (its statements, run after the lock, see the places
# committed before): a lock in a statement would not do, as the statement's snapshot is taken
# before it waits for the lock, and a place made meanwhile would be missed.
BEGIN_SEMAPHORE = "BEGIN; SELECT pg_advisory_xact_lock({key})"
# One try on a dedicated connection, in that transaction: $1 key, $2 sequence, $3 ttl (ms),
# $4 head of the queue table (others may only take while nobody waits there), $5 the slot keys
# as a text[] (asyncpg introspects a bigint[] on each new connection: a catalog query and more
# round trips inside the transaction that holds the semaphore's lock, which every other take
# waits for; a CI run's other client waited past 100 ms), $6 the permits class, $7 N, $8 owner
# (the permit's row in the holders' table, _kinds.py).
# Returns (slot key or NULL, another N or NULL, token, pid, timer). The slots are tried in
# order and the first free one is taken: LIMIT stops the scan there, and the CASE keeps the try
# from running unless the semaphore may be taken. The idle timer (the ttl) is only set, and the
# permits lock and the row only taken and written, with a slot.
TAKE_SEMAPHORE = (
    """
WITH serial AS MATERIALIZED (SELECT 1),"""
    + _OTHER
    + """,
free AS MATERIALIZED (
    SELECT NOT EXISTS (SELECT 1 FROM other) AND ($4 OR NOT EXISTS (
        SELECT 1 FROM {queue} WHERE key = $1 AND expires_at > now()
    )) AS free
),
slot AS MATERIALIZED (
    SELECT s.k FROM free, unnest($5::text[]::bigint[]) AS s(k)
    WHERE CASE WHEN free.free THEN pg_try_advisory_lock(s.k) ELSE false END
    LIMIT 1
),
marked AS MATERIALIZED (SELECT pg_advisory_lock_shared($6::int, $7::int) FROM slot),
token AS MATERIALIZED (SELECT slot.k, nextval($2::regclass) AS token FROM slot, marked),
kept AS (
    INSERT INTO {holders} (held, pid, key, token, owner, shared, value, application_name)
    SELECT k, pg_backend_pid(), $1, token, $8, false, ''::bytea,
        current_setting('application_name')
    FROM token
    ON CONFLICT (held, pid) DO UPDATE SET key = excluded.key, token = excluded.token,
        owner = excluded.owner, shared = false, value = excluded.value,
        application_name = excluded.application_name
),
-- A permit holds its slot alone: another session's row of it is a crashed holder's.
swept AS (
    DELETE FROM {holders} WHERE held IN (SELECT k FROM token) AND pid <> pg_backend_pid()
)
SELECT (SELECT k FROM slot), (SELECT min(n) FROM other), (SELECT token FROM token),
    pg_backend_pid(), (SELECT set_config('idle_session_timeout', $3, false) FROM slot)
"""
)

# A place in the queue table, unless another N holds or waits: (ticket, NULL) or (NULL, N).
# $1 key, $2 sequence, $3 waiter, $4 client, $5 lease (ms), $6 permits class, $7 N.
ENQUEUE_SEMAPHORE = (
    """
WITH serial AS MATERIALIZED (SELECT pg_advisory_xact_lock($1)),"""
    + _OTHER
    + """,
placed AS (
    INSERT INTO {queue} (key, ticket, waiter, client, lease_ms, expires_at)
    SELECT $1, nextval($2::regclass), $3, $4, $5::int,
        clock_timestamp() + $5::int * interval '1 ms'
    WHERE NOT EXISTS (SELECT 1 FROM other)
    RETURNING ticket
)
SELECT (SELECT ticket FROM placed), (SELECT min(n) FROM other)
"""
)

# The connection holds the permit and its permits lock only; the first waiter of the key, if
# any, hears of the free permit ($1 channel, $2 key).
RELEASE_SEMAPHORE = """
WITH gone AS (DELETE FROM {holders} WHERE pid = pg_backend_pid())
SELECT pg_advisory_unlock_all(), set_config('idle_session_timeout', '0', false),
    (SELECT pg_notify($1, ($2::bigint)::text)
     WHERE EXISTS (SELECT 1 FROM {queue} WHERE key = $2::bigint AND expires_at > now()))
"""

# Permits held and their N (each permit's connection holds one permits lock of the class, $1),
# waiters ($2: the key).
INSPECT_SEMAPHORE = """
SELECT
    (SELECT count(*) FROM pg_locks AS l
     WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.granted
       AND l.classid = $1::int::oid),
    coalesce(
        (SELECT min(l.objid::bigint) FROM pg_locks AS l
         WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.granted
           AND l.classid = $1::int::oid),
        (SELECT min(substring(q.waiter FROM ' permits=([0-9]+)$')::bigint) FROM {queue} AS q
         WHERE q.key = $2 AND q.expires_at > now())),
    (SELECT count(*) FROM {queue} WHERE key = $2 AND expires_at > now())
"""
# The permits' rows whose sessions hold their slots now ($1: the semaphore's key).
INSPECT_PERMITS = """
SELECT h.owner, h.token FROM {holders} AS h JOIN pg_locks AS l
    ON l.pid = h.pid AND l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted
   AND ((l.classid::bigint << 32) | l.objid::bigint) = h.held
WHERE h.key = $1
ORDER BY h.token
"""


@functools.lru_cache(maxsize=4096)  # hashed on every take; names repeat
def lock_key(name: str, schema: str = "public") -> int:
    """The advisory lock key (a signed 64-bit int) of lock ``name`` with tokens in ``schema``.

    The first 8 bytes of a BLAKE2b hash of the schema and the full UTF-8 name, so the key does
    not depend on the server's version or collation. In ``pg_locks`` the lock shows as
    ``locktype = 'advisory' AND objsubid = 1 AND classid = (key >> 32) & 0xFFFFFFFF AND
    objid = key & 0xFFFFFFFF``.
    """
    return hash_key(b"asynclock.pg", schema, name)


def hash_key(person: bytes, schema: str, name: str, size: int = 8) -> int:
    """The first ``size`` bytes of a BLAKE2b hash (``person``) of the schema and name, signed."""
    encoded_schema = schema.encode("utf-8")
    data = len(encoded_schema).to_bytes(2, "big") + encoded_schema + name.encode("utf-8")
    digest = hashlib.blake2b(data, digest_size=size, person=person).digest()
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


def holders_name(schema: str) -> str:
    return f"{quote_ident(schema)}.{quote_ident(HOLDERS_TABLE)}"
