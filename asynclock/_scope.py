"""Ties the body of ``async with locks.lock(...)`` to its lease.

The body runs in an anyio cancel scope whose deadline is the lease's local deadline, so expiry
needs no timer task and fires even while the renewal loop is stuck on a hung server. Loss proven
by the backend cancels the scope at once. Only *this* scope's cancellation becomes
:class:`LeaseLost`; a cancellation from an enclosing scope passes through untouched, the way
``asyncio.timeout`` treats cancellations it did not cause.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextvars import Token
from types import TracebackType

import anyio

from . import _fencing
from ._errors import LeaseLost
from ._lease import Lease, OnLost


class LockContext:
    """What ``LockClient.lock()`` returns: ``async with`` it to hold the lock for the body."""

    __slots__ = ("_acquire", "_context_token", "_lease", "_on_lost", "_scope")

    def __init__(self, acquire: Callable[[], Awaitable[Lease]], on_lost: OnLost) -> None:
        self._acquire = acquire
        self._on_lost = on_lost
        self._lease: Lease | None = None
        self._scope: anyio.CancelScope | None = None
        self._context_token: Token[tuple[Lease, ...]] | None = None

    async def __aenter__(self) -> Lease:
        if self._lease is not None:
            raise RuntimeError("this lock() context is already in use; call locks.lock() again")
        lease = await self._acquire()
        self._lease = lease
        self._context_token = _fencing.push(lease)
        if self._on_lost == "cancel":
            scope = anyio.CancelScope()
            scope.__enter__()
            lease._attach_scope(scope)
            self._scope = scope
        return lease

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        lease = self._lease
        assert lease is not None and self._context_token is not None
        _fencing.pop(self._context_token)
        caught_own_cancel = False
        if self._scope is not None:
            lease._detach_scope(self._scope)
            caught_own_cancel = bool(self._scope.__exit__(exc_type, exc, tb))
        reason = lease.lost_reason  # also marks the lease lost if its deadline has passed
        await lease.release()
        if self._on_lost == "flag" or reason is None:
            if caught_own_cancel:
                # Only a lost lease cancels our scope; this cannot happen, but never swallow.
                raise LeaseLost(lease.name, "cancelled by its lease scope")
            return
        if exc is not None and not caught_own_cancel:
            if isinstance(exc, anyio.get_cancelled_exc_class()):
                # Someone else cancelled us as well: theirs wins, as asyncio.timeout does.
                return
            raise LeaseLost(lease.name, reason) from exc
        raise LeaseLost(lease.name, reason)
