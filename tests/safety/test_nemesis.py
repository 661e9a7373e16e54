"""Safety runs with server faults on a schedule (the nemesis), beside the paused workers.

Each run has fencing on and must end safe: whatever the lock servers do (pause past the ttl,
jump their clock, lose their leader), no stale write is accepted and no update is lost. The
lock servers here are private to each test, since the faults would disturb the shared ones.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from asynclock.testing import (
    EtcdCluster,
    PostgresServer,
    RedisServer,
    SafetyConfig,
    SafetyReport,
    ZooKeeperEnsemble,
    run_safety,
)

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
    assert report.final_value == report.writes_accepted, summary(report)


async def test_redis_lock_server_paused_past_the_ttl(postgres_server: PostgresServer) -> None:
    with RedisServer() as server:
        url = f"{server.url}?prefix=nemesis-{uuid.uuid4().hex[:6]}:&durability_warning=false"
        report = await run_safety(
            fenced(
                url, postgres_server.url, 0.6, nemesis=[(2.0, server.pause), (3.5, server.resume)]
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


async def test_etcd_leader_killed(postgres_server: PostgresServer) -> None:
    with EtcdCluster(size=3) as cluster:
        url = f"{cluster.url}?prefix=/nemesis-{uuid.uuid4().hex[:6]}/"
        report = await run_safety(
            fenced(
                url, postgres_server.url, 2.0, duration=8.0, nemesis=[(2.5, cluster.kill_leader)]
            )
        )
    assert_safe(report)


async def test_zookeeper_leader_killed(postgres_server: PostgresServer) -> None:
    with ZooKeeperEnsemble(size=3) as ensemble:
        url = f"{ensemble.url}/nemesis-{uuid.uuid4().hex[:6]}"
        report = await run_safety(
            fenced(
                url, postgres_server.url, 2.0, duration=8.0, nemesis=[(2.5, ensemble.kill_leader)]
            )
        )
    assert_safe(report)
