"""The statements of semaphores (``_semaphores.py``).

A permit is an exclusive advisory lock on one of the semaphore's ``N`` slot keys, held by a
dedicated connection (its idle timer is the permit's ttl), together with a shared two-int4
advisory lock ``(permits class, N)``, so that ``pg_locks`` tells every client the ``N`` of the
holders. Waiters are places in the queue table under the semaphore's key; a place records its
``N`` in its waiter id (``"<id> permits=<N>"``). Takes and places of one semaphore are
serialised by a transaction lock on its key, held for one statement: the check of ``N`` and the
take are one step. Everything is an advisory lock or a place: it ends with the session, or
expires with the place, and nothing of a released semaphore stays on the server.
"""

from __future__ import annotations

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
# $4 head of the queue table (others may only take while nobody waits there), $5 the slot keys,
# $6 the permits class, $7 N, $8 owner (the permit's row in the holders' table, _kinds.py).
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
    SELECT s.k FROM free, unnest($5::bigint[]) AS s(k)
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
