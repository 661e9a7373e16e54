"""``asynclock demo``: worker processes contend for one lock and print their fencing tokens."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import tempfile
import time

import anyio

from .. import _registry
from .._connect import connect


def demo_worker(url: str, worker: int, rounds: int, hold: float) -> None:
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


def demo(url: str | None, workers: int, rounds: int, hold: float) -> int:
    with tempfile.TemporaryDirectory(prefix="asynclock-demo-") as directory:
        url = url or f"sqlite://{directory}/locks.db"
        connect(url, require=("fencing",))  # it prints tokens: refused before a worker starts
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
            f"{'yes' if increasing else 'NO'}" + (f"; {failed} worker(s) FAILED" if failed else "")
        )
        return 1 if failed or overlaps or not increasing else 0
