"""The stores behind the guards: a PostgreSQL connection with a table name of its own, and a
Redis client (the servers are the asynclock.testing plugin's)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from asynclock.testing import PostgresServer, RedisServer


@pytest.fixture
async def pg(postgres_server: PostgresServer) -> AsyncIterator[tuple[Any, str]]:
    import asyncpg

    connection = await asyncpg.connect(postgres_server.dsn)
    table = f"fences_{uuid.uuid4().hex[:8]}"
    yield connection, table
    await connection.execute(f"DROP TABLE IF EXISTS {table}")
    await connection.close()


@pytest.fixture
async def redis_client(redis_server: RedisServer) -> AsyncIterator[Any]:
    import redis.asyncio

    client = redis.asyncio.Redis(host=redis_server.host, port=redis_server.port)
    yield client
    await client.aclose()
