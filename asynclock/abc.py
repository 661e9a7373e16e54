"""The backend contract: the only interface a lock store has to implement.

A backend does what differs per store (take, wait for a turn, renew, release, the token) and says
what it guarantees. Deadlines, renewal cadence, cancellation of the body, contextvars and error
reporting are written once, above it, in :mod:`asynclock._client` and :mod:`asynclock._lease`.

Time: every timestamp in this contract is ``anyio.current_time()`` (``time.monotonic()`` on
asyncio), taken *before* the request it describes was sent. A server-side expiry started by that
request cannot come earlier than ``timestamp + ttl``, which is what makes the local deadline safe.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Generic, Literal, Protocol, Self, TypeVar

import anyio
from anyio.abc import AsyncResource

from ._errors import InvalidArgument, UnsupportedFeature

__all__ = (
    "Answered",
    "Backend",
    "Capabilities",
    "Grant",
    "HolderInfo",
    "Kind",
    "LockInfo",
    "LockRequest",
    "Lost",
    "RenewOutcome",
    "Renewed",
    "Unknown",
    "WaiterRegistry",
    "permits_mismatch",
)


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a backend guarantees, so that callers can demand it (``connect(url, require=...)``)."""

    #: Tokens strictly increase across every acquisition of a name, and survive server restarts
    #: (as far as the store itself keeps its data).
    fencing: bool
    #: Waiters are served in the order they started waiting.
    fifo: bool
    #: The backend can *prove* that a lease was lost (key gone, session expired) instead of only
    #: noticing that the local deadline passed.
    loss_detection: bool
    #: The lock survives the loss of a minority of servers.
    quorum: bool
    #: Locks exclude each other across processes (and hosts, when the store is shared).
    cross_process: bool = True
    #: Shared (read) holds: ``LockRequest.shared``, with writer preference (a waiting exclusive
    #: request blocks shared requests that come after it).
    shared_locks: bool = False
    #: Semaphores: ``LockRequest.kind == "semaphore"``, up to ``permits`` holds of one name,
    #: each its own lease.
    semaphores: bool = False
    #: Elections: ``kind == "election"`` holds keep ``LockRequest.value``, and ``inspect()``
    #: returns it (``LockInfo.value``): who leads, with which token.
    elections: bool = False
    #: ``extend(grant, ttl)`` can give one lease a different ttl (etcd, Redis, SQLite, memory).
    #: Without it, a lease's ttl is fixed by what holds it (a ZooKeeper session, a PostgreSQL
    #: session's idle timer) and ``extend`` only renews it now with that ttl.
    ttl_change: bool = False

    @classmethod
    def every(cls, **absent: bool) -> Capabilities:
        """Every guarantee but those named: ``Capabilities.every(quorum=False)``.

        Most stores give most guarantees, so a backend names what it lacks (one line to read)
        instead of listing nine flags.
        """
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(absent) - names)
        if unknown or any(absent.values()):
            raise TypeError(f"Capabilities.every() takes flags set to False, got {absent!r}")
        return cls(**{name: absent.get(name, True) for name in names})


#: What a request holds. Each kind is its own namespace: the lock ``"a"``, the semaphore ``"a"``
#: and the election ``"a"`` are three things that never exclude each other.
#:
#: - ``"lock"``: exclusive, or shared with other shared holds when ``LockRequest.shared``;
#: - ``"semaphore"``: one of ``LockRequest.permits`` holds of the name;
#: - ``"election"``: exclusive, keeping ``LockRequest.value`` for ``inspect()`` (the leader).
Kind = Literal["lock", "semaphore", "election"]


class Answered(Protocol):
    """:attr:`LockRequest.answered`: the acquire's first round trip was answered."""

    def __call__(self, grace: float = 0.0) -> None: ...


@dataclass(eq=False, slots=True)
class LockRequest:
    """One acquisition, as the core hands it to a backend. Read-only by convention: not frozen,
    since a frozen dataclass's ``__init__`` costs twice as much, on every acquire.

    The core only sends ``shared``, ``kind="semaphore"`` and ``kind="election"`` to backends whose
    :class:`Capabilities` say they can; a backend may still refuse what it cannot do with
    :class:`asynclock.UnsupportedFeature`.
    """

    name: str
    #: Requested lease length in seconds; the backend may grant a different one (``Grant.ttl``).
    ttl: float
    #: A random id unique to this lease: the value compared on renew and release, so that nobody
    #: can extend or delete a lock they do not hold. Never per thread or per task.
    owner: str
    #: Call this (from any task on the event loop) when the server proves the lease is gone
    #: outside of ``renew`` (a watch fired, a session expired). Idempotent.
    on_lost: Callable[[str], None] = field(compare=False, repr=False)
    #: The namespace and the rules of the hold (see :data:`Kind`).
    kind: Kind = "lock"
    #: ``kind="lock"`` only: a shared (read) hold, held together with other shared holds of the
    #: name and never with an exclusive one. A waiting exclusive request blocks the shared
    #: requests that come after it, so writers are not starved. Tokens of shared and exclusive
    #: holds of one name come from one counter: every hold's token is larger than the tokens of
    #: every hold granted before it.
    shared: bool = False
    #: ``kind="semaphore"`` only: how many holds of the name may exist at once. It is part of the
    #: name's state while anyone holds or waits for it: a request with a different number
    #: raises :class:`asynclock.InvalidArgument` naming both (see :func:`permits_mismatch`).
    permits: int = 1
    #: ``kind="election"`` only: the candidate's value, stored with the hold and returned by
    #: ``inspect()`` as ``LockInfo.value`` while it leads.
    value: bytes = b""
    #: Set by the core on a timed acquire from a backend whose ``acquire_tries_first`` is true:
    #: the backend calls it (once, from any task on the loop) as soon as the server has answered
    #: the acquire's first round trip, whatever the answer (taken, queued). Only from then on
    #: does the caller's timeout bound the wait, so that the first attempt is never cut short,
    #: as ``try_acquire``'s is not (``timeout=1e-9`` must not fail where ``timeout=0`` succeeds).
    #: A backend whose first round trip both tries and waits (no answer comes before the grant)
    #: calls it as it sends, with ``grace``: the seconds a free lock's answer takes at most; the
    #: timeout then ends the wait no sooner than that from now.
    answered: Answered | None = field(default=None, compare=False, repr=False)


@dataclass(eq=False, slots=True)
class Grant:
    """A lock the backend holds for us. Backends subclass it to keep what they need to release.

    ``valid_from`` is the monotonic time at which the request that started the current server-side
    expiry was sent, and ``ttl`` the length of that expiry as the server applies it.
    """

    name: str
    owner: str
    token: int | None
    valid_from: float
    ttl: float
    #: The request's kind (``LockRequest.kind``): the namespace the hold lives in.
    space: Kind = field(default="lock", kw_only=True)


@dataclass(frozen=True, slots=True)
class Renewed:
    """The server extended the lease: it expires no earlier than ``valid_from + ttl``."""

    valid_from: float
    ttl: float


@dataclass(frozen=True, slots=True)
class Lost:
    """The server proved that the lease is gone (key deleted, held by another, session expired)."""

    reason: str


@dataclass(frozen=True, slots=True)
class Unknown:
    """Renewal failed for a reason that proves nothing (timeout, connection reset).

    The local deadline is not moved; the core retries until it passes.
    """

    error: BaseException


RenewOutcome = Renewed | Lost | Unknown


@dataclass(frozen=True, slots=True)
class HolderInfo:
    """One hold of a name, as ``inspect()`` sees it (a reader, a permit, the leader)."""

    #: The holder's secret (backends) or its public id (what the client returns).
    owner: str | None = None
    token: int | None = None
    #: Seconds until the server would expire this hold if it stopped renewing.
    expires_in: float | None = None
    #: A shared (read) hold.
    shared: bool = False
    #: The value kept with an election's hold.
    value: bytes | None = None


@dataclass(frozen=True, slots=True)
class LockInfo:
    """What the store says about one lock now (``asynclock status``). ``None``: not known.

    For a name held by several (readers, a semaphore's permits), ``owner``, ``token`` and
    ``expires_in`` describe the hold with the lowest token, and ``holders`` lists them all.
    """

    name: str
    held: bool
    #: The holder's public id (``Lease.owner``: a hash of the secret its grant presents).
    #: Backends return the secret; the client hashes it before anyone sees it.
    owner: str | None = None
    #: The holder's fencing token.
    token: int | None = None
    #: Seconds until the server would expire the holder's lease if it stopped renewing.
    expires_in: float | None = None
    #: How many clients wait for it.
    waiters: int | None = None
    #: Who holds it, where the store can tell (a PostgreSQL session's application_name and pid).
    holder: str | None = None
    #: What was inspected (see :data:`Kind`).
    kind: Kind = "lock"
    #: Every current hold, lowest token first; empty when none, or when the store cannot list
    #: them (then ``held`` and ``owner`` still say what is known).
    holders: tuple[HolderInfo, ...] = ()
    #: A semaphore's number of permits (``None`` while nobody holds or waits for it).
    permits: int | None = None
    #: An election's leader value (the holder's ``LockRequest.value``).
    value: bytes | None = None

    @classmethod
    def of(
        cls,
        name: str,
        kind: Kind,
        holders: Iterable[HolderInfo],
        *,
        waiters: int | None = None,
        permits: int | None = None,
        held: bool | None = None,
        holder: str | None = None,
    ) -> LockInfo:
        """What every store's ``inspect()`` returns, from the current holds in any order: the
        hold with the lowest token describes the name, a semaphore's ``permits`` show while
        anyone holds or waits, an election's value is its leader's. ``held`` defaults to
        whether there is a hold (a store that cannot list an exclusive holder says so)."""
        ordered = tuple(sorted(holders, key=lambda hold: -1 if hold.token is None else hold.token))
        first = ordered[0] if ordered else HolderInfo()
        return cls(
            name,
            held=bool(ordered) if held is None else held,
            owner=first.owner,
            token=first.token,
            expires_in=first.expires_in,
            waiters=waiters,
            holder=holder,
            kind=kind,
            holders=ordered,
            permits=permits if kind == "semaphore" and (ordered or held or waiters) else None,
            value=first.value if kind == "election" else None,
        )


class WaiterRegistry(ABC):
    """Short-lived records of who waits for what, shared by every client of the store.

    Deadlock detection publishes one record per waiting task and reads them all to find cycles.
    A record vanishes by itself ``ttl`` seconds after it was last published, so a crashed waiter
    never leaves a false edge behind for long.
    """

    @abstractmethod
    async def publish(self, key: str, value: str, ttl: float) -> None:
        """Create or refresh the record ``key``."""

    @abstractmethod
    async def withdraw(self, key: str) -> None:
        """Remove the record ``key`` if it exists."""

    @abstractmethod
    async def scan(self) -> list[str]:
        """The values of every live record."""


G = TypeVar("G", bound=Grant)


def permits_mismatch(name: str, held: int, asked: int) -> InvalidArgument:
    """The error for a semaphore request whose ``permits`` differs from the name's."""
    return InvalidArgument(
        f"semaphore {name!r} has {held} permits (set by the clients that hold or wait for it), "
        f"but this request asked for {asked}: use the same permits in every client. The number "
        "can change once nobody holds or waits for the semaphore"
    )


class Backend(AsyncResource, Generic[G]):
    """A lock store. One instance per client; entered with ``async with`` before any other call
    (leaving it awaits ``aclose()``, as every anyio ``AsyncResource``).

    Every method may be cancelled at any await. ``acquire`` and ``try_acquire`` must then leave
    nothing behind (clean up in a shielded scope) and must not return a grant they have not handed
    over. Driver exceptions are translated to :class:`asynclock.LockError` subclasses here, at the
    boundary (the built-in backends use ``asynclock.backends._kit.translate``).
    """

    capabilities: Capabilities
    #: Why this instance lacks primitives its store has (its configuration), for the error
    #: that refuses them; empty: it has what its store has.
    limits: str = ""
    #: The shortest ttl the core accepts: a lease must outlast a renewal round trip plus the
    #: safety margin, or it is lost as soon as it is granted.
    min_ttl: float = 0.1
    #: The event loops the driver runs on (anyio backend names); others are refused at connect.
    event_loops: frozenset[str] = frozenset({"asyncio"})
    #: The driver's name, for messages ("redis-py", "asyncpg").
    driver: str = "its driver"
    #: Keywords of :func:`asynclock.connect` that are options of this backend too (PostgreSQL's
    #: ``connect_timeout``, Redlock's ``drift``): given to ``connect()``, they reach both.
    client_keywords: frozenset[str] = frozenset()
    #: How often an election's ``observe()`` looks when ``wait_for_change`` cannot push (s).
    poll_interval: float = 0.1
    #: True when ``acquire``'s first round trip takes a free lock at the cost of
    #: ``try_acquire`` (or queues the request) and then calls ``request.answered()``: the core
    #: then sends a timed acquire straight to ``acquire`` instead of trying once first, which
    #: costs a contended acquire a round trip. See :attr:`LockRequest.answered`.
    acquire_tries_first: bool = False

    @classmethod
    @abstractmethod
    def from_url(cls, url: str, options: Mapping[str, object]) -> Self:
        """Build a backend from its URL and options (query string merged with keyword arguments).

        Raise :class:`asynclock.InvalidURL` / :class:`asynclock.InvalidArgument` for anything it
        does not understand, naming the option. Must not do I/O.
        """

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    @abstractmethod
    async def open(self) -> None:
        """Connect and check that the server answers; raise ``BackendUnavailable`` if not.

        ``open()`` and ``aclose()`` run in the same task (the client's backend host task), at
        the same nesting level, so a backend may enter a task group for its background tasks
        here and leave it in ``aclose()``. The client bounds ``open()`` by its connect timeout.
        Must not need a running event loop before it is called: make anyio primitives here.
        """

    @abstractmethod
    async def aclose(self) -> None:
        """Close every connection and background task. Idempotent.

        Not shielded by the caller (a shield would break the nesting of a task group entered in
        ``open()``): shield the cleanup that must finish.
        """

    def check_ttl(self, ttl: float) -> None:
        """Raise :class:`asynclock.InvalidArgument` when the store cannot honour ``ttl``."""

    @abstractmethod
    async def try_acquire(self, request: LockRequest) -> G | None:
        """Take the lock if it is free, in one attempt; ``None`` when someone else holds it."""

    @abstractmethod
    async def acquire(self, request: LockRequest) -> G:
        """Wait until the lock is ours. Bounded by the caller's cancel scope, not by a timeout."""

    @abstractmethod
    async def renew(self, grants: Sequence[G]) -> Sequence[RenewOutcome]:
        """Extend every lease in ``grants``, in as few round trips as the store allows.

        Return one outcome per grant, in order. Raising counts as :class:`Unknown` for all.
        """

    @abstractmethod
    async def release(self, grant: G) -> None:
        """Free the lock if, and only if, it is still ours. Must not raise when it is not."""

    async def extend(self, grant: G, ttl: float) -> RenewOutcome:
        """Renew ``grant`` now so that the server keeps it at least ``ttl`` seconds from the
        moment the request was sent, and return the outcome (``Renewed.ttl`` is what the server
        applies from now on, and later renewals keep it).

        Never called while a renewal of ``grant`` is in flight. The default renews with the
        grant's current ttl, and refuses another ttl: backends whose ``capabilities.ttl_change``
        is true override it.
        """
        if ttl != grant.ttl:
            raise UnsupportedFeature(
                f"{self.describe()} cannot change the ttl of a held lock (from {grant.ttl:g} s "
                f"to {ttl:g} s): it is fixed by what holds the lock. Take the lock with the ttl "
                "you need, or call extend() with the lease's own ttl to renew it now"
            )
        return (await self.renew([grant]))[0]

    async def wait_for_change(self, name: str, kind: Kind, seen: LockInfo, timeout: float) -> None:
        """Return when the holders of ``name`` may no longer be those of ``seen`` (an earlier
        ``inspect()``), or after ``timeout`` seconds, whichever comes first. Spurious returns
        are fine: the caller inspects again.

        Elections' ``observe()`` uses it. The default polls (sleeps for the poll interval);
        backends that can push (a watch, a notification) override it, and must register their
        interest *before* checking ``seen`` against the store, so no change is missed between
        the two.
        """
        await anyio.sleep(min(timeout, self.poll_interval))

    async def inspect(self, name: str, kind: Kind = "lock") -> LockInfo:
        """What the store knows about ``name`` of ``kind`` now, for ``asynclock status`` and for
        elections (the leader's value and token)."""
        raise UnsupportedFeature(
            f"{self.describe()} cannot show a lock's holder and waiters (not implemented for "
            f"{type(self).__name__})"
        )

    def waiter_registry(self) -> WaiterRegistry | None:
        """Where deadlock detection keeps its records; ``None`` if the store offers none."""
        return None

    def describe(self) -> str:
        """A short, password-free description for messages ("redis://127.0.0.1:6379/0")."""
        return type(self).__name__

    def extra_info(self) -> Mapping[str, Any]:
        """Backend facts for ``asynclock status`` and benchmarks (versions, settings)."""
        return {}
