"""Pieces of an acquire that are not the client's state: how its end is observed, the timed
wait's first try, and a loss reported before the lease exists."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Awaitable, Callable, Sequence

import anyio

from . import _validate
from ._clock import now
from ._deadlock import wait_watching_deadlocks, waiter_for
from ._errors import (
    AcquireTimeout,
    BackendTimeout,
    BackendUnavailable,
    DeadlockDetected,
    InvalidArgument,
    UnsupportedFeature,
    Waiter,
)
from ._events import AcquireOutcome, Events
from ._lease import Lease, OnLost, public_owner
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


def check_request(
    backend: Backend[Grant], name: object, ttl: object, timeout: object
) -> tuple[str, float, float | None]:
    """The checked name, ttl and timeout of a request, or :class:`InvalidArgument`."""
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


def require(backend: Backend[Grant], capability: str, what: str) -> None:
    """Refuse, by name, a primitive the backend does not have."""
    if not getattr(backend.capabilities, capability):
        raise UnsupportedFeature(
            f"{backend.describe()} has no {what} (capabilities.{capability} is false); "
            + (backend.limits or "memory, SQLite, PostgreSQL, Redis, etcd and ZooKeeper have them")
        )


def public_info(info: LockInfo, kind: Kind) -> LockInfo:
    """``info`` with every owner secret replaced by its public id."""
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
) -> Grant | None:
    """Wait for the lock until ``timeout``; with deadlock detection, also until this task is
    found to be the victim of a cycle (then ``deadlocks`` holds the cycle)."""
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
        return await try_then_wait(backend, request, timeout, wait)
    finally:
        if observed:
            events.emit("waiting", request.name, -1)


async def try_then_wait(
    backend: Backend[Grant],
    request: LockRequest,
    timeout: float,
    wait: Callable[[], Awaitable[Grant | None]],
) -> Grant | None:
    """Try the lock once, then ``wait()`` for it until ``timeout`` has passed."""
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
    with anyio.move_on_at(deadline):
        return await wait()
    return None


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
