"""The PostgreSQL store behind the guards: a connection with a table name of its own (the Redis
client is tests/contract/backend_redis.py's raw_redis)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from asynclock.testing import PostgresServer


@pytest.fixture
async def pg(postgres_server: PostgresServer) -> AsyncIterator[tuple[Any, str]]:
    import asyncpg

    connection = await asyncpg.connect(postgres_server.dsn)
    table = f"fences_{uuid.uuid4().hex[:8]}"
    yield connection, table
    await connection.execute(f"DROP TABLE IF EXISTS {table}")
    await connection.close()
