"""The statements of each kind of hold (exclusive, shared, election) and the keys of each kind.

Every kind is its own key space: the lock "a", the semaphore "a" and the election "a" hash to
unrelated keys (BLAKE2b with a personalisation of their own), so they never exclude each other.
Semaphores are in ``_semaphores.py``; their statements are at the end of this file.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

from .._kit import Kind
from ._sql import lock_key, quote_ident

#: Who leads each election (a row per election key, written in the statement that takes the
#: lock). Unlogged: a crash ends every session, and with them every leader.
LEADERS_TABLE = "asynclock_leaders"
CREATE_LEADERS = """
CREATE UNLOGGED TABLE IF NOT EXISTS {leaders} (
    key bigint PRIMARY KEY,
    pid integer NOT NULL,
    token bigint NOT NULL,
    owner text NOT NULL,
    value bytea NOT NULL,
    application_name text NOT NULL
)
"""

# A take on a lane, try-lock and token in one round trip ($1 key, $2 sequence). See LANE_TAKE.
_LANE_TAKE = """
WITH attempt AS MATERIALIZED (
    SELECT {try_lock}($1) AS taken
    WHERE NOT EXISTS (SELECT 1 FROM {queue} WHERE key = $1 AND expires_at > now())
)
SELECT nextval($2::regclass) FROM attempt WHERE attempt.taken
"""
# A wait in the server's queue ($1 key, $2 sequence, $3 ttl ms, $4 head, $5 marker): see WAIT.
_WAIT = """
WITH empty AS MATERIALIZED (
    SELECT 1 WHERE $4 OR NOT EXISTS (SELECT 1 FROM {queue} WHERE key = $1 AND expires_at > now())
),
marked AS MATERIALIZED (SELECT pg_advisory_lock_shared($5) FROM empty WHERE $4),
granted AS MATERIALIZED (
    SELECT {lock}($1) FROM empty CROSS JOIN (SELECT count(*) FROM marked) AS heads
)
SELECT nextval($2::regclass), pg_backend_pid(), set_config('idle_session_timeout', $3, false)
FROM granted
"""
# One try on a dedicated connection (a shared hold while the lane holds the key shared already:
# the lane refuses a re-entrant take, as the server would let it jump a waiting writer).
# $1 key, $2 sequence, $3 ttl ms.
TRY_SHARED_DEDICATED = """
WITH attempt AS MATERIALIZED (
    SELECT pg_try_advisory_lock_shared($1) AS taken
    WHERE NOT EXISTS (SELECT 1 FROM {queue} WHERE key = $1 AND expires_at > now())
)
SELECT nextval($2::regclass), pg_backend_pid(), set_config('idle_session_timeout', $3, false)
FROM attempt WHERE attempt.taken
"""
_UNLOCK = "SELECT {unlock}($1)"
# The dedicated connection holds exactly this lock.
_RELEASE = "SELECT pg_advisory_unlock_all(), set_config('idle_session_timeout', '0', false)"

# -- elections: the same, and the leader's row written (and a NOTIFY sent) by the take ------------
# The row is upserted in the statement that takes the lock, so a leader's row is there as soon as
# the statement commits; a row whose pid no longer holds the key is a crashed leader's and is
# never read as the leader (inspect joins pg_locks by pid). Extra: $3/$6 owner, $4/$7 value,
# $5/$8 channel.
_KEEP = """
token AS MATERIALIZED (SELECT nextval($2::regclass) AS token FROM {granted}),
kept AS (
    INSERT INTO {leaders} (key, pid, token, owner, value, application_name)
    SELECT $1, pg_backend_pid(), token, ${owner}, ${value}, current_setting('application_name')
    FROM token
    ON CONFLICT (key) DO UPDATE SET pid = excluded.pid, token = excluded.token,
        owner = excluded.owner, value = excluded.value,
        application_name = excluded.application_name
)
"""
_ELECTION_LANE_TAKE = (
    """
WITH attempt AS MATERIALIZED (
    SELECT pg_try_advisory_lock($1) AS taken
    WHERE NOT EXISTS (SELECT 1 FROM {queue} WHERE key = $1 AND expires_at > now())
),
taken AS MATERIALIZED (SELECT 1 FROM attempt WHERE attempt.taken),
"""
    + _KEEP.format(granted="taken", leaders="{leaders}", owner=3, value=4)
    + "SELECT token, pg_notify($5, $1::text) FROM token"
)
_ELECTION_WAIT = (
    """
WITH empty AS MATERIALIZED (
    SELECT 1 WHERE $4 OR NOT EXISTS (SELECT 1 FROM {queue} WHERE key = $1 AND expires_at > now())
),
marked AS MATERIALIZED (SELECT pg_advisory_lock_shared($5) FROM empty WHERE $4),
granted AS MATERIALIZED (
    SELECT pg_advisory_lock($1) FROM empty CROSS JOIN (SELECT count(*) FROM marked) AS heads
),
"""
    + _KEEP.format(granted="granted", leaders="{leaders}", owner=6, value=7)
    + """SELECT token, pg_backend_pid(), set_config('idle_session_timeout', $3, false),
    pg_notify($8, $1::text)
FROM token"""
)
# The row goes with the lock (only our own: pid = ours); the NOTIFY tells the observers.
_ELECTION_UNLOCK = """
WITH gone AS (DELETE FROM {leaders} WHERE key = $1 AND pid = pg_backend_pid())
SELECT pg_advisory_unlock($1), pg_notify($2, $1::text)
"""
_ELECTION_RELEASE = """
WITH gone AS (DELETE FROM {leaders} WHERE key = $1 AND pid = pg_backend_pid())
SELECT pg_advisory_unlock_all(), set_config('idle_session_timeout', '0', false),
    pg_notify($2, $1::text)
"""
# The rows of leaders whose session ended without deleting them (killed, terminated, cut off):
# their pid no longer holds the key. A leader's row is written after its lock is granted, so no
# live leader's row matches (a take that overwrites a stale row meanwhile makes the DELETE
# re-check the new row, whose pid holds the key). Whether the row of pid $4 is still there
# (its session has not ended yet). $1 key, $2 classid, $3 objid.
SWEEP_LEADER = """
WITH gone AS (
    DELETE FROM {leaders} AS e WHERE e.key = $1 AND NOT EXISTS (
        SELECT 1 FROM pg_locks AS l
        WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted AND l.pid = e.pid
          AND l.classid = $2 AND l.objid = $3
    )
    RETURNING pid
)
SELECT EXISTS (SELECT 1 FROM {leaders} WHERE key = $1 AND pid = $4)
    AND NOT EXISTS (SELECT 1 FROM gone WHERE pid = $4)
"""
# The same for every election (open()).
SWEEP_LEADERS = """
DELETE FROM {leaders} AS e WHERE NOT EXISTS (
    SELECT 1 FROM pg_locks AS l
    WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted AND l.pid = e.pid
      AND ((l.classid::bigint << 32) | l.objid::bigint) = e.key
)
"""
# Holders and waiters of one key ($1, $2: classid, objid), and the leader's row ($3: the key)
# when its pid holds the key now.
INSPECT_HOLDS = """
SELECT l.granted, l.pid, l.mode, a.application_name, e.token, e.owner, e.value
FROM pg_locks AS l JOIN pg_stat_activity AS a ON a.pid = l.pid
LEFT JOIN {leaders} AS e ON e.key = $3 AND e.pid = l.pid AND l.granted
WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.classid = $1 AND l.objid = $2
ORDER BY e.token NULLS LAST, l.pid
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
    #: On a dedicated connection: ``$1`` key, then :meth:`unlock_args` (none: no arguments).
    release: str
    shared: bool = False
    election: bool = False
    #: A shared try on a dedicated connection (``TRY_SHARED_DEDICATED``).
    try_dedicated: str = ""

    def take_args(self, owner: str, value: bytes, channel: str) -> tuple[object, ...]:
        return (owner, value, channel) if self.election else ()

    def unlock_args(self, channel: str) -> tuple[object, ...]:
        return (channel,) if self.election else ()

    def release_args(self, key: int, channel: str) -> tuple[object, ...]:
        return (key, channel) if self.election else ()


def modes(queue: str, leaders: str) -> dict[tuple[Kind, bool], Mode]:
    """The modes by (kind, shared), for the queue table and the leaders' table of a schema."""

    def plain(lock: str, try_lock: str, unlock: str, *, shared: bool) -> Mode:
        return Mode(
            lane_take=_LANE_TAKE.format(try_lock=try_lock, queue=queue),
            wait=_WAIT.format(lock=lock, queue=queue),
            unlock=_UNLOCK.format(unlock=unlock),
            release=_RELEASE,
            shared=shared,
            try_dedicated=TRY_SHARED_DEDICATED.format(queue=queue) if shared else "",
        )

    tables = {"queue": queue, "leaders": leaders}
    return {
        ("lock", False): plain(
            "pg_advisory_lock", "pg_try_advisory_lock", "pg_advisory_unlock", shared=False
        ),
        ("lock", True): plain(
            "pg_advisory_lock_shared",
            "pg_try_advisory_lock_shared",
            "pg_advisory_unlock_shared",
            shared=True,
        ),
        ("election", False): Mode(
            lane_take=_ELECTION_LANE_TAKE.format(**tables),
            wait=_ELECTION_WAIT.format(**tables),
            unlock=_ELECTION_UNLOCK.format(**tables),
            release=_ELECTION_RELEASE.format(**tables),
            election=True,
        ),
    }


def leaders_name(schema: str) -> str:
    return f"{quote_ident(schema)}.{quote_ident(LEADERS_TABLE)}"


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
