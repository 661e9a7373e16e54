"""LockClient: locks on one backend: lock(), acquire(), try_acquire(), lock_all(), inspect()."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Self

import anyio

from . import _fencing, _validate
from ._clock import now
from ._deadlock import wait_watching_deadlocks, waiter_for
from ._errors import (
    AcquireTimeout,
    BackendTimeout,
    BackendUnavailable,
    DeadlockDetected,
    InvalidArgument,
    LockError,
    Waiter,
)
from ._events import AcquireOutcome, ConnectionState, Events, LossKind, StateChange
from ._host import BackendHost
from ._lease import Lease, OnLost, new_owner, public_owner
from ._renewal import RENEWAL
from ._scope import LockContext, MultiLockContext, release_all
from ._state import StateTracker
from .abc import Backend, Capabilities, Grant, LockInfo, LockRequest

logger = logging.getLogger("asynclock")


@dataclasses.dataclass(frozen=True, slots=True)
class _Settings:
    """How a client treats its leases (see :func:`asynclock.connect` for each)."""

    drift: float
    margin: float | None
    release_timeout: float
    deadlock_interval: float | None
    label: str | None


class LockClient:
    """Locks on one backend. Made by :func:`connect`; enter it (``async with``) or
    ``await client.start()`` it before use.

    Leaving the ``async with`` (or :meth:`aclose`) releases every lease still held and closes the
    backend, also when the block is cancelled.
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
        self._settings = _Settings(drift, margin, release_timeout, deadlock_interval, label)
        self._host = host = BackendHost(
            backend, connect_timeout=connect_timeout, release_timeout=release_timeout
        )
        self._events, self._state, self._supervisor = host.events, host.connection, host.supervisor
        #: The margin of each ttl asked for so far (checked once: most clients use one or two).
        self._margins: dict[float, float] = {}

    # -- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        await self._host.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        # The caller's exception is not ours to handle: closing is the same either way.
        try:
            await self._host.aclose()
        finally:
            await self._host.leave()

    async def start(self) -> Self:
        """Open the client without ``async with``; close it with :meth:`aclose`, from any task.

        For frameworks whose start-up and shutdown hooks run in different tasks (arq's
        ``on_startup``/``on_shutdown``, saq, taskiq, a test fixture). The client then keeps a
        task of its own for its background work, which :meth:`aclose` stops and waits for.
        Raises as ``async with`` does when the backend cannot be reached.
        """
        await self._host.start()
        return self

    async def aclose(self) -> None:
        """Release every lease still held and close the backend. Idempotent, and it finishes
        (within ``release_timeout + connect_timeout``) whatever cancels the caller, anyio's or
        asyncio's native cancellation alike. After :meth:`start`, any task may call it."""
        await self._host.aclose()

    # -- locks -------------------------------------------------------------------------------

    @property
    def capabilities(self) -> Capabilities:
        """What the backend guarantees."""
        return self._backend.capabilities

    @property
    def state(self) -> ConnectionState:
        """How this client sees its server, from its own calls (see :class:`ConnectionState`)."""
        return self._state.state

    def state_changes(self) -> AsyncIterator[StateChange]:
        """``async for change in locks.state_changes():`` every change of :attr:`state` from
        now on; the iteration ends when the client closes."""
        return self._state.changes()

    @property
    def held(self) -> frozenset[Lease]:
        """Every lease this client holds now."""
        return self._supervisor.leases

    @property
    def renew_calls(self) -> int:
        """How many renewal round trips the client has made (batched over all held leases)."""
        return self._supervisor.renew_calls

    def lock(
        self,
        name: str,
        *,
        ttl: float = 30.0,
        timeout: float | None = None,
        on_lost: OnLost = "cancel",
    ) -> LockContext:
        """Hold the lock ``name`` for the body of an ``async with``; yields the :class:`Lease`.

        ``timeout=None`` waits forever, ``timeout=0`` tries once; past it,
        :class:`AcquireTimeout` is raised. The lease is renewed in the background. If it is lost,
        the body is cancelled (``on_lost="cancel"``, the default) and the ``async with`` raises
        :class:`LeaseLost`; with ``on_lost="flag"`` the body runs on, ``lease.lost`` becomes true
        and ``lease.wait_lost()`` returns.
        """
        self._check_on_lost(on_lost)
        name, ttl, timeout = self._check(name, ttl, timeout)

        # A partial, not a closure: one coroutine fewer between the body and the backend.
        acquire = functools.partial(self._acquire, name, ttl, timeout, on_lost, track_context=False)
        return LockContext(acquire, on_lost, self._events, self._host.deadlines)

    def lock_all(
        self,
        names: Iterable[str],
        *,
        ttl: float = 30.0,
        timeout: float | None = None,
        on_lost: OnLost = "cancel",
    ) -> MultiLockContext:
        """Hold every lock in ``names`` for the body, all or nothing; yields a tuple of leases.

        The locks are taken in one canonical order (sorted by name, duplicates dropped), so two
        callers asking for ``{a, b}`` and ``{b, a}`` cannot deadlock each other. ``timeout``
        bounds the whole set. On timeout, cancellation or error, the locks already taken are
        released before the error propagates. The body is cancelled if any lease is lost, and
        ``current_token(name)`` gives each lock's token. The tuple is in canonical order.
        """
        self._check_on_lost(on_lost)
        unique = sorted({_validate.lock_name(name) for name in names}, key=_canonical)
        if not unique:
            raise InvalidArgument("lock_all needs at least one lock name")
        _, ttl, timeout = self._check(unique[0], ttl, timeout)

        async def acquire() -> list[Lease]:
            deadline = math.inf if timeout is None else anyio.current_time() + timeout
            taken: list[Lease] = []
            try:
                for name in unique:
                    # Out of time: the remaining locks still get one try each (timeout 0).
                    left = None if timeout is None else max(0.0, deadline - anyio.current_time())
                    try:
                        taken.append(
                            await self._acquire(name, ttl, left, on_lost, track_context=False)
                        )
                    except AcquireTimeout:
                        raise AcquireTimeout(name, timeout or 0.0) from None
            except BaseException:
                await release_all(taken)  # finishes whatever cancels us
                raise
            return taken

        return MultiLockContext(acquire, on_lost, self._events, self._host.deadlines)

    async def acquire(
        self,
        name: str,
        *,
        ttl: float = 30.0,
        timeout: float | None = None,
        on_lost: OnLost = "flag",
    ) -> Lease:
        """Take the lock and return its :class:`Lease`; release it with ``await lease.release()``.

        There is no body to cancel here, so loss is only flagged (``lease.lost``,
        ``lease.wait_lost()``). ``current_token()`` sees the lease in this task until released.
        """
        self._check_on_lost(on_lost)
        name, ttl, timeout = self._check(name, ttl, timeout)
        return await self._acquire(name, ttl, timeout, on_lost, track_context=True)

    async def try_acquire(self, name: str, *, ttl: float = 30.0) -> Lease | None:
        """Take the lock if it is free right now; ``None`` if someone else holds it."""
        name, ttl, _ = self._check(name, ttl, 0)
        try:
            return await self._acquire(name, ttl, 0, "flag", track_context=True)
        except AcquireTimeout:
            return None

    async def inspect(self, name: str) -> LockInfo:
        """What the server says about lock ``name`` now: held or not, by which lease, with which
        token, how long until it would expire, how many wait (``None`` where it cannot tell).

        Raises :class:`UnsupportedFeature` on backends that cannot tell (Redlock).
        """
        name = _validate.lock_name(name)
        if self._host.state != "open":
            raise RuntimeError(
                "the lock client is not open: use `async with asynclock.connect(url) as locks:`"
            )
        info = await self._backend.inspect(name)
        if info.owner is not None:
            info = dataclasses.replace(info, owner=public_owner(info.owner))
        return info

    # -- internals ---------------------------------------------------------------------------

    def _check(self, name: object, ttl: object, timeout: object) -> tuple[str, float, float | None]:
        checked_name = _validate.lock_name(name)
        checked_ttl = _validate.positive_seconds(ttl, "ttl")
        if checked_ttl < self._backend.min_ttl:
            raise InvalidArgument(
                f"ttl {checked_ttl:g} s is too short for {self._backend.describe()}: a lease must "
                "outlast a renewal round trip plus the safety margin; the minimum is "
                f"{self._backend.min_ttl:g} s"
            )
        self._backend.check_ttl(checked_ttl)
        return checked_name, checked_ttl, _validate.timeout(timeout)

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
    ) -> Lease:
        if self._host.state != "open":
            raise RuntimeError(
                "the lock client is not open: use `async with asynclock.connect(url) as locks:`"
            )
        margin = self._margin_for(ttl)
        losses = _LossBeforeLease()
        request = LockRequest(name=name, ttl=ttl, owner=new_owner(), on_lost=losses.report)
        events = self._events
        # Timed only when someone observes; None tells an observer who subscribed meanwhile
        # that this acquire was not timed.
        started = now() if events.active else None
        deadlocks: list[list[Waiter]] = []
        try:
            if timeout == 0:
                grant = await self._backend.try_acquire(request)
            elif timeout is None and not events.active and not self._settings.deadlock_interval:
                grant = await self._backend.acquire(request)  # the common case, directly
            else:
                grant = await self._wait(request, timeout, deadlocks)
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
        )
        losses.hand_to(lease)
        self._supervisor.add(lease)
        if track_context:
            _fencing.push(lease)
        return lease

    def _on_loss(self, lease: Lease, kind: LossKind, reason: str) -> None:
        if kind == "deadline":
            self._state.deadline_passed(lease.name)
        if self._events.active:
            self._events.emit("lost", lease.name, kind, reason)

    async def _wait(
        self, request: LockRequest, timeout: float | None, deadlocks: list[list[Waiter]]
    ) -> Grant | None:
        """Wait for the lock until ``timeout``; with deadlock detection, also until this task is
        found to be the victim of a cycle (then ``deadlocks`` holds the cycle)."""
        if not self._events.active:
            return await self._wait_for_grant(request, timeout, deadlocks)
        self._events.emit("waiting", request.name, 1)
        try:
            return await self._wait_for_grant(request, timeout, deadlocks)
        finally:
            self._events.emit("waiting", request.name, -1)

    async def _wait_for_grant(
        self, request: LockRequest, timeout: float | None, deadlocks: list[list[Waiter]]
    ) -> Grant | None:
        registry = self._backend.waiter_registry() if self._settings.deadlock_interval else None
        wait: Callable[[], Awaitable[Grant | None]]
        if registry is None or self._settings.deadlock_interval is None:
            wait = functools.partial(self._backend.acquire, request)
        else:
            wait = functools.partial(
                wait_watching_deadlocks,
                self._backend,
                request,
                registry,
                waiter_for(request.name, self._settings.label),
                interval=self._settings.deadlock_interval,
                found=deadlocks,
                release_timeout=self._settings.release_timeout,
            )
        if timeout is None:
            return await wait()
        return await try_then_wait(self._backend, request, timeout, wait)


def _canonical(name: str) -> bytes:
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


class _LossBeforeLease:
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
