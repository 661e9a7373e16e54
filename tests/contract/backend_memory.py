from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

import asynclock
from asynclock.backends.memory import MemoryBackend
from tests.contract.harness import BackendUnderTest


@pytest.fixture
def memory_backend() -> BackendUnderTest:
    namespace = f"contract-{uuid.uuid4().hex[:8]}"
    # Holding a backend keeps the namespace (and its token counters) alive for the test.
    server = MemoryBackend(namespace)

    async def revoke(name: str) -> None:
        server.expire(name)

    async def leftovers() -> list[str]:
        return server.leftovers()

    @contextmanager
    def hang(client: asynclock.LockClient) -> Iterator[None]:
        backend = client._backend
        assert isinstance(backend, MemoryBackend)
        backend.faults.paused = True
        try:
            yield
        finally:
            backend.faults.paused = False

    return BackendUnderTest("memory", f"memory://{namespace}", 1.0, revoke, leftovers, hang=hang)
