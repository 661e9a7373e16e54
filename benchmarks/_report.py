"""The results as a Markdown report and a PNG chart, both made from the JSON alone (so that
``--render results.json`` can redraw them without measuring again)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ._goals import evaluate


def _ok(record: Any) -> bool:
    return isinstance(record, dict) and "error" not in record and "skipped" not in record


def ms(value: Any) -> str:
    """Milliseconds with three significant digits; '-' for missing."""
    if not isinstance(value, (int, float)) or math.isnan(value):
        return "-"
    if value >= 100:
        return f"{value:.0f}"
    return f"{value:.3g}"


def ratio(value: Any, floor: Any) -> str:
    if not isinstance(value, (int, float)) or not isinstance(floor, (int, float)) or floor <= 0:
        return "-"
    result = value / floor
    return f"{result:.0f}x" if result >= 100 else f"{result:.2g}x"


def share(value: Any) -> str:
    if not isinstance(value, (int, float)) or math.isnan(value):
        return "-"
    return f"{value:.0%}"


def _bytes(value: Any) -> str:
    if not isinstance(value, (int, float)):
        return "-"
    if abs(value) >= 10_000:
        return f"{value / 1024:.0f} KiB"
    return f"{value:.0f} B"


def _phase_note(record: Any) -> str:
    if isinstance(record, dict):
        if "error" in record:
            return f"error: {record['error']}"
        if "skipped" in record:
            return f"skipped: {record['skipped']}"
    return "-"


def _table(header: list[str], rows: Iterable[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows]
    return lines


def handoff_record(
    entry: dict[str, Any], contenders: int, hold_ms: float, key: str = "contention_tasks"
) -> dict[str, Any] | None:
    records = entry.get(key)
    if not isinstance(records, list):
        return None
    for record in records:
        if (
            record.get("contenders") == contenders
            and abs(record.get("hold_ms", -1) - hold_ms) < 1e-6
        ):
            found: dict[str, Any] = record
            return found
    return None


def evaluate_targets(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Each issue #18 target: what was measured, whether it was met, by how much it was missed
    (``met`` None: not measured)."""
    return evaluate(data)


def slower_than_peers(data: dict[str, Any]) -> list[str]:
    """Where a peer library beat the asynclock backend it is compared with."""
    notes: list[str] = []
    backends = data.get("backends", {})
    contenders: int = data.get("settings", {}).get("peer_contenders", 8)
    for peer_name, peer in data.get("peers", {}).items():
        if peer.get("status") != "measured":
            continue
        ours = backends.get(peer["compare_with"], {})
        if ours.get("status") != "measured":
            continue
        our_p50 = ours.get("uncontended", {}).get("p50_ms")
        their_p50 = peer.get("uncontended", {}).get("p50_ms")
        if isinstance(our_p50, float) and isinstance(their_p50, float) and their_p50 < our_p50:
            notes.append(
                f"uncontended p50: {peer_name} {ms(their_p50)} ms vs asynclock "
                f"{peer['compare_with']} {ms(our_p50)} ms ({our_p50 / their_p50:.2g}x slower)"
            )
        for hold in (0.0, 1.0):
            mine = handoff_record(ours, contenders, hold)
            theirs = handoff_record(peer, contenders, hold)
            if not mine or not theirs:
                continue
            for key, what in (("p50_ms", "handoff p50"), ("p99_ms", "handoff p99")):
                a = mine["handoff"].get(key)
                b = theirs["handoff"].get(key)
                if isinstance(a, float) and isinstance(b, float) and b < a:
                    notes.append(
                        f"{contenders} contenders, hold {hold:g} ms, {what}: {peer_name} {ms(b)} ms vs "
                        f"asynclock {peer['compare_with']} {ms(a)} ms"
                    )
            a_rate, b_rate = mine.get("per_second"), theirs.get("per_second")
            if isinstance(a_rate, float) and isinstance(b_rate, float) and b_rate > a_rate:
                notes.append(
                    f"{contenders} contenders, hold {hold:g} ms, acquisitions/s: {peer_name} {b_rate:.0f} vs "
                    f"asynclock {peer['compare_with']} {a_rate:.0f}"
                )
    return notes


#: The columns of :func:`_contention_rows` after the backend's and the contenders'.
CONTENTION_COLUMNS = (
    "hold",
    "acq/s",
    "handoff p50 ms",
    "handoff p99 ms",
    "retaken",
    "fewest / most",
)


def _contention_rows(name: str, records: Any) -> list[list[str]]:
    if not isinstance(records, list):
        return [[name, _phase_note(records), "", "", "", "", "", ""]] if records is not None else []
    rows = []
    for record in records:
        handoff = record.get("handoff", {})
        rows.append(
            [
                name,
                str(record["contenders"]),
                f"{record['hold_ms']:g} ms",
                f"{record['per_second']:.0f}",
                ms(handoff.get("p50_ms")),
                ms(handoff.get("p99_ms")),
                share(record.get("retaken_share")),
                f"{record['min_per_worker']} / {record['max_per_worker']}"
                + (
                    f" ({record['failed_attempts']} failed tries)"
                    if record.get("failed_attempts")
                    else ""
                )
                + (" OVERLAP!" if record.get("overlaps") else "")
                + (f" errors: {'; '.join(record['errors'])}" if record.get("errors") else ""),
            ]
        )
    return rows


def markdown(data: dict[str, Any]) -> str:
    """The whole report: machine, tables, targets, where a peer is faster, what was not run."""
    out: list[str] = []
    machine = data.get("machine", {})
    out.append(f"# asynclock benchmarks ({data.get('settings', {}).get('mode', '?')} run)")
    out.append("")
    out.append(
        f"Measured {data.get('started_at', '?')} in {data.get('seconds', 0):.0f} s on "
        f"{machine.get('cpus', '?')} CPUs ({machine.get('cpu_model', '?')}), {machine.get('os', '?')}, "
        f"Python {machine.get('python', '?')}; load average {machine.get('load_start', '?')} at the start, "
        f"{machine.get('load_end', '?')} at the end. All servers on 127.0.0.1, data in RAM."
    )
    versions = data.get("versions", {})
    if versions:
        out.append("")
        out.append(
            "Versions: "
            + ", ".join(f"{key} {value}" for key, value in sorted(versions.items()))
            + "."
        )
    backends: dict[str, Any] = data.get("backends", {})
    measured = {
        name: entry for name, entry in backends.items() if entry.get("status") == "measured"
    }

    out += ["", "## Uncontended acquire + release (`async with locks.lock(name)`, empty body)", ""]
    rows = []
    for name, entry in measured.items():
        floor = entry.get("floor", {})
        pair = entry.get("pair", {})
        latency = entry.get("uncontended", {})
        if not _ok(latency):
            rows.append(
                [
                    name,
                    floor.get("label", "-"),
                    ms(floor.get("p50_ms")),
                    "-",
                    "-",
                    _phase_note(latency),
                    "",
                    "",
                    "",
                    "",
                ]
            )
            continue
        rows.append(
            [
                name,
                str(floor.get("label", _phase_note(floor))),
                ms(floor.get("p50_ms")),
                str(pair.get("label", "-")) if pair else "-",
                ms(pair.get("p50_ms")) if pair else "-",
                ms(latency.get("p50_ms")),
                ms(latency.get("p90_ms")),
                ms(latency.get("p99_ms")),
                ratio(latency.get("p50_ms"), floor.get("p50_ms")),
                ratio(latency.get("p50_ms"), pair.get("p50_ms")) if pair else "-",
            ]
        )
    out += _table(
        [
            "backend",
            "floor",
            "floor p50 ms",
            "pair floor",
            "pair p50 ms",
            "p50 ms",
            "p90 ms",
            "p99 ms",
            "p50 / floor",
            "p50 / pair",
        ],
        rows,
    )

    out += [
        "",
        "## Contention: tasks on one event loop, one shared client (in-client)",
        "",
        "Handoff: from the holder calling release to a *different* waiter's acquire returning "
        "(monotonic clock). Retaken: share of consecutive holds by the same worker. "
        "Fewest / most: acquisitions per worker (starvation shows as a low fewest).",
        "",
    ]
    rows = []
    for name, entry in measured.items():
        rows += _contention_rows(name, entry.get("contention_tasks"))
    out += _table(["backend", "tasks", *CONTENTION_COLUMNS], rows)

    from ._report_cross import sections

    out += sections(data)

    out += [
        "",
        "## Renewal cost: one client holding many locks",
        "",
        "Renew calls: the client's renewal round trips (`LockClient.renew_calls`) per renewal "
        "interval (ttl / 3). Server requests: what the server counted in the same window, per "
        "interval (PostgreSQL: not counted, see the docs).",
        "",
    ]
    rows = []
    for name, entry in measured.items():
        records = entry.get("renewal")
        if not isinstance(records, list):
            rows.append([name, _phase_note(records), "", "", "", ""])
            continue
        for record in records:
            capped = (
                f" (asked {record['capped_from']}: {record['capped_why']})"
                if "capped_from" in record
                else ""
            )
            server = record.get("server_requests_per_interval")
            rows.append(
                [
                    name,
                    f"{record['locks']}{capped}",
                    f"{record.get('interval_s', 0) * 3:g} s / {record.get('interval_s', 0):g} s",
                    f"{record.get('renew_calls_per_interval', '-'):g}"
                    if "renew_calls_per_interval" in record
                    else "-",
                    f"{server:g} {record.get('server_requests_label', '')}"
                    if isinstance(server, (int, float))
                    else "-",
                    f"{record.get('acquire_seconds', 0):.1f} s"
                    + (f", {record['lost']} lost" if record.get("lost") else ""),
                ]
            )
    out += _table(
        [
            "backend",
            "locks held",
            "ttl / interval",
            "renew calls / interval",
            "server requests / interval",
            "time to take them",
        ],
        rows,
    )

    out += [
        "",
        "## Lease loss and memory",
        "",
        "Loss: the lease is revoked on the server (row deleted, key deleted, lease revoked, "
        "znode deleted, session terminated) and the time until the body is cancelled and "
        "`LeaseLost` raised is measured. Memory: Python heap (tracemalloc) per held lock and "
        "per waiting task, net of a bare parked task; native memory of drivers is not seen.",
        "",
    ]
    rows = []
    for name, entry in measured.items():
        loss = entry.get("loss_to_cancel", {})
        memory = entry.get("memory", {})
        outcomes = loss.get("outcomes", {}) if isinstance(loss, dict) else {}
        rows.append(
            [
                name,
                f"{ms(loss.get('p50_ms'))} / {ms(loss.get('max_ms'))}"
                if _ok(loss) and loss.get("n")
                else _phase_note(loss),
                ", ".join(f"{key} {value}" for key, value in outcomes.items()) or "-",
                f"{loss.get('ttl_s', '-')} s" if isinstance(loss, dict) else "-",
                _bytes(memory.get("bytes_per_held_lock")) if _ok(memory) else _phase_note(memory),
                _bytes(memory.get("bytes_per_waiter")) if _ok(memory) else "-",
            ]
        )
    out += _table(
        [
            "backend",
            "loss -> cancelled p50 / max ms",
            "outcomes",
            "ttl",
            "per held lock",
            "per waiter",
        ],
        rows,
    )

    peers: dict[str, Any] = data.get("peers", {})
    if peers:
        out += [
            "",
            "## Peer libraries on the same servers",
            "",
            "Sync libraries run in threads (one per contender), timed in the thread. "
            "'vs asynclock' is the peer's p50 over the compared asynclock backend's p50.",
            "",
        ]
        rows = []
        holds: list[float] = data.get("settings", {}).get("holds_ms", [0.0, 1.0])
        contenders: int = data.get("settings", {}).get("peer_contenders", 8)
        for name, peer in peers.items():
            if peer.get("status") != "measured":
                rows.append(
                    [
                        name,
                        peer.get("server", "-"),
                        "-",
                        f"{peer.get('status')}: {peer.get('reason') or _phase_note(peer)}",
                        "",
                        "",
                        "",
                        "",
                        "",
                        "",
                        "",
                    ]
                )
                continue
            ours = backends.get(peer["compare_with"], {})
            floor = ours.get("floor", {}) if isinstance(ours.get("floor"), dict) else {}
            if not floor.get("p50_ms"):
                floor = data.get("floors", {}).get(peer["server"], {})
            latency = peer.get("uncontended", {})
            first = True
            for hold in holds:
                record = handoff_record(peer, contenders, hold)
                handoff = record.get("handoff", {}) if record else {}
                head = (
                    [
                        name,
                        f"{peer['server']} ({peer.get('version', '?')})",
                        "sync" if peer.get("sync") else "async",
                        ms(latency.get("p50_ms")),
                        ms(latency.get("p99_ms")),
                        ratio(latency.get("p50_ms"), floor.get("p50_ms")),
                        ratio(latency.get("p50_ms"), ours.get("uncontended", {}).get("p50_ms")),
                    ]
                    if first
                    else [""] * 7
                )
                first = False
                tail = "-"
                if record:
                    tail = f"{record['min_per_worker']} / {record['per_second']:.0f}"
                    if record.get("failed_attempts"):
                        tail += f" ({record['failed_attempts']} failed tries)"
                    if record.get("overlaps"):
                        tail += " OVERLAP!"
                rows.append(
                    [
                        *head,
                        f"{hold:g} ms",
                        f"{ms(handoff.get('p50_ms'))} / {ms(handoff.get('p99_ms'))}",
                        share(record.get("retaken_share")) if record else "-",
                        tail,
                    ]
                )
        out += _table(
            [
                "library",
                "server",
                "",
                "p50 ms",
                "p99 ms",
                "p50 / floor",
                "vs asynclock",
                "hold",
                f"{contenders}-way handoff p50 / p99 ms",
                "retaken",
                "fewest / acq/s",
            ],
            rows,
        )
        notes = [
            f"- {peer_name}: {peer['note']}"
            for peer_name, peer in peers.items()
            if peer.get("note") and peer.get("status") == "measured"
        ]
        if notes:
            out += ["", *notes]

    out += ["", "## Targets (issue #18)", ""]
    target_rows = evaluate_targets(data)
    out += _table(
        ["backend", "target", "measured", "met"],
        [
            [
                row["backend"],
                row["target"],
                row["measured"],
                {True: "met", False: "MISSED", None: "-"}[row["met"]],
            ]
            for row in target_rows
        ],
    )

    slower = slower_than_peers(data)
    if slower:
        out += ["", "## Where a peer is faster", "", *(f"- {line}" for line in slower)]

    logged = [
        f"- {name}: " + "; ".join(entry["log"])
        for name, entry in measured.items()
        if entry.get("log")
    ]
    if logged:
        out += ["", "## What asynclock logged during the run (commonest first)", "", *logged]

    missing = [
        f"- {name}: {entry.get('reason', '?')}"
        for name, entry in backends.items()
        if entry.get("status") != "measured"
    ]
    missing += [
        f"- peer {name}: {peer.get('reason') or _phase_note(peer)}"
        for name, peer in peers.items()
        if peer.get("status") not in ("measured",)
    ]
    if missing:
        out += ["", "## Not available in this run", "", *missing]
    return "\n".join(out) + "\n"


def chart(data: dict[str, Any], path: Path) -> None:
    """Uncontended latency per backend and peer (with the floor), and 8-contender handoff, as a
    PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contenders: int = data.get("settings", {}).get("peer_contenders", 8)
    rows: list[dict[str, Any]] = []

    def add(label: str, entry: dict[str, Any], color: str, floor: Any) -> None:
        latency = entry.get("uncontended", {})
        record = handoff_record(entry, contenders, 0.0)
        handoff = record.get("handoff", {}) if record else {}
        rows.append(
            {
                "label": label,
                "color": color,
                "p50": float(latency.get("p50_ms", math.nan)),
                "p99": float(latency.get("p99_ms", math.nan)),
                "floor": float(floor.get("p50_ms", math.nan))
                if isinstance(floor, dict)
                else math.nan,
                "handoff50": float(handoff.get("p50_ms", math.nan)),
                "handoff99": float(handoff.get("p99_ms", math.nan)),
                "note": (
                    f"retaken {share(record.get('retaken_share'))}, fewest {record.get('min_per_worker')}"
                    if record
                    else ""
                ),
            }
        )

    def floor_of(peer: dict[str, Any]) -> Any:
        ours = data.get("backends", {}).get(peer.get("compare_with"), {})
        if isinstance(ours.get("floor"), dict) and "p50_ms" in ours["floor"]:
            return ours["floor"]
        return data.get("floors", {}).get(peer.get("server"))

    def peer_label(name: str, peer: dict[str, Any]) -> str:
        return name + (" (sync)" if peer.get("sync") else "")

    peers: dict[str, Any] = data.get("peers", {})
    for name, entry in data.get("backends", {}).items():
        if entry.get("status") == "measured" and _ok(entry.get("uncontended")):
            add(f"asynclock {name}", entry, "tab:blue", entry.get("floor"))
            for peer_name, peer in peers.items():
                if peer.get("status") == "measured" and peer.get("compare_with") == name:
                    add(peer_label(peer_name, peer), peer, "tab:orange", floor_of(peer))
    for peer_name, peer in peers.items():
        label = peer_label(peer_name, peer)
        if peer.get("status") == "measured" and label not in [row["label"] for row in rows]:
            add(label, peer, "tab:orange", floor_of(peer))
    if not rows:
        return
    height = max(3.0, 0.38 * len(rows) + 1.5)
    figure, (left, right) = plt.subplots(1, 2, figsize=(14, height), sharey=True)
    positions = list(range(len(rows)))[::-1]
    colors = [row["color"] for row in rows]

    def column(key: str) -> list[float]:
        return [row[key] for row in rows]

    left.barh(positions, column("p50"), color=colors, alpha=0.85, label="p50")
    left.scatter(column("p99"), positions, color="black", marker="|", s=120, label="p99", zorder=3)
    left.scatter(
        column("floor"),
        positions,
        color="dimgray",
        marker="D",
        s=18,
        label="floor p50 (raw round trip)",
        zorder=3,
    )
    _log_scale(left, column("p50") + column("p99") + column("floor"))
    left.set_xlabel("uncontended acquire + release, ms (log)")
    left.set_yticks(positions, [row["label"] for row in rows])
    left.legend(loc="best", fontsize=8)
    right.barh(positions, column("handoff50"), color=colors, alpha=0.85, label="p50")
    right.scatter(
        column("handoff99"), positions, color="black", marker="|", s=120, label="p99", zorder=3
    )
    # Room on the right for the notes.
    _log_scale(right, column("handoff50") + column("handoff99"), headroom=12)
    for position, row in zip(positions, rows, strict=True):
        if row["note"]:
            anchor = row["handoff99"] if not math.isnan(row["handoff99"]) else 0.1
            right.annotate(
                row["note"],
                (anchor, position),
                xytext=(6, -3),
                textcoords="offset points",
                fontsize=7,
                color="dimgray",
            )
    right.set_xlabel(f"handoff to another waiter, {contenders} contenders, 0 ms hold, ms (log)")
    right.legend(loc="lower right", fontsize=8)
    for axis in (left, right):
        axis.grid(axis="x", which="both", alpha=0.3)
    machine = data.get("machine", {})
    figure.suptitle(
        f"asynclock {data.get('versions', {}).get('asynclock', '')}, "
        f"{data.get('settings', {}).get('mode', '')} run, {machine.get('cpus', '?')} CPUs "
        f"(shared), Python {machine.get('python', '?')}; blue: asynclock, orange: peer libraries",
        fontsize=10,
    )
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _log_scale(axis: Any, values: list[float], headroom: float = 2.0) -> None:
    """A log x axis over the positive values (left linear when there are none)."""
    seen = [value for value in values if math.isfinite(value) and value > 0]
    if seen:
        axis.set_xscale("log")
        axis.set_xlim(min(seen) / 2, max(seen) * headroom)
