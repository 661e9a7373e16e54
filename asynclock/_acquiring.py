"""Taking a lease: the client's core under its public API (:class:`ClientCore`), with the
request's checks, the timed wait's first try, how an acquire's end is observed, and a loss
reported before the lease exists."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import math
import time
from collections.abc import Awaitable, Callable, Sequence

import anyio

from . import _fencing, _validate
from ._clock import cancel_scope, now
from ._deadlock import actor_id, wait_watching_deadlocks, waiter_for
from ._errors import (
    AcquireTimeout,
    BackendTimeout,
    BackendUnavailable,
    DeadlockDetected,
    InvalidArgument,
    LockError,
    UnsupportedFeature,
    Waiter,
    WrongEventLoop,
)
from ._events import AcquireOutcome, ConnectionState, Events, LossKind
from ._extend import extend
from ._host import BackendHost
from ._lease import Lease, OnLost, new_owner, public_owner
from ._renewal import RENEWAL
from ._scope import release_all
from ._state import StateTracker
from .abc import Backend, Grant, Kind, LockInfo, LockRequest


@dataclasses.dataclass(frozen=True, slots=True)
class Settings:
    """How a client treats its leases (see :func:`asynclock.connect` for each)."""

    drift: float
    margin: float | None
    release_timeout: float
    deadlock_interval: float | None
    label: str | None


async def acquire_all(
    acquire: Callable[..., Awaitable[Lease]],
    names: Sequence[str],
    ttl: float,
    timeout: float | None,
    on_lost: OnLost,
) -> list[Lease]:
    """``lock_all``'s acquire: every lock in ``names`` (in that order), all or nothing."""
    deadline = math.inf if timeout is None else anyio.current_time() + timeout
    taken: list[Lease] = []
    try:
        for name in names:
            # Out of time: the remaining locks still get one try each (timeout 0).
            left = None if timeout is None else max(0.0, deadline - anyio.current_time())
            try:
                taken.append(await acquire(name, ttl, left, on_lost, track_context=False))
            except AcquireTimeout:
                raise AcquireTimeout(name, timeout or 0.0) from None
    except BaseException:
        await release_all(taken)  # finishes whatever cancels us
        raise
    return taken


def canonical(name: str) -> bytes:
    # Byte order of the UTF-8 form: the same in every process and language.
    return name.encode("utf-8")


def observe_acquire(
    state: StateTracker,
    events: Events,
    name: str,
    started: float | None,
    grant: Grant | None,
    error: BaseException | None,
) -> None:
    """Tell the connection state and the observers how an acquire ended."""
    outcome: AcquireOutcome
    if error is None:
        outcome = "acquired"
    elif isinstance(error, AcquireTimeout):
        outcome = "busy" if error.timeout == 0 else "timeout"
    elif isinstance(error, DeadlockDetected):
        outcome = "deadlock"
    elif isinstance(error, BackendUnavailable | BackendTimeout):
        state.reached(False, error)
        outcome = "error"
    elif isinstance(error, anyio.get_cancelled_exc_class()):
        outcome = "cancelled"
    else:
        outcome = "error"
    if outcome in ("acquired", "busy", "timeout"):
        state.reached(True)
    if events.active and started is not None:
        token = grant.token if grant is not None else None
        events.emit("acquired", name, outcome, now() - started, token)


async def wait_for_grant(
    backend: Backend[Grant],
    request: LockRequest,
    timeout: float | None,
    deadlocks: list[list[Waiter]],
    events: Events,
    settings: Settings,
    scope: anyio.CancelScope,
) -> Grant | None:
    """Wait for the lock until ``timeout`` (the deadline of ``scope``, which the caller
    enters); with deadlock detection, also until this task is found to be the victim of a
    cycle (then ``deadlocks`` holds the cycle)."""
    deadlock_interval = settings.deadlock_interval
    registry = None
    # Deadlock detection's wait-for graph knows exclusive locks only: a shared hold or a
    # permit is not one owner that another waiter waits for.
    if deadlock_interval and request.kind == "lock" and not request.shared:
        registry = backend.waiter_registry()
    wait: Callable[[], Awaitable[Grant | None]]
    if registry is None or deadlock_interval is None:
        wait = functools.partial(backend.acquire, request)
    else:
        wait = functools.partial(
            wait_watching_deadlocks,
            backend,
            request,
            registry,
            waiter_for(request.name, settings.label),
            interval=deadlock_interval,
            found=deadlocks,
            release_timeout=settings.release_timeout,
        )
    observed = events.active
    if observed:
        events.emit("waiting", request.name, 1)
    try:
        if timeout is None:
            return await wait()
        if backend.acquire_tries_first:
            return await wait_from_first_answer(request, timeout, wait, scope)
        return await try_then_wait(backend, request, timeout, wait, scope)
    finally:
        if observed:
            events.emit("waiting", request.name, -1)


async def try_then_wait(
    backend: Backend[Grant],
    request: LockRequest,
    timeout: float,
    wait: Callable[[], Awaitable[Grant | None]],
    scope: anyio.CancelScope,
) -> Grant | None:
    """Try the lock once, then ``wait()`` for it until ``timeout`` has passed (the deadline of
    ``scope``, which the caller entered: it ends the wait, and the caller returns None)."""
    deadline = anyio.current_time() + timeout
    # However short the timeout, the lock is tried once: it bounds the wait, not the first
    # attempt (timeout=1e-9 must not fail where timeout=0 succeeds).
    try:
        grant = await backend.try_acquire(request)
    except BackendTimeout:
        raise  # the server did not answer: one timeout is one op_timeout
    except BackendUnavailable:
        # With time left, the wait below retries as the backend does (a Redlock majority may
        # come back), as it did before this first try existed.
        if anyio.current_time() >= deadline:
            raise
        grant = None
    if grant is not None or anyio.current_time() >= deadline:
        return grant
    scope.deadline = deadline
    return await wait()


async def wait_from_first_answer(
    request: LockRequest,
    timeout: float,
    wait: Callable[[], Awaitable[Grant | None]],
    scope: anyio.CancelScope,
) -> Grant | None:
    """``wait()`` for a backend whose acquire begins with a try: ``timeout`` (counted from now)
    applies once the backend reports the first answer, so its first attempt always completes.
    The deadline is ``scope``'s, which the caller entered: it ends the wait, and the caller
    returns None."""
    deadline = now() + timeout

    def answered(grace: float = 0.0) -> None:
        scope.deadline = max(deadline, now() + grace) if grace else deadline

    request.answered = answered
    return await wait()


class LossBeforeLease:
    """``LockRequest.on_lost`` of one acquire: a loss the backend reports before the lease
    exists (between the grant and its registration) is kept and handed to it."""

    __slots__ = ("_lease", "_reasons")

    def __init__(self) -> None:
        self._lease: Lease | None = None
        self._reasons: list[str] | None = None

    def report(self, reason: str) -> None:
        if self._lease is not None:
            self._lease._mark_lost(reason)
        elif self._reasons is None:
            self._reasons = [reason]
        else:
            self._reasons.append(reason)

    def hand_to(self, lease: Lease) -> None:
        self._lease = lease
        for reason in self._reasons or ():
            lease._mark_lost(reason)


class ClientCore:
    """A lock client below its public API: the checks of a request, the acquire from the
    backend's answer to the registered :class:`Lease`, its extension and its loss.

    :class:`asynclock.LockClient` is this with the public methods; ``Semaphore`` and
    ``Election`` take their leases through it (the client makes them, so they cannot import it).
    """

    def __init__(
        self,
        backend: Backend[Grant],
        *,
        drift: float,
        margin: float | None,
        connect_timeout: float,
        release_timeout: float,
        deadlock_interval: float | None = None,
        label: str | None = None,
    ) -> None:
        self._backend = backend
        self._settings = Settings(drift, margin, release_timeout, deadlock_interval, label)
        self._host = host = BackendHost(
            backend, connect_timeout=connect_timeout, release_timeout=release_timeout
        )
        self._events, self._state, self._supervisor = host.events, host.connection, host.supervisor
        #: The margin of each ttl asked for so far (checked once: most clients use one or two).
        self._margins: dict[float, float] = {}

    def _check(self, name: object, ttl: object, timeout: object) -> tuple[str, float, float | None]:
        """The checked name, ttl and timeout of a request, or :class:`InvalidArgument`."""
        backend = self._backend
        checked_name = _validate.lock_name(name)
        checked_ttl = _validate.positive_seconds(ttl, "ttl")
        if checked_ttl < backend.min_ttl:
            raise InvalidArgument(
                f"ttl {checked_ttl:g} s is too short for {backend.describe()}: a lease must "
                "outlast a renewal round trip plus the safety margin; the minimum is "
                f"{backend.min_ttl:g} s"
            )
        backend.check_ttl(checked_ttl)
        return checked_name, checked_ttl, _validate.timeout(timeout)

    def _check_open(self) -> None:
        if self._host.state != "open":
            raise RuntimeError(
                "the lock client is not open: use `async with asynclock.connect(url) as locks:`"
            )

    def _require(self, capability: str, what: str) -> None:
        """Refuse, by name, a primitive the backend does not have."""
        backend = self._backend
        if not getattr(backend.capabilities, capability):
            raise UnsupportedFeature(
                f"{backend.describe()} has no {what} (capabilities.{capability} is false); "
                + (
                    backend.limits
                    or "memory, SQLite, PostgreSQL, Redis, etcd and ZooKeeper have them"
                )
            )

    async def _inspect(self, name: str, kind: Kind) -> LockInfo:
        """What the server says about ``name``, with every owner secret replaced by its
        public id."""
        self._check_open()
        info = await self._backend.inspect(name, kind)
        return dataclasses.replace(
            info,
            owner=None if info.owner is None else public_owner(info.owner),
            holders=tuple(
                dataclasses.replace(
                    holder, owner=None if holder.owner is None else public_owner(holder.owner)
                )
                for holder in info.holders
            ),
            kind=kind,
        )

    @staticmethod
    def _check_on_lost(on_lost: object) -> None:
        if on_lost not in ("cancel", "flag"):
            raise InvalidArgument(f"on_lost must be 'cancel' or 'flag', got {on_lost!r}")

    def _margin_for(self, ttl: float) -> float:
        known = self._margins.get(ttl)
        if known is not None:
            return known
        margin = self._settings.margin
        if margin is None:
            margin = min(1.0, ttl / 10.0)
        # A deadline before the first renewal would lose every lease.
        if not RENEWAL.leaves_time_to_renew(ttl, ttl * (1.0 - self._settings.drift) - margin):
            raise InvalidArgument(
                f"margin {margin:g} s leaves no time to renew a {ttl:g} s lease: use a larger ttl "
                "or a smaller margin"
            )
        if len(self._margins) < 64:
            self._margins[ttl] = margin
        return margin

    async def _acquire(
        self,
        name: str,
        ttl: float,
        timeout: float | None,
        on_lost: OnLost,
        *,
        track_context: bool,
        kind: Kind = "lock",
        shared: bool = False,
        permits: int = 1,
        value: bytes = b"",
    ) -> Lease:
        self._check_open()
        margin = self._margin_for(ttl)
        task = _waiting_task(self, name, shared, timeout, self._settings.label, kind)
        losses = LossBeforeLease()
        request = (
            LockRequest(name, ttl, new_owner(), losses.report)
            if kind == "lock" and not shared
            else LockRequest(name, ttl, new_owner(), losses.report, kind, shared, permits, value)
        )
        events = self._events
        # Timed only when someone observes; None tells an observer who subscribed meanwhile
        # that this acquire was not timed.
        started = now() if events.active else None
        deadlocks: list[list[Waiter]] = []
        try:
            grant = await self._ask(request, timeout, deadlocks)
        except BaseException as exc:
            error = exc
            if isinstance(exc, Exception) and not isinstance(exc, LockError):
                # A backend is meant to translate its driver's errors; one that slips through
                # still reaches the user as one of ours, with the original attached.
                error = BackendUnavailable(
                    f"acquiring {name!r} on {self._backend.describe()} failed: {exc!r}"
                )
            observe_acquire(self._state, events, name, started, None, error)
            if error is exc:
                raise
            raise error from exc
        if grant is None:
            refused = (
                DeadlockDetected(name, deadlocks[0])
                if deadlocks
                else AcquireTimeout(name, timeout or 0.0)
            )
            observe_acquire(self._state, events, name, started, None, refused)
            raise refused
        if events.active or self._state.state is not ConnectionState.CONNECTED:
            observe_acquire(self._state, events, name, started, grant, None)
        # No await from here until the lease is registered: a cancellation cannot strand it.
        lease = Lease(
            grant,
            on_lost=on_lost,
            drift=self._settings.drift,
            margin=margin,
            fencing=self._backend.capabilities.fencing,
            releaser=self._host.release,
            on_loss=self._on_loss,
            hold=None if kind == "lock" and not shared else (kind, shared, value),
            extender=self._extend,
            asked_ttl=ttl,
        )
        lease.holder = None if task is None else (self, task)
        losses.hand_to(lease)
        self._supervisor.add(lease)
        if track_context:
            _fencing.push(lease)
        return lease

    async def _ask(
        self, request: LockRequest, timeout: float | None, deadlocks: list[list[Waiter]]
    ) -> Grant | None:
        """The backend's grant for ``request`` (None: not within ``timeout``), or
        BackendUnavailable if the client closes meanwhile (``_host.InFlight``).

        One cancel scope ends the call either way: the client's close cancels it, and a
        ``timeout`` is its deadline (an anyio scope costs 5-10 us; two made a tenth of the
        core's work in a waited acquire)."""
        scope = cancel_scope()
        in_flight = self._host.in_flight
        in_flight.scopes.add(scope)
        try:
            with scope:
                events = self._events
                if timeout == 0:
                    return await self._backend.try_acquire(request)
                if timeout is None and not events.active and not self._settings.deadlock_interval:
                    return await self._backend.acquire(request)  # the common case, directly
                return await wait_for_grant(
                    self._backend, request, timeout, deadlocks, events, self._settings, scope
                )
        finally:
            in_flight.done(scope)
        # Here only when the scope absorbed a cancellation: the close's, or its deadline.
        if in_flight.closing or scope.deadline == math.inf:
            raise BackendUnavailable(f"the lock client for {self._backend.describe()} is closed")
        return None

    async def _extend(self, lease: Lease, ttl: float) -> None:
        """``lease.extend(ttl)``: one renewal now, with a new ttl (see :meth:`Lease.extend`)."""
        _, ttl, _ = self._check(lease.name, ttl, None)
        await extend(
            lease,
            ttl,
            self._margin_for,
            backend=self._backend,
            deadlines=self._host.deadlines,
            supervisor=self._supervisor,
        )

    def _on_loss(self, lease: Lease, kind: LossKind, reason: str) -> None:
        if kind == "deadline":
            self._state.deadline_passed(lease.name)
        if self._events.active:
            self._events.emit("lost", lease.name, kind, reason)


def _waiting_task(
    client: ClientCore,
    name: str,
    shared: bool,
    timeout: float | None,
    label: str | None,
    kind: Kind,
) -> int | None:
    """The id of the task that takes lock ``name`` (None for other kinds of hold), refusing at
    once a client used from another event loop than its own, and an unbounded wait for a lock
    that this task holds through ``client``: it would wait for ever (the server sees a holder
    and a waiter, not a re-entry), a deadlock of one. A wait with a ``timeout`` or inside a
    cancel scope with a deadline is the caller's to bound; another task, one started in the
    body too, may wait for it."""
    loop = client._host.loop
    if loop is not None and asyncio.get_running_loop() is not loop:
        raise WrongEventLoop(
            f"this lock client of {client._backend.describe()} was opened on another event "
            "loop than the one running now (a session-scoped client used in a test whose "
            "loop is the function's, say): open one client per event loop"
        )
    if kind != "lock":
        return None
    task = _task_id()
    if timeout is not None:
        return task  # a try, or a bounded wait
    for held in _fencing.held_leases():
        if (
            held.holder == (client, task)
            and held.name == name
            and held.held
            and not (shared and held.shared)
            and anyio.current_effective_deadline() == math.inf
        ):
            waiter = Waiter(actor=actor_id(label), holds=(name,), waits=name, since=time.time())
            raise DeadlockDetected(name, [waiter])
    return task


def _task_id() -> int:
    """The current task's id, as anyio gives it (``id()`` of the task), without its cost."""
    try:
        return id(asyncio.current_task())
    except RuntimeError:  # not on asyncio: trio
        return anyio.get_current_task().id
