"""The benchmark harness (issues #9, #18): nothing here checks how fast anything is, only that
every measurement ran and produced a well-formed, sane record."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def bench(out: Path, *args: str, timeout: float) -> tuple[dict[str, Any], Any]:
    """`asynclock bench` as a user runs it from a checkout: its JSON record, and the process."""
    command = [sys.executable, "-m", "asynclock", "bench", *args, "--no-chart", "--output-dir"]
    done = subprocess.run(
        [*command, str(out)], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "latest.json").read_text()), done


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("bench")
    data, _ = bench(out, "--smoke", "--backends", "sqlite", "--quiet", timeout=100)
    return data, out


def positive(value: object) -> bool:
    return isinstance(value, (int, float)) and value > 0


def check_summary(summary: dict[str, Any]) -> None:
    assert summary["n"] > 0
    assert 0 < summary["min_ms"] <= summary["p50_ms"] <= summary["p90_ms"]
    assert summary["p90_ms"] <= summary["p99_ms"] <= summary["max_ms"]
    # Sane: nothing on a loopback/embedded store takes a minute.
    assert summary["max_ms"] < 60_000


def test_the_smoke_run_records_sane_numbers_and_a_report(
    results: tuple[dict[str, Any], Path],
) -> None:
    data, out = results
    assert (data["schema"], data["settings"]["mode"]) == (1, "smoke")
    assert positive(data["machine"]["cpus"])
    assert data["machine"]["python"].startswith("3.")
    assert {"asynclock", "anyio", "sqlite"} <= set(data["versions"])
    assert positive(data["seconds"])
    # Only the embedded backend was asked for; no server was started.
    assert (list(data["backends"]), data["peers"]) == (["sqlite"], {})

    entry = data["backends"]["sqlite"]
    assert entry["status"] == "measured"
    assert entry["capabilities"]["cross_process"] is True
    for key in ("floor", "pair", "uncontended"):
        check_summary(entry[key])
    assert entry["floor"]["label"]

    # In one client (tasks), and across clients: in one process, and in processes.
    for mode in ("contention_tasks", "contention_clients", "contention_processes"):
        runs = entry[mode]
        assert isinstance(runs, list) and runs, runs
        for run in runs:
            assert run["contenders"] >= 2
            assert run["acquisitions"] > 0
            assert positive(run["per_second"])
            assert run["overlaps"] == 0  # never two holders at once
            if run["acquisitions"] >= 2:
                assert 0 <= run["retaken_share"] <= 1
            else:
                # One hold in the window: no turn passed, so no share (the report shows "-").
                # A loaded CI run's smoke process contention had one (ci6 here).
                assert math.isnan(run["retaken_share"]), run
            assert 0 <= run["min_per_worker"] <= run["max_per_worker"] <= run["acquisitions"]
            if run["handoff"]["n"]:
                check_summary(run["handoff"])

    assert data["settings"]["fairness"] == {
        "waiters": 6, "spacing_ms": 2.0, "processes": 2, "ttl_s": 30.0
    }  # fmt: skip
    for where, processes in (("processes", 2), ("one_client", 1)):
        fair = entry["fairness"][where]
        assert (fair["waiters"], fair["processes"], fair["granted"]) == (6, processes, 6)
        assert 0 <= fair["mean_displacement"] <= fair["max_displacement"] < 6
        assert positive(fair["drain_s"])

    (renewal,) = entry["renewal"]
    assert (renewal["locks"], renewal["lost"]) == (2, 0)
    assert positive(renewal["renew_calls_per_interval"])

    loss = entry["loss_to_cancel"]
    check_summary(loss)
    assert loss["outcomes"] == {"LeaseLost": 1}

    memory = entry["memory"]
    assert positive(memory["bytes_per_held_lock"])
    assert positive(memory["bytes_per_waiter"])

    report = (out / "latest.md").read_text()
    for heading in (
        "## Uncontended",
        "## Contention: tasks",
        "## Contention across clients",
        "### Clients in one process",
        "### Processes",
        "## Fairness across clients",
        "## Renewal",
        "## Targets",
    ):
        assert heading in report
    assert "| sqlite |" in report
    # Targets of backends that were not run are listed, not silently dropped.
    assert {row["backend"] for row in data["targets"]} == {"postgres", "redis", "etcd", "memory"}
    assert all(row["met"] is None for row in data["targets"])


def test_the_targets_say_met_missed_by_how_much_or_why_not_measured_and_cells_their_n() -> None:
    from benchmarks._goals import evaluate
    from benchmarks._screen import percentile_cell

    summary = {"n": 40, "p50_ms": 1.25, "p99_ms": 9.5}
    assert percentile_cell(summary, "p99_ms") == "p99 n/a (n=40)"
    assert percentile_cell(summary, "p50_ms") == "1.25"
    assert percentile_cell({"n": 4, "p50_ms": 1.0}, "p50_ms") == "p50 n/a (n=4)"
    assert percentile_cell({**summary, "n": 100}, "p99_ms") == "9.5"
    assert percentile_cell({"skipped": "no time"}, "p50_ms") == "skipped"

    def contention(per_second: float, p50: float, p99: float) -> dict[str, Any]:
        handoff = {"p50_ms": p50, "p99_ms": p99}
        return dict(contenders=8, hold_ms=0.0, per_second=per_second, handoff=handoff,
                    acquisitions=int(per_second), retaken_share=0.01,
                    min_per_worker=int(per_second / 8 * 0.9))  # fmt: skip

    measured = "measured"
    memory = {"status": measured, "uncontended": {"p50_ms": 0.018}, "pair": {"p50_ms": 0.006}}
    redis = {"status": measured, "floor": {"p50_ms": 0.1}, "uncontended": {"p50_ms": 0.3}}
    data: dict[str, Any] = {
        "backends": {
            "memory": memory,
            "redis": {**redis, "contention_tasks": [contention(1000.0, 0.25, 1.0)]},
            "etcd": {"status": "unavailable", "reason": "etcd is not installed"},
        },
        "peers": {
            "python-redis-lock": {
                "status": measured,
                "contention_tasks": [contention(1250, 0.2, 1.5)],
            }
        },
    }
    rows = {(row["backend"], row["target"]): row for row in evaluate(data)}
    core = rows[("memory", "uncontended p50 <= 3x anyio.Lock")]
    assert core["met"] is True
    row = rows[("redis", "8-task acquisitions/s >= python-redis-lock's")]
    assert row["met"] is False and "missed by 20%" in row["measured"]
    assert rows[("redis", "8-task hand-over p50 <= 2 x PING")]["met"] is False
    assert rows[("redis", "8-task fairness: retaken <= 5 %")]["met"] is True
    etcd = rows[("etcd", "8-task acquisitions/s >= aetcd Lock's")]
    assert etcd["met"] is None and "not installed" in etcd["measured"]
    postgres = rows[("postgres", "uncontended p50 <= 1.3x the bare asyncpg advisory pair")]
    assert postgres["met"] is None and "not measured" in postgres["measured"]


@pytest.mark.anyio
async def test_alternated_rounds_flip_the_order_and_give_a_ratio_per_round() -> None:
    """asynclock and its peer take turns, the order flipped every round; each round gives
    asynclock's acquisitions/s over the peer's per client count (None when the peer made
    none), the median of those; rounds after the first run only while they fit."""
    from benchmarks import _alternate
    from benchmarks._contend import Run

    ours, peer = object(), object()
    calls: list[tuple[str, int, str]] = []
    rates = iter([100.0, 200.0, 300.0, 100.0, 150.0, 100.0, 0.0, 50.0])  # in call order

    async def measure(unit: object, run: Run, name: str) -> dict[str, Any]:
        calls.append(("ours" if unit is ours else "peer", run.contenders, name))
        return {"per_second": next(rates), "retaken_share": 0.0 if unit is ours else 0.1}

    fitting = iter([True, False])
    record = await _alternate.alternated(
        ours,  # type: ignore[arg-type]
        peer,  # type: ignore[arg-type]
        duration=0.5,
        grace=1.0,
        name_of=lambda what: f"bench/{what}",
        fits=lambda seconds: next(fitting),
        measure=measure,
    )
    sides = [(side, count) for side, count, _ in calls]
    assert sides == [
        ("ours", 2), ("peer", 2), ("ours", 8), ("peer", 8),  # round 0: asynclock first
        ("peer", 2), ("ours", 2), ("peer", 8), ("ours", 8),  # round 1: the peer first
    ]  # fmt: skip
    assert len({name for _, _, name in calls}) == len(calls)  # a lock name of its own each
    assert record["rounds"] == 2  # the third did not fit
    two, eight = record["clients"]["2"], record["clients"]["8"]
    assert (two["ours"], two["peer"]) == ([100.0, 100.0], [200.0, 150.0])
    assert two["ratios"] == [0.5, 100.0 / 150.0] and two["median"] == (0.5 + 100.0 / 150.0) / 2
    assert eight["ratios"] == [3.0, None] and eight["median"] == 3.0
    assert two["peer_retaken"] == [0.1, 0.1] and two["ours_retaken"] == [0.0, 0.0]
    rows = _alternate.rows(
        {"peers": {"p": {"compare_with": "redis", "alternated": record}, "q": {"status": "x"}}}
    )
    assert rows[1][:4] == ["redis / p", "8", "3.00x", "3.00, -"]
    assert rows[0][4] == "100 / 200, 100 / 150" and rows[0][5] == "0% / 10%, 0% / 10%"


def test_fairness_is_the_grant_order_against_the_start_order() -> None:
    from benchmarks._fairness import Fairness, analyse, schedule

    setting = Fairness(waiters=6, spacing=0.002, processes=2)
    starts = schedule(setting, 2, t0=100.0)
    assert starts == [[(0, 100.0), (2, 100.004), (4, 100.008)], [(1, 100.002), (3, 100.006), (5, 100.01)]]  # fmt: skip
    # Granted 0, 2, 4 (process 0 three times in a row), then 1, 3; waiter 5 never. Waiter 1
    # called acquire 5 ms late, after waiter 4.
    called = {0: 100.0, 1: 100.007, 2: 100.004, 3: 100.0065, 4: 100.008}
    grants = [(t, i, called[i]) for t, i in [(1.0, 0), (2.0, 2), (3.0, 4), (4.0, 1), (5.0, 3)]]
    record = analyse(list(reversed(grants)), setting, 2, t0=100.0)
    assert (record["granted"], record["not_granted"]) == (5, 1)
    # Ranks 0..4 against start ranks 0, 2, 4, 1, 3: displacements 0, 1, 2, 2, 1.
    assert record["max_displacement"] == 2
    assert record["mean_displacement"] == 6 / 5
    assert record["longest_run_one_process"] == 3
    assert record["in_start_order"] == 1
    # Against the calls (0, 2, 3, 1, 4): ranks 0, 1, 4, 3, 2: displacements 0, 0, 2, 0, 2.
    assert (record["max_displacement_vs_calls"], record["mean_displacement_vs_calls"]) == (2, 0.8)
    assert record["call_lag_max_ms"] == pytest.approx(5.0)


# -- the main job's quick run: every backend within a small budget (issue #18) ---------------
SEVEN = ["memory", "sqlite", "redis", "redlock", "etcd", "zookeeper", "postgres"]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str, str]:
    # As scripts/main runs it, with a budget a fifth of the main job's.
    data, done = bench(tmp_path_factory.mktemp("quick"), "--quick", "--budget", "10", timeout=120)
    return data, done.stdout, done.stderr


def table_rows(stdout: str) -> dict[str, list[str]]:
    lines = [line for line in stdout.splitlines() if line.startswith("| ")]
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[1:]]
    return {row[0]: row for row in cells}


def test_the_quick_run_lists_all_seven_backends_in_one_table(
    quick_run: tuple[dict[str, Any], str, str],
) -> None:
    data, stdout, stderr = quick_run
    assert list(data["backends"]) == SEVEN
    rows = table_rows(stdout)
    assert list(rows) == SEVEN
    for name, entry in data["backends"].items():
        row = rows[name]
        if entry["status"] != "measured":
            # A server that is not installed is said to be missing, with the reason below.
            assert row[1] == entry["status"] == "not available"
            assert f"{name}: {entry['reason']}" in stdout
            continue
        # Every backend got its share: no column of the table was skipped or failed.
        assert not {"skipped", "error", "not run", "-"} & set(row[1:]), row
        for key in ("floor", "uncontended"):
            assert entry[key]["n"] > 0
        assert [r for r in entry["contention_tasks"] if (r["contenders"], r["hold_ms"]) == (8, 0)]
        assert sum(entry["loss_to_cancel"]["outcomes"].values()) >= 1
    # Progress went to stderr as the run went, the table (only) to stdout.
    assert "plan: 7 backends" in stderr
    for name in SEVEN:
        assert f"\n{name}: " in stderr
    assert "## Uncontended" not in stdout
    # Every server the run started says how long it took to start.
    assert set(data["servers"]["started"]) <= {"redis", "redlock", "etcd", "zookeeper", "postgres"}
    assert all(positive(seconds) for seconds in data["servers"]["started"].values())
