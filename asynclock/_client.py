"""LockClient: locks on one backend: lock(), acquire(), try_acquire(), lock_all(), inspect()."""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections.abc import AsyncIterator, Iterable
from typing import Self

import anyio

from . import _fencing, _validate
from ._acquiring import (
    LossBeforeLease,
    Settings,
    acquire_all,
    canonical,
    check_request,
    observe_acquire,
    public_info,
    require,
    wait_for_grant,
)
from ._clock import now
from ._deadlock import actor_id
from ._errors import (
    AcquireTimeout,
    BackendUnavailable,
    DeadlockDetected,
    InvalidArgument,
    LockError,
    Waiter,
    WrongEventLoop,
)
from ._events import ConnectionState, LossKind, StateChange
from ._extend import extend
from ._host import BackendHost
from ._lease import Lease, OnLost, new_owner
from ._primitives import Election, Semaphore
from ._renewal import RENEWAL
from ._scope import AsyncOnly, LockContext, MultiLockContext
from .abc import (
    Backend,
    Capabilities,
    Grant,
    Kind,
    LockInfo,
    LockRequest,
)

logger = logging.getLogger("asynclock")


class LockClient(AsyncOnly):
    """Locks on one backend. Made by :func:`connect`; enter it (``async with``) or
    ``await client.start()`` it before use.

    Leaving the ``async with`` (or :meth:`aclose`) releases every lease still held and closes the
    backend, also when the block is cancelled.
    """

    _misuse = "a lock client is opened with `async with asynclock.connect(url) as locks:`"

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

    # -- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        # In a task of the client's own (start()), not in the caller's: a pytest-asyncio
        # fixture, or a framework's lifespan, enters in one task and exits in another, and a
        # task group entered in the first cannot be left from the second.
        await self._host.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        # The caller's exception is not ours to handle: closing is the same either way.
        await self._host.aclose()

    async def start(self) -> Self:
        """Open the client without ``async with``; close it with :meth:`aclose`, from any task.

        What ``async with`` does, for frameworks whose start-up and shutdown hooks are two
        calls (arq's ``on_startup``/``on_shutdown``, saq, taskiq). The client keeps a task of
        its own for its background work, which :meth:`aclose` stops and waits for. Raises as
        ``async with`` does when the backend cannot be reached.
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
        shared: bool = False,
    ) -> LockContext:
        """Hold the lock ``name`` for the body of an ``async with``; yields the :class:`Lease`.

        ``timeout=None`` waits forever, ``timeout=0`` tries once; past it,
        :class:`AcquireTimeout` is raised. The lease is renewed in the background. If it is lost,
        the body is cancelled (``on_lost="cancel"``, the default) and the ``async with`` raises
        :class:`LeaseLost`; with ``on_lost="flag"`` the body runs on, ``lease.lost`` becomes true
        and ``lease.wait_lost()`` returns.

        ``shared=True`` takes a shared (read) hold: held together with other shared holds of
        the name, never with an exclusive one. A waiting exclusive request blocks the shared
        requests that come after it, so a stream of readers cannot starve a writer. Every hold,
        shared or not, gets a token larger than all before it (``capabilities.shared_locks``).
        """
        self._check_on_lost(on_lost)
        name, ttl, timeout = self._check(name, ttl, timeout)
        if shared:
            self._check_shared()
            acquire = functools.partial(
                self._acquire, name, ttl, timeout, on_lost, track_context=False, shared=True
            )
        else:
            # A partial, not a closure: one coroutine fewer between the body and the backend.
            acquire = functools.partial(
                self._acquire, name, ttl, timeout, on_lost, track_context=False
            )
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
        unique = sorted({_validate.lock_name(name) for name in names}, key=canonical)
        if not unique:
            raise InvalidArgument("lock_all needs at least one lock name")
        _, ttl, timeout = self._check(unique[0], ttl, timeout)

        acquire = functools.partial(acquire_all, self._acquire, unique, ttl, timeout, on_lost)
        return MultiLockContext(acquire, on_lost, self._events, self._host.deadlines)

    async def acquire(
        self,
        name: str,
        *,
        ttl: float = 30.0,
        timeout: float | None = None,
        on_lost: OnLost = "flag",
        shared: bool = False,
    ) -> Lease:
        """Take the lock and return its :class:`Lease`; release it with ``await lease.release()``.

        There is no body to cancel here, so loss is only flagged (``lease.lost``,
        ``lease.wait_lost()``). ``current_token()`` sees the lease in this task until released.
        ``shared`` as for :meth:`lock`.
        """
        self._check_on_lost(on_lost)
        name, ttl, timeout = self._check(name, ttl, timeout)
        if shared:
            self._check_shared()
        return await self._acquire(
            name, ttl, timeout, on_lost, track_context=True, shared=bool(shared)
        )

    async def try_acquire(
        self, name: str, *, ttl: float = 30.0, shared: bool = False
    ) -> Lease | None:
        """Take the lock if it is free right now; ``None`` if someone else holds it (for a
        shared hold: if a writer holds it or waits for it)."""
        name, ttl, _ = self._check(name, ttl, 0)
        if shared:
            self._check_shared()
        try:
            return await self._acquire(
                name, ttl, 0, "flag", track_context=True, shared=bool(shared)
            )
        except AcquireTimeout:
            return None

    def semaphore(self, name: str, *, permits: int) -> Semaphore:
        """A semaphore of ``permits`` holds of ``name``, each its own lease (see
        :class:`Semaphore`). Semaphores are a namespace of their own: the lock ``"a"`` and the
        semaphore ``"a"`` are unrelated."""
        return Semaphore(self, name, permits)

    def election(self, name: str) -> Election:
        """The leader election ``name`` (see :class:`Election`), a namespace of its own."""
        return Election(self, name)

    async def inspect(self, name: str, kind: Kind = "lock") -> LockInfo:
        """What the server says about ``name`` now: held or not, by which lease, with which
        token, how long until it would expire, how many wait (``None`` where it cannot tell).
        ``holders`` lists every hold (readers, a semaphore's permits); ``kind`` picks the
        namespace (``"lock"``, ``"semaphore"``, ``"election"``).

        Raises :class:`UnsupportedFeature` on backends that cannot tell (Redlock).
        """
        name = _validate.lock_name(name)
        if kind not in ("lock", "semaphore", "election"):
            raise InvalidArgument(f"kind must be 'lock', 'semaphore' or 'election', got {kind!r}")
        self._check_open()
        return public_info(await self._backend.inspect(name, kind), kind)

    # -- internals ---------------------------------------------------------------------------

    def _check(self, name: object, ttl: object, timeout: object) -> tuple[str, float, float | None]:
        return check_request(self._backend, name, ttl, timeout)

    def _check_open(self) -> None:
        if self._host.state != "open":
            raise RuntimeError(
                "the lock client is not open: use `async with asynclock.connect(url) as locks:`"
            )

    def _check_shared(self) -> None:
        self._require("shared_locks", "shared (read) locks")

    def _require(self, capability: str, what: str) -> None:
        require(self._backend, capability, what)

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
        if self._host.state != "open":
            raise RuntimeError(
                "the lock client is not open: use `async with asynclock.connect(url) as locks:`"
            )
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
            if timeout == 0:
                grant = await self._backend.try_acquire(request)
            elif timeout is None and not events.active and not self._settings.deadlock_interval:
                grant = await self._backend.acquire(request)  # the common case, directly
            else:
                grant = await wait_for_grant(
                    self._backend, request, timeout, deadlocks, events, self._settings
                )
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
    client: LockClient,
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
