"""asynclock.otel's metrics and spans, read back from the SDK's in-memory reader and exporter
(providers passed explicitly). asynclock.otel is imported inside the tests: importing it here adds
``otel`` to ``dir(asynclock)``, which test_core's check of the public names reads."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import pytest
from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

import asynclock
from tests.integrations._memory import memory, memory_locks

if TYPE_CHECKING:
    from asynclock.otel import Instrumentation
    from asynclock.testing import RedisServer

pytestmark = pytest.mark.anyio

EXAMPLE = Path(__file__).parents[1] / "examples" / "otel_metrics.py"


SHORT = {
    "lock_name": "asynclock.lock.name",
    "outcome": "asynclock.outcome",
    "lease_lost": "asynclock.lease.lost",
    "loss_kind": "asynclock.loss.kind",
    "state": "asynclock.connection.state",
    "previous": "asynclock.connection.previous_state",
}


@dataclass
class Telemetry:
    reader: InMemoryMetricReader
    exporter: InMemorySpanExporter
    meter_provider: MeterProvider
    tracer_provider: TracerProvider

    def instrument(self, client: asynclock.LockClient, **options: Any) -> Instrumentation:
        from asynclock.otel import instrument

        return instrument(
            client,
            meter_provider=self.meter_provider,
            tracer_provider=self.tracer_provider,
            **options,
        )

    def points(self, name: str) -> list[tuple[dict[str, Any], Any]]:
        data = self.reader.get_metrics_data()
        found: list[tuple[dict[str, Any], Any]] = []
        for resource in data.resource_metrics if data else ():
            for scope in resource.scope_metrics:
                assert scope.scope.name == "asynclock"
                for metric in scope.metrics:
                    if metric.name == name:
                        found += [(dict(p.attributes or {}), p) for p in metric.data.data_points]
        return found

    def point(self, name: str, **attributes: Any) -> Any:
        """The one point of ``name`` whose attributes include ``attributes`` (keys of SHORT)."""
        wanted = {SHORT[key]: value for key, value in attributes.items()}
        matching = [
            point
            for found, point in self.points(name)
            if all(found.get(key) == value for key, value in wanted.items())
        ]
        assert len(matching) == 1, (name, attributes, self.points(name))
        return matching[0]

    def spans(self, name: str) -> list[ReadableSpan]:
        return [span for span in self.exporter.get_finished_spans() if span.name == name]


@pytest.fixture
def telemetry() -> Iterator[Telemetry]:
    reader = InMemoryMetricReader()
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    meter_provider = MeterProvider(metric_readers=[reader])
    yield Telemetry(reader, exporter, meter_provider, tracer_provider)
    meter_provider.shutdown()
    tracer_provider.shutdown()


@pytest.fixture
async def locks() -> AsyncIterator[asynclock.LockClient]:
    async with memory_locks() as client:
        yield client


async def test_acquire_and_hold_are_measured_and_the_body_span_is_the_parent_of_its_work(
    telemetry: Telemetry, locks: asynclock.LockClient
) -> None:
    telemetry.instrument(locks)
    tracer = telemetry.tracer_provider.get_tracer("app")
    with tracer.start_as_current_span("request") as request:
        async with locks.lock("account:42", ttl=5) as lease:
            with tracer.start_as_current_span("work"):
                await anyio.sleep(0.05)
        assert trace.get_current_span() is request  # the body's span is no longer current

    assert telemetry.point("asynclock.acquire.duration", lock_name="account:{}").count == 1
    assert telemetry.points("asynclock.acquire.duration")[0][0] == {
        "asynclock.backend": "memory",
        "asynclock.lock.name": "account:{}",
        "asynclock.outcome": "acquired",
    }
    hold = telemetry.point("asynclock.hold.duration", lock_name="account:{}", lease_lost=False)
    assert hold.count == 1 and 0.05 <= hold.sum < 1.0

    (acquire_span,) = telemetry.spans("asynclock.acquire")
    (hold_span,) = telemetry.spans("asynclock.hold")
    (work,) = telemetry.spans("work")
    (request_span,) = telemetry.spans("request")
    assert acquire_span.attributes is not None and hold_span.attributes is not None
    assert acquire_span.attributes["asynclock.token"] == lease.token
    assert acquire_span.attributes["asynclock.outcome"] == "acquired"
    assert hold_span.attributes["asynclock.token"] == lease.token
    assert hold_span.attributes["asynclock.lock.name"] == "account:{}"
    assert hold_span.status.status_code is StatusCode.UNSET
    # request -> (acquire, hold -> work)
    assert acquire_span.parent is not None and hold_span.parent is not None
    assert acquire_span.parent.span_id == request_span.context.span_id
    assert hold_span.parent.span_id == request_span.context.span_id
    assert work.parent is not None and work.parent.span_id == hold_span.context.span_id
    assert acquire_span.start_time is not None and acquire_span.end_time is not None
    assert acquire_span.start_time <= acquire_span.end_time


async def test_waiters_timeouts_and_busy_answers(
    telemetry: Telemetry, locks: asynclock.LockClient
) -> None:
    telemetry.instrument(locks)
    holder = await locks.acquire("queue:7", ttl=5)
    waited = anyio.Event()

    async def wait() -> None:
        with pytest.raises(asynclock.AcquireTimeout):
            await locks.acquire("queue:7", timeout=0.3)
        waited.set()

    async with anyio.create_task_group() as task_group:
        task_group.start_soon(wait)
        await anyio.sleep(0.1)
        assert telemetry.point("asynclock.waiters", lock_name="queue:{}").value == 1
        await waited.wait()
    assert telemetry.point("asynclock.waiters", lock_name="queue:{}").value == 0
    with anyio.move_on_after(0.1):
        await locks.acquire("queue:7", ttl=5)
    assert telemetry.point("asynclock.waiters").value == 0  # the cancelled wait left none
    other = await locks.try_acquire("queue:8")  # another name: free
    assert other is not None
    await other.release()
    assert await locks.try_acquire("queue:7") is None  # held: busy
    await holder.release()

    timeout = telemetry.point("asynclock.acquire.duration", outcome="timeout")
    assert timeout.count == 1 and 0.3 <= timeout.sum < 1.0
    assert telemetry.point("asynclock.acquire.duration", outcome="busy").count == 1
    assert telemetry.point("asynclock.acquire.duration", outcome="acquired").count == 2
    assert telemetry.point("asynclock.acquire.duration", outcome="cancelled").count == 1
    statuses = {
        (span.attributes or {})["asynclock.outcome"]: span.status.status_code
        for span in telemetry.spans("asynclock.acquire")
    }
    assert statuses == {
        "acquired": StatusCode.UNSET,
        "busy": StatusCode.UNSET,  # try_acquire's expected answer, not an error
        "timeout": StatusCode.ERROR,
        "cancelled": StatusCode.UNSET,  # the caller's decision, not a failure
    }


@pytest.mark.expect_log("lease on 'a' lost: no successful renewal before the local deadline")
async def test_a_renewal_blip_is_measured_without_a_loss_and_a_hang_until_the_deadline(
    telemetry: Telemetry, locks: asynclock.LockClient
) -> None:
    telemetry.instrument(locks)
    changes = locks.state_changes()
    async with locks.lock("a", ttl=1.0) as lease:
        memory(locks).faults.renew = "fail"
        with anyio.fail_after(1):
            assert (await anext(changes)).state is asynclock.ConnectionState.SUSPENDED
        assert not locks.state.connected
        memory(locks).faults.renew = "ok"
        with anyio.fail_after(1):
            assert (await anext(changes)).state is asynclock.ConnectionState.RECONNECTED
        await anyio.sleep(1.0)  # renewed again past the ttl
        assert lease.remaining > 0.3
    assert not lease.lost

    failures = telemetry.point("asynclock.renewal.failures", outcome="failed").value
    failed = telemetry.point("asynclock.renewal.duration", outcome="failed").count
    assert failures == failed >= 1
    assert telemetry.point("asynclock.renewal.duration", outcome="renewed").count >= 1
    assert [attributes for attributes, _ in telemetry.points("asynclock.renewal.failures")] == [
        {"asynclock.backend": "memory", "asynclock.outcome": "failed"}
    ]
    for state, previous in [("suspended", "connected"), ("reconnected", "suspended")]:
        point = telemetry.point(
            "asynclock.connection.state_changes", state=state, previous=previous
        )
        assert point.value == 1, state
    assert not telemetry.points("asynclock.leases.lost")
    # A hung renewal is lost at the deadline, and the state goes lost.
    telemetry.exporter.clear()
    memory(locks).faults.renew = "hang"
    with pytest.raises(asynclock.LeaseLost):
        async with locks.lock("a", ttl=1.0):
            await anyio.sleep(5)
    assert telemetry.point("asynclock.leases.lost", loss_kind="deadline").value == 1
    assert telemetry.point("asynclock.connection.state_changes", state="lost").value == 1
    (span,) = telemetry.spans("asynclock.hold")
    assert span.status.status_code is StatusCode.ERROR
    assert "deadline" in (span.status.description or "")


@pytest.mark.expect_log("lease on 'order:9' lost: the lock was removed on the server")
@pytest.mark.expect_log("lease on 'a' lost: no successful renewal before the local deadline")
@pytest.mark.expect_log("lease on 'a' was lost after its body had run to completion")
async def test_a_loss_marks_the_body_span_as_an_error_unless_the_body_had_finished(
    telemetry: Telemetry, locks: asynclock.LockClient
) -> None:
    telemetry.instrument(locks)
    with pytest.raises(asynclock.LeaseLost) as info:
        async with locks.lock("order:9", ttl=30):
            memory(locks).expire("order:9", notify=True)
            await anyio.sleep(5)

    assert telemetry.point("asynclock.leases.lost", loss_kind="server").value == 1
    assert telemetry.points("asynclock.leases.lost")[0][0]["asynclock.lock.name"] == "order:{}"
    assert telemetry.point("asynclock.hold.duration", lease_lost=True).count == 1
    (span,) = telemetry.spans("asynclock.hold")
    assert span.status.status_code is StatusCode.ERROR
    assert span.status.description == f"lease lost: {info.value.reason}"
    events = {event.name: event for event in span.events}
    assert (events["asynclock.lease.lost"].attributes or {})["asynclock.loss.kind"] == "server"
    assert str((events["exception"].attributes or {})["exception.type"]).endswith("LeaseLost")
    # A body that finished before its loss was known is counted, not an error.
    telemetry.exporter.clear()
    async with locks.lock("a", ttl=0.3):
        time.sleep(0.35)  # noqa: ASYNC251 - blocking the loop is the point: a pause
    assert telemetry.point("asynclock.leases.finished_after_loss").value == 1
    assert telemetry.point("asynclock.leases.lost", loss_kind="deadline").value == 1
    (span,) = telemetry.spans("asynclock.hold")
    assert span.status.status_code is StatusCode.UNSET  # its result was kept
    assert (span.attributes or {})["asynclock.lease.lost_after_completion"] is True
    assert "asynclock.lease.finished_after_loss" in [event.name for event in span.events]


async def test_the_default_and_a_custom_template(
    telemetry: Telemetry, locks: asynclock.LockClient
) -> None:
    from asynclock.otel import default_name_template

    # The default hides what varies per instance.
    assert default_name_template("account:12345") == "account:{}"
    assert default_name_template("user-42-orders") == "user-{}-orders"
    assert default_name_template(f"job/{uuid.uuid4()}/step-2") == "job/{}/step-{}"
    assert default_name_template(f"blob:{uuid.uuid4().hex}") == "blob:{}"
    assert default_name_template("deadline-cafe") == "deadline-cafe"  # words, not hex ids
    assert default_name_template("migrations") == "migrations"
    telemetry.instrument(locks, name_template=lambda name: name.partition(":")[0])
    for user in ("alice", "bob"):
        async with locks.lock(f"user:{user}", ttl=5):
            pass
    assert telemetry.point("asynclock.hold.duration", lock_name="user").count == 2
    assert telemetry.point("asynclock.acquire.duration", lock_name="user").count == 2


async def test_an_acquire_begun_before_instrument_is_left_out_and_lock_all_makes_one_span(
    telemetry: Telemetry, locks: asynclock.LockClient
) -> None:
    # With nobody subscribed the core does not time an acquire: one that began before
    # instrument() would be reported as lasting since the clock's zero. It is left out.
    holder = await locks.acquire("a", ttl=5)
    async with anyio.create_task_group() as task_group:
        task_group.start_soon(lambda: locks.acquire("a", ttl=5, timeout=5))
        await anyio.sleep(0.05)
        telemetry.instrument(locks)
        await holder.release()
    async with locks.lock("b", ttl=5):
        pass
    (point,) = [point for _, point in telemetry.points("asynclock.acquire.duration")]
    assert point.count == 1 and point.sum < 1.0  # only "b"
    assert len(telemetry.spans("asynclock.acquire")) == 1
    # lock_all measures each acquire and makes one hold span.
    telemetry.exporter.clear()
    async with locks.lock_all(["transfer:2", "transfer:1"], ttl=5) as leases:
        pass
    assert telemetry.point("asynclock.acquire.duration", lock_name="transfer:{}").count == 2
    assert telemetry.point("asynclock.hold.duration", lock_name="transfer:{}").count == 2
    assert len(telemetry.spans("asynclock.acquire")) == 2
    # One body, so one span: it carries the first lock's token (canonical order).
    (span,) = telemetry.spans("asynclock.hold")
    assert (span.attributes or {})["asynclock.token"] == leases[0].token


async def test_an_error_of_the_body_marks_its_span_and_uninstrument_stops_recording(
    telemetry: Telemetry, locks: asynclock.LockClient
) -> None:
    instrumentation = telemetry.instrument(locks)
    with pytest.raises(KeyError):
        async with locks.lock("a", ttl=5):
            raise KeyError("x")
    (span,) = telemetry.spans("asynclock.hold")
    assert span.status.status_code is StatusCode.ERROR
    assert span.status.description == "KeyError: 'x'"
    instrumentation.uninstrument()
    instrumentation.uninstrument()  # idempotent
    assert not locks._events
    async with locks.lock("a", ttl=5):
        pass
    assert telemetry.point("asynclock.acquire.duration").count == 1
    assert len(telemetry.spans("asynclock.hold")) == 1


async def test_acquire_and_hold_on_a_real_redis(
    telemetry: Telemetry, redis_server: RedisServer
) -> None:
    url = f"{redis_server.url}?prefix=otel-{uuid.uuid4().hex[:6]}:&durability_warning=false"
    async with asynclock.connect(url) as locks:
        telemetry.instrument(locks)
        async with locks.lock("invoice:1001", ttl=5) as lease:
            await anyio.sleep(0.01)
    assert telemetry.point("asynclock.acquire.duration", outcome="acquired").count == 1
    assert telemetry.points("asynclock.hold.duration")[0][0] == {
        "asynclock.backend": "redis",
        "asynclock.lock.name": "invoice:{}",
        "asynclock.lease.lost": False,
    }
    (span,) = telemetry.spans("asynclock.hold")
    assert (span.attributes or {})["asynclock.token"] == lease.token


def test_the_example_runs_and_asynclock_never_imports_opentelemetry_itself() -> None:
    done = subprocess.run(
        [sys.executable, "-W", "error", str(EXAMPLE)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "asynclock.acquire.duration" in done.stdout
    assert "as expected" in done.stdout
    script = """
import sys
import asynclock, asynclock.integrations, asynclock.testing
assert not [name for name in sys.modules if name.startswith("opentelemetry")], "imported"
sys.modules["opentelemetry"] = None  # as if it were not installed
try:
    import asynclock.otel
except asynclock.MissingDependency as exc:
    print(exc)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "pip install 'asynclock[otel]'" in done.stdout
