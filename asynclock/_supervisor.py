"""The renewal loop: one task per client keeps every held lease alive, in batched round trips."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import anyio

from ._events import Events
from ._lease import Lease
from ._renewal import RENEWAL
from ._state import StateTracker
from .abc import Backend, Grant, Lost, Renewed, RenewOutcome, Unknown

logger = logging.getLogger("asynclock")


class Supervisor:
    """Renews leases on the schedule of :data:`asynclock._renewal.RENEWAL` and ends them when
    renewal proves loss.

    Leases that fall due close together are renewed in one ``Backend.renew`` call (the policy's
    batch window), so the phases of many leases converge and 10,000 held locks cost one round
    trip per interval on backends that batch.

    A renewal call is bounded by the earliest deadline in its batch: a server that hangs cannot
    hold the loop past the moment the lease must be given up. Deadlines themselves do not depend on
    this loop at all (the client's ``Deadlines`` task in :mod:`asynclock._scope` enforces them), so a
    stuck loop never delays a cancellation.
    """

    def __init__(self, backend: Backend[Grant], events: Events, state: StateTracker) -> None:
        self._backend = backend
        self._events = events
        self._state = state
        self._leases: set[Lease] = set()
        #: The loop's sleep, and when it ends. A lease due earlier moves that deadline instead
        #: of waking the loop: acquiring costs the renewal task nothing until a renewal is due.
        self._sleep: anyio.CancelScope | None = None
        self._next_look = math.inf
        #: When the renewal in flight counts as unanswered (inf: none in flight), and the
        #: watcher's sleep until then (``watch``).
        self._suspect_at = math.inf
        self._suspect_sleep: anyio.CancelScope | None = None
        self._suspect_leases = 0
        #: Round trips made, for benchmarks and tests that check batching.
        self.renew_calls = 0

    def add(self, lease: Lease) -> None:
        self._leases.add(lease)
        if lease.next_renewal < self._next_look:
            self._next_look = lease.next_renewal
            if self._sleep is not None:
                self._sleep.deadline = lease.next_renewal

    def discard(self, lease: Lease) -> None:
        self._leases.discard(lease)

    @property
    def leases(self) -> frozenset[Lease]:
        return frozenset(self._leases)

    async def run(self) -> None:
        while True:
            self._leases = {lease for lease in self._leases if lease.held}
            batch = self._due(anyio.current_time())
            if not batch:
                # A lease being extended is looked at again when the extend ends (add()).
                self._next_look = min(
                    (lease.next_renewal for lease in self._leases if not lease.busy),
                    default=math.inf,
                )
                with anyio.move_on_at(self._next_look) as self._sleep:
                    await anyio.sleep_forever()
                self._sleep = None
                continue
            self._next_look = -math.inf  # busy renewing: it looks again right after
            await self._renew(batch)

    def _due(self, now: float) -> list[Lease]:
        due = [lease for lease in self._leases if lease.next_renewal <= now and not lease.busy]
        if not due:
            return []
        return [
            lease
            for lease in self._leases
            if RENEWAL.joins_batch(lease.next_renewal, lease.ttl, now)
            and not lease.lost
            and not lease.busy  # an extend() in flight renews it
        ]

    async def _renew(self, batch: Sequence[Lease]) -> None:
        for lease in batch:
            lease.busy = True
        try:
            await self._renew_batch(batch)
        finally:
            for lease in batch:
                lease._set_idle()

    async def _renew_batch(self, batch: Sequence[Lease]) -> None:
        outcomes: Sequence[RenewOutcome] | None = None
        self.renew_calls += 1
        started = anyio.current_time()
        # A renewal that hangs says the server is unreachable long before it times out.
        self._suspect(
            started + RENEWAL.suspect_after(min(lease.ttl for lease in batch)), len(batch)
        )
        try:
            with anyio.move_on_at(min(lease.deadline for lease in batch)):
                try:
                    outcomes = await self._backend.renew([lease.grant for lease in batch])
                except Exception as exc:
                    logger.info("asynclock: renewal of %d lease(s) failed: %r", len(batch), exc)
                    outcomes = [Unknown(exc)] * len(batch)
        finally:
            self._suspect(math.inf, 0)
        if outcomes is None:
            outcomes = [Unknown(TimeoutError("renewal did not answer before the deadline"))] * len(
                batch
            )
        if len(outcomes) != len(batch):
            raise RuntimeError(
                f"{type(self._backend).__name__}.renew returned {len(outcomes)} outcomes "
                f"for {len(batch)} grants"
            )
        now = anyio.current_time()
        self._report(outcomes, now - started)
        for lease, outcome in zip(batch, outcomes, strict=True):
            match outcome:
                case Renewed(valid_from=valid_from, ttl=ttl):
                    lease._extend(valid_from, ttl)
                case Lost(reason=reason):
                    if lease.held:
                        lease._mark_lost(reason)
                case Unknown():
                    lease.next_renewal = RENEWAL.retry_at(now, lease.ttl)

    def _suspect(self, at: float, leases: int) -> None:
        """Have ``watch`` report the server unreachable at ``at`` (inf: not at all)."""
        self._suspect_at = at
        self._suspect_leases = leases
        if self._suspect_sleep is not None:
            self._suspect_sleep.deadline = at

    async def watch(self) -> None:
        """Turn the client's state SUSPENDED when a renewal goes unanswered past its time.

        One task for the client's life, whose sleep each renewal moves (two timer changes): a
        task and a task group per renewal made about half of a quiet renewal's Python calls."""
        while True:
            with anyio.move_on_at(self._suspect_at) as self._suspect_sleep:
                await anyio.sleep_forever()
            self._suspect_sleep = None
            # A renewal that ended meanwhile reset the time: its answer counts, not the sleep.
            if anyio.current_time() >= self._suspect_at:
                leases, self._suspect_at = self._suspect_leases, math.inf
                self._state.reached(
                    False,
                    TimeoutError(f"a renewal of {leases} lease(s) has not been answered yet"),
                )

    def _report(self, outcomes: Sequence[RenewOutcome], latency: float) -> None:
        # Any answer from the server (renewed or proven lost) shows it reachable; only a round
        # trip in which every outcome is unknown counts as a failed call.
        unknown = [outcome for outcome in outcomes if isinstance(outcome, Unknown)]
        reached = len(unknown) < len(outcomes)
        self._state.reached(reached, None if reached else unknown[0].error)
        if self._events.active:
            lost = any(isinstance(outcome, Lost) for outcome in outcomes)
            result = "lost" if lost else "renewed" if reached else "failed"
            self._events.emit("renewed", len(outcomes), latency, result)
