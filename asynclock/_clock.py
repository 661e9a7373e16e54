"""The clock of leases and cancel scopes: ``anyio.current_time()``, cheaply on asyncio.

``anyio.current_time()`` finds the running library (sniffio) on every call, which costs more than
the rest of an uncontended ``lock()`` + release does on the in-process backend, where the clock is
read several times. On asyncio the same value is the running loop's ``time()``.
"""

from __future__ import annotations

import asyncio

import anyio

__all__ = ("now",)


def now() -> float:
    """``anyio.current_time()``: the event loop's monotonic clock, in seconds."""
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:  # trio (or no event loop, where anyio raises its own error)
        return anyio.current_time()
