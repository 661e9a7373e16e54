"""The event loop's cheap primitives: the clock, cancel scopes and a checkpoint, on asyncio.

``anyio.current_time()``, ``anyio.CancelScope()`` and ``anyio.lowlevel.checkpoint()`` find the
running library (sniffio) on every call. On the hot path of an uncontended ``lock()`` + release
on the in-process backend, that lookup cost more than the rest of the cycle. On asyncio the same
things are the running loop's ``time()``, anyio's asyncio scope class, and ``asyncio.sleep(0)``
(which is what anyio's asyncio checkpoint awaits). Elsewhere (trio) they are anyio's own.
"""

from __future__ import annotations

import asyncio
import math
import types
from collections.abc import Awaitable, Callable, Generator

import anyio
import anyio.lowlevel

__all__ = ("cancel_scope", "checkpoint", "now")

#: anyio's asyncio cancel scope class, learnt from the first scope anyio makes on asyncio.
_asyncio_scope: Callable[..., anyio.CancelScope] | None = None


def now() -> float:
    """``anyio.current_time()``: the event loop's monotonic clock, in seconds."""
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:  # trio (or no event loop, where anyio raises its own error)
        return anyio.current_time()


def cancel_scope(*, shield: bool = False, deadline: float = math.inf) -> anyio.CancelScope:
    """``anyio.CancelScope(shield=shield, deadline=deadline)``, without looking up the event
    loop library (2 us of the 6 a scope with a deadline costs)."""
    global _asyncio_scope
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return anyio.CancelScope(shield=shield, deadline=deadline)
    if _asyncio_scope is None:
        scope = anyio.CancelScope(shield=shield, deadline=deadline)
        _asyncio_scope = type(scope)
        return scope
    return _asyncio_scope(shield=shield, deadline=deadline)


def checkpoint() -> Awaitable[None]:
    """``anyio.lowlevel.checkpoint()``: let other tasks run, and take a pending cancellation."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return anyio.lowlevel.checkpoint()
    return _yield_to_loop()


@types.coroutine
def _yield_to_loop() -> Generator[None, None, None]:
    # A bare yield is how asyncio.sleep(0) lets the loop run once (asyncio's __sleep0), here
    # without the coroutine around it.
    yield
