"""What happens to a client's locks, told to whoever listens: metrics, traces, connection state.

The core calls one :class:`Events` hub per client at each point worth observing (an acquire
ending, a body entered and left, a release, a renewal round trip, a loss). Observers subscribe
to the hub. With none subscribed, each point costs one attribute test: the hub is falsy.

Observers run inline, in the task where the event happened, and must not block or raise; an
observer that raises is logged and dropped, never allowed to break a lock.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

logger = logging.getLogger("asynclock")

#: How an acquire ended.
AcquireOutcome = Literal["acquired", "busy", "timeout", "deadlock", "error", "cancelled"]
#: Why a lease was lost: the local deadline passed without a renewal, or the server proved it
#: gone.
LossKind = Literal["deadline", "server"]
#: How a renewal round trip ended, for the leases in it.
RenewalOutcome = Literal["renewed", "failed", "lost"]


class ConnectionState(enum.Enum):
    """A client's view of its lock server, from its own traffic (as Curator's states).

    ``SUSPENDED``: calls are failing (unreachable, timing out), but the leases held are still
    inside their local deadlines. ``LOST``: while suspended, a held lease reached its deadline
    and was given up. ``RECONNECTED``: a call succeeded again after SUSPENDED or LOST.
    """

    CONNECTED = "connected"
    SUSPENDED = "suspended"
    LOST = "lost"
    RECONNECTED = "reconnected"
    CLOSED = "closed"

    @property
    def connected(self) -> bool:
        """True when the last call reached the server."""
        return self in (ConnectionState.CONNECTED, ConnectionState.RECONNECTED)


@dataclass(frozen=True, slots=True)
class StateChange:
    """One change of :class:`ConnectionState`: from ``previous`` to ``state``, and why."""

    previous: ConnectionState
    state: ConnectionState
    reason: str
    #: ``anyio.current_time()`` when it changed.
    at: float


@dataclass(frozen=True, slots=True)
class Source:
    """Which client an event comes from: what observers put on their metrics."""

    #: The backend's URL scheme (``redis``, ``etcd``, ...).
    backend: str
    #: The backend's ``describe()``: its address, without credentials.
    address: str


class Observer:
    """Subscribe a subclass to a client's hub (``client._events.subscribe``) to be told what
    happens. Every method has a default that does nothing; override what you need.

    ``at`` and ``started`` are ``anyio.current_time()`` values; durations are seconds.
    """

    def acquired(
        self, source: Source, name: str, outcome: AcquireOutcome, wait: float, token: int | None
    ) -> None:
        """An acquire ended (its wait included)."""

    def waiting(self, source: Source, name: str, delta: int) -> None:
        """A task began (+1) or ended (-1) waiting for a held lock."""

    def body_entered(self, source: Source, name: str, token: int | None) -> Any:
        """The body of ``async with locks.lock(name)`` starts; what is returned is handed to
        :meth:`body_exited` (a span, say)."""
        return None

    def body_exited(self, source: Source, handle: Any, error: BaseException | None) -> None:
        """That body ended, with the exception ``async with`` raises (None when none)."""

    def released(self, source: Source, name: str, held: float, lost: bool) -> None:
        """A lease ended: ``held`` seconds after it was granted, released or given up."""

    def renewed(self, source: Source, leases: int, latency: float, outcome: RenewalOutcome) -> None:
        """A renewal round trip for ``leases`` leases ended after ``latency`` seconds."""

    def lost(self, source: Source, name: str, kind: LossKind, reason: str) -> None:
        """A lease was lost."""

    def finished_after_loss(self, source: Source, name: str, reason: str) -> None:
        """A body ran to completion although its lease was lost: its result is kept
        (``async with`` does not raise), and this is where the loss is reported."""

    def state_changed(self, source: Source, change: StateChange) -> None:
        """The client's :class:`ConnectionState` changed."""


class Events:
    """One client's hub: calls each subscribed observer, in order of subscription."""

    __slots__ = ("_observers", "active", "source")

    def __init__(self, source: Source) -> None:
        self.source = source
        self._observers: list[Observer] = []
        #: Whether anyone subscribed: the core reads this on every acquire and release before
        #: doing anything for observers (an attribute, not ``__bool__``: no call on that path).
        self.active = False

    def __bool__(self) -> bool:
        return self.active

    def subscribe(self, observer: Observer) -> None:
        self._observers.append(observer)
        self.active = True

    def unsubscribe(self, observer: Observer) -> None:
        if observer in self._observers:
            self._observers.remove(observer)
        self.active = bool(self._observers)

    def emit(self, event: str, *args: Any) -> None:
        """Call ``event`` on every observer with the source and ``args``."""
        for observer in tuple(self._observers):
            self._call(observer, event, args)

    def enter_body(self, name: str, token: int | None) -> list[tuple[Observer, Any]]:
        """Tell every observer a body starts; what each returned, to hand back on exit."""
        return [
            (observer, self._call(observer, "body_entered", (name, token)))
            for observer in tuple(self._observers)
        ]

    def exit_body(
        self, handles: Sequence[tuple[Observer, Any]], error: BaseException | None
    ) -> None:
        for observer, handle in handles:
            self._call(observer, "body_exited", (handle, error))

    def _call(self, observer: Observer, event: str, args: tuple[Any, ...]) -> Any:
        try:
            return getattr(observer, event)(self.source, *args)
        except Exception:
            logger.exception(
                "asynclock: observer %r failed on %s; it is unsubscribed", observer, event
            )
            self.unsubscribe(observer)
            return None
