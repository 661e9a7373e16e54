"""Safety runs (short profile): worker processes paused past their ttl between read and write.

With fencing the resource must end with no lost update and no stale write accepted, whatever the
pauses did; without it the same faults must visibly corrupt the counter (the seeds' point).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from asynclock.testing import PostgresServer, RedisServer
from asynclock.testing._safety import SafetyConfig, SafetyReport, run_safety

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


@pytest.fixture(params=["postgresql", "redis"])
def resource(
    request: pytest.FixtureRequest, postgres_server: PostgresServer, redis_server: RedisServer
) -> str:
    return postgres_server.url if request.param == "postgresql" else redis_server.url


def summary(report: SafetyReport) -> str:
    return f"{report.as_dict()} errors={report.errors[:3]}"


@pytest.mark.parametrize("pause_kind", ["stop", "block"])
async def test_the_guard_refuses_every_stale_write(
    tmp_path: Path, resource: str, pause_kind: str
) -> None:
    # on_lost="flag": nothing but the guard stands between a stale holder and the resource.
    config = SafetyConfig(
        url=f"sqlite://{tmp_path}/locks.db",
        resource=resource,
        workers=4,
        duration=4.0,
        ttl=0.6,
        fencing=True,
        cancel_on_loss=False,
        pause_probability=0.25,
        pause_kind=pause_kind,  # type: ignore[arg-type]
    )
    report = await run_safety(config)
    assert not report.errors, summary(report)
    assert report.lost_leases > 0, summary(report)  # the faults happened ...
    assert report.overtaken_holds > 0, summary(report)  # ... and two workers held at once
    assert report.writes_refused > 0, summary(report)  # ... and the guard refused the stale ones
    assert report.safe, summary(report)
    assert report.final_value == report.writes_accepted


async def test_without_fencing_the_same_faults_lose_updates(tmp_path: Path, resource: str) -> None:
    config = SafetyConfig(
        url=f"sqlite://{tmp_path}/locks.db",
        resource=resource,
        workers=4,
        duration=4.0,
        ttl=0.6,
        fencing=False,
        cancel_on_loss=False,
        pause_probability=0.25,
    )
    report = await run_safety(config)
    assert not report.errors, summary(report)
    assert report.lost_leases > 0, summary(report)
    assert not report.safe, summary(report)
    assert report.lost_updates > 0, summary(report)


async def test_cancellation_and_fencing_together_are_safe(tmp_path: Path, resource: str) -> None:
    config = SafetyConfig(
        url=f"sqlite://{tmp_path}/locks.db",
        resource=resource,
        workers=4,
        duration=4.0,
        ttl=0.6,
        fencing=True,
        cancel_on_loss=True,
        pause_probability=0.25,
    )
    report = await run_safety(config)
    assert not report.errors, summary(report)
    assert report.lost_leases > 0, summary(report)
    assert report.safe, summary(report)
