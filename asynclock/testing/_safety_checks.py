"""The checks of a safety run: what the workers' histories and the resource's log show.

Locks and elections (a read-modify-write counter behind a token guard):

- lost updates: writes accepted minus the final counter (two holders wrote the same value);
- stale writes accepted: writes whose token is lower than one the resource had already accepted;
- overlapping / overtaken holds: what a lease alone cannot prevent.

Semaphores (each hold enters and exits the resource, behind a permit guard): the *span* of a
token at the resource runs from its first accepted access to its last, in commit order; more
than ``permits`` spans open at once is what a semaphore must prevent, and what a holder paused
past its ttl does without a guard (its exit lands after its permit went to another).

Tokens (``token_errors``): for a lock and an election, each hold's token is larger than the one
of the hold before it (the terms' tokens rise); for a semaphore, no token is given twice.
"""

from __future__ import annotations

import itertools
from typing import Any

from ._safety_config import SafetyReport


def _holds(
    report: SafetyReport, histories: list[list[dict[str, Any]]]
) -> tuple[list[tuple[int, float, float]], list[int]]:
    """(worker, start, end) of every hold that ended, and the holds' tokens in the order they
    were taken; counts acquisitions, writes and losses on the way."""
    holds: list[tuple[int, float, float]] = []
    acquired: list[tuple[float, int]] = []
    for worker, events in enumerate(histories):
        start: dict[str, Any] | None = None
        end: float | None = None
        for event in events:
            op = event["op"]
            if op == "acquire":
                start, end = event, None
                report.holds += 1
                if event.get("token") is not None:
                    acquired.append((event["t"], event["token"]))
            elif op == "write":
                if event["ok"]:
                    report.writes_accepted += 1
                else:
                    report.writes_refused += 1
            elif op == "end":
                end = event["t"]
            elif op in ("release", "lost") and start is not None:
                holds.append((worker, start["t"], end if end is not None else event["t"]))
                if op == "lost":
                    report.lost_leases += 1
                    report.cancel_margins.append(start["expires"] - (end or event["t"]))
                start = None
            elif op == "error":
                report.errors.append(event["reason"])
    return holds, [token for _, token in sorted(acquired)]


def check_lock(
    report: SafetyReport, histories: list[list[dict[str, Any]]], log: list[tuple[int | None, int]]
) -> None:
    """A lock's or an election's run: a read-modify-write counter behind a token guard."""
    holds, tokens = _holds(report, histories)
    # One holder at a time: each hold's token is larger than the one before it.
    report.token_errors = sum(later <= earlier for earlier, later in itertools.pairwise(tokens))
    holds.sort(key=lambda hold: hold[1])
    overlapping: set[int] = set()
    overtaken: set[int] = set()
    for index, (worker, _, end_t) in enumerate(holds):
        for later in range(index + 1, len(holds)):
            other_worker, other_start, _ = holds[later]
            if other_start >= end_t:
                break
            if other_worker != worker:
                overlapping.update((index, later))
                overtaken.add(index)
    report.overlapping_holds = len(overlapping)
    report.overtaken_holds = len(overtaken)
    report.final_value = log[-1][1] if log else 0
    report.lost_updates = len(log) - report.final_value
    highest: int | None = None
    for token, _ in log:
        if token is None:
            continue
        if highest is not None and token < highest:
            report.stale_writes_accepted += 1
        highest = token if highest is None else max(highest, token)


def most_at_once(intervals: list[tuple[float, float]]) -> int:
    """The largest number of the closed intervals that share a moment."""
    edges = sorted([(start, 0) for start, _ in intervals] + [(end, 1) for _, end in intervals])
    open_now = most = 0
    for _, closing in edges:
        open_now += -1 if closing else 1
        most = max(most, open_now)
    return most


def check_permits(
    report: SafetyReport, histories: list[list[dict[str, Any]]], log: list[tuple[int | None, str]]
) -> None:
    """A semaphore's run: at most ``permits`` tokens' spans open at once at the resource."""
    holds, tokens = _holds(report, histories)
    # Permits are held side by side, so their order of taking is not known here: each token
    # must only be unique.
    report.token_errors = len(tokens) - len(set(tokens))
    report.most_holds_at_once = most_at_once([(start, end) for _, start, end in holds])
    spans: dict[int | None, list[int]] = {}
    for seq, (token, _) in enumerate(log):
        spans.setdefault(token, [seq, seq])[1] = seq
    report.final_value = len(log)
    report.most_writers_at_once = most_at_once([(first, last) for first, last in spans.values()])
    # The accesses that found more than `permits` spans open (counting their own).
    report.stale_writes_accepted = sum(
        sum(first <= seq <= last for first, last in spans.values()) > report.config.permits
        for seq in range(len(log))
    )
