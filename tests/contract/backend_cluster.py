from __future__ import annotations

import pytest
from redis.crc import key_slot

from asynclock.testing import Server
from asynclock.testing._redis_topologies import RedisClusterNodes
from tests.contract.harness import BackendUnderTest


@pytest.fixture
def cluster_backend(redis_cluster_nodes: RedisClusterNodes) -> BackendUnderTest:
    # Imported here: this plugin loads before backend_redis, which pytest must rewrite.
    from tests.contract.backend_redis import redis_family

    cluster = redis_cluster_nodes
    return redis_family(
        "cluster",
        cluster.url,
        lambda key: [cluster.node_for_slot(key_slot(key.encode()))],
        lambda: cluster.nodes,
        options={"durability_warning": False, "op_timeout": 1.0},
        # The fault suite pauses and restarts every node (no replicas: nothing fails over).
        servers=list[Server](cluster.nodes),
        url_for_hosts=lambda hosts: f"redis+cluster://{hosts}",
        many_hosts=True,
        persistent=False,
    )
