"""OpenTelemetry metrics and spans from a lock client: ``asynclock.otel.instrument``.

    pip install 'asynclock[otel]' opentelemetry-sdk
    python examples/otel_metrics.py                            # in-memory backend
    ASYNCLOCK_URL=redis://127.0.0.1:6379 python examples/otel_metrics.py

Five jobs on two accounts take ``account:<id>`` locks; jobs on one account wait for each other.
The SDK's in-memory reader and exporter stand in for an OTLP or Prometheus exporter: the script
prints each metric's data points (attributes carry the template ``account:{}``, not the account
number) and the spans (each job's ``asynclock.hold`` span is the parent of the job's own span),
then checks what it printed and says "as expected" (exit status 1 otherwise).
"""

from __future__ import annotations

import asyncio
import os
import sys
import uuid

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    HistogramDataPoint,
    InMemoryMetricReader,
    NumberDataPoint,
)
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import asynclock
import asynclock.otel


async def demo(lock_url: str) -> bool:
    reader = InMemoryMetricReader()
    exporter = InMemorySpanExporter()
    meter_provider = MeterProvider(metric_readers=[reader])
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = tracer_provider.get_tracer("example")

    async with asynclock.connect(lock_url) as locks:
        asynclock.otel.instrument(
            locks, meter_provider=meter_provider, tracer_provider=tracer_provider
        )

        async def job(account: int) -> None:
            async with locks.lock(f"account:{account}", ttl=10, timeout=10):
                with tracer.start_as_current_span("settle"):
                    await asyncio.sleep(0.02)

        await asyncio.gather(*(job(account) for account in (1001, 1001, 1001, 2002, 2002)))

    data = reader.get_metrics_data()
    assert data is not None
    acquired = 0
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                print(f"{metric.name} ({metric.unit})")
                for point in metric.data.data_points:
                    attributes = dict(point.attributes or {})
                    if isinstance(point, HistogramDataPoint):
                        value = f"count={point.count} sum={point.sum:.3f}"
                        if metric.name == "asynclock.acquire.duration":
                            acquired += point.count
                    elif isinstance(point, NumberDataPoint):
                        value = f"value={point.value}"
                    else:  # exponential histograms: none here
                        continue
                    print(f"    {attributes} {value}")
    spans = exporter.get_finished_spans()
    holds = {span.context.span_id for span in spans if span.name == "asynclock.hold"}
    nested = [span for span in spans if span.name == "settle" and span.parent is not None]
    print(f"spans: {sorted({span.name for span in spans})}")
    meter_provider.shutdown()
    tracer_provider.shutdown()
    ok = (
        acquired == 5
        and len(holds) == 5
        and len(nested) == 5
        and all(span.parent is not None and span.parent.span_id in holds for span in nested)
    )
    print("as expected" if ok else "NOT as expected")
    return ok


def main() -> int:
    lock_url = os.environ.get("ASYNCLOCK_URL") or f"memory://otel-example-{uuid.uuid4().hex[:8]}"
    return 0 if asyncio.run(demo(lock_url)) else 1


if __name__ == "__main__":
    sys.exit(main())
