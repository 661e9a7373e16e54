"""The statements of each kind of hold (exclusive, shared, election) and the keys of each kind.

Every kind is its own key space: the lock "a", the semaphore "a" and the election "a" hash to
unrelated keys (BLAKE2b with a personalisation of their own), so they never exclude each other.
Semaphores are in ``_semaphores.py``, their statements in ``_semaphore_sql.py``; their permits
keep rows in the holders' table below too.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

from .._kit import Kind, LockRequest, UnsupportedFeature
from ._sql import lock_key, quote_ident

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
_KEEP = """
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
_SWEPT_ALONE = """,
swept AS (
    DELETE FROM {holders} WHERE held = $1 AND pid <> pg_backend_pid()
        AND EXISTS (SELECT 1 FROM token)
)"""
_SWEPT_SHARED = """,
swept AS (
    DELETE FROM {holders} AS h WHERE h.key = $1 AND h.pid <> pg_backend_pid()
        AND NOT EXISTS (SELECT 1 FROM pg_stat_get_activity(h.pid))
        AND EXISTS (SELECT 1 FROM token)
)"""
# A take on a lane (a holding connection shared by the locks of one ttl, whose idle timer is
# set once, when it connects): try-lock and token in one round trip, no row when busy.
# Only when nobody waits in the queue table: its head may be between two steps (see _queue.py).
# $1 key, $2 sequence; kept: $3 owner, $4 value; an election's NOTIFY: $5 channel.
_LANE_TAKE = """
WITH attempt AS MATERIALIZED (
    SELECT {try_lock}($1) AS taken
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
# empty, which the statement checks before it queues (no row comes back otherwise).
# The head first takes the key's marker ($5, shared, released with the lock): inspect counts it
# once, not in both queues.
# $1 key, $2 sequence, $3 ttl ms, $4 head, $5 marker; kept: $6 owner, $7 value; NOTIFY: $8
# channel.
_WAIT = """
WITH empty AS MATERIALIZED (
    SELECT 1 WHERE $4 OR NOT EXISTS (SELECT 1 FROM {queue} WHERE key = $1 AND expires_at > now())
),
marked AS MATERIALIZED (SELECT pg_advisory_lock_shared($5) FROM empty WHERE $4),
granted AS MATERIALIZED (
    SELECT {lock}($1) FROM empty CROSS JOIN (SELECT count(*) FROM marked) AS heads
),
token AS MATERIALIZED (SELECT nextval($2::regclass) AS token FROM granted)
{keep}
SELECT token, pg_backend_pid(), set_config('idle_session_timeout', $3, false){notify}
FROM token
"""
# One try on a dedicated connection (a shared hold while the lane holds the key shared already:
# the lane refuses a re-entrant take, as the server would let it jump a waiting writer).
# $1 key, $2 sequence, $3 ttl ms, $4 owner, $5 value.
TRY_SHARED_DEDICATED = """
WITH attempt AS MATERIALIZED (
    SELECT pg_try_advisory_lock_shared($1) AS taken
    WHERE NOT EXISTS (SELECT 1 FROM {queue} WHERE key = $1 AND expires_at > now())
),
token AS MATERIALIZED (SELECT nextval($2::regclass) AS token FROM attempt WHERE attempt.taken),
{keep}
SELECT token, pg_backend_pid(), set_config('idle_session_timeout', $3, false) FROM token
"""
# A lane's unlock of one key ($1; NOTIFY: $2 channel), and its row with it (ours only).
_UNLOCK = """
WITH gone AS (DELETE FROM {holders} WHERE held = $1 AND pid = pg_backend_pid())
SELECT {unlock}($1){notify}
"""
# The dedicated connection holds exactly this lock ($1 key; NOTIFY: $2 channel).
_RELEASE = """
WITH gone AS (DELETE FROM {holders} WHERE pid = pg_backend_pid())
SELECT pg_advisory_unlock_all(), set_config('idle_session_timeout', '0', false){notify}
"""
# $1 is the key: cast to bigint first, or a statement that uses $1 nowhere else (_RELEASE) makes
# asyncpg type it as text and refuse the int key.
_NOTIFY = ", pg_notify(${channel}, $1::bigint::text)"

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


@dataclass(frozen=True, slots=True)
class Mode:
    """The statements of one kind of hold, formatted for one schema's tables."""

    #: On a lane: ``$1`` key, ``$2`` sequence, then :meth:`take_args`; the token, or no row.
    lane_take: str
    #: In the server's queue: ``$1`` key, ``$2`` sequence, ``$3`` ttl (ms), ``$4`` head,
    #: ``$5`` marker, then :meth:`take_args`; (token, pid, ...).
    wait: str
    #: On a lane: ``$1`` key, then :meth:`unlock_args`.
    unlock: str
    #: On a dedicated connection: :meth:`release_args`.
    release: str
    shared: bool = False
    election: bool = False
    #: Its holds keep a row in the holders' table (owner, token, value for inspect()).
    kept: bool = True
    #: A shared try on a dedicated connection (``TRY_SHARED_DEDICATED``).
    try_dedicated: str = ""

    def take_args(self, owner: str, value: bytes, channel: str) -> tuple[object, ...]:
        if not self.kept:
            return ()
        return (owner, value, channel) if self.election else (owner, value)

    def unlock_args(self, channel: str) -> tuple[object, ...]:
        return (channel,) if self.election else ()

    def release_args(self, key: int, channel: str) -> tuple[object, ...]:
        if not self.kept:
            return ()
        return (key, channel) if self.election else ()


def modes(queue: str, holders: str) -> dict[tuple[Kind, bool], Mode]:
    """The modes by (kind, shared), for the queue table and the holders' table of a schema."""

    def keep(owner: int, value: int, *, shared: bool) -> str:
        kept = _KEEP.format(
            holders=holders, owner=owner, value=value, shared="true" if shared else "false"
        )
        swept = (_SWEPT_SHARED if shared else _SWEPT_ALONE).format(holders=holders)
        return "," + kept + swept

    def lane_take(try_lock: str, *, kept: bool, shared: bool = False, notify: bool = False) -> str:
        return _LANE_TAKE.format(
            try_lock=try_lock,
            queue=queue,
            keep=keep(3, 4, shared=shared) if kept else "",
            notify=_NOTIFY.format(channel=5) if notify else "",
        )

    def wait(lock: str, *, kept: bool, shared: bool = False, notify: bool = False) -> str:
        return _WAIT.format(
            lock=lock,
            queue=queue,
            keep=keep(6, 7, shared=shared) if kept else "",
            notify=_NOTIFY.format(channel=8) if notify else "",
        )

    def unlock(function: str, *, notify: bool = False) -> str:
        notifying = _NOTIFY.format(channel=2) if notify else ""
        return _UNLOCK.format(holders=holders, unlock=function, notify=notifying)

    def release(*, notify: bool = False) -> str:
        notifying = _NOTIFY.format(channel=2) if notify else ""
        return _RELEASE.format(holders=holders, notify=notifying)

    return {
        # Exclusive locks keep no row: their takes stay one write-free round trip.
        ("lock", False): Mode(
            lane_take=lane_take("pg_try_advisory_lock", kept=False),
            wait=wait("pg_advisory_lock", kept=False),
            unlock="SELECT pg_advisory_unlock($1)",
            release="SELECT pg_advisory_unlock_all(), set_config('idle_session_timeout', '0', false)",
            kept=False,
        ),
        ("lock", True): Mode(
            lane_take=lane_take("pg_try_advisory_lock_shared", kept=True, shared=True),
            wait=wait("pg_advisory_lock_shared", kept=True, shared=True),
            unlock=unlock("pg_advisory_unlock_shared"),
            release=release(),
            shared=True,
            try_dedicated=TRY_SHARED_DEDICATED.format(
                queue=queue, keep=keep(4, 5, shared=True)[1:]
            ),
        ),
        ("election", False): Mode(
            lane_take=lane_take("pg_try_advisory_lock", kept=True, notify=True),
            wait=wait("pg_advisory_lock", kept=True, notify=True),
            unlock=unlock("pg_advisory_unlock", notify=True),
            release=release(notify=True),
            election=True,
        ),
    }


def holders_name(schema: str) -> str:
    return f"{quote_ident(schema)}.{quote_ident(HOLDERS_TABLE)}"


def _hash(person: bytes, schema: str, name: str, size: int = 8) -> int:
    encoded_schema = schema.encode("utf-8")
    data = len(encoded_schema).to_bytes(2, "big") + encoded_schema + name.encode("utf-8")
    digest = hashlib.blake2b(data, digest_size=size, person=person).digest()
    return int.from_bytes(digest, "big", signed=True)


@functools.lru_cache(maxsize=4096)
def kind_key(name: str, kind: Kind, schema: str = "public") -> int:
    """The advisory lock key of ``name`` of ``kind``: :func:`lock_key` for locks; for the others
    a hash of their own (an election's lock; a semaphore's key in the queue table, and the key
    that serialises its takes)."""
    if kind == "lock":
        return lock_key(name, schema)
    return _hash(b"asynclock.pg." + kind[:3].encode(), schema, name)


@functools.lru_cache(maxsize=1024)
def slot_keys(name: str, permits: int, schema: str = "public") -> tuple[int, ...]:
    """The advisory lock keys of a semaphore's permits, one per slot."""
    return tuple(_hash(b"asynclock.pgslot", schema, f"{slot}\0{name}") for slot in range(permits))


@functools.lru_cache(maxsize=1024)
def permits_class(name: str, schema: str = "public") -> int:
    """The first key (a signed int4) of the shared two-int4 lock ``(class, permits)`` that every
    holder of a semaphore holds: ``pg_locks`` shows the permits of the holders (``objid``)."""
    return _hash(b"asynclock.pgsemn", schema, name, size=4)


def split(key: int) -> tuple[int, int]:
    """``(classid, objid)`` of a bigint key as ``pg_locks`` shows it."""
    unsigned = key & 0xFFFFFFFFFFFFFFFF
    return unsigned >> 32, unsigned & 0xFFFFFFFF


def no_holders_table(request: LockRequest, server: str, holders: str) -> UnsupportedFeature:
    """The refusal of a kind that needs the holders' table, which open() could not create."""
    create = " ".join(CREATE_HOLDERS.format(holders=holders).split())
    return UnsupportedFeature(
        f"{request.kind} {request.name!r}: shared locks, semaphores and elections on {server} "
        f"need the table {holders}, which this user may not create: create it once as its "
        f"owner with {create}, and GRANT SELECT, INSERT, UPDATE, DELETE ON it TO the lock users"
    )
