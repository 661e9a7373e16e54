"""The performance targets of issue #18, checked against one run's results.

Every target is a ratio or a bound within one run (ours beside the floor or the peer, on the same
server), so that a loaded machine moves both sides. A row says what was measured, whether the
target was met, and by how much it was missed; a target whose figures are missing (a backend not
installed, a run without ``--peers``, a phase cut by the budget) says "not measured" and why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: (contenders, hold in ms) of the contention run a target reads.
Run = tuple[int, float]


@dataclass(frozen=True)
class Figure:
    """One number read from the results, with what it is."""

    value: float
    text: str


def _ms(value: float) -> str:
    return f"{value:.3g} ms"


def _record(entry: dict[str, Any] | None, run: Run) -> dict[str, Any] | None:
    records = entry.get("contention_tasks") if isinstance(entry, dict) else None
    if not isinstance(records, list):
        return None
    contenders, hold = run
    for record in records:
        if record.get("contenders") == contenders and abs(record.get("hold_ms", -1) - hold) < 1e-6:
            found: dict[str, Any] = record
            return found
    return None


def _measured(entry: Any) -> bool:
    return isinstance(entry, dict) and entry.get("status") == "measured"


def _p50(record: Any) -> float | None:
    if isinstance(record, dict) and "error" not in record and "skipped" not in record:
        value = record.get("p50_ms")
        if isinstance(value, (int, float)) and value > 0:
            return float(value)
    return None


class Goals:
    """Reads one run's JSON and evaluates each target into report rows."""

    def __init__(self, data: dict[str, Any]) -> None:
        self._backends: dict[str, Any] = data.get("backends", {})
        self._peers: dict[str, Any] = data.get("peers", {})
        self.rows: list[dict[str, Any]] = []

    def _why_missing(self, backend: str, peer: str | None = None) -> str:
        entry = self._backends.get(backend, {})
        if not _measured(entry):
            return f"not measured ({entry.get('reason', 'backend not run')})"
        if peer is not None and not _measured(self._peers.get(peer)):
            state = self._peers.get(peer, {})
            return f"not measured ({state.get('reason', 'peer not run: use --peers')})"
        return "not measured (a phase was cut or failed: see the full report)"

    def _row(
        self,
        backend: str,
        target: str,
        ours: Figure | None,
        bound: Figure | None,
        *,
        at_most: bool,
        peer: str | None = None,
    ) -> None:
        """``ours`` must be at most (``at_most``) or at least ``bound``."""
        if ours is None or bound is None:
            self.rows.append(
                {
                    "backend": backend,
                    "target": target,
                    "measured": self._why_missing(backend, peer),
                    "met": None,
                }
            )
            return
        met = ours.value <= bound.value if at_most else ours.value >= bound.value
        measured = f"{ours.text} vs {bound.text}"
        if not met and bound.value > 0:
            off = ours.value / bound.value - 1 if at_most else 1 - ours.value / bound.value
            measured += f"; missed by {off:.0%}"
        self.rows.append({"backend": backend, "target": target, "measured": measured, "met": met})

    # -- what the targets read ----------------------------------------------------------------

    def latency_ratio(self, backend: str, against: str, most: float, label: str) -> None:
        """Uncontended p50 at most ``most`` times the p50 of ``against`` (floor or pair)."""
        entry = self._backends.get(backend, {})
        ours = _p50(entry.get("uncontended")) if _measured(entry) else None
        theirs = _p50(entry.get(against)) if _measured(entry) else None
        self._row(
            backend,
            f"uncontended p50 <= {most:g}x {label}",
            Figure(ours, _ms(ours)) if ours else None,
            Figure(theirs * most, f"{most:g} x {_ms(theirs)}") if theirs else None,
            at_most=True,
        )

    def handoff_bound(
        self, backend: str, run: Run, key: str, most: Callable[[], float | None], label: str
    ) -> None:
        """Hand-over ``key`` (p50_ms / p99_ms) of ``run`` at most ``most()`` ms."""
        record = _record(self._backends.get(backend), run)
        value = record["handoff"].get(key) if record else None
        bound = most()
        self._row(
            backend,
            f"{run[0]}-task hand-over {key[:3]} <= {label}",
            Figure(value, _ms(value)) if isinstance(value, (int, float)) else None,
            Figure(bound, _ms(bound)) if bound is not None else None,
            at_most=True,
        )

    def against_peer(
        self, backend: str, peer: str, run: Run, what: str, share: float = 1.0
    ) -> None:
        """Throughput (``what="per_second"``, at least ``share`` of the peer's) or hand-over p99
        (``what="p99_ms"``, at most the peer's) in the same contention run."""
        ours = _record(self._backends.get(backend), run)
        theirs = _record(self._peers.get(peer), run)
        contenders = run[0]
        if what == "per_second":
            mine = ours.get("per_second") if ours else None
            other = theirs.get("per_second") if theirs else None
            factor = "" if share == 1.0 else f"{share:g}x "
            self._row(
                backend,
                f"{contenders}-task acquisitions/s >= {factor}{peer}'s",
                Figure(mine, f"{mine:.0f}/s") if isinstance(mine, (int, float)) else None,
                Figure(other * share, f"{factor}{other:.0f}/s")
                if isinstance(other, (int, float))
                else None,
                at_most=False,
                peer=peer,
            )
            return
        mine = ours["handoff"].get(what) if ours else None
        other = theirs["handoff"].get(what) if theirs else None
        self._row(
            backend,
            f"{contenders}-task hand-over {what[:3]} <= {peer}'s",
            Figure(mine, _ms(mine)) if isinstance(mine, (int, float)) else None,
            Figure(other, _ms(other)) if isinstance(other, (int, float)) else None,
            at_most=True,
            peer=peer,
        )

    def fair(self, backend: str, run: Run) -> None:
        """Retaken share <= 5 % and no worker under 80 % of the mean, in ``run``."""
        record = _record(self._backends.get(backend), run)
        retaken = record.get("retaken_share") if record else None
        self._row(
            backend,
            f"{run[0]}-task fairness: retaken <= 5 %",
            Figure(retaken, f"{retaken:.1%}") if isinstance(retaken, (int, float)) else None,
            Figure(0.05, "5 %"),
            at_most=True,
        )
        lowest = record.get("min_per_worker") if record else None
        total = record.get("acquisitions") if record else None
        mean = total / run[0] if isinstance(total, (int, float)) and total else None
        self._row(
            backend,
            f"{run[0]}-task fairness: no worker under 80 % of the mean",
            Figure(lowest, f"{lowest} (lowest worker)") if isinstance(lowest, int) else None,
            Figure(mean * 0.8, f"0.8 x {mean:.0f}") if mean else None,
            at_most=False,
        )

    def floor_p50(self, backend: str, times: float) -> Callable[[], float | None]:
        def bound() -> float | None:
            entry = self._backends.get(backend, {})
            floor = _p50(entry.get("floor")) if _measured(entry) else None
            return floor * times if floor else None

        return bound


def evaluate(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Every issue #18 target, in the order the issue lists them."""
    goals = Goals(data)
    eight, two = (8, 0.0), (2, 0.0)
    # PostgreSQL: near the bare advisory pair, and near asyncpg under contention.
    goals.latency_ratio("postgres", "pair", 1.3, "the bare asyncpg advisory pair")
    goals.against_peer("postgres", "asyncpg advisory pair", eight, "per_second", share=0.8)
    goals.handoff_bound("postgres", eight, "p99_ms", lambda: 1.0, "1 ms")
    # Redis: as fast as python-redis-lock, fair, and a hand-over near one round trip.
    goals.against_peer("redis", "python-redis-lock", eight, "per_second")
    goals.fair("redis", eight)
    goals.handoff_bound("redis", eight, "p50_ms", goals.floor_p50("redis", 2.0), "2 x PING")
    # etcd: at or ahead of aetcd's lock under contention.
    for run in (two, eight):
        goals.against_peer("etcd", "aetcd Lock", run, "per_second")
        goals.against_peer("etcd", "aetcd Lock", run, "p99_ms")
    # The core: lock() + release on memory:// within 3x anyio.Lock.
    goals.latency_ratio("memory", "pair", 3.0, "anyio.Lock")
    return goals.rows
