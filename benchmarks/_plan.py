"""How a run's time budget is shared between the backends and peers it measures.

Every backend gets a share of what is left when its turn comes (a peer half a share: it only
times latency and contention), so that a quick run measures all of them with fewer iterations
each instead of spending the budget on the first few and skipping the rest. Time a backend
leaves unused goes to the ones after it.

Within a share, the phases the summary table shows (floor, uncontended latency, the 8-task
contention run, one lease loss) always run, with their timing loops cut to fit the share; the
others (more contention runs, processes, memory, renewal) run only while the share lasts.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

#: What a peer's share weighs against a backend's (a peer runs two of a backend's phases).
PEER_WEIGHT = 0.5


@dataclass(slots=True)
class Plan:
    """The run's measuring deadline, and the units (backends, peers) still to be measured."""

    #: ``time.monotonic()`` by which the measurements should be over.
    deadline: float
    weights: dict[str, float] = field(default_factory=dict)

    @classmethod
    def make(
        cls, deadline: float, backends: list[str], peers: list[str], alternated: Sequence[str] = ()
    ) -> Plan:
        weights = {f"backend {name}": 1.0 for name in backends}
        weights.update({f"peer {name}": PEER_WEIGHT for name in peers})
        weights.update({f"alternated {name}": PEER_WEIGHT for name in alternated})
        return cls(deadline, weights)

    def share(self, unit: str) -> float:
        """The deadline of ``unit`` ("backend NAME", "peer NAME", or "alternated NAME": a peer's
        rounds against its backend, ``_alternate``), which starts now: its weight's part of the
        time left. Each unit gets one share; asking again is an error."""
        weight = self.weights.pop(unit)
        now = time.monotonic()
        left = max(0.0, self.deadline - now)
        total = weight + sum(self.weights.values())
        return now + left * weight / total

    def per_backend(self) -> float:
        """The seconds a backend would get if the time left were shared out now (progress)."""
        total = sum(self.weights.values())
        left = max(0.0, self.deadline - time.monotonic())
        return left / total if total else left
