"""Read-write locks from before ``locks.lock(name, shared=True)``: kept as a thin wrapper.

Deprecated: use ``locks.lock(name, shared=True)`` for a read hold and ``locks.lock(name)`` for a
write hold, on any backend whose ``capabilities.shared_locks`` is true (ZooKeeper among them).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .._client import LockClient
    from .._lease import Lease, OnLost

__all__ = ("ReadWriteLock",)


class ReadWriteLock:
    """Deprecated: ``read()`` is ``locks.lock(name, shared=True)``, ``write()`` is
    ``locks.lock(name)``; use those.

    It was the ZooKeeper backend's read-write lock, and takes the same holds as before (on
    ZooKeeper: ``-read-`` nodes in the writers' queue, a reader waits for the writers before
    it, a writer for everyone before it). It now works on every backend with shared locks::

        rw = ReadWriteLock(locks, "catalog")    # DeprecationWarning
        async with rw.read(ttl=10) as lease:    # the same as locks.lock("catalog", ttl=10, shared=True)
            ...
    """

    def __init__(self, locks: LockClient, name: str) -> None:
        warnings.warn(
            "asynclock.extras.zookeeper.ReadWriteLock is deprecated: use "
            "locks.lock(name, shared=True) for a read hold and locks.lock(name) for a write hold",
            DeprecationWarning,
            stacklevel=2,
        )
        self._locks = locks
        self.name = name

    @contextlib.asynccontextmanager
    async def read(
        self, *, ttl: float = 30.0, timeout: float | None = None, on_lost: OnLost = "cancel"
    ) -> AsyncIterator[Lease]:
        """Hold the lock shared with other readers: ``locks.lock(name, shared=True)``."""
        context = self._locks.lock(
            self.name, ttl=ttl, timeout=timeout, on_lost=on_lost, shared=True
        )
        async with context as lease:
            yield lease

    @contextlib.asynccontextmanager
    async def write(
        self, *, ttl: float = 30.0, timeout: float | None = None, on_lost: OnLost = "cancel"
    ) -> AsyncIterator[Lease]:
        """Hold the lock alone (no reader, no other writer): ``locks.lock(name)``."""
        async with self._locks.lock(self.name, ttl=ttl, timeout=timeout, on_lost=on_lost) as lease:
            yield lease
