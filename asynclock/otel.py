"""OpenTelemetry metrics and spans for a lock client (the optional extra ``asynclock[otel]``).

::

    import asynclock.otel

    async with asynclock.connect(url) as locks:
        instrumentation = asynclock.otel.instrument(locks)
        ...
        instrumentation.uninstrument()  # optional: closing the client ends the events anyway

Only the OpenTelemetry *API* is used: without providers passed in, the global ones
(``opentelemetry.metrics.get_meter_provider()``, ``opentelemetry.trace.get_tracer_provider()``)
are used, which record nothing until an SDK is configured. Nothing else in asynclock imports this
module, so a program that does not import it pays nothing for it.

Metric attributes carry the backend's URL scheme and a *template* of the lock name, never the
raw name: ``account:12345`` becomes ``account:{}``, so that one time series is made per kind of
lock, not one per account (see :func:`default_name_template`, and ``name_template`` to choose
another). The metrics, spans and attributes are listed in docs/observability.md.
"""

from __future__ import annotations

import functools
import math
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio

from ._errors import LeaseLost, MissingDependency
from ._events import AcquireOutcome, LossKind, Observer, RenewalOutcome, Source, StateChange

try:
    from opentelemetry import context as otel_context
    from opentelemetry import metrics, trace
    from opentelemetry.trace import Span, SpanKind, Status, StatusCode
except ImportError as exc:  # pragma: no cover - the tests run with the SDK installed
    raise MissingDependency(
        "asynclock.otel needs the OpenTelemetry API: pip install 'asynclock[otel]'"
    ) from exc

if TYPE_CHECKING:
    from ._client import LockClient

__all__ = ("Instrumentation", "default_name_template", "instrument")

#: The instrumentation scope's name (``InstrumentationScope.name`` on every metric and span).
SCOPE = "asynclock"

# Attribute keys, named as OpenTelemetry's semantic conventions name their own (dotted,
# namespaced, snake_case).
BACKEND = "asynclock.backend"
LOCK_NAME = "asynclock.lock.name"
OUTCOME = "asynclock.outcome"
TOKEN = "asynclock.token"
LOST = "asynclock.lease.lost"
LOSS_KIND = "asynclock.loss.kind"
STATE = "asynclock.connection.state"
PREVIOUS_STATE = "asynclock.connection.previous_state"

# Spans end with an error status for these acquire outcomes; "busy" (try_acquire's expected
# answer) and "cancelled" (the caller's own decision) are not errors of the lock.
_FAILED_ACQUIRES = frozenset({"timeout", "deadlock", "error"})

# Every instrument once: the attribute that holds it, its kind (``meter.create_<kind>``), name,
# unit and description (docs/observability.md lists them for users).
_INSTRUMENTS = (
    ("_acquire", "histogram", "asynclock.acquire.duration", "s",
     "Time from asking for a lock to the answer (its wait included)."),
    ("_hold", "histogram", "asynclock.hold.duration", "s",
     "Time from a lease's grant to its release or loss."),
    ("_renewal", "histogram", "asynclock.renewal.duration", "s",
     "Latency of one renewal round trip (for all leases it renews)."),
    ("_renewal_failures", "counter", "asynclock.renewal.failures", "{renewal}",
     "Renewal round trips that renewed nothing: failed, or proved a loss."),
    ("_lost", "counter", "asynclock.leases.lost", "{lease}",
     "Leases lost before their release, by kind (deadline or server)."),
    ("_finished_after_loss", "counter", "asynclock.leases.finished_after_loss", "{lease}",
     "Bodies that ran to completion before their lease's loss was known."),
    ("_waiters", "up_down_counter", "asynclock.waiters", "{waiter}",
     "Tasks waiting for a held lock."),
    ("_state_changes", "counter", "asynclock.connection.state_changes", "{change}",
     "Changes of the client's connection state, by the state entered."),
)  # fmt: skip

_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
# A whole word of 8 hex digits or more: a hash, an object id (no English word is that long in
# hex letters alone, so names such as "deadline" or "cafe" are left alone).
_HEX = re.compile(r"(?<![0-9A-Za-z_])[0-9a-fA-F]{8,}(?![0-9A-Za-z_])")
_DIGITS = re.compile(r"\d+")


@functools.lru_cache(maxsize=4096)
def default_name_template(name: str) -> str:
    """The name with what varies per instance replaced by ``{}``: UUIDs, words of 8 or more hex
    digits, then every run of digits.

    >>> default_name_template("account:12345")
    'account:{}'
    >>> default_name_template("job/3f2b9c1e-8d4a-4b6e-9f0a-1c2d3e4f5a6b/step-2")
    'job/{}/step-{}'
    >>> default_name_template("cache:deadbeefcafe")
    'cache:{}'
    >>> default_name_template("migrations")
    'migrations'

    A name that varies in other ways (``user:alice``) still makes one series per value: pass
    your own ``name_template`` then, such as ``lambda name: name.partition(":")[0]``.
    """
    name = _UUID.sub("{}", name)
    name = _HEX.sub("{}", name)
    return _DIGITS.sub("{}", name)


class Instrumentation(Observer):
    """Records one client's lock events as OpenTelemetry metrics and spans.

    Made by :func:`instrument`; :meth:`uninstrument` stops it. Its methods are the
    :class:`~asynclock._events.Observer` callbacks the client calls: not for you to call.
    """

    # Made in __init__ from _INSTRUMENTS.
    _acquire: metrics.Histogram
    _hold: metrics.Histogram
    _renewal: metrics.Histogram
    _renewal_failures: metrics.Counter
    _lost: metrics.Counter
    _finished_after_loss: metrics.Counter
    _waiters: metrics.UpDownCounter
    _state_changes: metrics.Counter

    def __init__(
        self,
        client: LockClient,
        *,
        meter_provider: metrics.MeterProvider | None = None,
        tracer_provider: trace.TracerProvider | None = None,
        name_template: Callable[[str], str] = default_name_template,
    ) -> None:
        self._client = client
        self._template = name_template
        meter = metrics.get_meter(SCOPE, meter_provider=meter_provider)
        self._tracer = trace.get_tracer(SCOPE, tracer_provider=tracer_provider)
        for attribute, kind, name, unit, description in _INSTRUMENTS:
            create = getattr(meter, f"create_{kind}")
            setattr(self, attribute, create(name, unit=unit, description=description))
        # The body spans open now, by lock name: a loss (told from the renewal task) is added to
        # them as an event when it happens, not only when the body ends.
        self._bodies: dict[str, list[Span]] = {}
        # The core times an acquire only when someone observes as it begins: one that began
        # before this subscription is reported as lasting since the clock's zero. Such a wait
        # is longer than we have been subscribed, which is how it is recognised and left out.
        try:
            self._since = anyio.current_time()
        except Exception:  # made outside any event loop: no acquire can be in flight yet
            self._since = -math.inf
        client._events.subscribe(self)

    def uninstrument(self) -> None:
        """Stop recording (idempotent). Spans already open still end when their body does."""
        self._client._events.unsubscribe(self)

    def _attributes(self, source: Source, name: str) -> dict[str, Any]:
        return {BACKEND: source.backend, LOCK_NAME: self._template(name)}

    # Observer callbacks.

    def acquired(
        self, source: Source, name: str, outcome: AcquireOutcome, wait: float, token: int | None
    ) -> None:
        if wait > anyio.current_time() - self._since:
            return  # began before we subscribed: its start is unknown (see __init__)
        attributes = self._attributes(source, name)
        self._acquire.record(wait, {**attributes, OUTCOME: outcome})
        # Told when the acquire has ended: the span is made then, starting when it began.
        end = time.time_ns()
        span = self._tracer.start_span(
            "asynclock.acquire",
            kind=SpanKind.INTERNAL,
            attributes={**attributes, OUTCOME: outcome},
            start_time=end - int(wait * 1e9),
        )
        if token is not None:
            span.set_attribute(TOKEN, token)
        if outcome in _FAILED_ACQUIRES:
            span.set_status(Status(StatusCode.ERROR, f"acquire ended: {outcome}"))
        span.end(end)

    def waiting(self, source: Source, name: str, delta: int) -> None:
        self._waiters.add(delta, self._attributes(source, name))

    def body_entered(self, source: Source, name: str, token: int | None) -> Any:
        attributes = self._attributes(source, name)
        if token is not None:
            attributes[TOKEN] = token
        span = self._tracer.start_span(
            "asynclock.hold", kind=SpanKind.INTERNAL, attributes=attributes
        )
        # Made current so that the body's own spans are its children. ``async with`` enters and
        # exits in the same task (the same context), where body_exited detaches it again.
        context_token = otel_context.attach(trace.set_span_in_context(span))
        self._bodies.setdefault(name, []).append(span)
        return (name, span, context_token)

    def body_exited(self, source: Source, handle: Any, error: BaseException | None) -> None:
        name, span, context_token = handle
        otel_context.detach(context_token)
        open_spans = self._bodies.get(name, [])
        if span in open_spans:
            open_spans.remove(span)
            if not open_spans:
                del self._bodies[name]
        if isinstance(error, LeaseLost):
            span.record_exception(error)
            span.set_status(Status(StatusCode.ERROR, f"lease lost: {error.reason}"))
        elif isinstance(error, Exception):
            span.record_exception(error)
            span.set_status(Status(StatusCode.ERROR, f"{type(error).__qualname__}: {error}"))
        elif error is not None:  # cancelled from outside, or KeyboardInterrupt: not a failure
            span.set_attribute("error.type", type(error).__qualname__)
        span.end()

    def released(self, source: Source, name: str, held: float, lost: bool) -> None:
        self._hold.record(held, {**self._attributes(source, name), LOST: lost})

    def renewed(self, source: Source, leases: int, latency: float, outcome: RenewalOutcome) -> None:
        attributes = {BACKEND: source.backend, OUTCOME: outcome}
        self._renewal.record(latency, attributes)
        if outcome != "renewed":
            self._renewal_failures.add(1, attributes)

    def lost(self, source: Source, name: str, kind: LossKind, reason: str) -> None:
        self._lost.add(1, {**self._attributes(source, name), LOSS_KIND: kind})
        for span in self._bodies.get(name, ()):
            span.add_event("asynclock.lease.lost", {LOSS_KIND: kind, "asynclock.reason": reason})

    def finished_after_loss(self, source: Source, name: str, reason: str) -> None:
        self._finished_after_loss.add(1, self._attributes(source, name))
        for span in self._bodies.get(name, ()):
            # The body's result is kept, so its span is not an error; the loss is on it.
            span.set_attribute("asynclock.lease.lost_after_completion", True)
            span.add_event("asynclock.lease.finished_after_loss", {"asynclock.reason": reason})

    def state_changed(self, source: Source, change: StateChange) -> None:
        self._state_changes.add(
            1,
            {
                BACKEND: source.backend,
                STATE: change.state.value,
                PREVIOUS_STATE: change.previous.value,
            },
        )


def instrument(
    client: LockClient,
    *,
    meter_provider: metrics.MeterProvider | None = None,
    tracer_provider: trace.TracerProvider | None = None,
    name_template: Callable[[str], str] = default_name_template,
) -> Instrumentation:
    """Record ``client``'s lock events as OpenTelemetry metrics and spans, until
    :meth:`Instrumentation.uninstrument`.

    :param meter_provider: where the metrics go; the global meter provider by default.
    :param tracer_provider: where the spans go; the global tracer provider by default.
    :param name_template: maps a lock name to the value of the ``asynclock.lock.name``
        attribute. It must have few distinct values (one time series is made per value):
        :func:`default_name_template` by default. It must not raise: an observer that raises
        is unsubscribed (and logged).

    Instrumenting one client twice records everything twice; instrument each client once.
    """
    return Instrumentation(
        client,
        meter_provider=meter_provider,
        tracer_provider=tracer_provider,
        name_template=name_template,
    )
