"""Ties the body of ``async with locks.lock(...)`` (or ``lock_all``) to its leases.

The body runs in an anyio cancel scope, cancelled when one of its leases is lost: at once when
the backend proves the loss, and at the earliest local deadline of its leases by the client's
one :class:`Deadlines` task, which fires even while the renewal loop is stuck on a hung server. Only *this* scope's cancellation
becomes :class:`LeaseLost`; a cancellation from an enclosing scope passes through untouched, the
way ``asyncio.timeout`` treats cancellations it did not cause.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Collection, Sequence
from contextvars import Token
from types import TracebackType
from typing import Any, ClassVar, Generic, NoReturn, TypeVar

import anyio

from . import _fencing
from ._clock import cancel_scope, now
from ._errors import LeaseLost
from ._events import Events, Observer
from ._lease import Lease, OnLost

T = TypeVar("T")
E = TypeVar("E", bound=BaseException | None)

logger = logging.getLogger("asynclock")


class BodyScope:
    """The cancel scope of one body, shared by the leases it depends on."""

    __slots__ = ("leases", "scope")

    def __init__(self, leases: Sequence[Lease]) -> None:
        # No deadline on the scope itself: a deadline is a timer armed and disarmed per body,
        # which cost a third of an uncontended cycle on memory:// (the loop's heap fills with
        # cancelled timers). The client's one Deadlines task cancels it instead.
        self.scope = cancel_scope()
        self.leases = leases

    @property
    def deadline(self) -> float:
        """The earliest local deadline of the leases still held (inf when none is)."""
        earliest = math.inf
        for lease in self.leases:
            if lease.held and lease.deadline < earliest:
                earliest = lease.deadline
        return earliest

    def cancel(self) -> None:
        self.scope.cancel()


class Deadlines:
    """Ends the leases of running bodies at their local deadlines: one task per client.

    Each body's leases are checked when the earliest deadline among them passes, which marks
    them lost and cancels the body, exactly as a proven loss does. This does not depend on the
    renewal loop, so a renewal stuck on a hung server never delays it. The task sleeps until the
    earliest deadline it knows; a body whose deadline is later (the common case: leases taken one
    after another have ever later deadlines) costs it nothing, and renewals only move deadlines
    later, so the task may wake early and sleep again, never late.
    """

    __slots__ = ("_bodies", "_sleep", "_wake_at")

    def __init__(self) -> None:
        self._bodies: set[BodyScope] = set()
        self._sleep: anyio.CancelScope | None = None
        self._wake_at = math.inf

    def watch(self, body: BodyScope) -> None:
        self._bodies.add(body)
        deadline = body.deadline
        if deadline < self._wake_at:
            self._wake_at = deadline
            if self._sleep is not None:
                self._sleep.deadline = deadline

    def moved(self, deadline: float) -> None:
        """A lease's deadline moved to ``deadline`` (an ``extend()``), perhaps earlier."""
        if deadline < self._wake_at:
            self._wake_at = deadline
            if self._sleep is not None:
                self._sleep.deadline = deadline

    def unwatch(self, body: BodyScope) -> None:
        self._bodies.discard(body)

    async def run(self) -> None:
        while True:
            at = now()
            for body in list(self._bodies):
                if body.deadline <= at:
                    for lease in body.leases:
                        lease._check_deadline()  # marks it lost: that cancels the body
            self._wake_at = min((body.deadline for body in self._bodies), default=math.inf)
            with anyio.move_on_at(self._wake_at) as self._sleep:
                await anyio.sleep_forever()
            self._sleep = None


class AsyncOnly:
    """What is used with ``async with`` only: ``with`` says so, not Python's bare TypeError."""

    __slots__ = ()
    _misuse: ClassVar[str]

    def __enter__(self) -> NoReturn:
        raise TypeError(f"{self._misuse}, not `with`")

    def __exit__(self, *exc_info: object) -> None:  # pragma: no cover - __enter__ raised
        return None


class _HeldContext(AsyncOnly, ABC, Generic[T]):
    __slots__ = (
        "_acquire",
        "_body",
        "_context_tokens",
        "_deadlines",
        "_events",
        "_leases",
        "_observed",
        "_on_lost",
    )

    _misuse = "a lock is held with `async with locks.lock(name) as lease:`"

    def __await__(self) -> NoReturn:
        raise TypeError(
            f"{self._misuse}, not awaited; `lease = await locks.acquire(name)` takes one "
            "without a block"
        )

    def __init__(
        self,
        acquire: Callable[[], Awaitable[Lease | list[Lease]]],
        on_lost: OnLost,
        events: Events,
        deadlines: Deadlines,
    ) -> None:
        self._acquire = acquire
        self._deadlines = deadlines
        self._on_lost = on_lost
        self._events = events
        self._leases: list[Lease] | None = None
        self._body: BodyScope | None = None
        self._context_tokens: list[Token[tuple[Lease, ...]]] = []
        #: What each observer returned when the body began (its span, say).
        self._observed: Sequence[tuple[Observer, Any]] = ()

    @abstractmethod
    def _result(self, leases: list[Lease]) -> T:
        """What ``async with ... as`` binds."""

    async def __aenter__(self) -> T:
        if self._leases is not None:
            raise RuntimeError("this lock context is already in use; call locks.lock() again")
        taken = await self._acquire()
        leases = taken if isinstance(taken, list) else [taken]
        self._leases = leases
        self._context_tokens = [_fencing.push(lease) for lease in leases]
        if self._on_lost == "cancel":
            body = BodyScope(leases)
            body.scope.__enter__()
            self._body = body
            for lease in leases:
                lease._attach_scope(body)
            self._deadlines.watch(body)
        if self._events.active:
            lease = leases[0]
            self._observed = self._events.enter_body(lease.name, lease.grant.token)
        return self._result(leases)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        leases = self._leases
        assert leases is not None
        for token in reversed(self._context_tokens):
            _fencing.pop(token)
        caught_own_cancel = False
        if self._body is not None:
            self._deadlines.unwatch(self._body)
            for lease in leases:
                lease._detach_scope(self._body)
            # Read cancelled_caught, not __exit__'s return value: trio's scope returns True on a
            # clean exit too, which would turn every clean exit into a LeaseLost.
            self._body.scope.__exit__(exc_type, exc, tb)
            caught_own_cancel = self._body.scope.cancelled_caught
        # Reading lost_reason also marks a lease lost whose deadline has passed.
        lost = [(lease.name, reason) for lease in leases if (reason := lease.lost_reason)]
        if len(leases) == 1:
            # The common case, without two more coroutines (Lease.release, release_all).
            await leases[0]._releaser(leases[0])
        else:
            await release_all(leases)
        if self._on_lost == "flag" or not lost:
            if caught_own_cancel:
                # Only a lost lease cancels our scope; this cannot happen, but never swallow.
                raise self._exited(LeaseLost(leases[0].name, "cancelled by its lease scope"))
            self._exited(exc)
            return
        name, reason = lost[0]
        if exc is None:
            # The body returned: its work is done, whether the loss came too late to stop it
            # (this process was paused, the deadline passed without a checkpoint) or it went on
            # regardless. Raising now could only get finished work redone; the loss is
            # reported beside the result instead. LeaseLost means the body did not finish.
            for lease_name, lease_reason in lost:
                logger.warning(
                    "asynclock: lease on %r was lost after its body had run to completion "
                    "(%s); the body's work is done, but another holder may have overlapped "
                    "it unless its writes were fenced",
                    lease_name,
                    lease_reason,
                )
                if self._events.active:
                    self._events.emit("finished_after_loss", lease_name, lease_reason)
            self._exited(None)
            return
        if exc is not None and not caught_own_cancel:
            if isinstance(exc, anyio.get_cancelled_exc_class()):
                # Someone else cancelled us as well: theirs wins, as asyncio.timeout does.
                self._exited(exc)
                return
            raise self._exited(LeaseLost(name, reason)) from exc
        raise self._exited(LeaseLost(name, reason))

    def _exited(self, error: E) -> E:
        """Tell the observers the body ended with ``error`` (what ``async with`` raises)."""
        if self._observed:
            self._events.exit_body(self._observed, error)
        return error


async def release_all(leases: Collection[Lease]) -> None:
    """Release every lease, concurrently when there are several.

    Each release finishes whatever cancels the caller (see :mod:`asynclock._shield`). A task
    group whose host task is cancelled natively still waits for its children, which are
    shielded, so every release ends before the caller's cancellation propagates.
    """
    if len(leases) == 1:
        await next(iter(leases)).release()
    elif leases:
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as task_group:
                for lease in leases:
                    task_group.start_soon(lease.release)


class LockContext(_HeldContext[Lease]):
    """What ``LockClient.lock()`` returns: ``async with`` it to hold the lock for the body."""

    __slots__ = ()

    def _result(self, leases: list[Lease]) -> Lease:
        return leases[0]


class MultiLockContext(_HeldContext[tuple[Lease, ...]]):
    """What ``LockClient.lock_all()`` returns: every lock of the set, held for the body."""

    __slots__ = ()

    def _result(self, leases: list[Lease]) -> tuple[Lease, ...]:
        return tuple(leases)
