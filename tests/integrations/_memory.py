"""Lock clients on memory:// and their backend's fault hooks, for tests that need no web stack."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import asynclock
from asynclock.backends.memory import MemoryBackend


@asynccontextmanager
async def memory_locks() -> AsyncIterator[asynclock.LockClient]:
    async with asynclock.connect(f"memory://integrations-{uuid.uuid4().hex[:8]}") as locks:
        yield locks


def memory(locks: asynclock.LockClient) -> MemoryBackend:
    backend = locks._backend
    assert isinstance(backend, MemoryBackend)
    return backend
