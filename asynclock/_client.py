"""``connect(url)``: the client that owns a backend, its connections and the renewal task."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import sys
import uuid
from collections.abc import Collection, Iterable
from types import TracebackType
from typing import Any, Self

import anyio
from anyio.abc import TaskGroup, TaskStatus

from . import _fencing, _validate
from ._deadlock import waiter_for, watch_for_deadlock
from ._errors import (
    AcquireTimeout,
    BackendTimeout,
    BackendUnavailable,
    DeadlockDetected,
    InvalidArgument,
    LockError,
    UnsupportedFeature,
    Waiter,
)
from ._lease import Lease, OnLost, public_owner
from ._registry import make_backend, redact
from ._renewal import RENEWAL
from ._scope import LockContext, MultiLockContext, release_all
from ._shield import Deferred, finish, on_asyncio
from ._supervisor import Supervisor
from .abc import Backend, Capabilities, Grant, LockInfo, LockRequest, WaiterRegistry

logger = logging.getLogger("asynclock")

_CAPABILITY_NAMES = ("fencing", "fifo", "loss_detection", "quorum", "cross_process")
#: How long releasing an already lost lease may keep the caller: the server may be hanging (often
#: the reason for the loss), and the rest of the release goes on in the background.
_LOST_RELEASE_WAIT = 0.25
#: How long closing the client waits for releases still retried in the background.
_CLOSE_GRACE = 1.0


def connect(
    url: str,
    /,
    *,
    require: Collection[str] = (),
    drift: float = 0.01,
    margin: float | None = None,
    connect_timeout: float = 10.0,
    release_timeout: float = 5.0,
    deadlock_detection: bool = False,
    deadlock_interval: float = 0.5,
    label: str | None = None,
    **options: Any,
) -> LockClient:
    """Make a lock client for ``url``; use it as ``async with asynclock.connect(url) as locks:``.

    The URL scheme picks the backend (``sqlite:///path``, ``redis://``, ``redlock://``,
    ``etcd://``, ``zookeeper://``, ``postgresql://``, ``memory://``). Backend options can be given
    in the query string or as keyword arguments; keyword arguments win.

    ``require`` names capabilities the backend must have (``"fencing"``, ``"fifo"``,
    ``"loss_detection"``, ``"quorum"``, ``"cross_process"``); a backend without one is refused with
    :class:`UnsupportedFeature` before anything connects.

    ``drift`` (share of the ttl) and ``margin`` (seconds; default ``min(1, ttl / 10)``) shorten the
    local deadline so that the body is cancelled before the server can expire the lock, even if
    the two clocks run at slightly different rates.

    Nothing connects until the client is entered, and bad input is refused at once:

    >>> asynclock.connect("mysql://db.internal/locks")
    Traceback (most recent call last):
    asynclock.InvalidURL: unknown lock backend 'mysql' in 'mysql://db.internal/locks'; known schemes: etcd, memory, postgres, postgresql, redis, rediss, redlock, sqlite, zookeeper
    >>> asynclock.connect("sqlite:///tmp/locks.db", ttl=5)
    Traceback (most recent call last):
    asynclock.InvalidArgument: unknown option(s) for sqlite://: ttl (known: busy_timeout, synchronous)

    ``deadlock_detection=True`` makes every wait longer than ``deadlock_interval`` publish who
    waits for what in the lock store, and fails the youngest waiter of any cycle with
    :class:`DeadlockDetected` (within about three intervals). ``label`` names this client in those
    records and errors (default: the host name).
    """
    drift = _validate.positive_seconds(drift, "drift") if drift else 0.0
    if drift >= 0.5:
        raise InvalidArgument(f"drift is a share of the ttl below 0.5, got {drift!r}")
    if margin is not None:
        margin = _validate.positive_seconds(margin, "margin")
    connect_timeout = _validate.positive_seconds(connect_timeout, "connect_timeout")
    release_timeout = _validate.positive_seconds(release_timeout, "release_timeout")
    if isinstance(require, str):
        require = (require,)  # require="fencing" means the one capability, not its letters
    unknown = set(require) - set(_CAPABILITY_NAMES)
    if unknown:
        raise InvalidArgument(
            f"unknown capabilities in require: {', '.join(sorted(unknown))} "
            f"(known: {', '.join(_CAPABILITY_NAMES)})"
        )
    deadlock_interval = _validate.positive_seconds(deadlock_interval, "deadlock_interval")
    if label is not None and (not isinstance(label, str) or "/" in label or not label):
        raise InvalidArgument(f"label must be a non-empty str without '/', got {label!r}")
    backend = make_backend(url, options)
    _check_event_loop(backend, url)
    if deadlock_detection and backend.waiter_registry() is None:
        raise UnsupportedFeature(
            f"{redact(url)} has no place for deadlock detection's records; use lock_all() or "
            "timeouts instead, or a backend that has one (see the multi-lock guide)"
        )
    missing = [name for name in require if not getattr(backend.capabilities, name)]
    if missing:
        raise UnsupportedFeature(
            f"{redact(url)} does not provide {', '.join(missing)}; see the backend guide for one "
            "that does (etcd, ZooKeeper and PostgreSQL provide fencing and loss detection)"
        )
    return LockClient(
        backend,
        drift=drift,
        margin=margin,
        connect_timeout=connect_timeout,
        release_timeout=release_timeout,
        deadlock_interval=deadlock_interval if deadlock_detection else None,
        label=label,
    )


class LockClient:
    """Locks on one backend. Made by :func:`connect`; enter it before use.

    Leaving the ``async with`` releases every lease still held and closes the backend, also when
    the block is cancelled.
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
        self._deadlock_interval = deadlock_interval
        self._label = label
        self._drift = drift
        self._margin = margin
        self._connect_timeout = connect_timeout
        self._release_timeout = release_timeout
        self._supervisor = Supervisor(backend)
        self._task_group: TaskGroup | None = None
        # Made in __aenter__: anyio primitives need a running event loop, and a client may be
        # made at import time. The renewal task has its own scope so that closing the client
        # stops it without cancelling the caller's code, which runs inside the group's scope.
        self._renewal_scope: anyio.CancelScope
        self._close_requested: anyio.Event
        self._backend_closed: anyio.Event
        #: Releases that did not finish in time and go on in the background.
        self._deferred = Deferred(attempt_timeout=release_timeout)
        self._state = "new"

    # -- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        if self._state != "new":
            raise RuntimeError("a LockClient can be entered once; call asynclock.connect() again")
        _check_event_loop(self._backend, self._backend.describe())
        self._state = "opening"
        self._renewal_scope = anyio.CancelScope()
        self._close_requested = anyio.Event()
        self._backend_closed = anyio.Event()
        task_group = anyio.create_task_group()
        await task_group.__aenter__()
        try:
            await task_group.start(self._host_backend, name="asynclock backend")
        except BaseException:
            self._state = "closed"
            # Nothing else runs in the group yet; close it without handing it the error, which
            # would come back wrapped in an ExceptionGroup. (No shield here: a scope entered
            # between the group's enter and exit would break their nesting.)
            await task_group.__aexit__(None, None, None)
            raise
        task_group.start_soon(self._renew, name="asynclock renewal")
        self._task_group = task_group
        self._deferred.bind(task_group)
        self._state = "open"
        return self

    async def _host_backend(self, *, task_status: TaskStatus[None]) -> None:
        """Open, hold and close the backend in one task of the client's task group.

        The backend may enter a task group in ``open()`` and leave it in ``aclose()``: both run
        here, and the connect timeout's scope stays open (disarmed) in between, so everything
        the backend starts nests inside it properly.
        """
        opened = False
        try:
            with anyio.CancelScope(
                deadline=anyio.current_time() + self._connect_timeout
            ) as connect_scope:
                await self._backend.open()
                opened = True
                connect_scope.deadline = math.inf
                task_status.started()
                await self._close_requested.wait()
                # Called at the nesting level of open(), so that a task group the backend
                # entered there can be left here.
                await self._backend.aclose()
        except BaseException:
            if not opened:
                with anyio.CancelScope(shield=True):
                    await self._backend.aclose()
            raise
        finally:
            self._backend_closed.set()
        if not opened:
            with anyio.CancelScope(shield=True):
                await self._backend.aclose()
            raise BackendTimeout(
                f"{self._backend.describe()} did not answer within {self._connect_timeout:g} s; "
                "check that the server runs and the URL's host and port are right, or raise "
                "connect_timeout"
            )

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            await self.aclose()
        finally:
            task_group, self._task_group = self._task_group, None
            if task_group is not None:
                # The renewal task is stopped by now. The caller's exception is not the task
                # group's business: handing it over would wrap it in an ExceptionGroup. Only a
                # crash of the renewal task itself surfaces from here (as a group).
                await task_group.__aexit__(None, None, None)

    async def aclose(self) -> None:
        """Release every lease still held and close the backend. Idempotent, and it finishes
        (within ``release_timeout + connect_timeout``) whatever cancels the caller, anyio's or
        asyncio's native cancellation alike."""
        if self._state != "open":
            return
        self._state = "closing"
        closed = await finish(
            self._close,
            timeout=self._release_timeout + self._connect_timeout,
            what=f"closing the lock client of {self._backend.describe()}",
        )
        if not closed and self._task_group is not None:
            # The backend did not close in time: stop its host task rather than hang the exit.
            self._task_group.cancel_scope.cancel()
        self._state = "closed"

    async def _close(self) -> None:
        await release_all(self._supervisor.leases)
        # Releases still retried in the background get a little longer (a server that hung
        # may be back), then stop: the server frees what they held when its lease expires
        # (etcd and ZooKeeper at once, since closing the backend ends its lease or session).
        await self._deferred.aclose(min(self._release_timeout, _CLOSE_GRACE))
        self._renewal_scope.cancel()
        self._close_requested.set()
        await self._backend_closed.wait()

    async def _renew(self) -> None:
        with self._renewal_scope:
            await self._supervisor.run()

    # -- locks -------------------------------------------------------------------------------

    @property
    def capabilities(self) -> Capabilities:
        """What the backend guarantees."""
        return self._backend.capabilities

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

        async def acquire() -> list[Lease]:
            return [await self._acquire(name, ttl, timeout, on_lost, track_context=False)]

        return LockContext(acquire, on_lost)

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

        return MultiLockContext(acquire, on_lost)

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
        if self._state != "open":
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
        margin = self._margin if self._margin is not None else min(1.0, ttl / 10.0)
        # A deadline before the first renewal would lose every lease.
        if not RENEWAL.leaves_time_to_renew(ttl, ttl * (1.0 - self._drift) - margin):
            raise InvalidArgument(
                f"margin {margin:g} s leaves no time to renew a {ttl:g} s lease: use a larger ttl "
                "or a smaller margin"
            )
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
        if self._state != "open":
            raise RuntimeError(
                "the lock client is not open: use `async with asynclock.connect(url) as locks:`"
            )
        margin = self._margin_for(ttl)
        holder: list[Lease] = []
        early_loss: list[str] = []

        def lost(reason: str) -> None:
            if holder:
                holder[0]._mark_lost(reason)
            else:
                early_loss.append(reason)

        request = LockRequest(name=name, ttl=ttl, owner=uuid.uuid4().hex, on_lost=lost)
        grant: Grant | None = None
        deadlocks: list[list[Waiter]] = []
        try:
            if timeout == 0:
                grant = await self._backend.try_acquire(request)
            else:
                grant = await self._wait(request, timeout, deadlocks)
        except LockError:
            raise
        except Exception as exc:
            # A backend is meant to translate its driver's errors; one that slips through still
            # reaches the user as one of ours, with the original attached.
            raise BackendUnavailable(
                f"acquiring {name!r} on {self._backend.describe()} failed: {exc!r}"
            ) from exc
        if grant is None and deadlocks:
            raise DeadlockDetected(name, deadlocks[0])
        if grant is None:
            raise AcquireTimeout(name, timeout or 0.0)
        # No await from here until the lease is registered: a cancellation cannot strand it.
        lease = Lease(
            grant,
            on_lost=on_lost,
            drift=self._drift,
            margin=margin,
            fencing=self._backend.capabilities.fencing,
            releaser=self._release,
        )
        holder.append(lease)
        for reason in early_loss:
            lease._mark_lost(reason)
        self._supervisor.add(lease)
        if track_context:
            _fencing.push(lease)
        return lease

    async def _wait(
        self, request: LockRequest, timeout: float | None, deadlocks: list[list[Waiter]]
    ) -> Grant | None:
        """Wait for the lock until ``timeout``; with deadlock detection, also until this task is
        found to be the victim of a cycle (then ``deadlocks`` holds the cycle)."""
        registry = self._backend.waiter_registry() if self._deadlock_interval else None
        if timeout is None and registry is None:
            return await self._backend.acquire(request)
        deadline = math.inf
        if timeout is not None:
            deadline = anyio.current_time() + timeout
            # However short the timeout, the lock is tried once: it bounds the wait, not the
            # first attempt (timeout=1e-9 must not fail where timeout=0 succeeds).
            try:
                grant = await self._backend.try_acquire(request)
            except BackendUnavailable:
                # With time left, the wait below retries as the backend does (a Redlock
                # majority may come back), as it did before this first try existed.
                if anyio.current_time() >= deadline:
                    raise
                grant = None
            if grant is not None or anyio.current_time() >= deadline:
                return grant
        with anyio.CancelScope(deadline=deadline):
            if registry is None or self._deadlock_interval is None:
                return await self._backend.acquire(request)
            return await self._wait_watching_deadlocks(request, registry, deadlocks)
        return None

    async def _wait_watching_deadlocks(
        self, request: LockRequest, registry: WaiterRegistry, deadlocks: list[list[Waiter]]
    ) -> Grant | None:
        assert self._deadlock_interval is not None
        me = waiter_for(request.name, self._label)
        grant: Grant | None = None
        try:
            async with anyio.create_task_group() as task_group:
                await task_group.start(
                    functools.partial(
                        watch_for_deadlock,
                        registry,
                        me,
                        interval=self._deadlock_interval,
                        found=deadlocks,
                        give_up=task_group.cancel_scope,
                    )
                )
                grant = await self._backend.acquire(request)
                task_group.cancel_scope.cancel()
        except BaseException:
            # Cancelled while the watcher stopped: the grant exists on the server and must not
            # be stranded there.
            if grant is not None:
                await finish(
                    functools.partial(self._backend.release, grant),
                    timeout=self._release_timeout,
                    what=f"releasing {request.name!r} after a cancelled acquire",
                )
            raise
        return grant

    async def _release(self, lease: Lease) -> None:
        if lease.released:
            return
        lease._check_deadline()
        lost = lease.lost
        lease._mark_released()
        self._supervisor.discard(lease)
        _fencing.discard(lease)
        grant = lease.grant
        # A lost lease is released only so that nothing stays behind: the caller need not wait
        # for a server that may be hanging (that is often why the lease was lost).
        wait = min(self._release_timeout, _LOST_RELEASE_WAIT) if lost else self._release_timeout
        try:
            await finish(
                functools.partial(self._backend.release, grant),
                timeout=wait,
                what=f"releasing {grant.name!r}",
                unfinished=functools.partial(self._defer_release, grant, None),
            )
        except Exception as exc:
            self._defer_release(grant, exc)

    def _defer_release(self, grant: Grant, error: BaseException | None) -> None:
        """Go on releasing ``grant`` in the client's task group until the server answers."""
        what = f"in {self._release_timeout:g} s" if error is None else f"({error!r})"
        retried = self._deferred.retry(
            functools.partial(self._backend.release, grant), f"releasing {grant.name!r}"
        )
        logger.warning(
            "asynclock: releasing %r on %s did not complete %s; %s",
            grant.name,
            self._backend.describe(),
            what,
            "retrying in the background until the server answers or the client closes"
            if retried
            else "the client is closed, so the server frees it when its lease expires",
        )


def _check_event_loop(backend: Backend[Grant], url: str) -> None:
    """Refuse, by name, a backend whose driver cannot run on the event loop in use (trio)."""
    if on_asyncio() or "trio" in backend.event_loops:
        return
    trio = sys.modules.get("trio")  # a running trio has been imported
    if trio is None:
        return
    try:
        trio.lowlevel.current_task()
    except RuntimeError:
        return  # no event loop at all (a client made at import time)
    raise UnsupportedFeature(
        f"{redact(url)} needs asyncio: its driver ({backend.driver}) does not run under trio. "
        "Under trio use memory:// or sqlite://, or run this client on asyncio"
    )


def _canonical(name: str) -> bytes:
    # Byte order of the UTF-8 form: the same in every process and language.
    return name.encode("utf-8")
