"""Each kind of hold (exclusive, shared, election): its statements, formatted for one schema's
tables from the templates in ``_sql.py``, and its key space.

Every kind is its own key space: the lock "a", the semaphore "a" and the election "a" hash to
unrelated keys (BLAKE2b with a personalisation of their own), so they never exclude each other.
Semaphores take their own way (``_semaphores.py``); their permits keep rows in the holders'
table too.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from .._kit import Kind, LockRequest, UnsupportedFeature
from ._sql import (
    CREATE_HOLDERS,
    KEEP,
    LANE_TAKE,
    NOTIFY,
    RELEASE,
    RELEASE_KEPT,
    SWEPT_ALONE,
    SWEPT_SHARED,
    TRY_DEDICATED_TAIL,
    UNLOCK,
    UNLOCK_KEPT,
    WAIT,
    hash_key,
    lock_key,
)


@dataclass(frozen=True, slots=True)
class Mode:
    """The statements of one kind of hold, formatted for one schema's tables."""

    #: On a lane: ``$1`` key, ``$2`` sequence, then :meth:`take_args`; the token, or no row.
    lane_take: str
    #: In the server's queue: ``$1`` key, ``$2`` sequence, ``$3`` ttl (ms), ``$4`` head,
    #: ``$5`` marker, ``$6`` client, then :meth:`take_args`; (token, pid, ...).
    wait: str
    #: On a lane: ``$1`` key, then :meth:`unlock_args`.
    unlock: str
    #: On a dedicated connection: :meth:`release_args`.
    release: str
    shared: bool = False
    election: bool = False
    #: Its holds keep a row in the holders' table (owner, token, value for inspect()).
    kept: bool = True
    #: A shared try on a dedicated connection (``TRY_DEDICATED_TAIL``).
    try_dedicated: str = ""

    def take_args(self, owner: str, value: bytes, channel: str) -> tuple[object, ...]:
        if not self.kept:
            return ()
        return (owner, value, channel) if self.election else (owner, value)

    def unlock_args(self, channel: str) -> tuple[object, ...]:
        return (channel,) if self.election else ()

    def release_args(self, key: int, channel: str) -> tuple[object, ...]:
        return (key, channel) if self.election else ()


def modes(queue: str, holders: str) -> dict[tuple[Kind, bool], Mode]:
    """The modes by (kind, shared), for the queue table and the holders' table of a schema."""

    def keep(owner: int, value: int, *, shared: bool) -> str:
        kept = KEEP.format(
            holders=holders, owner=owner, value=value, shared="true" if shared else "false"
        )
        swept = (SWEPT_SHARED if shared else SWEPT_ALONE).format(holders=holders)
        return "," + kept + swept

    def take(
        template: str,
        lock: str,
        first: int,
        *,
        kept: bool,
        shared: bool = False,
        notify: bool = False,
        tail: str = "",
    ) -> str:
        """``template`` (``LANE_TAKE`` or ``WAIT``) taking with ``lock``; a kept hold's owner and
        value in ``$first`` and the next, an election's NOTIFY channel after them; ``tail``: more
        columns of the row it returns."""
        return template.format(
            lock=lock,
            try_lock=lock.replace("pg_advisory", "pg_try_advisory", 1),
            queue=queue,
            keep=keep(first, first + 1, shared=shared) if kept else "",
            notify=(NOTIFY.format(channel=first + 2) if notify else "") + tail,
        )

    def unlock(function: str, *, notify: bool = False) -> str:
        notifying = NOTIFY.format(channel=2) if notify else ""
        return UNLOCK_KEPT.format(holders=holders, unlock=function, notify=notifying)

    def release(*, notify: bool = False) -> str:
        notifying = NOTIFY.format(channel=2) if notify else ""
        return RELEASE_KEPT.format(holders=holders, notify=notifying)

    return {
        # Exclusive locks keep no row: their takes stay one write-free round trip.
        ("lock", False): Mode(
            lane_take=take(LANE_TAKE, "pg_try_advisory_lock", 3, kept=False),
            wait=take(WAIT, "pg_advisory_lock", 7, kept=False),
            unlock=UNLOCK,
            release=RELEASE,
            kept=False,
        ),
        ("lock", True): Mode(
            lane_take=take(LANE_TAKE, "pg_try_advisory_lock_shared", 3, kept=True, shared=True),
            wait=take(WAIT, "pg_advisory_lock_shared", 7, kept=True, shared=True),
            unlock=unlock("pg_advisory_unlock_shared"),
            release=release(),
            shared=True,
            try_dedicated=take(
                LANE_TAKE,
                "pg_try_advisory_lock_shared",
                4,
                kept=True,
                shared=True,
                tail=TRY_DEDICATED_TAIL,
            ),
        ),
        ("election", False): Mode(
            lane_take=take(LANE_TAKE, "pg_try_advisory_lock", 3, kept=True, notify=True),
            wait=take(WAIT, "pg_advisory_lock", 7, kept=True, notify=True),
            unlock=unlock("pg_advisory_unlock", notify=True),
            release=release(notify=True),
            election=True,
        ),
    }


@functools.lru_cache(maxsize=4096)
def kind_key(name: str, kind: Kind, schema: str = "public") -> int:
    """The advisory lock key of ``name`` of ``kind``: :func:`lock_key` for locks; for the others
    a hash of their own (an election's lock; a semaphore's key in the queue table, and the key
    that serialises its takes)."""
    if kind == "lock":
        return lock_key(name, schema)
    return hash_key(b"asynclock.pg." + kind[:3].encode(), schema, name)


@functools.lru_cache(maxsize=1024)
def slot_keys(name: str, permits: int, schema: str = "public") -> tuple[int, ...]:
    """The advisory lock keys of a semaphore's permits, one per slot."""
    return tuple(
        hash_key(b"asynclock.pgslot", schema, f"{slot}\0{name}") for slot in range(permits)
    )


@functools.lru_cache(maxsize=1024)
def permits_class(name: str, schema: str = "public") -> int:
    """The first key (a signed int4) of the shared two-int4 lock ``(class, permits)`` that every
    holder of a semaphore holds: ``pg_locks`` shows the permits of the holders (``objid``)."""
    return hash_key(b"asynclock.pgsemn", schema, name, size=4)


def split(key: int) -> tuple[int, int]:
    """``(classid, objid)`` of a bigint key as ``pg_locks`` shows it."""
    unsigned = key & 0xFFFFFFFFFFFFFFFF
    return unsigned >> 32, unsigned & 0xFFFFFFFF


def no_holders_table(request: LockRequest, server: str, holders: str) -> UnsupportedFeature:
    """The refusal of a kind that needs the holders' table, which open() could not create."""
    return UnsupportedFeature(
        f"{request.kind} {request.name!r}: shared locks, semaphores and elections on {server} "
        f"need the table {holders}, which this user may not create: {holders_advice(holders)}"
    )


def holders_advice(holders: str) -> str:
    """What the owner of the schema does for the holders' table (for a message)."""
    create = " ".join(CREATE_HOLDERS.format(holders=holders).split())
    return (
        f"create it once as its owner with {create}, and GRANT SELECT, INSERT, UPDATE, DELETE "
        "ON it TO the lock users"
    )
