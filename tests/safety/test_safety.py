"""Safety runs (short profile) of locks, semaphores and elections: worker processes paused past
their ttl between read and write (a semaphore's enter and exit).

With fencing, the resource must end with no lost update, no stale write accepted and never more
than ``permits`` writers at once, whatever the pauses did; without it, the same faults must
visibly corrupt it (the seeds' point). Every lock backend runs against the real server from the
testing toolkit.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from pathlib import Path

import anyio
import pytest

import asynclock
from asynclock._registry import make_backend
from asynclock.testing import EtcdServer, PostgresServer, RedisServer, ZooKeeperServer, _forked
from asynclock.testing._host import log_tail
from asynclock.testing._safety import SafetyConfig, SafetyReport, run_safety

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


@pytest.fixture(params=["sqlite", "redis", "etcd", "zookeeper", "postgres"])
def lock_backend(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, float]:
    """A lock backend's URL and a short ttl it honours."""
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
        # The ttl is the session timeout; the test server allows 1 to 10 s.
        return f"{zookeeper.url}/safety-{tag}", 1.0
    postgres: PostgresServer = request.getfixturevalue("postgres_server")
    return postgres.url, 1.0


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite://{tmp_path}/locks.db"


def summary(report: SafetyReport) -> str:
    return f"{report.as_dict()} errors={report.errors[:3]}"


def config(url: str, ttl: float, resource: str, **changes: object) -> SafetyConfig:
    values: dict[str, object] = {
        "url": url,
        "resource": resource,
        "workers": 4 if changes.get("primitive", "lock") == "lock" else 5,
        "duration": ttl * 2,  # and on until the fault happened (min_takeovers)
        "ttl": ttl,
        "fencing": True,
        # on_lost="flag": nothing but the guard stands between a stale holder and the resource.
        "cancel_on_loss": False,
        "pause_probability": 0.25,
        # The checks need a stopped holder overtaken: a loaded host that made too few holds in
        # the duration goes on until one was (ci: 4 holds in 3 s, no stale write to refuse).
        "min_takeovers": 1 if changes.get("pause_kind", "stop") == "stop" else 0,
        "permits": 2,
    }
    values.update(changes)
    return SafetyConfig(**values)  # type: ignore[arg-type]


def capable(url: str, capability: str) -> None:
    # Every lock backend of this module has it: one added without it must say so here, not skip.
    assert getattr(make_backend(url, {}).capabilities, capability), (
        f"{url.split('://')[0]}:// has no {capability}: leave it out of lock_backend's params"
    )


@pytest.mark.parametrize("primitive", ["lock", "election"])
async def test_with_fencing_no_stale_write_is_accepted(
    lock_backend: tuple[str, float], postgres_server: PostgresServer, primitive: str
) -> None:
    url, ttl = lock_backend
    if primitive == "election":
        capable(url, "elections")
    report = await run_safety(config(url, ttl, postgres_server.url, primitive=primitive))
    assert not report.errors, summary(report)
    assert report.lost_leases > 0, summary(report)  # the faults happened ...
    assert report.overtaken_holds > 0, summary(report)  # ... two workers held at once ...
    assert report.writes_refused > 0, summary(report)  # ... and the guard refused the stale ones
    assert report.token_errors == 0, summary(report)
    assert report.safe, summary(report)
    assert report.final_value == report.writes_accepted


async def test_without_fencing_the_same_faults_lose_updates(
    lock_backend: tuple[str, float], redis_server: RedisServer
) -> None:
    url, ttl = lock_backend
    report = await run_safety(config(url, ttl, redis_server.url, fencing=False))
    assert not report.errors, summary(report)
    assert report.lost_leases > 0, summary(report)
    assert not report.safe, summary(report)
    assert report.lost_updates > 0, summary(report)


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
    report = await run_safety(
        config(sqlite_url, 0.6, postgres_server.url, primitive="semaphore", fencing=False)
    )
    assert not report.errors, summary(report)
    assert report.lost_leases > 0, summary(report)
    assert report.most_writers_at_once is not None and report.most_writers_at_once > 2
    assert not report.safe, summary(report)


async def test_election_without_fencing_loses_updates(
    sqlite_url: str, redis_server: RedisServer
) -> None:
    report = await run_safety(
        config(sqlite_url, 0.6, redis_server.url, primitive="election", fencing=False)
    )
    assert not report.errors, summary(report)
    assert report.lost_leases > 0, summary(report)
    assert report.lost_updates > 0, summary(report)
    assert not report.safe, summary(report)


@pytest.mark.parametrize("pause_kind", ["stop", "block"])
async def test_cancellation_and_fencing_together_on_a_redis_resource(
    sqlite_url: str, redis_server: RedisServer, pause_kind: str
) -> None:
    report = await run_safety(
        config(sqlite_url, 0.6, redis_server.url, cancel_on_loss=True, pause_kind=pause_kind)
    )
    assert not report.errors, summary(report)
    assert report.lost_leases > 0, summary(report)
    assert report.safe, summary(report)


async def test_redlock_has_no_fencing_and_loses_updates_under_pauses(
    redis_servers: list[RedisServer], postgres_server: PostgresServer
) -> None:
    url = "redlock://" + ",".join(server.address for server in redis_servers) + "/0"
    url += f"?prefix=safety-{uuid.uuid4().hex[:8]}:"
    with pytest.raises(asynclock.UnsupportedFeature, match="no fencing tokens"):
        await run_safety(config(url, 0.6, postgres_server.url))
    with pytest.raises(asynclock.UnsupportedFeature, match="no semaphores"):
        await run_safety(
            config(url, 0.6, postgres_server.url, primitive="semaphore", fencing=False)
        )
    report = await run_safety(config(url, 0.6, postgres_server.url, fencing=False))
    assert not report.errors, summary(report)
    assert report.overtaken_holds > 0, summary(report)
    assert not report.safe, summary(report)


async def test_a_semaphore_run_needs_a_postgresql_resource() -> None:
    with pytest.raises(ValueError, match="postgresql"):
        url = "memory://safety-resource"
        await run_safety(config(url, 0.6, "redis://127.0.0.1:1/0", primitive="semaphore"))


def forked_workers() -> set[int]:
    """The worker processes the fork server of this test process runs now."""
    if _forked._server is None:
        return set()
    pid = _forked._server[0].pid
    return {int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}


def run_directory() -> Path | None:
    """The directory of the safety run under way, once its 4 workers each write their log
    there (their standard output); None before.

    A worker's standard output is the fork server's until the worker has redirected it, a
    moment after the fork, and the workers' pids need not rise in their order (they wrap at
    ``pid_max``, 32768 on the CI machine): so every worker is read, not the first one.
    """
    logs = set()
    for worker in forked_workers():
        with contextlib.suppress(OSError):  # exited, or not yet in /proc
            logs.add(Path(os.readlink(f"/proc/{worker}/fd/1")))
    if len(logs) != 4 or any(log.suffix != ".log" for log in logs):
        return None
    (directory,) = {log.parent for log in logs}
    return directory


@pytest.mark.parametrize("cancels", [1, 2])
async def test_a_run_cancelled_natively_leaves_no_worker_process_and_no_files(
    sqlite_url: str, redis_server: RedisServer, cancels: int
) -> None:
    """``task.cancel()`` (once, and again while the first unwinds) as the workers run: every
    worker is killed and reaped, and the run's directory is gone."""
    run = asyncio.create_task(run_safety(config(sqlite_url, 0.6, redis_server.url, duration=60)))
    directory = None
    try:
        with anyio.fail_after(30):
            while (directory := run_directory()) is None:  # noqa: ASYNC110
                await anyio.sleep(0.02)
            while not (directory / "go").exists():  # noqa: ASYNC110
                await anyio.sleep(0.02)
    except TimeoutError:
        # Say what the workers did (read before the cancelled run removes its directory).
        found = sorted(directory.glob("*")) if directory is not None else []
        said = (
            f"the run did not start within 30 s; workers {sorted(forked_workers())}, run "
            f"directory {directory}: {[path.name for path in found]}\n"
            + log_tail(path for path in found if path.suffix == ".log")
        )
        run.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await run
        pytest.fail(said, pytrace=False)
    await anyio.sleep(0.3)  # holds under way
    for _ in range(cancels):
        run.cancel()
        await asyncio.sleep(0)
    with pytest.raises(asyncio.CancelledError):
        await run
    assert forked_workers() == set()
    assert not directory.exists()
