from __future__ import annotations

import uuid

import pytest
import redis.asyncio

from asynclock.backends import _redis_scripts as lua
from asynclock.testing._redis_topologies import RedisSentinelGroup
from tests.contract.backend_redis import redis_leftovers
from tests.contract.harness import BackendUnderTest


@pytest.fixture
def sentinel_backend(redis_sentinel_group: RedisSentinelGroup) -> BackendUnderTest:
    group = redis_sentinel_group
    tag = uuid.uuid4().hex[:10]
    prefix = f"contract-{tag}:"
    client_name = f"asynclock-contract-{tag}"

    async def revoke(name: str) -> None:
        master = group.master()
        async with redis.asyncio.Redis(host=master.host, port=master.port) as raw:
            assert await raw.delete(lua.lock_key(prefix, name)) == 1

    async def leftovers() -> list[str]:
        # The master of now: a fault test may have caused a failover.
        return await redis_leftovers(group.master(), prefix, client_name)

    return BackendUnderTest(
        "sentinel",
        group.url,
        1.0,
        revoke,
        leftovers,
        options={
            "prefix": prefix,
            "client_name": client_name,
            "durability_warning": False,
            "op_timeout": 1.0,
        },
        # The fault suite pauses and restarts the master; a pause past the sentinels'
        # down-after-milliseconds fails it over, which the URL follows.
        servers=[group.master()],
        url_for_hosts=lambda hosts: f"redis+sentinel://{hosts}/asynclock/0",
        many_hosts=True,
        persistent=False,
        long_waits={"waiter_ttl": 60},
    )
