"""Read-write locks on ZooKeeper (they take a lock client, so they live above the backends)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from .._errors import UnsupportedFeature
from ..backends.zookeeper import ZooKeeperBackend
from ..backends.zookeeper._names import EXCLUSIVE, KIND, SHARED, Kind

if TYPE_CHECKING:
    from .._client import LockClient
    from .._lease import Lease, OnLost

__all__ = ("ReadWriteLock",)


class ReadWriteLock:
    """A read-write lock on ZooKeeper: many readers or one writer, served in arrival order.

    Readers queue in the same znode directory as writers (``-read-`` nodes next to ``-lock-``
    nodes): a reader waits only for writers that came before it, a writer for everyone before
    it, so a steady stream of readers cannot starve a writer. The write side *is* the plain
    lock: ``locks.lock(name)`` and ``ReadWriteLock(locks, name).write()`` exclude each other and
    every reader. Leases, renewal, loss and fencing tokens work as for ``locks.lock``::

        rw = ReadWriteLock(locks, "catalog")
        async with rw.read(ttl=10) as lease:
            ...
    """

    def __init__(self, locks: LockClient, name: str) -> None:
        if not isinstance(locks._backend, ZooKeeperBackend):
            raise UnsupportedFeature(
                f"read-write locks need the zookeeper:// backend, not {locks._backend.describe()}"
            )
        self._locks = locks
        self.name = name

    @contextlib.asynccontextmanager
    async def read(
        self, *, ttl: float = 30.0, timeout: float | None = None, on_lost: OnLost = "cancel"
    ) -> AsyncIterator[Lease]:
        """Hold the lock shared with other readers for the body of an ``async with``."""
        async with self._hold(SHARED, ttl, timeout, on_lost) as lease:
            yield lease

    @contextlib.asynccontextmanager
    async def write(
        self, *, ttl: float = 30.0, timeout: float | None = None, on_lost: OnLost = "cancel"
    ) -> AsyncIterator[Lease]:
        """Hold the lock alone (no reader, no other writer) for the body of an ``async with``."""
        async with self._hold(EXCLUSIVE, ttl, timeout, on_lost) as lease:
            yield lease

    @contextlib.asynccontextmanager
    async def _hold(
        self, kind: Kind, ttl: float, timeout: float | None, on_lost: OnLost
    ) -> AsyncIterator[Lease]:
        context = self._locks.lock(self.name, ttl=ttl, timeout=timeout, on_lost=on_lost)
        # The kind reaches the backend's acquire through this context variable, and only
        # that acquire: it is reset before the body runs.
        token = KIND.set(kind)
        pending = True
        try:
            async with context as lease:
                KIND.reset(token)
                pending = False
                yield lease
        finally:
            if pending:
                KIND.reset(token)
