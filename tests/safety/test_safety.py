"""Safety runs (short profile): worker processes paused past their ttl between read and write.

With fencing, the resource must end with no lost update and no stale write accepted, whatever the
pauses did; without it, the same faults must visibly corrupt the counter (the seeds' point).
Every lock backend runs against the real server from the testing toolkit.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

import asynclock
from asynclock.testing import EtcdServer, PostgresServer, RedisServer, ZooKeeperServer
from asynclock.testing._safety import SafetyConfig, SafetyReport, run_safety

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


@dataclass
class LockBackend:
    name: str
    url: str
    ttl: float


@pytest.fixture(params=["sqlite", "redis", "etcd", "zookeeper", "postgres"])
def lock_backend(request: pytest.FixtureRequest, tmp_path: Path) -> LockBackend:
    tag = uuid.uuid4().hex[:8]
    if request.param == "sqlite":
        return LockBackend("sqlite", f"sqlite://{tmp_path}/locks.db", 0.6)
    if request.param == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        return LockBackend(
            "redis", f"{server.url}?prefix=safety-{tag}:&durability_warning=false", 0.6
        )
    if request.param == "etcd":
        etcd: EtcdServer = request.getfixturevalue("etcd_server")
        # etcd grants leases of at least 2 s.
        return LockBackend("etcd", f"{etcd.url}?prefix=/safety-{tag}/", 2.0)
    if request.param == "zookeeper":
        zookeeper: ZooKeeperServer = request.getfixturevalue("zookeeper_server")
        # The ttl is the session timeout; the test server allows 1 to 10 s.
        return LockBackend("zookeeper", f"{zookeeper.url}/safety-{tag}", 1.0)
    postgres: PostgresServer = request.getfixturevalue("postgres_server")
    return LockBackend("postgres", postgres.url, 1.0)


def summary(report: SafetyReport) -> str:
    return f"{report.as_dict()} errors={report.errors[:3]}"


def config(lock: LockBackend, resource: str, **changes: object) -> SafetyConfig:
    defaults: dict[str, object] = {
        "url": lock.url,
        "resource": resource,
        "workers": 4,
        "duration": max(3.0, lock.ttl * 5),
        "ttl": lock.ttl,
        "fencing": True,
        # on_lost="flag": nothing but the guard stands between a stale holder and the resource.
        "cancel_on_loss": False,
        "pause_probability": 0.25,
    }
    defaults.update(changes)
    return SafetyConfig(**defaults)  # type: ignore[arg-type]


async def test_with_fencing_no_stale_write_is_accepted(
    lock_backend: LockBackend, postgres_server: PostgresServer
) -> None:
    report = await run_safety(config(lock_backend, postgres_server.url))
    assert not report.errors, summary(report)
    assert report.lost_leases > 0, summary(report)  # the faults happened ...
    assert report.overtaken_holds > 0, summary(report)  # ... two workers held at once ...
    assert report.writes_refused > 0, summary(report)  # ... and the guard refused the stale ones
    assert report.safe, summary(report)
    assert report.final_value == report.writes_accepted


async def test_without_fencing_the_same_faults_lose_updates(
    lock_backend: LockBackend, redis_server: RedisServer
) -> None:
    report = await run_safety(config(lock_backend, redis_server.url, fencing=False))
    assert not report.errors, summary(report)
    assert report.lost_leases > 0, summary(report)
    assert not report.safe, summary(report)
    assert report.lost_updates > 0, summary(report)


@pytest.mark.parametrize("pause_kind", ["stop", "block"])
async def test_cancellation_and_fencing_together_on_a_redis_resource(
    tmp_path: Path, redis_server: RedisServer, pause_kind: str
) -> None:
    lock = LockBackend("sqlite", f"sqlite://{tmp_path}/locks.db", 0.6)
    report = await run_safety(
        config(lock, redis_server.url, cancel_on_loss=True, pause_kind=pause_kind)
    )
    assert not report.errors, summary(report)
    assert report.lost_leases > 0, summary(report)
    assert report.safe, summary(report)


async def test_redlock_has_no_fencing_and_loses_updates_under_pauses(
    redis_servers: list[RedisServer], postgres_server: PostgresServer
) -> None:
    url = "redlock://" + ",".join(server.address for server in redis_servers) + "/0"
    lock = LockBackend("redlock", f"{url}?prefix=safety-{uuid.uuid4().hex[:8]}:", 0.6)
    with pytest.raises(asynclock.UnsupportedFeature, match="no fencing tokens"):
        await run_safety(config(lock, postgres_server.url))
    report = await run_safety(config(lock, postgres_server.url, fencing=False))
    assert not report.errors, summary(report)
    assert report.overtaken_holds > 0, summary(report)
    assert not report.safe, summary(report)
