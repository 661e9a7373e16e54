"""Summaries of timings, and what a sequence of holds says about a lock under contention."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: Below this many samples a median is not reported (the table says "n/a"), and a timing loop
#: does not stop on its time cap (``_contend.time_op``).
MIN_P50_SAMPLES = 10


def percentile(sorted_values: Sequence[float], share: float) -> float:
    """The ``share`` (0-1) percentile of already sorted values, by linear interpolation."""
    if not sorted_values:
        return math.nan
    position = (len(sorted_values) - 1) * share
    low = math.floor(position)
    high = math.ceil(position)
    fraction = position - low
    return sorted_values[low] * (1 - fraction) + sorted_values[high] * fraction


def summarize(seconds: Sequence[float]) -> dict[str, Any]:
    """Count, p50/p90/p99, mean and extremes of durations given in seconds, as milliseconds."""
    ordered = sorted(seconds)
    if not ordered:
        return {"n": 0}
    return {
        "n": len(ordered),
        "p50_ms": percentile(ordered, 0.50) * 1e3,
        "p90_ms": percentile(ordered, 0.90) * 1e3,
        "p99_ms": percentile(ordered, 0.99) * 1e3,
        "mean_ms": sum(ordered) / len(ordered) * 1e3,
        "min_ms": ordered[0] * 1e3,
        "max_ms": ordered[-1] * 1e3,
    }


@dataclass(frozen=True, slots=True)
class Hold:
    """One acquisition: who, when ``acquire`` returned and when ``release`` was called, both on
    ``time.monotonic()`` (one clock for every process on a Linux host)."""

    worker: int
    acquired: float
    released: float


def analyse_holds(
    holds: Sequence[Hold], *, workers: int, started: float, ended: float
) -> dict[str, Any]:
    """Throughput, handoff latency, the releaser's retake share and starvation of one run.

    Only holds that began inside ``[started, ended)`` count: the queue drains after the end.
    A handoff is a release followed by an acquisition by a *different* worker; its latency runs
    from the moment the releaser called release to the moment the next holder's acquire returned.
    """
    inside = sorted((h for h in holds if started <= h.acquired < ended), key=lambda h: h.acquired)
    handoffs: list[float] = []
    retaken = 0
    overlaps = 0
    for before, after in itertools.pairwise(inside):
        if after.acquired < before.released:
            overlaps += 1
        if after.worker == before.worker:
            retaken += 1
        else:
            handoffs.append(after.acquired - before.released)
    counts = Counter(h.worker for h in inside)
    per_worker = [counts.get(worker, 0) for worker in range(workers)]
    pairs = max(len(inside) - 1, 0)
    elapsed = ended - started
    return {
        "acquisitions": len(inside),
        "seconds": elapsed,
        "per_second": len(inside) / elapsed if elapsed > 0 else math.nan,
        "handoff": summarize(handoffs),
        "retaken_share": retaken / pairs if pairs else math.nan,
        "min_per_worker": min(per_worker) if per_worker else 0,
        "max_per_worker": max(per_worker) if per_worker else 0,
        # Holds that overlap in time: a correct lock has none.
        "overlaps": overlaps,
    }
