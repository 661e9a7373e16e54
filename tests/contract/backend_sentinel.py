from __future__ import annotations

import time

import pytest

from asynclock.testing import ServerError
from asynclock.testing._redis_topologies import SERVICE, RedisSentinelGroup
from tests.contract.backend_redis import redis_family
from tests.contract.harness import BackendUnderTest


def _settled(group: RedisSentinelGroup) -> bool:
    """No failover under way: every sentinel names one master and sees it up, it says it is
    the master, and every other node replicates it."""
    try:
        named = {
            tuple(sentinel.call("SENTINEL", "get-master-addr-by-name", SERVICE))
            for sentinel in group.sentinels
        }
        master = group.master()
        for sentinel in group.sentinels:
            state = sentinel.call("SENTINEL", "master", SERVICE)
            if dict(zip(state[::2], state[1::2], strict=True))["flags"] != "master":
                return False
        return (
            len(named) == 1
            and master.role() == "master"
            and all(
                node.role() == "slave"
                and f"master_port:{master.port}" in (info := node.call("INFO", "replication"))
                and "master_link_status:up" in info
                for node in group.replicas()
            )
        )
    except (OSError, ServerError):
        return False


@pytest.fixture
def sentinel_backend(redis_sentinel_group: RedisSentinelGroup) -> BackendUnderTest:
    group = redis_sentinel_group
    # A fault test before this one (a master paused or restarted past the sentinels'
    # down-after time) may have started a failover that would end in the middle of this one:
    # a release sent to the demoted master fails ("a failover is under way").
    deadline = time.monotonic() + 30
    while not _settled(group):
        assert time.monotonic() < deadline, f"{group!r}: a failover did not end in 30 s"
        time.sleep(0.05)
    return redis_family(
        "sentinel",
        group.url,
        # The master of now: a fault test may have caused a failover.
        lambda key: [group.master()],
        lambda: [group.master()],
        options={"durability_warning": False, "op_timeout": 1.0},
        # The fault suite pauses and restarts the master; a pause past the sentinels'
        # down-after-milliseconds fails it over, which the URL follows.
        servers=[group.master()],
        url_for_hosts=lambda hosts: f"redis+sentinel://{hosts}/asynclock/0",
        many_hosts=True,
        persistent=False,
    )
