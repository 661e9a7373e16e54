"""The fencing tokens of the locks held in the current context, through contextvars.

The value is an immutable tuple, innermost lock last, so a child task started inside a critical
section inherits a snapshot of it (contextvars are copied into new tasks), and nothing a child does
can change what its parent sees.
"""

from __future__ import annotations

from contextvars import ContextVar, Token

from ._errors import NotHeld
from ._lease import Lease

_held: ContextVar[tuple[Lease, ...]] = ContextVar("asynclock_held", default=())


def push(lease: Lease) -> Token[tuple[Lease, ...]]:
    return _held.set((*_held.get(), lease))


def pop(token: Token[tuple[Lease, ...]]) -> None:
    _held.reset(token)


def discard(lease: Lease) -> None:
    """Forget ``lease`` in this context (release of a lease taken with ``acquire()``)."""
    held = _held.get()
    if lease in held:
        _held.set(tuple(other for other in held if other is not lease))


def held_leases() -> tuple[Lease, ...]:
    """The leases held in the current context, outermost first."""
    return _held.get()


def current_lease(name: str | None = None) -> Lease:
    """The innermost lease held in this context, or the innermost one on ``name``."""
    held = _held.get()
    for lease in reversed(held):
        if name is None or lease.name == name:
            return lease
    if name is None:
        raise NotHeld(
            "no lock is held in this context: call current_token() inside "
            "`async with locks.lock(...)`, or in a task started from there"
        )
    names = ", ".join(repr(lease.name) for lease in held) or "none"
    raise NotHeld(f"lock {name!r} is not held in this context (held here: {names})")


def current_token(name: str | None = None) -> int:
    """The fencing token of the innermost lock held in this context (or of the lock ``name``).

    Raises :class:`asynclock.NotHeld` when no such lock is held, and
    :class:`asynclock.UnsupportedFeature` when the backend has no sound tokens (Redlock).

    >>> import anyio, asynclock
    >>> async def main() -> None:
    ...     async with asynclock.connect("memory://doc") as locks:
    ...         async with locks.lock("orders/42"):
    ...             print(asynclock.current_token(), asynclock.current_token("orders/42"))
    >>> anyio.run(main)
    1 1
    >>> asynclock.current_token()
    Traceback (most recent call last):
    asynclock.NotHeld: no lock is held in this context: call current_token() inside `async with locks.lock(...)`, or in a task started from there
    """
    return current_lease(name).token
