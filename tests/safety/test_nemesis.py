"""Safety runs with server faults on a schedule (the nemesis), beside the paused workers.

Each run has fencing on and must end safe: whatever the lock servers do (pause past the ttl,
jump their clock, lose their leader), no stale write is accepted and no update is lost. The
lock servers here are private to each test, since the faults would disturb the shared ones.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from asynclock.backends.redis import _scripts as lua
from asynclock.testing import (
    EtcdCluster,
    PostgresServer,
    RedisServer,
    SafetyConfig,
    SafetyReport,
    ZooKeeperEnsemble,
    run_safety,
)
from asynclock.testing._redis_topologies import RedisSentinelGroup

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


def summary(report: SafetyReport) -> str:
    return f"{report.as_dict()} errors={report.errors[:3]}"


def fenced(url: str, resource: str, ttl: float, **changes: object) -> SafetyConfig:
    values: dict[str, object] = {
        "url": url,
        "resource": resource,
        "workers": 4,
        "duration": 6.0,
        "ttl": ttl,
        "fencing": True,
        "cancel_on_loss": False,
        "pause_probability": 0.1,
        "permits": 2,
    }
    values.update(changes)
    return SafetyConfig(**values)  # type: ignore[arg-type]


def assert_safe(report: SafetyReport) -> None:
    # Server faults make some calls fail (recorded as errors by the workers); what matters is
    # that no worker crashed and the resource stayed consistent.
    crashed = [error for error in report.errors if error.startswith("worker ")]
    assert not crashed, summary(report)
    assert report.holds > 0, summary(report)
    assert report.safe, summary(report)
    if report.config.primitive == "semaphore":
        writers = report.most_writers_at_once
        assert writers is not None and writers <= report.config.permits, summary(report)
    else:
        assert report.final_value == report.writes_accepted, summary(report)


@pytest.mark.parametrize("primitive", ["lock", "semaphore", "election"])
async def test_redis_lock_server_paused_past_the_ttl(
    postgres_server: PostgresServer, primitive: str
) -> None:
    with RedisServer() as server:
        url = f"{server.url}?prefix=nemesis-{uuid.uuid4().hex[:6]}:&durability_warning=false"
        report = await run_safety(
            fenced(
                url,
                postgres_server.url,
                0.6,
                primitive=primitive,
                workers=5 if primitive == "semaphore" else 4,
                nemesis=[(2.0, server.pause), (3.5, server.resume)],
            )
        )
    assert_safe(report)
    assert report.lost_leases > 0, summary(report)


async def test_redis_lock_server_clock_jumps_forward(postgres_server: PostgresServer) -> None:
    """A forward jump expires keys early on the server: two holders, so only fencing helps."""
    with RedisServer(faketime="+0") as server:
        url = f"{server.url}?prefix=nemesis-{uuid.uuid4().hex[:6]}:&durability_warning=false"
        jumps = [(1.0 + index, lambda: server.jump_clock(5.0)) for index in range(4)]
        report = await run_safety(fenced(url, postgres_server.url, 2.0, nemesis=jumps))
    assert_safe(report)


async def test_redis_lock_server_killed_and_restarted(
    tmp_path: Path, postgres_server: PostgresServer
) -> None:
    with RedisServer() as server:
        url = f"{server.url}?prefix=nemesis-{uuid.uuid4().hex[:6]}:&durability_warning=false"
        report = await run_safety(
            fenced(
                url, postgres_server.url, 0.6, nemesis=[(2.0, server.kill), (2.5, server.restart)]
            )
        )
    # Without persistence the restart resets the token counter: the guard must refuse the
    # smaller tokens the restarted server hands out, so the run stays safe (if slow).
    assert_safe(report)


@pytest.mark.parametrize(
    ("store", "primitive"),
    [("etcd", "lock"), ("etcd", "election"), ("zookeeper", "lock"), ("zookeeper", "semaphore")],
)
async def test_leader_killed(postgres_server: PostgresServer, store: str, primitive: str) -> None:
    chroot = f"/nemesis-{uuid.uuid4().hex[:6]}"
    with EtcdCluster(size=3) if store == "etcd" else ZooKeeperEnsemble(size=3) as servers:
        url = f"{servers.url}?prefix={chroot}/" if store == "etcd" else servers.url + chroot
        report = await run_safety(
            fenced(
                url,
                postgres_server.url,
                2.0,
                duration=8.0,
                primitive=primitive,
                workers=5 if primitive == "semaphore" else 4,
                nemesis=[(2.5, servers.kill_leader)],
            )
        )
    assert_safe(report)
    assert report.token_errors == 0, summary(report)


async def test_redis_sentinel_master_fails_before_replicating(
    postgres_server: PostgresServer,
) -> None:
    """The documented caveat of Redis replication, on purpose: the master dies with a lock it
    just granted not yet on its replica, the sentinels promote the replica, and the lock is
    granted again while its first holder is still in its body. The fenced resource refuses the
    first holder's write. No worker is paused: every refusal here is the failover's doing."""
    prefix = f"nemesis-{uuid.uuid4().hex[:6]}:"
    with RedisSentinelGroup() as group:
        url = f"{group.url}?prefix={prefix}&durability_warning=false&op_timeout=0.5"
        counter = lua.token_key(prefix, "safety")

        def fail_over_after_a_fresh_take() -> None:
            # Right after a take: its holder has just read and has all of ``hold`` to go, which
            # outlasts the failover (~2 s) and the next take on the new master.
            master = group.master()
            # Every worker connected first (a client that cannot reach a master while it
            # opens fails at once, by contract): each has a restart watcher and a connection.
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                clients = master.call("CLIENT", "LIST").count(" name=asynclock ")
                if clients >= 8:
                    break
                time.sleep(0.01)
            first = master.call("GET", counter)
            deadline = time.monotonic() + 5
            while master.call("GET", counter) == first and time.monotonic() < deadline:
                time.sleep(0.002)
            group.fail_over_losing(f"{prefix}*")

        report = await run_safety(
            fenced(
                url,
                postgres_server.url,
                2.0,
                duration=9.0,
                hold=4.0,
                pause_probability=0.0,
                nemesis=[(1.0, fail_over_after_a_fresh_take)],
            )
        )
    assert_safe(report)
    # The lock was granted twice at once, and the first holder's late write was refused.
    assert report.overlapping_holds > 0, summary(report)
    assert report.writes_refused > 0, summary(report)
