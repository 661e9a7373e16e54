"""The one-screen summary a run ends with: every backend side by side (and its peers, with
``--peers``), made from the results JSON alone, like the full report.

A cell never shows a figure its samples cannot carry: a p99 needs at least
:data:`MIN_P99_SAMPLES` samples, a p50 :data:`MIN_P50_SAMPLES`; below that the cell says
"n/a" and how many there were. The few lease losses a quick run times are shown with their
count.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ._cross import TABLE_CLIENTS
from ._report import handoff_record, ms, ratio
from ._stats import MIN_P50_SAMPLES
from ._suite import SHARE_SPENT, TABLE_RUN

#: Below this many samples a p99 is one of the few slowest, not a percentile.
MIN_P99_SAMPLES = 100

HEADER = (
    "backend",
    "floor p50 ms",
    "lock p50 ms",
    "lock p99",
    "p50/floor",
    f"in-client: {TABLE_RUN[0]}-task handoff p99",
    f"cross-client: {TABLE_CLIENTS} clients acq/s",
    f"{TABLE_CLIENTS} clients handoff p50",
    "loss -> cancel",
)


def percentile_cell(summary: Any, key: str) -> str:
    """``summary[key]`` (``"p50_ms"``, ``"p99_ms"``) if there are samples enough for it."""
    if not isinstance(summary, dict):
        return "-"
    if "error" in summary or "skipped" in summary:
        return "error" if "error" in summary else "skipped"
    count = summary.get("n", 0)
    need = MIN_P99_SAMPLES if key == "p99_ms" else MIN_P50_SAMPLES
    if count < need:
        return f"{key[:3]} n/a (n={count})"
    return ms(summary.get(key))


def _floor_cell(floor: Any) -> str:
    if not isinstance(floor, dict) or "p50_ms" not in floor:
        return "-"
    return f"{percentile_cell(floor, 'p50_ms')} {floor.get('label', '?')}"


def _ratio_cell(latency: Any, floor: Any) -> str:
    """The p50 over the floor's p50, when both are shown."""
    if not isinstance(latency, dict) or not isinstance(floor, dict):
        return "-"
    if latency.get("n", 0) < MIN_P50_SAMPLES or floor.get("n", 0) < MIN_P50_SAMPLES:
        return "-"
    return ratio(latency.get("p50_ms"), floor.get("p50_ms"))


def _handoff_cell(entry: dict[str, Any]) -> str:
    records = entry.get("contention_tasks")
    if isinstance(records, dict):
        return "error" if "error" in records else "skipped"
    record = handoff_record(entry, TABLE_RUN[0], TABLE_RUN[1])
    if record is None:
        return "not run"
    cell = percentile_cell(record.get("handoff", {}), "p99_ms")
    if record.get("overlaps"):
        cell += " OVERLAP!"
    return cell


def _clients_cells(entry: dict[str, Any]) -> list[str]:
    """The cross-client run the table shows: acquisitions/s and hand-over p50."""
    records = entry.get("contention_clients")
    if isinstance(records, dict):
        cell = "error" if "error" in records else "skipped"
        return [cell, cell]
    record = handoff_record(entry, TABLE_CLIENTS, 0.0, key="contention_clients")
    if record is None:
        return ["not run", "not run"]
    rate = f"{record['per_second']:.0f}" + (" OVERLAP!" if record.get("overlaps") else "")
    retaken = record.get("retaken_share")
    if isinstance(retaken, float) and retaken > 0.05:
        rate += f" ({retaken:.0%} retaken)"
    return [rate, percentile_cell(record.get("handoff", {}), "p50_ms")]


def _loss_cell(loss: Any) -> str:
    if not isinstance(loss, dict):
        return "-"
    if "error" in loss or "skipped" in loss:
        return "error" if "error" in loss else "skipped"
    count = loss.get("n", 0)
    tries = sum(loss.get("outcomes", {}).values())
    if not count:
        return f"never cancelled ({tries} tries)"
    cell = f"{ms(loss.get('p50_ms'))} (n={count})"
    if tries > count:
        cell += f", {tries - count} not cancelled"
    return cell


def _peer_floor(data: dict[str, Any], peer: dict[str, Any]) -> Any:
    ours = data.get("backends", {}).get(peer.get("compare_with"), {})
    if isinstance(ours.get("floor"), dict) and "p50_ms" in ours["floor"]:
        return ours["floor"]
    return data.get("floors", {}).get(peer.get("server"))


def rows(data: dict[str, Any]) -> list[list[str]]:
    """One row per backend, each followed by its peers' rows (``--peers``)."""
    out: list[list[str]] = []
    peers: dict[str, Any] = data.get("peers", {})
    shown: set[str] = set()
    for name, entry in data.get("backends", {}).items():
        if entry.get("status") != "measured":
            out.append([name, entry.get("status", "?"), *[""] * (len(HEADER) - 2)])
        else:
            floor, latency = entry.get("floor"), entry.get("uncontended")
            out.append(
                [
                    name,
                    _floor_cell(floor),
                    percentile_cell(latency, "p50_ms"),
                    percentile_cell(latency, "p99_ms"),
                    _ratio_cell(latency, floor),
                    _handoff_cell(entry),
                    *_clients_cells(entry),
                    _loss_cell(entry.get("loss_to_cancel")),
                ]
            )
        for peer_name, peer in peers.items():
            # A peer that did not import has no record of what it compares with: its server
            # kind is named as the backend is.
            if peer.get("compare_with", peer.get("server")) == name:
                out.append(_peer_row(data, peer_name, peer))
                shown.add(peer_name)
    for peer_name, peer in peers.items():
        if peer_name not in shown:
            out.append(_peer_row(data, peer_name, peer))
    return out


def _peer_row(data: dict[str, Any], name: str, peer: dict[str, Any]) -> list[str]:
    label = f"  + {name}" + ("*" if peer.get("sync") else "")
    if peer.get("status") != "measured":
        return [label, peer.get("status", "?"), *[""] * (len(HEADER) - 2)]
    floor, latency = _peer_floor(data, peer), peer.get("uncontended")
    return [
        label,
        _floor_cell(floor),
        percentile_cell(latency, "p50_ms"),
        percentile_cell(latency, "p99_ms"),
        _ratio_cell(latency, floor),
        _handoff_cell(peer),
        *_clients_cells(peer),
        "not measured",
    ]


def table(header: Iterable[str], body: list[list[str]]) -> list[str]:
    """A Markdown table padded to line up in a terminal too."""
    head = list(header)
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]

    def line(cells: list[str]) -> str:
        return (
            "| "
            + " | ".join(cell.ljust(width) for cell, width in zip(cells, widths, strict=True))
            + " |"
        )

    return [line(head), "|" + "|".join("-" * (width + 2) for width in widths) + "|"] + [
        line(row) for row in body
    ]


def _title(data: dict[str, Any]) -> list[str]:
    settings = data.get("settings", {})
    backends = data.get("backends", {})
    measured = sum(entry.get("status") == "measured" for entry in backends.values())
    budget = settings.get("budget_s")
    lines = [
        f"asynclock bench, {settings.get('mode', '?')} run of {data.get('started_at', '?')}: "
        f"{measured} of {len(backends)} backends measured"
        + (f", {len(data.get('peers', {}))} peers" if data.get("peers") else "")
        + f" in {data.get('seconds', 0):.1f} s"
        + (f" (budget {budget:g} s)" if isinstance(budget, (int, float)) and budget else "")
    ]
    servers = data.get("servers", {})
    started: dict[str, float] = servers.get("started", {})
    if started:
        each = ", ".join(f"{kind} {seconds:.2f}" for kind, seconds in started.items())
        lines.append(
            f"servers started at once in {servers.get('all_s', 0):.2f} s ({each} s), "
            f"stopped in {servers.get('stop_s', 0):.2f} s"
            + (f"; given: {', '.join(servers['given'])}" if servers.get("given") else "")
        )
    machine = data.get("machine", {})
    lines.append(
        f"{machine.get('cpus', '?')} CPUs, load average {machine.get('load_start', '?')} at the "
        f"start, {machine.get('load_end', '?')} at the end"
    )
    return lines


def _notes(data: dict[str, Any]) -> list[str]:
    settings = data.get("settings", {})
    backends: dict[str, Any] = data.get("backends", {})
    measured = {n: e for n, e in backends.items() if e.get("status") == "measured"}
    ttls: dict[str, list[str]] = {}
    for name, entry in measured.items():
        loss = entry.get("loss_to_cancel")
        if isinstance(loss, dict) and "ttl_s" in loss:
            ttls.setdefault(f"{loss['ttl_s']:g} s", []).append(name)
    ttl_text = "; ".join(f"ttl {ttl}: {', '.join(names)}" for ttl, names in ttls.items())
    notes = [
        "floor: one raw round trip of the backend's own client (named in the cell). "
        "lock: acquire + release, `async with locks.lock(name): pass`, one task, "
        f"up to {settings.get('latency_iterations', '?')} iterations; ms. "
        f"in-client handoff: {TABLE_RUN[0]} tasks sharing one client, {TABLE_RUN[1]:g} ms hold, "
        "from a release to another task's acquire returning, ms. cross-client: "
        f"{TABLE_CLIENTS} contenders in one process, each with its own client (asynclock: its "
        f"own connect(url), ttl {settings.get('client_ttl_s', '?')} s; a peer: its own "
        "client), 0 ms hold: acquisitions/s (and the share retaken by the releaser when over "
        "5 %), hand-over p50 ms. loss -> cancel: the lease "
        "revoked on the server, until the body gets LeaseLost; median ms of n tries"
        + (f" ({ttl_text})" if ttl_text else "")
        + f". n/a: a p99 needs {MIN_P99_SAMPLES} samples, a p50 {MIN_P50_SAMPLES}."
    ]
    if data.get("peers"):
        notes.append(
            "+ peers: other libraries on the same servers, each with its defaults (* a blocking "
            "library, timed in its own threads); none cancels its caller's work when its lock is "
            "lost, so loss -> cancel is not measured for them."
        )
    cut = _cut(settings, measured)
    if cut:
        notes.append("cut to fit the budget (the full report lists each): " + "; ".join(cut))
    missing = [
        f"{name}: {entry.get('reason', '?')}"
        for name, entry in backends.items()
        if entry.get("status") != "measured"
    ]
    missing += [
        f"peer {name}: {peer.get('reason') or peer.get('error') or peer.get('skipped', '?')}"
        for name, peer in data.get("peers", {}).items()
        if peer.get("status") != "measured"
    ]
    if missing:
        notes.append("not measured: " + "; ".join(missing))
    return notes


def _cut(settings: dict[str, Any], measured: dict[str, Any]) -> list[str]:
    """What the backends' shares left out: phases skipped, runs or counts not reached."""
    skipped: dict[str, list[str]] = {}
    for name, entry in measured.items():
        for key in ("memory", "contention_processes", "fairness", "renewal"):
            record = entry.get(key)
            if isinstance(record, dict) and record.get("skipped") == SHARE_SPENT:
                skipped.setdefault(key.replace("_", " "), []).append(name)
    out = [f"{what} for {', '.join(names)}" for what, names in skipped.items()]
    holds = len(settings.get("holds_ms", []))
    planned = {
        "contention_tasks": ("contention runs", len(settings.get("contenders", [])) * holds),
        "contention_clients": ("client runs", len(settings.get("client_counts", []))),
        "contention_processes": ("process runs", len(settings.get("process_contenders", []))),
        "renewal": ("renewal counts", len(settings.get("renewal_counts", []))),
    }
    for key, (what, wanted) in planned.items():
        short = [
            f"{name} {len(entry[key])}"
            for name, entry in measured.items()
            if isinstance(entry.get(key), list) and len(entry[key]) < wanted
        ]
        if short:
            out.append(f"{what}, of {wanted}: {', '.join(short)}")
    return out


def screen(data: dict[str, Any]) -> str:
    """The summary: a title, the side-by-side table, what the columns are, what was cut."""
    lines = [*_title(data), "", *table(HEADER, rows(data)), ""]
    lines += [f"- {note}" for note in _notes(data)]
    return "\n".join(lines) + "\n"
