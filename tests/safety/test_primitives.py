"""Safety runs of semaphores and elections (short profile), the faults of the lock runs.

Semaphore: worker processes hold permits and enter and exit a resource (a PostgreSQL log behind
:class:`asynclock.fencing.PostgresSemaphoreGuard`); a hold paused past its ttl between the two
exits after its permit went to another. Fenced: never more than ``permits`` writers at once at
the resource. Unfenced: more, under the same pauses.

Election: terms do the read-modify-write of the lock runs; a leader paused past its ttl loses
its term, the next term's token is larger, and the old term's writes are refused.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

import asynclock
from asynclock._registry import make_backend
from asynclock.testing import EtcdServer, PostgresServer, RedisServer, ZooKeeperServer
from asynclock.testing._safety import SafetyConfig, SafetyReport, run_safety

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


def summary(report: SafetyReport) -> str:
    return f"{report.as_dict()} errors={report.errors[:3]}"


def config(url: str, ttl: float, resource: str, **changes: object) -> SafetyConfig:
    values: dict[str, object] = {
        "url": url,
        "resource": resource,
        "workers": 5,
        "duration": max(3.0, ttl * 5),
        "ttl": ttl,
        "fencing": True,
        "cancel_on_loss": False,
        "pause_probability": 0.25,
        "permits": 2,
    }
    values.update(changes)
    return SafetyConfig(**values)  # type: ignore[arg-type]


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite://{tmp_path}/locks.db"


@pytest.fixture(params=["sqlite", "redis", "etcd", "zookeeper", "postgres"])
def lock_backend(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, float]:
    """A lock backend's URL and a short ttl it honours (as in test_safety.py)."""
    tag = uuid.uuid4().hex[:8]
    if request.param == "sqlite":
        return f"sqlite://{tmp_path}/locks.db", 0.6
    if request.param == "redis":
        redis: RedisServer = request.getfixturevalue("redis_server")
        return f"{redis.url}?prefix=safety-{tag}:&durability_warning=false", 0.6
    if request.param == "etcd":
        etcd: EtcdServer = request.getfixturevalue("etcd_server")
        return f"{etcd.url}?prefix=/safety-{tag}/", 2.0  # etcd grants leases of 2 s at least
    if request.param == "zookeeper":
        zookeeper: ZooKeeperServer = request.getfixturevalue("zookeeper_server")
        return f"{zookeeper.url}/safety-{tag}", 1.0
    postgres: PostgresServer = request.getfixturevalue("postgres_server")
    return postgres.url, 1.0


def capable(url: str, capability: str) -> None:
    if not getattr(make_backend(url, {}).capabilities, capability):
        pytest.skip(f"{url.split('://')[0]}:// has no {capability}")


async def test_semaphore_with_fencing_never_more_than_n_writers(
    lock_backend: tuple[str, float], postgres_server: PostgresServer
) -> None:
    url, ttl = lock_backend
    capable(url, "semaphores")
    report = await run_safety(config(url, ttl, postgres_server.url, primitive="semaphore"))
    assert not report.errors, summary(report)
    assert report.lost_leases > 0, summary(report)
    # The pauses made more holds than permits at once, as the workers saw them ...
    assert report.most_holds_at_once is not None and report.most_holds_at_once > 2, summary(report)
    assert report.writes_refused > 0, summary(report)  # ... and the guard refused the stale
    assert report.most_writers_at_once is not None and report.most_writers_at_once <= 2
    assert report.safe, summary(report)


async def test_semaphore_without_fencing_lets_more_than_n_writers_in(
    sqlite_url: str, postgres_server: PostgresServer
) -> None:
    capable(sqlite_url, "semaphores")
    report = await run_safety(
        config(sqlite_url, 0.6, postgres_server.url, primitive="semaphore", fencing=False)
    )
    assert not report.errors, summary(report)
    assert report.lost_leases > 0, summary(report)
    assert report.most_writers_at_once is not None and report.most_writers_at_once > 2
    assert not report.safe, summary(report)


async def test_election_with_fencing_refuses_old_terms(
    lock_backend: tuple[str, float], postgres_server: PostgresServer
) -> None:
    url, ttl = lock_backend
    capable(url, "elections")
    report = await run_safety(config(url, ttl, postgres_server.url, primitive="election"))
    assert not report.errors, summary(report)
    assert report.lost_leases > 0, summary(report)
    assert report.overtaken_holds > 0, summary(report)
    assert report.writes_refused > 0, summary(report)
    assert report.token_errors == 0, summary(report)
    assert report.safe, summary(report)
    assert report.final_value == report.writes_accepted


async def test_election_without_fencing_loses_updates(
    sqlite_url: str, redis_server: RedisServer
) -> None:
    capable(sqlite_url, "elections")
    report = await run_safety(
        config(sqlite_url, 0.6, redis_server.url, primitive="election", fencing=False)
    )
    assert not report.errors, summary(report)
    assert report.lost_leases > 0, summary(report)
    assert report.lost_updates > 0, summary(report)
    assert not report.safe, summary(report)


async def test_a_semaphore_run_needs_a_postgresql_resource() -> None:
    with pytest.raises(ValueError, match="postgresql"):
        url = "memory://safety-resource"
        await run_safety(config(url, 0.6, "redis://127.0.0.1:1/0", primitive="semaphore"))


async def test_a_run_of_a_primitive_the_backend_lacks_is_refused(
    redis_servers: list[RedisServer], postgres_server: PostgresServer
) -> None:
    url = "redlock://" + ",".join(server.address for server in redis_servers) + "/0"
    with pytest.raises(asynclock.UnsupportedFeature, match="no semaphores"):
        await run_safety(
            config(url, 0.6, postgres_server.url, primitive="semaphore", fencing=False)
        )
