from __future__ import annotations

import uuid
from collections.abc import Sequence

import pytest
import redis.asyncio

from asynclock.backends.redis import _scripts as lua
from asynclock.testing import RedisServer
from tests.contract.backend_redis import redis_leftovers
from tests.contract.harness import BackendUnderTest


async def redlock_leftovers(
    servers: Sequence[RedisServer], prefix: str, client_name: str
) -> list[str]:
    """:func:`redis_leftovers` on every master."""
    found: list[str] = []
    for server in servers:
        found += [
            f"{server.address}: {item}"
            for item in await redis_leftovers(server, prefix, client_name)
        ]
    return found


def redlock_url(masters: Sequence[str | RedisServer]) -> str:
    addresses = [each if isinstance(each, str) else each.address for each in masters]
    return "redlock://" + ",".join(addresses) + "/0"


@pytest.fixture
def redlock_backend(redis_servers: list[RedisServer]) -> BackendUnderTest:
    tag = uuid.uuid4().hex[:10]
    prefix = f"contract-{tag}:"
    client_name = f"asynclock-contract-{tag}"

    async def revoke(name: str) -> None:
        # A majority of masters forget the lock: no majority can hold it for us any more.
        for server in redis_servers[:2]:
            async with redis.asyncio.Redis(host=server.host, port=server.port) as raw:
                assert await raw.delete(lua.lock_key(prefix, name)) == 1

    async def leftovers() -> list[str]:
        return await redlock_leftovers(redis_servers, prefix, client_name)

    return BackendUnderTest(
        "redlock",
        redlock_url(redis_servers),
        1.0,
        revoke,
        leftovers,
        options={"prefix": prefix, "client_name": client_name},
        servers=list(redis_servers),
        url_via=redlock_url,
        # Three masters are the minimum: the entry under test plus two more.
        url_for_hosts=lambda hosts: f"redlock://{hosts},127.0.0.1:1,127.0.0.1:2/0",
        many_hosts=True,
        persistent=False,
    )
