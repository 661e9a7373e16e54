from __future__ import annotations

import uuid

import anyio
import pytest
import redis.asyncio

from asynclock.backends import _redis_scripts as lua
from asynclock.testing import RedisServer
from tests.contract.harness import BackendUnderTest


async def redis_leftovers(server: RedisServer, prefix: str, client_name: str) -> list[str]:
    """Keys under ``prefix`` (fencing counters excepted, of every kind: locks, semaphores and
    elections alike, they are meant to stay) and connections named ``client_name`` still open
    on ``server``. So a semaphore's or an election's holds, queue and permits count here."""
    token_prefixes = tuple(f"{prefix}{space}{lua.TOKEN_TAG}" for space in lua.KIND_SPACE.values())
    async with redis.asyncio.Redis(host=server.host, port=server.port) as raw:
        keys = [
            key.decode()
            async for key in raw.scan_iter(match=f"{prefix}*", count=1000)
            if not key.decode().startswith(token_prefixes)
        ]
        # A client that just closed its sockets may still be listed for a moment.
        with anyio.move_on_after(2):
            while True:
                clients = [
                    f"connection {entry['addr']} named {entry['name']}"
                    for entry in await raw.client_list()
                    if entry.get("name") == client_name
                ]
                if not clients:
                    break
                await anyio.sleep(0.02)
    return sorted(keys) + clients


@pytest.fixture
def redis_backend(redis_server: RedisServer) -> BackendUnderTest:
    tag = uuid.uuid4().hex[:10]
    prefix = f"contract-{tag}:"
    client_name = f"asynclock-contract-{tag}"

    async def revoke(name: str) -> None:
        async with redis.asyncio.Redis(host=redis_server.host, port=redis_server.port) as raw:
            assert await raw.delete(lua.lock_key(prefix, name)) == 1

    async def leftovers() -> list[str]:
        return await redis_leftovers(redis_server, prefix, client_name)

    return BackendUnderTest(
        "redis",
        redis_server.url,
        1.0,
        revoke,
        leftovers,
        # The test servers run without persistence (--appendonly no), which is what the
        # durability warning is about; tests/backends/test_redis.py checks that it appears.
        options={"prefix": prefix, "client_name": client_name, "durability_warning": False},
        servers=[redis_server],
        url_via=lambda addresses: f"redis://{addresses[0]}/0",
        url_for_hosts=lambda hosts: f"redis://{hosts}/0",
        persistent=False,
    )
