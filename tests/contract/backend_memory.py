from __future__ import annotations

import uuid

import pytest

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
        return sorted(name for name in server._store.locks if server.holder(name) is not None)

    return BackendUnderTest("memory", f"memory://{namespace}", 1.0, revoke, leftovers)
