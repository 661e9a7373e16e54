from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

import asynclock

from ._memory import memory_locks


@pytest.fixture
async def locks() -> AsyncIterator[asynclock.LockClient]:
    async with memory_locks() as client:
        yield client
