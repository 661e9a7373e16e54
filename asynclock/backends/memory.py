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
    redact,
    split_userinfo,
)

__all__ = ("Faults", "MemoryBackend")


@dataclass(slots=True)
class _Holder:
    owner: str
    expires_at: float
    on_lost: Callable[[str], None]


@dataclass(slots=True)
class _Lock:
    holder: _Holder | None = None
    #: The waiters' owner ids in the order they came, each with the event that wakes it.
    #: Only the first is ever woken, so a hand-over costs the same however many wait (one
    #: event for all woke every waiter at every release: 1,000 waiters, 1,000 wake-ups each).
    waiters: OrderedDict[str, anyio.Event] = field(default_factory=OrderedDict)
    counter: int = 0

    def free(self, now: float) -> bool:
        return self.holder is None or self.holder.expires_at <= now

    def first(self) -> str | None:
        return next(iter(self.waiters), None)

    def notify(self) -> None:
        """Wake the first waiter: the holder changed, or the first waiter did."""
        first = self.first()
        if first is not None:
            self.waiters[first].set()


class _Store:
    """The "server": the locks of one namespace, shared by every client in the process."""

    def __init__(self) -> None:
        self.locks: dict[str, _Lock] = {}
        #: Deadlock detection's records: key -> (value, expires at).
        self.waiters: dict[str, tuple[str, float]] = {}

    def get(self, name: str) -> _Lock:
        lock = self.locks.get(name)
        if lock is None:
            lock = self.locks[name] = _Lock()
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
    capabilities = Capabilities(
        fencing=True, fifo=True, loss_detection=True, quorum=False, cross_process=False
    )

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

    def expire(self, name: str, *, notify: bool = False) -> None:
        """Drop the lock on the "server", as a ttl expiry or an operator's delete would.

        With ``notify=True`` the holder is told at once (a backend with push notification, like
        a ZooKeeper session event); otherwise it finds out on its next renewal.
        """
        lock = self._store.get(name)
        holder, lock.holder = lock.holder, None
        lock.notify()
        if notify and holder is not None:
            holder.on_lost("the lock was removed on the server")

    def holder(self, name: str) -> str | None:
        """The owner id holding ``name`` now, if any."""
        lock = self._store.get(name)
        if lock.free(anyio.current_time()):
            return None
        assert lock.holder is not None
        return lock.holder.owner

    def waiting(self, name: str) -> int:
        return len(self._store.get(name).waiters)

    async def inspect(self, name: str, kind: Kind = "lock") -> LockInfo:
        await anyio.lowlevel.checkpoint()
        lock = self._store.get(name)
        now = anyio.current_time()
        if lock.free(now) or lock.holder is None:
            return LockInfo(name, held=False, waiters=len(lock.waiters))
        return LockInfo(
            name,
            held=True,
            owner=lock.holder.owner,
            token=lock.counter,
            expires_in=lock.holder.expires_at - now,
            waiters=len(lock.waiters),
        )

    # -- the contract ------------------------------------------------------------------------

    def _take(self, lock: _Lock, request: LockRequest, sent_at: float) -> Grant:
        lock.counter += 1
        lock.holder = _Holder(request.owner, sent_at + request.ttl, request.on_lost)
        return Grant(request.name, request.owner, lock.counter, sent_at, request.ttl)

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

    async def try_acquire(self, request: LockRequest) -> Grant | None:
        await self._server()
        lock = self._store.get(request.name)
        at = now()
        if lock.free(at) and not lock.waiters:
            return self._take(lock, request, at)
        return None

    async def acquire(self, request: LockRequest) -> Grant:
        await self._server()
        lock = self._store.get(request.name)
        at = now()
        if lock.free(at) and not lock.waiters:
            # Nobody to queue behind: taken at once, without a place or an event.
            return self._take(lock, request, at)
        owner = request.owner
        lock.waiters[owner] = woken = anyio.Event()
        try:
            while True:
                at = now()
                if lock.free(at) and lock.first() == owner:
                    del lock.waiters[owner]
                    # The next one must look again: it waits for this holder's expiry now.
                    lock.notify()
                    return self._take(lock, request, at)
                # Only the first waiter needs the holder's expiry: it is woken when it
                # becomes the first.
                expiry = math.inf
                if lock.holder is not None and lock.first() == owner:
                    expiry = lock.holder.expires_at
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
        outcomes: list[RenewOutcome] = []
        for grant in grants:
            lock = self._store.get(grant.name)
            holder = lock.holder
            if holder is None or holder.owner != grant.owner:
                outcomes.append(Lost("the lock is no longer held by this lease on the server"))
            elif holder.expires_at <= sent_at:
                outcomes.append(Lost("the lock expired on the server before it was renewed"))
            else:
                holder.expires_at = sent_at + grant.ttl
                outcomes.append(Renewed(sent_at, grant.ttl))
        return outcomes

    async def release(self, grant: Grant) -> None:
        # No checkpoint unless paused: releasing never waits for anyone (as anyio.Lock's
        # release), and a cancellation has nothing to interrupt.
        if self.faults.paused:
            await self._server()
        lock = self._store.get(grant.name)
        if lock.holder is not None and lock.holder.owner == grant.owner:
            lock.holder = None
            lock.notify()
