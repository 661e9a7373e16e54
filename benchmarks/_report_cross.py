"""The report's sections on contention across clients and fairness (issue #29), from the JSON."""

from __future__ import annotations

from typing import Any

from . import _alternate
from ._report import CONTENTION_COLUMNS, _contention_rows, _phase_note, _table, ms, ratio

#: (key, what) of the runs across clients, in the order the report shows them.
CROSS = (
    ("contention_clients", "clients in one process"),
    ("contention_processes", "processes"),
)


def _units(data: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Each measured backend, followed by its measured peers (``+ name``)."""
    peers: dict[str, Any] = data.get("peers", {})
    out: list[tuple[str, dict[str, Any]]] = []
    for name, entry in data.get("backends", {}).items():
        if entry.get("status") == "measured":
            out.append((name, entry))
        for peer_name, peer in peers.items():
            if peer.get("compare_with") == name and peer.get("status") == "measured":
                out.append((f"+ {peer_name}", peer))
    return out


def _record(entry: dict[str, Any], key: str, contenders: int) -> dict[str, Any] | None:
    records = entry.get(key)
    if not isinstance(records, list):
        return None
    for record in records:
        if record.get("contenders") == contenders and not record.get("hold_ms"):
            found: dict[str, Any] = record
            return found
    return None


def _rate_ratio(ours: dict[str, Any] | None, theirs: dict[str, Any] | None) -> str:
    if not ours or not theirs:
        return "-"
    return ratio(ours.get("per_second"), theirs.get("per_second"))


def _handoff_pair(ours: dict[str, Any] | None, theirs: dict[str, Any] | None) -> str:
    if not ours or not theirs:
        return "-"
    mine = ours.get("handoff", {}).get("p50_ms")
    other = theirs.get("handoff", {}).get("p50_ms")
    return f"{ms(mine)} / {ms(other)}"


def _retaken(record: dict[str, Any] | None) -> str:
    share = record.get("retaken_share") if record else None
    return "-" if not isinstance(share, float) or share != share else f"{share:.0%}"


def ratio_rows(data: dict[str, Any]) -> list[list[str]]:
    """asynclock over each peer, same run: latency ratio (above 1x is slower), throughput
    ratios (below 1x is behind), hand-over p50 ours / theirs, retaken ours / theirs."""
    backends: dict[str, Any] = data.get("backends", {})
    rows = []
    for peer_name, peer in data.get("peers", {}).items():
        ours = backends.get(peer.get("compare_with", ""), {})
        if peer.get("status") != "measured" or ours.get("status") != "measured":
            continue
        row = [
            f"{peer['compare_with']} / {peer_name}",
            ratio(
                ours.get("uncontended", {}).get("p50_ms"), peer.get("uncontended", {}).get("p50_ms")
            ),
        ]
        for key, count in (
            ("contention_clients", 2),
            ("contention_clients", 8),
            ("contention_processes", 2),
            ("contention_processes", 8),
        ):
            row.append(_rate_ratio(_record(ours, key, count), _record(peer, key, count)))
        mine, theirs = (
            _record(ours, "contention_clients", 8),
            _record(peer, "contention_clients", 8),
        )
        row.append(_handoff_pair(mine, theirs))
        row.append(f"{_retaken(mine)} / {_retaken(theirs)}")
        rows.append(row)
    return rows


def _fairness_rows(name: str, record: Any) -> list[list[str]]:
    if not isinstance(record, dict) or "error" in record or "skipped" in record:
        return [[name, _phase_note(record), *[""] * 8]] if record is not None else []
    rows = []
    for key, where in (("processes", "processes"), ("one_client", "one client")):
        run = record.get(key)
        if not isinstance(run, dict):
            continue
        setting = (
            f"{run['waiters']} waiters {run['spacing_ms']:g} ms apart"
            + (f" over {run['processes']} processes" if key == "processes" else "")
            + (f" (capped from {record['capped_from']})" if "capped_from" in record else "")
        )
        longest = run.get("longest_run_one_process")
        lag = run.get("call_lag_max_ms")
        calls = (
            f"{run['max_displacement_vs_calls']} / {run['mean_displacement_vs_calls']:.2f}"
            if "max_displacement_vs_calls" in run
            else "-"
        )
        rows.append(
            [
                name,
                where,
                setting,
                f"{run['granted']}"
                + (f" ({run['not_granted']} not)" if run["not_granted"] else ""),
                str(run["max_displacement"]),
                f"{run['mean_displacement']:.2f}",
                "-" if longest is None else str(longest),
                f"{run['drain_s']:.2f}" if "drain_s" in run else "-",
                calls,
                ms(lag),
            ]
        )
    return rows


def sections(data: dict[str, Any]) -> list[str]:
    """The Markdown of the runs across clients and of the fairness runs."""
    settings = data.get("settings", {})
    units = _units(data)
    out = [
        "",
        "## Contention across clients: each contender its own client (cross-client)",
        "",
        "Unlike the in-client runs above (tasks sharing one client, where a hand-over can stay "
        "inside the client), each contender here has a client of its own: its own "
        "`asynclock.connect(url)` (ttl "
        f"{settings.get('client_ttl_s', '?')} s, renewal and fencing on), or the peer's own "
        "client or connection; all on one lock name, 0 ms hold. *Clients in one process*: N "
        "contenders on one event loop (a blocking peer: N threads); *processes*: N worker "
        "processes, one client each. Handoff: from a release to another contender's grant "
        "(`time.monotonic()`, one clock for every process on Linux).",
        "",
    ]
    header = ["backend / peer", "contenders", *CONTENTION_COLUMNS]
    for key, what in CROSS:
        rows = []
        for name, entry in units:
            if key in entry:
                rows += _contention_rows(name, entry.get(key))
        if rows:
            out += [f"### {what[0].upper()}{what[1:]}", "", *_table(header, rows), ""]
    ratios = ratio_rows(data)
    if ratios:
        out += [
            "### asynclock over its peer, same run",
            "",
            "Uncontended p50 ratio: above 1x is slower. Acquisitions/s ratios: below 1x is "
            "behind. Hand-over p50 and retaken: asynclock / the peer, 8 clients in one process.",
            "",
            *_table(
                [
                    "backend / peer",
                    "uncontended p50",
                    "2 clients acq/s",
                    "8 clients acq/s",
                    "2 processes acq/s",
                    "8 processes acq/s",
                    "8 clients handoff p50 ms",
                    "8 clients retaken",
                ],
                ratios,
            ),
            "",
        ]
    alternated = _alternate.rows(data)
    if alternated:
        out += [
            "### asynclock over its peer, alternated rounds",
            "",
            "The two take turns on the same servers with the same harness (clients in one "
            "process, 0 ms hold), the order flipped every round, so that the machine's drift "
            "from one minute to the next falls on both: each round's acquisitions/s ratio "
            "(below 1x is behind), their median, the rates and the shares retaken by the "
            "releaser, asynclock / the peer.",
            "",
            *_table(
                [
                    "backend / peer",
                    "clients",
                    "median",
                    "ratio per round",
                    "acq/s per round",
                    "retaken per round",
                ],
                alternated,
            ),
            "",
        ]
    fair_rows = []
    for name, entry in units:
        if "fairness" in entry:
            fair_rows += _fairness_rows(name, entry.get("fairness"))
    if fair_rows:
        out += [
            "## Fairness across clients",
            "",
            "Waiters started D ms apart in a known order (round-robin over P processes, one "
            "client each; or all in one client), queued behind a holder on a client of its own, "
            "which then releases; each waiter releases as soon as it is granted. Displacement: "
            "|grant rank - start rank| per waiter (0 everywhere is FIFO). Longest run: most "
            "grants in a row to one process. Drain: from the holder's release to the last "
            "grant. Against calls: the displacement against the order in which the waiters "
            "called acquire, and the latest call after its scheduled start: on a loaded machine "
            "a process can be descheduled for longer than the spacing, and the calls then reach "
            "the lock out of the schedule's order (against the calls is closer to the lock's own "
            "order). Every worker process (asynclock's and each peer's) freezes its heap after "
            "set-up (`gc.freeze()`), and so does the benchmark's process for a run in one client: "
            "identical workers otherwise collect their oldest generation at the same moment, a "
            "pause of 40-90 ms in each that makes their calls late together.",
            "",
            *_table(
                [
                    "backend / peer",
                    "where",
                    "setting",
                    "granted",
                    "max displacement",
                    "mean",
                    "longest run",
                    "drain s",
                    "against calls: max / mean",
                    "latest call ms",
                ],
                fair_rows,
            ),
            "",
        ]
    return out
