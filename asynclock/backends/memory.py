"""``memory://[namespace]``: an in-process reference backend, with fault hooks for tests.

Clients that connect to the same namespace in one process contend for the same locks, so the
core can be tested without a server. :class:`Faults` makes renewals fail, hang or prove loss, and
:meth:`MemoryBackend.expire` plays the server dropping a lock. Not for production: nothing
outside this process is excluded.
"""

from __future__ import annotations

import math
import weakref
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Self
from urllib.parse import urlsplit

import anyio
import anyio.lowlevel

from ._kit import (
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
    Unknown,
    WaiterRegistry,
    checkpoint,
    now,
    permits_mismatch,
    redact,
    split_userinfo,
)

__all__ = ("Faults", "MemoryBackend")


@dataclass(slots=True)
class _Holder:
    owner: str
    expires_at: float
    on_lost: Callable[[str], None]
    token: int = 0
    shared: bool = False
    value: bytes = b""


@dataclass(slots=True)
class _Lock:
    """One name of one kind: its exclusive holder, or its shared holders (readers, a
    semaphore's permits), its queue and its token counter."""

    holder: _Holder | None = None
    #: Shared holds (readers) or a semaphore's permits, by owner id.
    holders: dict[str, _Holder] = field(default_factory=dict)
    #: The waiters' owner ids in the order they came, each with the event that wakes it.
    #: Only the first is ever woken, and only the first may take: a waiter that takes wakes
    #: the next, so readers (and permits) behind each other pass in a chain, and a hand-over
    #: costs the same however many wait (one event for all woke every waiter at every release:
    #: 1,000 waiters, 1,000 wake-ups each).
    waiters: OrderedDict[str, anyio.Event] = field(default_factory=OrderedDict)
    counter: int = 0
    #: A semaphore's size, while anyone holds or waits for it.
    permits: int = 0
    #: Set (and replaced) on every change of holders: what wait_for_change waits on.
    changed: anyio.Event | None = None

    def free(self, now: float) -> bool:
        holder = self.holder
        if holder is not None and holder.expires_at > now:
            return False
        return not self.holders or not self.live(now)

    def live(self, now: float) -> list[_Holder]:
        """The shared holds (or permits) still held: expired ones are dropped."""
        holders = self.holders
        if not holders:
            return []
        expired = [owner for owner, held in holders.items() if held.expires_at <= now]
        for owner in expired:
            del holders[owner]
        return list(holders.values())

    def can_take(self, request: LockRequest, now: float) -> bool:
        if request.kind == "semaphore":
            return len(self.live(now)) < request.permits
        exclusive_free = self.holder is None or self.holder.expires_at <= now
        if request.shared:
            return exclusive_free
        return exclusive_free and not self.live(now)

    def expiry(self) -> float:
        """When the first waiter must look again without a wake-up: a blocking hold expires."""
        times = [held.expires_at for held in self.holders.values()]
        if self.holder is not None:
            times.append(self.holder.expires_at)
        return min(times, default=math.inf)

    def first(self) -> str | None:
        return next(iter(self.waiters), None)

    def notify(self) -> None:
        """Wake the first waiter: the holders changed, or the first waiter did."""
        first = self.first()
        if first is not None:
            self.waiters[first].set()
        if self.changed is not None:
            self.notify_watchers()

    def notify_watchers(self) -> None:
        """Wake the observers waiting for a change of holders."""
        if self.changed is not None:
            self.changed.set()
            self.changed = None

    def find(self, owner: str) -> _Holder | None:
        holder = self.holder
        if holder is not None and holder.owner == owner:
            return holder
        return self.holders.get(owner)

    def drop(self, owner: str) -> bool:
        if self.holder is not None and self.holder.owner == owner:
            self.holder = None
            return True
        return self.holders.pop(owner, None) is not None

    def all_holds(self, now: float) -> list[_Holder]:
        holds = self.live(now)
        if self.holder is not None and self.holder.expires_at > now:
            holds.append(self.holder)
        return sorted(holds, key=lambda held: held.token)


class _Store:
    """The "server": the locks of one namespace, shared by every client in the process."""

    def __init__(self) -> None:
        #: Each kind is a namespace of its own: the lock "a" and the semaphore "a" are unrelated.
        self.spaces: dict[Kind, dict[str, _Lock]] = {"lock": {}, "semaphore": {}, "election": {}}
        self.locks = self.spaces["lock"]
        #: Deadlock detection's records: key -> (value, expires at).
        self.waiters: dict[str, tuple[str, float]] = {}

    def get(self, name: str, kind: Kind = "lock") -> _Lock:
        space = self.locks if kind == "lock" else self.spaces[kind]
        lock = space.get(name)
        if lock is None:
            lock = space[name] = _Lock()
        return lock


# Namespaces live as long as a backend uses them; the token counters with them.
_stores: weakref.WeakValueDictionary[str, _Store] = weakref.WeakValueDictionary()


@dataclass(slots=True)
class Faults:
    """What the next renewals of one client do: ``"ok"``, ``"fail"`` (an error that proves
    nothing), ``"hang"`` (never answer) or ``"lost"`` (the server says the lock is gone)."""

    renew: Literal["ok", "fail", "hang", "lost"] = "ok"
    #: Refuse to connect, as an unreachable server would.
    unreachable: bool = False
    #: Every call waits while this is true, as on a server that was paused (SIGSTOP); the calls
    #: go on when it is set back to false.
    paused: bool = False


class _MemoryWaiters(WaiterRegistry):
    def __init__(self, store: _Store) -> None:
        self._store = store

    async def publish(self, key: str, value: str, ttl: float) -> None:
        await anyio.lowlevel.checkpoint()
        self._store.waiters[key] = (value, anyio.current_time() + ttl)

    async def withdraw(self, key: str) -> None:
        await anyio.lowlevel.checkpoint()
        self._store.waiters.pop(key, None)

    async def scan(self) -> list[str]:
        await anyio.lowlevel.checkpoint()
        now = anyio.current_time()
        return [value for value, expires in self._store.waiters.values() if expires > now]


class MemoryBackend(Backend[Grant]):
    # Pure anyio (and the standard library): runs on trio as well.
    event_loops = frozenset({"asyncio", "trio"})
    # No round trip to outlast: only the margin.
    min_ttl = 0.01
    acquire_tries_first = True
    capabilities = Capabilities.every(quorum=False, cross_process=False)

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        store = _stores.get(namespace)
        if store is None:
            store = _stores[namespace] = _Store()
        self._store = store
        self.faults = Faults()

    @classmethod
    def from_url(cls, url: str, options: Mapping[str, object]) -> Self:
        parts = urlsplit(url)
        userinfo, namespace = split_userinfo(parts.netloc)
        # A namespace is a name, not a server: no port, no user or password.
        if userinfo is not None or ":" in namespace:
            raise InvalidURL(
                f"memory:// takes only a namespace name, as in memory://tests; got {redact(url)!r}"
            )
        Options(options, "memory://").finish()
        return cls(parts.netloc + parts.path)

    def describe(self) -> str:
        return f"memory://{self.namespace}"

    def waiter_registry(self) -> WaiterRegistry:
        return _MemoryWaiters(self._store)

    async def open(self) -> None:
        await self._server()
        if self.faults.unreachable:
            raise BackendUnavailable(f"{self.describe()} is marked unreachable by its test faults")

    async def aclose(self) -> None:
        pass

    # -- test hooks: the server's side -------------------------------------------------------

    def expire(self, name: str, *, notify: bool = False, kind: Kind = "lock") -> None:
        """Drop every hold of ``name`` on the "server", as a ttl expiry or an operator's delete
        would.

        With ``notify=True`` the holders are told at once (a backend with push notification,
        like a ZooKeeper session event); otherwise they find out on their next renewal.
        """
        lock = self._store.get(name, kind)
        holds = [*lock.holders.values(), *([lock.holder] if lock.holder else [])]
        lock.holder = None
        lock.holders.clear()
        lock.notify()
        if notify:
            for held in holds:
                held.on_lost("the lock was removed on the server")

    def holder(self, name: str, kind: Kind = "lock") -> str | None:
        """The owner id holding ``name`` now (the lowest token's, if several), if any."""
        holds = self._store.get(name, kind).all_holds(anyio.current_time())
        return holds[0].owner if holds else None

    def waiting(self, name: str, kind: Kind = "lock") -> int:
        return len(self._store.get(name, kind).waiters)

    def leftovers(self) -> list[str]:
        """Every ``kind:name`` still held (for tests: empty when every client released)."""
        at = anyio.current_time()
        return sorted(
            f"{kind}:{name}"
            for kind, space in self._store.spaces.items()
            for name, lock in space.items()
            if lock.all_holds(at) or lock.waiters
        )

    async def inspect(self, name: str, kind: Kind = "lock") -> LockInfo:
        await anyio.lowlevel.checkpoint()
        lock = self._store.get(name, kind)
        at = anyio.current_time()
        holds = lock.all_holds(at)
        holders = (
            HolderInfo(held.owner, held.token, held.expires_at - at, held.shared, held.value)
            for held in holds
        )
        # LockInfo.of shows a semaphore's permits while anyone holds or waits.
        return LockInfo.of(name, kind, holders, waiters=len(lock.waiters), permits=lock.permits)

    async def wait_for_change(self, name: str, kind: Kind, seen: LockInfo, timeout: float) -> None:
        lock = self._store.get(name, kind)
        if lock.changed is None:
            lock.changed = anyio.Event()
        changed = lock.changed  # registered before the look: no change slips between
        now_info = await self.inspect(name, kind)
        if (now_info.owner, now_info.token) != (seen.owner, seen.token):
            return
        # An expiry sets no event: look again when the first hold would expire.
        with anyio.move_on_at(min(anyio.current_time() + timeout, lock.expiry())):
            await changed.wait()

    # -- the contract ------------------------------------------------------------------------

    def _take(self, lock: _Lock, request: LockRequest, sent_at: float) -> Grant:
        lock.counter += 1
        token = lock.counter
        owner = request.owner
        kind = request.kind
        if kind == "lock" and not request.shared:
            # The common case first, as it was before the other kinds existed.
            lock.holder = _Holder(owner, sent_at + request.ttl, request.on_lost, token)
            if lock.changed is not None:
                lock.notify_watchers()
            return Grant(request.name, owner, token, sent_at, request.ttl)
        if kind == "election":
            lock.holder = _Holder(
                owner, sent_at + request.ttl, request.on_lost, token, value=request.value
            )
        else:  # a reader or a permit
            lock.holders[owner] = _Holder(
                owner, sent_at + request.ttl, request.on_lost, token, request.shared
            )
        lock.notify_watchers()
        return Grant(request.name, owner, token, sent_at, request.ttl, space=kind)

    def _server(self) -> Awaitable[None]:
        """Where a call meets the "server": a checkpoint, or a wait while it is paused (a
        release only checkpoints while paused). Not a coroutine itself: on the common path it
        is the checkpoint, one frame fewer for every call."""
        if self.faults.paused:
            return self._paused()
        return checkpoint()

    async def _paused(self) -> None:
        await checkpoint()
        while self.faults.paused:  # noqa: ASYNC110 (a test fault, set from outside)
            await anyio.sleep(0.005)

    def _lock_for(self, request: LockRequest, at: float) -> _Lock:
        kind = request.kind
        if kind == "lock":
            return self._store.get(request.name)
        lock = self._store.get(request.name, kind)
        if kind == "semaphore":
            if lock.permits != request.permits and (lock.live(at) or lock.waiters):
                raise permits_mismatch(request.name, lock.permits, request.permits)
            lock.permits = request.permits
        return lock

    async def try_acquire(self, request: LockRequest) -> Grant | None:
        await self._server()
        at = now()
        lock = self._lock_for(request, at)
        if not lock.waiters and lock.can_take(request, at):
            return self._take(lock, request, at)
        return None

    async def acquire(self, request: LockRequest) -> Grant:
        await self._server()
        at = now()
        if request.kind == "lock" and not request.shared:
            lock = self._store.get(request.name)
            free = lock.free(at)  # the common case, without can_take's questions
        else:
            lock = self._lock_for(request, at)
            free = lock.can_take(request, at)
        if free and not lock.waiters:
            # Nobody to queue behind: taken at once, without a place or an event.
            return self._take(lock, request, at)
        owner = request.owner
        lock.waiters[owner] = woken = anyio.Event()
        if request.answered is not None:
            request.answered()  # queued: the caller's timeout applies from here
        try:
            while True:
                at = now()
                # Only the first waiter may take, and only it needs the holders' expiry: it
                # is woken when it becomes the first.
                expiry = math.inf
                if lock.first() == owner:
                    if lock.can_take(request, at):
                        del lock.waiters[owner]
                        # The next one must look again: it may share with this holder (a
                        # reader, a permit), or it waits for this holder's expiry now.
                        lock.notify()
                        return self._take(lock, request, at)
                    expiry = lock.expiry()
                with anyio.move_on_at(expiry):
                    await woken.wait()
                if woken.is_set():
                    lock.waiters[owner] = woken = anyio.Event()  # keeps its place
        finally:
            if owner in lock.waiters:
                first = lock.first() == owner
                del lock.waiters[owner]
                if first:
                    lock.notify()

    async def renew(self, grants: Sequence[Grant]) -> Sequence[RenewOutcome]:
        sent_at = anyio.current_time()
        await self._server()
        match self.faults.renew:
            case "fail":
                return [Unknown(BackendUnavailable("injected renewal failure"))] * len(grants)
            case "hang":
                await anyio.sleep_forever()
            case "lost":
                return [Lost("injected: the server says the lock is gone")] * len(grants)
        return [self._renew_one(grant, sent_at, grant.ttl) for grant in grants]

    def _renew_one(self, grant: Grant, sent_at: float, ttl: float) -> RenewOutcome:
        holder = self._store.get(grant.name, grant.space).find(grant.owner)
        if holder is None:
            return Lost("the lock is no longer held by this lease on the server")
        if holder.expires_at <= sent_at:
            return Lost("the lock expired on the server before it was renewed")
        holder.expires_at = sent_at + ttl
        return Renewed(sent_at, ttl)

    async def extend(self, grant: Grant, ttl: float) -> RenewOutcome:
        # Not subject to Faults.renew: that fault stands for the background renewal failing,
        # which is what an extend() is for.
        sent_at = anyio.current_time()
        await self._server()
        return self._renew_one(grant, sent_at, ttl)

    async def release(self, grant: Grant) -> None:
        # No checkpoint unless paused: releasing never waits for anyone (as anyio.Lock's
        # release), and a cancellation has nothing to interrupt.
        if self.faults.paused:
            await self._server()
        space = grant.space
        store = self._store
        lock = (store.locks if space == "lock" else store.spaces[space]).get(grant.name)
        if lock is not None and lock.drop(grant.owner):
            lock.notify()
