"""The embedded backend's contract calls: a worker thread runs the file's transactions (see
``_sql.py``), one at a time, and waiting is polling plus wake-ups within the process."""

from __future__ import annotations

import functools
import math
import os
import sqlite3
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Self, TypeVar

import anyio
import anyio.to_thread

from .._kit import (
    Backend,
    BackendUnavailable,
    Capabilities,
    Grant,
    HolderInfo,
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
from . import _sql
from ._sql import BOOT_ID, SCHEMA, WAITER_TTL, Want

__all__ = ("SQLiteBackend", "SQLiteGrant")

T = TypeVar("T")

_SYNCHRONOUS = ("off", "normal", "full", "extra")

#: Backoff while polling a held lock: 2 ms first, doubling up to 50 ms, each drawn from
#: [pause / 2, pause]. The cap also bounds how long a waiter's queue row goes unrefreshed.
_POLL = RetryPolicy(first=0.002, cap=0.05, factor=2.0, jitter=0.5)
#: Pauses between attempts to open a new file that another process is switching to WAL:
#: 5-20 ms each.
_OPEN_RACE = RetryPolicy(first=0.02, cap=0.02, factor=1.0, jitter=0.75)
#: Every driver error is the file being unusable (locked past busy_timeout, unreadable, full).
_ERRORS: Translator = {sqlite3.Error: BackendUnavailable}

# Backends of this process by database path, so a release wakes local waiters at once.
_local: weakref.WeakValueDictionary[int, SQLiteBackend] = weakref.WeakValueDictionary()


@dataclass(eq=False, slots=True)
class SQLiteGrant(Grant):
    """A hold, with what finds its row again."""

    shared: bool = False

    def want(self, ttl: float | None = None) -> Want:
        """What renew and release need to find the hold (with ``ttl``, for ``extend``)."""
        ttl = self.ttl if ttl is None else ttl
        return Want(self.space, self.name, self.owner, ttl, shared=self.shared)


def _want(request: LockRequest, since: int | None = None) -> Want:
    return Want(
        request.kind,
        request.name,
        request.owner,
        request.ttl,
        shared=request.kind == "lock" and request.shared,
        permits=request.permits if request.kind == "semaphore" else 1,
        value=request.value if request.kind == "election" else None,
        since=since,
    )


class _SQLiteWaiters(WaiterRegistry):
    """Deadlock detection's records, in the same file and on the same clock as the locks."""

    def __init__(self, backend: SQLiteBackend) -> None:
        self._backend = backend

    async def publish(self, key: str, value: str, ttl: float) -> None:
        def publish() -> None:
            self._backend._db().execute(
                "INSERT OR REPLACE INTO asynclock_waiters (key, value, boot_id, expires_at) "
                "VALUES (?, ?, ?, ?)",
                (key, value, BOOT_ID, time.monotonic() + ttl),
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
                (BOOT_ID, now),
            )
            rows = db.execute("SELECT value FROM asynclock_waiters").fetchall()
            return [row[0] for row in rows]

        return await self._backend._run(scan)


class _LocalQueue:
    """This client's waiters for one name, in the order of their rows in the file, each with
    the event that tells it that it is the first now (and polls). Only the first is ever woken:
    a hand-over costs the same however many wait here."""

    def __init__(self) -> None:
        self._turns: OrderedDict[str, anyio.Event] = OrderedDict()
        #: Set (and replaced) by a release of the name in this process: the first looks.
        self.released = anyio.Event()
        self._refreshed = -math.inf

    def join(self, owner: str) -> None:
        self._turns[owner] = anyio.Event()

    def first(self) -> str | None:
        return next(iter(self._turns), None)

    def turn(self, owner: str) -> anyio.Event:
        return self._turns[owner]

    def to_back(self, owner: str) -> None:
        del self._turns[owner]
        self._turns[owner] = anyio.Event()
        self._notify()

    def leave(self, owner: str) -> bool:
        """Remove ``owner``; False when nobody is left."""
        was_first = self.first() == owner
        del self._turns[owner]
        if was_first:
            self._notify()
        return bool(self._turns)

    def wake(self) -> None:
        self.released.set()
        self.released = anyio.Event()

    def due(self, now: float) -> Sequence[str]:
        """The waiters whose rows a take refreshes, asked in the worker thread by the take's
        transaction at its time: all of them a few times per ``WAITER_TTL`` (at every poll,
        1,000 waiters would cost 1,000 writes a poll). Asked there, not when the take is
        queued, so that a take that waited (for the file, the disk, or this process,
        stopped) keeps them all; and read only when due, so that a poll costs the same with
        1,000 waiters as with one."""
        if self._refreshed > now - WAITER_TTL / 4:
            return ()
        self._refreshed = now  # one float: the GIL keeps it whole
        # One C-level copy, which the GIL keeps whole against the event loop thread's joins
        # and leaves.
        return tuple(self._turns)

    def _notify(self) -> None:
        first = self.first()
        if first is not None:
            self._turns[first].set()
            # Its turn stays set: it polls from now on, waiting on ``released`` instead.


class SQLiteBackend(Backend[SQLiteGrant]):
    # Pure anyio (and the standard library): runs on trio as well.
    event_loops = frozenset({"asyncio", "trio"})
    acquire_tries_first = True
    capabilities = Capabilities.every(quorum=False)

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
        #: This client's waiters per (kind, name).
        self._queues: dict[tuple[Kind, str], _LocalQueue] = {}
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
        # Processes opening a new file at once race to switch it to WAL, and SQLite reports
        # that race as "database is locked" without waiting on its busy handler: retry, within
        # busy_timeout.
        pauses = _OPEN_RACE.backoff()
        deadline = time.monotonic() + self._busy_timeout
        with translate(_ERRORS, f"cannot open {self.describe()}"):
            while True:
                try:
                    self._connection = self._connect_once()
                except sqlite3.OperationalError as exc:
                    if "locked" not in str(exc) or time.monotonic() >= deadline:
                        raise
                else:
                    return
                time.sleep(pauses.next_delay())  # in the worker thread

    def _connect_once(self) -> sqlite3.Connection:
        connection = sqlite3.connect(
            self.path, timeout=self._busy_timeout, isolation_level=None, check_same_thread=False
        )
        try:
            connection.execute("PRAGMA journal_mode=WAL")
            connection.execute(f"PRAGMA synchronous={self._synchronous}")
            connection.executescript(SCHEMA)
            _sql.forget_other_boots(connection)
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

    async def try_acquire(self, request: LockRequest) -> SQLiteGrant | None:
        # The waiters of this client are in the file's queue like everyone's: no jumping it.
        grant, _ = await self._take(request, wait=False)
        return grant if isinstance(grant, SQLiteGrant) else None

    async def acquire(self, request: LockRequest) -> SQLiteGrant:
        # Every waiter has a row in the file's queue, in arrival order, so that a writer
        # waiting in another process holds back later readers there. Of this client's tasks
        # only the first polls (and refreshes the rows of the others): the others cannot be
        # granted before it, and a releasing task, which runs on, meets their rows.
        since = time.monotonic_ns()  # the place this request takes in the file's queue
        key = (request.kind, request.name)
        local = self._queues.get(key)
        if local is None:
            local = self._queues[key] = _LocalQueue()
        local.join(request.owner)
        polls = _POLL.backoff()
        queued = False
        try:
            while True:
                if not queued or local.first() == request.owner:
                    grant, retry_at = await self._take(
                        request, wait=True, keep=local.due, since=None if queued else since
                    )
                    if isinstance(grant, SQLiteGrant):
                        return grant
                    if grant and queued:
                        # Our row lapsed (this process was stopped, the file locked for long)
                        # and we are behind everyone now, this client's other waiters too: the
                        # first of them in the file must be the one that polls.
                        local.to_back(request.owner)
                    queued = True
                    if request.answered is not None:
                        request.answered()  # queued: the caller's timeout applies from here
                    # Until a release in this process, the holder's expiry, or the next poll.
                    wake_at = min(retry_at, anyio.current_time() + polls.next_delay())
                    event = local.released
                else:
                    wake_at = math.inf  # until the waiters ahead in this client are gone
                    event = local.turn(request.owner)
                with anyio.move_on_at(wake_at):
                    await event.wait()
        except BaseException:
            if queued:
                await finish(
                    functools.partial(self._run, lambda: _sql.dequeue(self._db(), request.owner)),
                    timeout=self._busy_timeout,
                    what=f"leaving the queue of {request.name!r}",
                )
            raise
        finally:
            if not local.leave(request.owner):
                del self._queues[key]

    async def _take(
        self,
        request: LockRequest,
        *,
        wait: bool,
        keep: Callable[[float], Sequence[str]] = lambda now: (),
        since: int | None = None,
    ) -> tuple[SQLiteGrant | bool, float]:
        """One attempt: the grant, or whether the request took a new place in the queue (at
        ``since``, or now) and when the earliest hold in the way expires."""
        sent_at = anyio.current_time()
        want = _want(request, since)
        # anyio's cancellation waits for the statement (see _run), and nothing awaits between a
        # successful take and the return. A native Task.cancel() does not wait: the statement
        # may still run in the thread, so it is marked abandoned and undone (hold and queue
        # row alike). A statement that raised (the file locked past busy_timeout, a refusal of
        # permits that differ) was rolled back: nothing to undo, and no second busy_timeout.
        try:
            taken = await self._run(lambda: self._take_sync(want, wait, keep))
        except Exception:
            raise
        except BaseException:
            self._abandon(request)
            await finish(
                functools.partial(self._run, lambda: _sql.release(self._db(), want)),
                timeout=self._busy_timeout,
                what=f"undoing a cancelled take of {request.name!r}",
            )
            raise
        if taken.token is None:
            return taken.placed, taken.retry_at
        grant = SQLiteGrant(
            request.name,
            request.owner,
            taken.token,
            sent_at,
            request.ttl,
            space=want.kind,
            shared=want.shared,
        )
        return grant, 0.0

    async def renew(self, grants: Sequence[SQLiteGrant]) -> Sequence[RenewOutcome]:
        sent_at = anyio.current_time()
        wants = [grant.want() for grant in grants]
        alive = await self._run(lambda: _sql.renew(self._db(), wants))
        return [
            Renewed(sent_at, grant.ttl) if ok else _gone()
            for grant, ok in zip(grants, alive, strict=True)
        ]

    async def extend(self, grant: SQLiteGrant, ttl: float) -> RenewOutcome:
        # Each hold has its own expiry: the new ttl is this one lease's, and renewals after
        # this one apply it too (the core copies Renewed.ttl into the grant; so do we, in case).
        sent_at = anyio.current_time()
        want = grant.want(ttl)
        (ok,) = await self._run(lambda: _sql.renew(self._db(), [want]))
        if not ok:
            return _gone()
        grant.ttl = ttl
        return Renewed(sent_at, ttl)

    async def release(self, grant: SQLiteGrant) -> None:
        want = grant.want()
        await self._run(lambda: _sql.release(self._db(), want))
        key = (grant.space, grant.name)
        for backend in list(_local.values()):
            if backend.path == self.path:
                backend._wake(key)

    async def inspect(self, name: str, kind: Kind = "lock") -> LockInfo:
        seen = await self._run(lambda: _sql.look(self._db(), kind, name))
        held, now = seen.holds, seen.at
        holders = (
            HolderInfo(
                owner=hold.owner,
                token=hold.token,
                expires_in=hold.expires_at - now,
                shared=hold.shared,
                value=hold.value if kind == "election" else None,
            )
            for hold in held
        )
        # A semaphore's (LockInfo.of shows them for semaphores only, while anyone holds or waits).
        permits = held[0].permits if held else seen.permits
        return LockInfo.of(name, kind, holders, waiters=seen.waiters, permits=permits)

    async def wait_for_change(self, name: str, kind: Kind, seen: LockInfo, timeout: float) -> None:
        # Polling, as the default; a release by a client of this process wakes it at once.
        released = self._released
        assert released is not None
        with anyio.move_on_after(min(timeout, self.poll_interval)):
            await released.wait()

    def _abandon(self, request: LockRequest) -> None:
        now = time.monotonic()
        for owner, since in list(self._abandoned.items()):
            if since < now - 60:
                del self._abandoned[owner]
        self._abandoned[request.owner] = now

    def _wake(self, key: tuple[Kind, str]) -> None:
        """A hold of ``key`` was released in this process: its first waiter here looks now,
        and so do the observers."""
        local = self._queues.get(key)
        if local is not None:
            local.wake()
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

    def _take_sync(
        self, want: Want, wait: bool, keep: Callable[[float], Sequence[str]]
    ) -> _sql.Taken:
        if want.owner in self._abandoned:
            return _sql.Taken(None)  # its caller is gone (and an undo follows)
        return _sql.take(self._db(), want, wait=wait, keep=keep)


def _gone() -> Lost:
    return Lost("the lock row is gone or expired (another process may hold it now)")
