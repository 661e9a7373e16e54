"""The file's tables and the transactions on them: plain functions on a ``sqlite3`` connection,
run in the backend's worker thread, one transaction each.

Exclusive locks keep the table and the token counter of earlier versions
(``asynclock_locks``, ``asynclock_tokens``), so processes of an older asynclock on the same file
still exclude them. Every other hold (a shared one, a semaphore's permit, an election's leader)
is a row of ``asynclock_holds``. Waiters are rows of ``asynclock_queue``, in ``seq`` order, each
kept alive by its process while it waits (``WAITER_TTL``): a request is granted only if it agrees
with the holds and with every live waiter ahead of it, which is what gives writers their
preference and semaphores their FIFO order across processes.
"""

from __future__ import annotations

import math
import sqlite3
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .._kit import Kind, permits_mismatch

SCHEMA = """
CREATE TABLE IF NOT EXISTS asynclock_locks (
    name TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    token INTEGER NOT NULL,
    boot_id TEXT NOT NULL,
    expires_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS asynclock_tokens (
    name TEXT PRIMARY KEY,
    last INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS asynclock_waiters (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL,
    boot_id TEXT NOT NULL,
    expires_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS asynclock_holds (
    kind TEXT NOT NULL,
    name TEXT NOT NULL,
    owner TEXT NOT NULL,
    token INTEGER NOT NULL,
    shared INTEGER NOT NULL,
    permits INTEGER NOT NULL,
    value BLOB,
    boot_id TEXT NOT NULL,
    expires_at REAL NOT NULL,
    PRIMARY KEY (kind, name, owner)
);
CREATE TABLE IF NOT EXISTS asynclock_queue (
    seq INTEGER PRIMARY KEY,
    kind TEXT NOT NULL,
    name TEXT NOT NULL,
    owner TEXT NOT NULL UNIQUE,
    shared INTEGER NOT NULL,
    permits INTEGER NOT NULL,
    boot_id TEXT NOT NULL,
    expires_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS asynclock_queue_by_name ON asynclock_queue (kind, name, seq);
CREATE INDEX IF NOT EXISTS asynclock_queue_by_expiry ON asynclock_queue (kind, name, expires_at);
CREATE TABLE IF NOT EXISTS asynclock_counters (
    kind TEXT NOT NULL,
    name TEXT NOT NULL,
    last INTEGER NOT NULL,
    PRIMARY KEY (kind, name)
);
"""

#: How long a waiter's row outlives its last refresh. Waiters refresh at every poll (at least
#: every 50 ms), so only a killed or stopped process lets its rows lapse; until they do, the
#: requests behind them wait (a stopped waiter's place is lost, never anyone's hold).
WAITER_TTL = 2.0


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as file:
            return file.read().strip()
    except OSError:
        # Without a boot id a reboot is not detected; monotonic clocks elsewhere restart too,
        # so fall back to the wall-clock moment the machine booted, to a second.
        return str(round(time.time() - time.monotonic()))


BOOT_ID = _boot_id()


@dataclass(frozen=True, slots=True)
class Want:
    """A request as the file sees it."""

    kind: Kind
    name: str
    owner: str
    ttl: float
    shared: bool = False
    permits: int = 1
    value: bytes | None = None
    #: When the request was made (``time.monotonic_ns()``, one clock for every process of the
    #: host): the place it takes in the queue, so that the order is that of the requests, not
    #: of their turns at the file's write lock (four processes queueing 1,000 waiters 2 ms
    #: apart got places up to 365 out of order that way). ``None``: now (a place taken again).
    since: int | None = None

    @property
    def exclusive_lock(self) -> bool:
        """Kept in ``asynclock_locks``, where older versions look."""
        return self.kind == "lock" and not self.shared


@dataclass(frozen=True, slots=True)
class Hold:
    owner: str
    token: int
    shared: bool
    permits: int
    value: bytes | None
    expires_at: float


@dataclass(frozen=True, slots=True)
class Taken:
    token: int | None
    #: When the earliest hold in the way expires (monotonic), if the request was not granted.
    retry_at: float = 0.0
    #: The request took a new place at the end of the queue (its first, or its old one lapsed).
    placed: bool = False


class Transaction:
    """``BEGIN IMMEDIATE`` (or ``begin``) .. ``COMMIT``, rolled back on any exception (a raise
    inside is how a transaction refuses: nothing it wrote stays). A class, not a generator: it
    costs a third as much, on every take, renewal and release."""

    __slots__ = ("begin", "db")

    def __init__(self, db: sqlite3.Connection, begin: str = "BEGIN IMMEDIATE") -> None:
        self.db, self.begin = db, begin

    def __enter__(self) -> None:
        self.db.execute(self.begin)

    def __exit__(self, kind: object, exc: object, tb: object) -> None:
        if exc is None:
            try:
                self.db.execute("COMMIT")
            except BaseException:
                # A COMMIT refused as busy leaves the transaction open: nothing of it stays.
                if self.db.in_transaction:
                    self.db.execute("ROLLBACK")
                raise
        elif self.db.in_transaction:
            self.db.execute("ROLLBACK")


_LIVE = "boot_id = ? AND expires_at > ?"
_STALE = "(boot_id != ? OR expires_at <= ?)"


def _sweep_holds(db: sqlite3.Connection, kind: Kind, name: str, now: float) -> None:
    """Delete the holds of ``name`` whose process stopped renewing them (or died before a
    reboot): there is no server to do it, so whoever takes does."""
    args = (kind, name, BOOT_ID, now)
    db.execute(f"DELETE FROM asynclock_holds WHERE kind = ? AND name = ? AND {_STALE}", args)
    if kind == "lock":
        db.execute(f"DELETE FROM asynclock_locks WHERE name = ? AND {_STALE}", args[1:])


def holds(db: sqlite3.Connection, kind: Kind, name: str, now: float) -> list[Hold]:
    """The live holds of ``name``, lowest token first."""
    found = [
        Hold(row[0], int(row[1]), bool(row[2]), int(row[3]), row[4], float(row[5]))
        for row in db.execute(
            "SELECT owner, token, shared, permits, value, expires_at FROM asynclock_holds "
            f"WHERE kind = ? AND name = ? AND {_LIVE}",
            (kind, name, BOOT_ID, now),
        )
    ]
    if kind == "lock":
        row = db.execute(
            f"SELECT owner, token, expires_at FROM asynclock_locks WHERE name = ? AND {_LIVE}",
            (name, BOOT_ID, now),
        ).fetchone()
        if row is not None:
            found.append(Hold(row[0], int(row[1]), False, 1, None, float(row[2])))
    return sorted(found, key=lambda hold: hold.token)


class _Queue:
    """The queue of one name as one take reads it: only as far as the decision needs (a poll
    costs the same with 1,000 waiters behind it as with none)."""

    def __init__(self, db: sqlite3.Connection, want: Want, now: float) -> None:
        self.db, self.want, self.now = db, want, now
        row = db.execute(
            f"SELECT seq FROM asynclock_queue WHERE owner = ? AND {_LIVE}",
            (want.owner, BOOT_ID, now),
        ).fetchone()
        #: Our place; a request without one (new, or its row lapsed) goes behind everyone.
        self.seq: float = math.inf if row is None else int(row[0])
        where = "kind = ? AND name = ? AND seq < ?"
        self._ahead = f"FROM asynclock_queue WHERE {where} AND {_LIVE}"
        self._args = (want.kind, want.name, self.seq, BOOT_ID, now)

    def sweep(self) -> None:
        """Delete the lapsed rows of the name (a waiter's process stopped): through the index
        on expiry, so a take reads only those. Rows of an earlier boot went at ``open()``."""
        self.db.execute(
            "DELETE FROM asynclock_queue WHERE kind = ? AND name = ? AND expires_at <= ?",
            (self.want.kind, self.want.name, self.now),
        )

    def any_ahead(self, *, writers_only: bool = False) -> bool:
        only = " AND shared = 0" if writers_only else ""
        return (
            self.db.execute(f"SELECT 1 {self._ahead}{only} LIMIT 1", self._args).fetchone()
            is not None
        )

    def other_permits(self) -> int | None:
        """The permits of another live waiter: every live row has the same (a row is only
        written after the check), so one row tells."""
        row = self.db.execute(
            "SELECT permits FROM asynclock_queue WHERE kind = ? AND name = ? AND owner != ? "
            f"AND {_LIVE} ORDER BY seq LIMIT 1",
            (self.want.kind, self.want.name, self.want.owner, BOOT_ID, self.now),
        ).fetchone()
        return None if row is None else int(row[0])


def _grantable(want: Want, held: Sequence[Hold], queue: _Queue) -> bool:
    if want.kind == "semaphore":
        # Strict FIFO: while anyone waits ahead, a free permit is theirs, even if two are
        # free (then the one ahead takes its turn first, and this request the next).
        return len(held) < want.permits and not queue.any_ahead()
    if want.shared:
        # Writer preference: a writer waiting ahead blocks this reader as a writer holding.
        return all(hold.shared for hold in held) and not queue.any_ahead(writers_only=True)
    return not held and not queue.any_ahead()


def _check_permits(want: Want, held: Sequence[Hold], queue: _Queue) -> None:
    if want.kind != "semaphore":
        return
    others = [hold.permits for hold in held if hold.owner != want.owner]
    waiting = queue.other_permits()
    if waiting is not None:
        others.append(waiting)
    mismatched = [permits for permits in others if permits != want.permits]
    if mismatched:
        raise permits_mismatch(want.name, mismatched[0], want.permits)


def _next_token(db: sqlite3.Connection, want: Want) -> int:
    if want.kind == "lock":
        # The counter of earlier versions: shared and exclusive holds of a lock share it.
        row = db.execute(
            "INSERT INTO asynclock_tokens (name, last) VALUES (?, 1) "
            "ON CONFLICT (name) DO UPDATE SET last = last + 1 RETURNING last",
            (want.name,),
        ).fetchone()
    else:
        row = db.execute(
            "INSERT INTO asynclock_counters (kind, name, last) VALUES (?, ?, 1) "
            "ON CONFLICT (kind, name) DO UPDATE SET last = last + 1 RETURNING last",
            (want.kind, want.name),
        ).fetchone()
    return int(row[0])


def _insert_hold(db: sqlite3.Connection, want: Want, token: int, now: float) -> None:
    if want.exclusive_lock:
        db.execute(
            "INSERT OR REPLACE INTO asynclock_locks (name, owner, token, boot_id, expires_at) "
            "VALUES (?, ?, ?, ?, ?)",
            (want.name, want.owner, token, BOOT_ID, now + want.ttl),
        )
        return
    db.execute(
        "INSERT OR REPLACE INTO asynclock_holds (kind, name, owner, token, shared, permits, "
        "value, boot_id, expires_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (
            want.kind,
            want.name,
            want.owner,
            token,
            int(want.shared),
            want.permits,
            want.value,
            BOOT_ID,
            now + want.ttl,
        ),
    )


def take(
    db: sqlite3.Connection,
    want: Want,
    *,
    wait: bool,
    keep: Callable[[float], Sequence[str]] = lambda now: (),
) -> Taken:
    """One attempt at ``want``. With ``wait``, a request that is not granted keeps (or takes)
    its place in the queue; ``keep`` names, at the transaction's time, the owners of this
    process's other waiters for the name whose places are refreshed in it."""
    with Transaction(db):
        now = time.monotonic()
        # This process is running this transaction, so its waiters are alive: their places are
        # kept before the lapsed rows are swept. Swept first, a stall of this process or of
        # the disk under it longer than WAITER_TTL cost its own waiters their places (on a
        # loaded machine, 989 of 1,000 went to the back of the line).
        owners = [*keep(now), want.owner] if wait else []
        db.executemany(
            "UPDATE asynclock_queue SET expires_at = ? WHERE owner = ? AND boot_id = ?",
            [(now + WAITER_TTL, owner, BOOT_ID) for owner in owners],
        )
        _sweep_holds(db, want.kind, want.name, now)
        held = holds(db, want.kind, want.name, now)
        queue = _Queue(db, want, now)
        queue.sweep()
        _check_permits(want, held, queue)
        if _grantable(want, held, queue):
            token = _next_token(db, want)
            _insert_hold(db, want, token, now)
            db.execute("DELETE FROM asynclock_queue WHERE owner = ?", (want.owner,))
            return Taken(token)
        # A new request takes the place of the moment it was made; one whose row was swept by
        # another process while this one stood still takes one behind everyone (the others
        # went on without it).
        placed = wait and queue.seq == math.inf
        if placed:
            seq = time.monotonic_ns() if want.since is None else want.since
            while db.execute("SELECT 1 FROM asynclock_queue WHERE seq = ?", (seq,)).fetchone():
                seq += 1  # another request of the same nanosecond
            db.execute(
                "INSERT OR REPLACE INTO asynclock_queue (seq, kind, name, owner, shared, "
                "permits, boot_id, expires_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    seq,
                    want.kind,
                    want.name,
                    want.owner,
                    int(want.shared),
                    want.permits,
                    BOOT_ID,
                    now + WAITER_TTL,
                ),
            )
        return Taken(None, min((hold.expires_at for hold in held), default=math.inf), placed)


def _row(want: Want) -> tuple[str, str, tuple[str, ...]]:
    """The table of ``want``'s hold, and the WHERE clause (with its args) that finds it."""
    if want.exclusive_lock:
        return "asynclock_locks", "name = ? AND owner = ?", (want.name, want.owner)
    where = "kind = ? AND name = ? AND owner = ?"
    return "asynclock_holds", where, (want.kind, want.name, want.owner)


def renew(db: sqlite3.Connection, wants: Sequence[Want]) -> list[bool]:
    """Move each live hold's expiry to ``now + ttl``; False for those that are gone."""
    with Transaction(db):
        now = time.monotonic()
        alive = []
        for want in wants:
            table, where, args = _row(want)
            cursor = db.execute(
                f"UPDATE {table} SET expires_at = ? WHERE {where} AND {_LIVE}",
                (now + want.ttl, *args, BOOT_ID, now),
            )
            alive.append(cursor.rowcount == 1)
    return alive


def release(db: sqlite3.Connection, want: Want) -> None:
    """Delete the hold and the queue row of ``want.owner``, if there are any: also the undo of
    a take whose caller was cancelled, granted or queued."""
    table, where, args = _row(want)
    with Transaction(db):
        db.execute(f"DELETE FROM {table} WHERE {where}", args)
        db.execute("DELETE FROM asynclock_queue WHERE owner = ?", (want.owner,))


def dequeue(db: sqlite3.Connection, owner: str) -> None:
    """Leave the queue (a waiter that gave up)."""
    db.execute("DELETE FROM asynclock_queue WHERE owner = ?", (owner,))


@dataclass(frozen=True, slots=True)
class Look:
    holds: list[Hold]
    waiters: int
    #: The permits of the first waiter (a semaphore's, when nobody holds it).
    permits: int | None
    #: When it was read (monotonic).
    at: float


def look(db: sqlite3.Connection, kind: Kind, name: str) -> Look:
    """The holds and waiters of ``name`` in one read."""
    # A deferred transaction: one snapshot for every read, without SQLite's write lock.
    with Transaction(db, "BEGIN"):
        now = time.monotonic()
        live = f"FROM asynclock_queue WHERE kind = ? AND name = ? AND {_LIVE}"
        args = (kind, name, BOOT_ID, now)
        (count,) = db.execute(f"SELECT count(*) {live}", args).fetchone()
        first = db.execute(f"SELECT permits {live} ORDER BY seq LIMIT 1", args).fetchone()
        permits = None if first is None else int(first[0])
        return Look(holds(db, kind, name, now), int(count), permits, now)


def forget_other_boots(db: sqlite3.Connection) -> None:
    """Delete every hold and waiter written before the last reboot: none can be live."""
    with Transaction(db):
        for table in ("asynclock_holds", "asynclock_queue", "asynclock_locks"):
            db.execute(f"DELETE FROM {table} WHERE boot_id != ?", (BOOT_ID,))
