from __future__ import annotations

import uuid

import pytest
import redis.asyncio
from redis.crc import key_slot

from asynclock.backends.redis import _scripts as lua
from asynclock.testing import Server
from asynclock.testing._redis_topologies import RedisClusterNodes
from tests.contract.harness import BackendUnderTest


@pytest.fixture
def cluster_backend(redis_cluster_nodes: RedisClusterNodes) -> BackendUnderTest:
    cluster = redis_cluster_nodes
    tag = uuid.uuid4().hex[:10]
    prefix = f"contract-{tag}:"
    client_name = f"asynclock-contract-{tag}"

    async def revoke(name: str) -> None:
        key = lua.lock_key(prefix, name)
        node = cluster.node_for_slot(key_slot(key.encode()))
        async with redis.asyncio.Redis(host=node.host, port=node.port) as raw:
            assert await raw.delete(key) == 1

    async def leftovers() -> list[str]:
        # Imported here: this plugin loads before backend_redis, which pytest must rewrite.
        from tests.contract.backend_redis import redis_leftovers

        found: list[str] = []
        for node in cluster.nodes:
            found += await redis_leftovers(node, prefix, client_name)
        return found

    return BackendUnderTest(
        "cluster",
        cluster.url,
        1.0,
        revoke,
        leftovers,
        options={
            "prefix": prefix,
            "client_name": client_name,
            "durability_warning": False,
            "op_timeout": 1.0,
        },
        # The fault suite pauses and restarts every node (no replicas: nothing fails over).
        servers=list[Server](cluster.nodes),
        url_for_hosts=lambda hosts: f"redis+cluster://{hosts}",
        many_hosts=True,
        persistent=False,
        long_waits={"waiter_ttl": 60},
    )
