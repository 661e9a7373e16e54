"""The ``asynclock`` command: ``asynclock demo`` for now (``run``, ``status`` and ``bench`` follow).

``asynclock demo`` starts several worker *processes* that contend for one lock on the embedded
backend (or any URL) and print who held it, with which fencing token, so that the cross-process
exclusion and the strictly increasing tokens can be seen with nothing installed.
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

import anyio

from . import _registry
from ._client import connect
from ._errors import LockError


def _demo_worker(url: str, worker: int, rounds: int, hold: float) -> None:
    async def run() -> None:
        async with connect(url) as locks:
            for _ in range(rounds):
                async with locks.lock("demo", ttl=5, timeout=60) as lease:
                    started = time.monotonic()
                    await anyio.sleep(hold)
                    print(
                        f"worker {worker} (pid {os.getpid()}) held 'demo' with token "
                        f"{lease.token:>4} from {started:.3f} to {time.monotonic():.3f}",
                        flush=True,
                    )
                # Let the others have a turn; the embedded backend is not FIFO across processes.
                await anyio.sleep(hold / 2)

    anyio.run(run)


def _demo(url: str | None, workers: int, rounds: int, hold: float) -> int:
    with tempfile.TemporaryDirectory(prefix="asynclock-demo-") as directory:
        url = url or f"sqlite://{directory}/locks.db"
        print(f"{workers} processes contend for the lock 'demo' on {_registry.redact(url)}")
        command = [sys.executable, "-m", "asynclock", "_demo-worker", url]
        children = [
            subprocess.Popen(
                [*command, str(worker), str(rounds), str(hold)], stdout=subprocess.PIPE, text=True
            )
            for worker in range(1, workers + 1)
        ]
        lines: list[str] = []
        failed = 0
        for child in children:
            out, _ = child.communicate()
            lines.extend(out.splitlines())
            failed += child.returncode != 0
        # Sorted by the start of each hold: CLOCK_MONOTONIC is shared by the processes.
        lines.sort(key=lambda line: float(line.split(" from ")[1].split()[0]))
        tokens: list[int] = []
        overlaps = 0
        previous_end = 0.0
        for line in lines:
            print(line)
            tokens.append(int(line.split("token")[1].split()[0]))
            start, end = (float(part) for part in line.split(" from ")[1].split(" to "))
            overlaps += start < previous_end
            previous_end = end
        increasing = all(a < b for a, b in itertools.pairwise(tokens))
        print(
            f"{len(lines)} holds, {overlaps} overlapping, tokens strictly increasing: "
            f"{'yes' if increasing else 'NO'}"
        )
        return 1 if failed or overlaps or not increasing else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asynclock", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="processes contending for one lock, with tokens")
    demo.add_argument("--url", help="lock URL (default: a temporary SQLite file)")
    demo.add_argument("--workers", type=int, default=2)
    demo.add_argument("--rounds", type=int, default=5)
    demo.add_argument("--hold", type=float, default=0.05, help="seconds each hold lasts")
    worker = commands.add_parser("_demo-worker")
    worker.add_argument("url")
    worker.add_argument("worker", type=int)
    worker.add_argument("rounds", type=int)
    worker.add_argument("hold", type=float)
    args = parser.parse_args(argv)
    try:
        if args.command == "demo":
            return _demo(args.url, args.workers, args.rounds, args.hold)
        _demo_worker(args.url, args.worker, args.rounds, args.hold)
    except LockError as exc:
        print(f"asynclock: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    return 0
