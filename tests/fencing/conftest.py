"""The PostgreSQL store behind the guards (the Redis client is tests/contract/backend_redis.py's
raw_redis)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest

from tests.contract.backend_postgres import Pg


@pytest.fixture
async def fences(pg: Pg) -> AsyncIterator[tuple[asyncpg.Connection, str]]:
    """A connection, and a guard table name of the test's own."""
    table = f"fences_{uuid.uuid4().hex[:8]}"
    yield pg.admin, table
    await pg.admin.execute(f"DROP TABLE IF EXISTS {table}")
