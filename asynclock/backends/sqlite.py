"""``sqlite:///path/to/locks.db``: the embedded backend, no server needed.

Locks exclude each other across every process on one host that opens the same file. A lock row
carries an expiry on ``CLOCK_MONOTONIC`` (``time.monotonic()``, one clock for every process on a
Linux host) and the kernel's boot id, so a row left by a killed process frees itself when its
ttl runs out, and a row from before a reboot never looks held. Tokens come from a counter table
bumped in the same transaction as the take, so they strictly increase across restarts of every
process (``synchronous=full``, the default, also across power loss).

Waiting polls with capped, jittered backoff; waiters in this process are also woken at once by a
release in this process. There is no FIFO order across processes.
"""

from __future__ import annotations

import functools
import math
import os
import sqlite3
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Self, TypeVar

import anyio
import anyio.to_thread

from ._kit import (
    Backend,
    BackendUnavailable,
    Capabilities,
    Grant,
    InvalidURL,
    Kind,
    LockInfo,
    LockRequest,
    Lost,
    Options,
    Renewed,
    RenewOutcome,
    RetryPolicy,
    Translator,
    WaiterRegistry,
    finish,
    translate,
)

__all__ = ("SQLiteBackend",)

T = TypeVar("T")

_SCHEMA = """
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
"""

_SYNCHRONOUS = ("off", "normal", "full", "extra")

#: Backoff while polling a held lock: 2 ms first, doubling up to 50 ms, each drawn from
#: [pause / 2, pause].
_POLL = RetryPolicy(first=0.002, cap=0.05, factor=2.0, jitter=0.5)
#: Pauses between attempts to open a new file that another process is switching to WAL:
#: 5-20 ms each.
_OPEN_RACE = RetryPolicy(first=0.02, cap=0.02, factor=1.0, jitter=0.75)
#: Every driver error is the file being unusable (locked past busy_timeout, unreadable, full).
_ERRORS: Translator = {sqlite3.Error: BackendUnavailable}


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as file:
            return file.read().strip()
    except OSError:
        # Without a boot id a reboot is not detected; monotonic clocks elsewhere restart too,
        # so fall back to the wall-clock moment the machine booted, to a second.
        return str(round(time.time() - time.monotonic()))


_BOOT_ID = _boot_id()

# Backends of this process by database path, so a release wakes local waiters at once.
_local: weakref.WeakValueDictionary[int, SQLiteBackend] = weakref.WeakValueDictionary()


@dataclass(frozen=True, slots=True)
class _Taken:
    token: int | None
    #: When the current holder's row expires (monotonic), if the lock was not free.
    holder_expires_at: float


class _SQLiteWaiters(WaiterRegistry):
    """Deadlock detection's records, in the same file and on the same clock as the locks."""

    def __init__(self, backend: SQLiteBackend) -> None:
        self._backend = backend

    async def publish(self, key: str, value: str, ttl: float) -> None:
        def publish() -> None:
            self._backend._db().execute(
                "INSERT OR REPLACE INTO asynclock_waiters (key, value, boot_id, expires_at) "
                "VALUES (?, ?, ?, ?)",
                (key, value, _BOOT_ID, time.monotonic() + ttl),
            )

        await self._backend._run(publish)

    async def withdraw(self, key: str) -> None:
        await self._backend._run(
            lambda: self._backend._db().execute(
                "DELETE FROM asynclock_waiters WHERE key = ?", (key,)
            )
        )

    async def scan(self) -> list[str]:
        def scan() -> list[str]:
            db = self._backend._db()
            now = time.monotonic()
            # Expired records are swept here, by whoever looks: there is no server to do it.
            db.execute(
                "DELETE FROM asynclock_waiters WHERE boot_id != ? OR expires_at <= ?",
                (_BOOT_ID, now),
            )
            rows = db.execute("SELECT value FROM asynclock_waiters").fetchall()
            return [row[0] for row in rows]

        return await self._backend._run(scan)


class SQLiteBackend(Backend[Grant]):
    # Pure anyio (and the standard library): runs on trio as well.
    event_loops = frozenset({"asyncio", "trio"})
    capabilities = Capabilities(
        fencing=True, fifo=False, loss_detection=True, quorum=False, cross_process=True
    )

    def __init__(self, path: str, *, synchronous: str = "full", busy_timeout: float = 10.0) -> None:
        self.path = path
        self._synchronous = synchronous
        self._busy_timeout = busy_timeout
        self._connection: sqlite3.Connection | None = None
        # One statement at a time on the one connection, in the order they were asked for.
        # (anyio primitives need the event loop: made in open().)
        self._limiter: anyio.CapacityLimiter | None = None
        self._thread_lock = threading.Lock()
        self._released: anyio.Event | None = None
        #: This client's waiters per lock name, in arrival order.
        self._queues: dict[str, deque[str]] = {}
        #: Owner ids of takes whose caller was cancelled natively while the statement ran in
        #: the worker thread (anyio's shield does not hold back Task.cancel()). A take that has
        #: not run yet skips them; one that ran is undone. Kept a minute, then forgotten.
        self._abandoned: dict[str, float] = {}
        _local[id(self)] = self

    @classmethod
    def from_url(cls, url: str, options: Mapping[str, object]) -> Self:
        path = url[len("sqlite://") :]
        if not path:
            raise InvalidURL(
                "sqlite:// needs a database file: sqlite:///absolute/path/locks.db or "
                "sqlite://relative/locks.db"
            )
        opts = Options(options, "sqlite://")
        synchronous = opts.text("synchronous", "full").lower()
        if synchronous not in _SYNCHRONOUS:
            raise InvalidURL(
                f"option 'synchronous' of sqlite:// must be one of {', '.join(_SYNCHRONOUS)}, "
                f"got {synchronous!r}"
            )
        busy_timeout = opts.number("busy_timeout", 10.0, minimum=0.001)
        opts.finish(("synchronous", "busy_timeout"))
        return cls(path, synchronous=synchronous, busy_timeout=busy_timeout)

    def describe(self) -> str:
        return f"sqlite://{self.path}"

    def waiter_registry(self) -> WaiterRegistry:
        return _SQLiteWaiters(self)

    async def open(self) -> None:
        self._limiter = anyio.CapacityLimiter(1)
        self._released = anyio.Event()
        await self._run(self._open_sync)

    def _open_sync(self) -> None:
        directory = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(directory):
            raise BackendUnavailable(
                f"cannot open {self.describe()}: the directory {directory!r} does not exist"
            )
        with translate(_ERRORS, f"cannot open {self.describe()}"):
            self._connection = self._connect_sync()

    def _connect_sync(self) -> sqlite3.Connection:
        # Processes opening a new file at once race to switch it to WAL, and SQLite reports
        # that race as "database is locked" without waiting on its busy handler: retry, within
        # busy_timeout.
        pauses = _OPEN_RACE.backoff()
        deadline = time.monotonic() + self._busy_timeout
        while True:
            try:
                return self._connect_once()
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() >= deadline:
                    raise
            time.sleep(pauses.next_delay())  # in the worker thread

    def _connect_once(self) -> sqlite3.Connection:
        connection = sqlite3.connect(
            self.path, timeout=self._busy_timeout, isolation_level=None, check_same_thread=False
        )
        try:
            connection.execute("PRAGMA journal_mode=WAL")
            connection.execute(f"PRAGMA synchronous={self._synchronous}")
            connection.executescript(_SCHEMA)
        except BaseException:
            connection.close()
            raise
        return connection

    async def aclose(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            await self._run(connection.close)
        _local.pop(id(self), None)

    # -- the contract ------------------------------------------------------------------------

    async def try_acquire(self, request: LockRequest) -> Grant | None:
        if self._queues.get(request.name):
            return None  # tasks of this client wait for it already: no jumping the queue
        grant, _ = await self._take(request)
        return grant

    async def acquire(self, request: LockRequest) -> Grant:
        # Tasks of this client queue in arrival order and only the first one polls the file:
        # otherwise a releasing task, which runs on, would retake the lock before the woken
        # waiters get a turn. Across processes there is no queue, only polling.
        queue = self._queues.setdefault(request.name, deque())
        queue.append(request.owner)
        polls = _POLL.backoff()
        try:
            while True:
                if queue[0] == request.owner:
                    grant, holder_expires_at = await self._take(request)
                    if grant is not None:
                        return grant
                    wake_at = min(holder_expires_at, anyio.current_time() + polls.next_delay())
                else:
                    wake_at = math.inf  # woken when the waiter ahead leaves
                # Sleep until a release in this process, the holder's expiry, or the next poll.
                released = self._released
                assert released is not None
                with anyio.move_on_at(wake_at):
                    await released.wait()
        finally:
            queue.remove(request.owner)
            if not queue:
                del self._queues[request.name]
            self._wake_waiters()

    async def _take(self, request: LockRequest) -> tuple[Grant | None, float]:
        """One attempt: the grant, or None and when the current holder's row expires."""
        sent_at = anyio.current_time()
        # anyio's cancellation waits for the statement (see _run), and nothing awaits between a
        # successful take and the return. A native Task.cancel() does not wait: the statement
        # may still run in the thread, so it is marked abandoned and undone.
        try:
            taken = await self._run(lambda: self._take_sync(request))
        except BaseException:
            self._abandon(request)
            undo = Grant(request.name, request.owner, None, sent_at, request.ttl)
            await finish(
                functools.partial(self.release, undo),
                timeout=self._busy_timeout,
                what=f"undoing a cancelled take of {request.name!r}",
            )
            raise
        if taken.token is None:
            return None, taken.holder_expires_at
        return Grant(request.name, request.owner, taken.token, sent_at, request.ttl), 0.0

    async def renew(self, grants: Sequence[Grant]) -> Sequence[RenewOutcome]:
        sent_at = anyio.current_time()
        alive = await self._run(lambda: self._renew_sync(grants))
        return [
            Renewed(sent_at, grant.ttl)
            if ok
            else Lost("the lock row is gone or expired (another process may hold it now)")
            for grant, ok in zip(grants, alive, strict=True)
        ]

    async def release(self, grant: Grant) -> None:
        await self._run(lambda: self._release_sync(grant))
        for backend in list(_local.values()):
            if backend.path == self.path:
                backend._wake_waiters()

    async def inspect(self, name: str, kind: Kind = "lock") -> LockInfo:
        def read() -> tuple[str, int, str, float] | None:
            row = (
                self._db()
                .execute(
                    "SELECT owner, token, boot_id, expires_at FROM asynclock_locks WHERE name = ?",
                    (name,),
                )
                .fetchone()
            )
            return None if row is None else (row[0], int(row[1]), row[2], float(row[3]))

        row = await self._run(read)
        now = time.monotonic()
        if row is None or row[2] != _BOOT_ID or row[3] <= now:
            return LockInfo(name, held=False)
        # Waiters poll; they leave no trace in the file.
        return LockInfo(name, held=True, owner=row[0], token=row[1], expires_in=row[3] - now)

    def _abandon(self, request: LockRequest) -> None:
        now = time.monotonic()
        for owner, since in list(self._abandoned.items()):
            if since < now - 60:
                del self._abandoned[owner]
        self._abandoned[request.owner] = now

    def _wake_waiters(self) -> None:
        if self._released is not None:
            self._released.set()
            self._released = anyio.Event()

    # -- in the worker thread ----------------------------------------------------------------

    async def _run(self, func: Callable[[], T]) -> T:
        # abandon_on_cancel=False: a statement always completes, so the caller sees its result
        # and can undo it; a cancelled caller is told at its next await instead.
        def locked() -> T:
            with self._thread_lock:
                return func()

        with translate(_ERRORS, self.describe()):
            return await anyio.to_thread.run_sync(locked, limiter=self._limiter)

    def _db(self) -> sqlite3.Connection:
        if self._connection is None:
            raise BackendUnavailable(f"{self.describe()} is closed")
        return self._connection

    def _take_sync(self, request: LockRequest) -> _Taken:
        db = self._db()
        if request.owner in self._abandoned:
            return _Taken(None, 0.0)  # its caller is gone (and an undo follows)
        db.execute("BEGIN IMMEDIATE")
        try:
            now = time.monotonic()
            row = db.execute(
                "SELECT boot_id, expires_at FROM asynclock_locks WHERE name = ?", (request.name,)
            ).fetchone()
            if row is not None and row[0] == _BOOT_ID and row[1] > now:
                db.execute("ROLLBACK")
                return _Taken(None, row[1])
            (token,) = db.execute(
                "INSERT INTO asynclock_tokens (name, last) VALUES (?, 1) "
                "ON CONFLICT (name) DO UPDATE SET last = last + 1 RETURNING last",
                (request.name,),
            ).fetchone()
            db.execute(
                "INSERT OR REPLACE INTO asynclock_locks (name, owner, token, boot_id, expires_at) "
                "VALUES (?, ?, ?, ?, ?)",
                (request.name, request.owner, token, _BOOT_ID, now + request.ttl),
            )
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        return _Taken(int(token), 0.0)

    def _renew_sync(self, grants: Sequence[Grant]) -> list[bool]:
        db = self._db()
        db.execute("BEGIN IMMEDIATE")
        try:
            now = time.monotonic()
            alive = [
                db.execute(
                    "UPDATE asynclock_locks SET expires_at = ? WHERE name = ? AND owner = ? "
                    "AND boot_id = ? AND expires_at > ?",
                    (now + grant.ttl, grant.name, grant.owner, _BOOT_ID, now),
                ).rowcount
                == 1
                for grant in grants
            ]
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        return alive

    def _release_sync(self, grant: Grant) -> None:
        self._db().execute(
            "DELETE FROM asynclock_locks WHERE name = ? AND owner = ?", (grant.name, grant.owner)
        )
