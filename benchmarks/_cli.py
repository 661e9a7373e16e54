"""``asynclock bench`` / ``python -m benchmarks``: options, servers, the run, the files written."""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio

from . import _report, _screen
from ._fairness import Fairness
from ._peers import PEERS, Peer
from ._plan import Plan
from ._servers import BACKENDS, Endpoint, NotAvailable, start_all
from ._suite import LogCounter, Settings, measure_alternated, measure_peer, measure_target
from ._targets import TARGETS, Target, make_target, package_version

RESULTS = Path(__file__).resolve().parent / "results"
#: Seconds the budget keeps for stopping the servers (0.7-0.8 s for all of them here).
STOP_RESERVE = 1.5

DESCRIPTION = """\
Measure asynclock's backends (and, with --peers, the peer libraries) on real servers started on
127.0.0.1 through asynclock.testing, within a time budget shared out across them, and print a
one-screen table of every backend side by side, each figure beside the raw round trip of the
same client library (a full run prints the full report before it). Backends whose module or
server is missing are listed as not available. Results go to benchmarks/results/ (latest.json,
latest.md with the full report, latest.png).
"""


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="asynclock bench", description=DESCRIPTION)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="short runs (a few hundred iterations, 0.4 s contention runs, fewer locks); "
        "every backend fits in 50 s with --budget 50 (what scripts/main runs)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="the shortest run that goes through every measurement once (for the test "
        "suite; its numbers mean nothing)",
    )
    parser.add_argument(
        "--backends",
        default=",".join(BACKENDS),
        metavar="NAMES",
        help=f"comma-separated backends to measure (default: all of {','.join(BACKENDS)}); "
        "sqlite, the embedded one, is always included",
    )
    parser.add_argument(
        "--url",
        action="append",
        default=[],
        metavar="NAME=URL",
        help="use this already running server for backend NAME (loopback only) instead of "
        "starting one, e.g. --url redis=redis://127.0.0.1:6379/0; repeatable",
    )
    parser.add_argument(
        "--peers",
        action="store_true",
        help="also measure redis-py Lock, python-redis-lock, pottery, aioredlock, aetcd, aiozk, "
        "kazoo and a bare asyncpg advisory lock on the same servers",
    )
    parser.add_argument(
        "--processes",
        choices=("embedded", "all", "none"),
        default="all",
        help="contention between processes, one client each: for every backend and peer "
        "(default), for the embedded backend only, or not at all",
    )
    parser.add_argument(
        "--waiters",
        type=int,
        default=None,
        metavar="W",
        help="fairness runs: waiters started in a known order (default 1000; --quick 40)",
    )
    parser.add_argument(
        "--spacing-ms",
        type=float,
        default=None,
        metavar="D",
        help="fairness runs: milliseconds between two waiters' starts (default 2)",
    )
    parser.add_argument(
        "--fair-processes",
        type=int,
        default=None,
        metavar="P",
        help="fairness runs: processes the waiters are spread over, one client each "
        "(default 4; --quick 2)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help="the run's time in seconds, servers' start and stop included, shared out across "
        "the backends (a peer gets half a share): each always gets the summary's figures, "
        "with fewer iterations if its share is short, and what else fits "
        "(default 570, --quick 240, --smoke 60)",
    )
    parser.add_argument(
        "--output-dir",
        type=Path,
        default=RESULTS,
        help="where latest.json, latest.md and latest.png go (default: benchmarks/results)",
    )
    parser.add_argument("--no-chart", action="store_true", help="do not draw the PNG chart")
    parser.add_argument(
        "--render",
        type=Path,
        metavar="JSON",
        help="measure nothing: redraw the Markdown and the chart from a results JSON",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return parser


def _stop_on_signals() -> None:
    """Ctrl-C and SIGTERM end the run through its ``finally`` blocks, so that every server it
    started is stopped (a shell starts background jobs with SIGINT ignored; restore it)."""
    if threading.current_thread() is not threading.main_thread():
        return

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _stop_on_signals()
    if args.render is not None:
        data = json.loads(args.render.read_text())
        return _write(data, args.output_dir, chart=not args.no_chart)
    urls: dict[str, str] = {}
    for item in args.url:
        name, sep, url = item.partition("=")
        if not sep or name not in BACKENDS:
            raise SystemExit(
                f"--url takes NAME=URL with NAME one of {', '.join(BACKENDS)}; got {item!r}"
            )
        urls[name] = url
    selected = [name.strip() for name in args.backends.split(",") if name.strip()]
    unknown = sorted(set(selected) - set(BACKENDS))
    if unknown:
        raise SystemExit(f"unknown backends: {', '.join(unknown)} (known: {', '.join(BACKENDS)})")
    if "sqlite" not in selected:
        selected.append("sqlite")
    selected = [name for name in BACKENDS if name in selected]
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    budget = (
        args.budget if args.budget is not None else {"smoke": 60.0, "quick": 240.0}.get(mode, 570.0)
    )
    settings = Settings.make(mode=mode, budget=budget, processes=args.processes, quiet=args.quiet)
    if (args.waiters, args.spacing_ms, args.fair_processes) != (None, None, None):
        default = settings.fairness
        fairness = Fairness(
            max(1, args.waiters if args.waiters is not None else default.waiters),
            max(0.0, args.spacing_ms / 1e3 if args.spacing_ms is not None else default.spacing),
            max(1, args.fair_processes or default.processes),
        )
        settings = replace(settings, fairness=fairness)
    data = run(selected, urls, settings, peers=args.peers)
    return _write(data, args.output_dir, chart=not args.no_chart)


def _write(data: dict[str, Any], directory: Path, *, chart: bool) -> int:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "latest.json").write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    table = _report.markdown(data)
    (directory / "latest.md").write_text(table)
    if chart:
        try:
            _report.chart(data, directory / "latest.png")
        except ImportError as exc:
            chart = False
            print(f"no chart: {exc} (pip install matplotlib)", file=sys.stderr)
        except (
            Exception
        ) as exc:  # the figures are written already; a drawing bug must not hide them
            chart = False
            print(f"no chart: {type(exc).__name__}: {exc}", file=sys.stderr)
    # A quick run ends with the summary alone (the full report is in the file); a full run
    # prints the full report, then the summary, so that the summary is what stays on screen.
    if data.get("settings", {}).get("mode") not in ("quick", "smoke"):
        print(table)
    print(_screen.screen(data), end="")
    print(
        f"written: {directory / 'latest.json'}, latest.md (the full report)"
        + (", latest.png" if chart else "")
    )
    return 0


def _machine() -> dict[str, Any]:
    model = "?"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as file:
            for line in file:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    system = platform.platform()
    try:
        with open("/etc/os-release", encoding="utf-8") as file:
            for line in file:
                if line.startswith("PRETTY_NAME="):
                    system = line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return {
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "os": system,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "load_start": _load(),
    }


def _commit() -> str:
    """The checkout's commit (with "+changes" when the work tree differs from it)."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "asynclock"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"
    return (head or "?") + ("+changes" if dirty else "")


def _load() -> str:
    try:
        return " ".join(f"{value:.1f}" for value in os.getloadavg())
    except OSError:
        return "?"


def run(
    selected: list[str], urls: dict[str, str], settings: Settings, *, peers: bool
) -> dict[str, Any]:
    """Start the servers, measure, stop the servers; returns the results (JSON-ready)."""
    say = settings.progress
    began = time.monotonic()
    tag = uuid.uuid4().hex[:8]
    data: dict[str, Any] = {
        "schema": 1,
        "started_at": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "settings": settings.settings_record(),
        "machine": _machine(),
        "versions": {
            "asynclock": package_version("asynclock"),
            "asynclock commit": _commit(),
            "anyio": package_version("anyio"),
            "python": platform.python_version(),
        },
        "backends": {},
        "peers": {},
        "floors": {},
    }
    # The peers of the backends being measured, on the same servers.
    peer_objects = [peer for peer in PEERS if peers and peer.compare_with in selected]
    kinds = {kind for name in selected if (kind := BACKENDS[name])}
    kinds |= {peer.server for peer in peer_objects}
    with ExitStack() as stack:
        workdir = Path(
            stack.enter_context(
                tempfile.TemporaryDirectory(prefix="asynclock-bench-", dir=_ram_dir())
            )
        )
        endpoints, data["servers"] = start_all(kinds, urls, stack, say)
        targets: list[Target] = []
        for name in selected:
            kind = BACKENDS[name]
            endpoint = endpoints.get(kind) if kind is not None else None
            if name == "sqlite" and "sqlite" in urls:
                endpoint = endpoint_from_sqlite(urls["sqlite"])
            if isinstance(endpoint, NotAvailable):
                data["backends"][name] = {"status": "not available", "reason": str(endpoint)}
                continue
            try:
                targets.append(make_target(name, endpoint, workdir, tag))
            except NotAvailable as exc:
                data["backends"][name] = {"status": "not available", "reason": str(exc)}
                say(f"{name}: not available: {exc}")
        available_peers: list[Peer] = []
        for peer_class in peer_objects:
            endpoint = endpoints.get(peer_class.server)
            if not isinstance(endpoint, Endpoint):
                data["peers"][peer_class.name] = {
                    "status": "not available",
                    "server": peer_class.server,
                    "reason": f"no {peer_class.server} server: {endpoint}",
                }
                continue
            peer = peer_class(endpoint)
            try:
                peer.check()
            except NotAvailable as exc:
                data["peers"][peer_class.name] = {
                    "status": "not available",
                    "server": peer_class.server,
                    "reason": str(exc),
                }
                continue
            available_peers.append(peer)
        # Stopping the servers comes out of the budget too (well under a second each here).
        names = {target.name for target in targets}
        plan = Plan.make(
            settings.deadline - (STOP_RESERVE if data["servers"]["started"] else 0.2),
            [target.name for target in targets],
            [peer.name for peer in available_peers],
            [p.name for p in available_peers if p.alternated and p.compare_with in names],
        )
        say(
            f"plan: {len(targets)} backends, {len(available_peers)} peers in "
            f"{max(0.0, plan.deadline - time.monotonic()):.0f} s: about "
            f"{plan.per_backend():.1f} s a backend"
        )
        measured = anyio.run(_measure, targets, available_peers, endpoints, settings, plan, tag)
        for name in selected:
            if name in measured["backends"]:
                data["backends"][name] = measured["backends"][name]
        data["backends"] = {
            name: data["backends"][name] for name in selected if name in data["backends"]
        }
        data["peers"].update(measured["peers"])
        data["peers"] = {
            peer.name: data["peers"][peer.name] for peer in PEERS if peer.name in data["peers"]
        }
        data["floors"] = measured["floors"]
        data["versions"].update(measured["versions"])
        say("stopping servers")
        stopping = time.monotonic()
    data["servers"]["stop_s"] = time.monotonic() - stopping
    data["machine"]["load_end"] = _load()
    data["seconds"] = time.monotonic() - began
    data["targets"] = _report.evaluate_targets(data)
    return data


def endpoint_from_sqlite(url: str) -> Endpoint:
    return Endpoint("sqlite", url, (("127.0.0.1", 0),), started=False)


def _ram_dir() -> str | None:
    """The embedded backend's file goes where the servers keep their data: RAM if possible."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) else None


async def _measure(
    targets: list[Target],
    peers: list[Peer],
    endpoints: dict[str, Endpoint | NotAvailable],
    settings: Settings,
    plan: Plan,
    tag: str,
) -> dict[str, Any]:
    logger = logging.getLogger("asynclock")
    counter = LogCounter()
    logger.addHandler(counter)
    try:
        return await _measure_all(targets, peers, endpoints, settings, plan, tag, counter)
    finally:
        logger.removeHandler(counter)


async def _measure_all(
    targets: list[Target],
    peers: list[Peer],
    endpoints: dict[str, Endpoint | NotAvailable],
    settings: Settings,
    plan: Plan,
    tag: str,
    counter: LogCounter,
) -> dict[str, Any]:
    """Each backend, then its peers, each within its share of the plan (``_plan``)."""

    def share(unit: str) -> Settings:
        return replace(settings, deadline=plan.share(unit))

    results: dict[str, Any] = {"backends": {}, "peers": {}, "floors": {}, "versions": {}}
    done: set[str] = set()
    for target in targets:
        entry = await measure_target(target, share(f"backend {target.name}"), tag)
        entry["log"] = counter.take()
        results["backends"][target.name] = entry
        results["versions"].update(entry.get("versions", {}))
        if isinstance(entry.get("floor"), dict) and "p50_ms" in entry["floor"]:
            kind = BACKENDS[target.name]
            if kind is not None:
                results["floors"][kind] = entry["floor"]
        for peer in peers:
            if peer.compare_with == target.name and peer.name not in done:
                results["peers"][peer.name] = await measure_peer(
                    peer, share(f"peer {peer.name}"), tag
                )
                if peer.alternated:
                    results["peers"][peer.name]["alternated"] = await measure_alternated(
                        target, peer, entry, results["peers"][peer.name],
                        share(f"alternated {peer.name}"), tag,
                    )  # fmt: skip
                counter.take()
                done.add(peer.name)
    # Peers whose asynclock backend was not measured still run, with a floor of their own.
    for peer in peers:
        if peer.name in done:
            continue
        if peer.server not in results["floors"]:
            endpoint = endpoints[peer.server]
            assert isinstance(endpoint, Endpoint)
            floor_target = TARGETS[peer.server](endpoint.url, {}, endpoint)
            from ._contend import time_op
            from ._stats import summarize

            try:
                async with floor_target.floor() as op:
                    results["floors"][peer.server] = {
                        "label": floor_target.floor_label,
                        **summarize(await time_op(op, settings.floor)),
                    }
            except Exception as exc:
                settings.progress(f"floor of {peer.server}: {type(exc).__name__}: {exc}")
        results["peers"][peer.name] = await measure_peer(peer, share(f"peer {peer.name}"), tag)
    for peer in peers:
        results["versions"][peer.distribution] = peer.version()
    return results
