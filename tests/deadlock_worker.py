"""A process that takes lock N, waits for every peer to hold theirs, then wants lock N+1.

Usage: python -m tests.deadlock_worker URL INDEX COUNT READY_DIR
Prints "deadlock <message>" if it was chosen to give up, "done" if it got both locks.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import anyio

import asynclock


async def main(url: str, index: int, count: int, ready: Path) -> None:
    async with asynclock.connect(
        url, deadlock_detection=True, deadlock_interval=0.2, label=f"worker{index}"
    ) as locks:
        async with locks.lock(f"ring/{index}", ttl=20):
            (ready / str(index)).touch()
            while len(list(ready.iterdir())) < count:  # noqa: ASYNC110, ASYNC240 - peers are processes
                await anyio.sleep(0.01)
            started = time.monotonic()
            try:
                async with locks.lock(f"ring/{(index + 1) % count}", ttl=20, timeout=30):
                    print("done", flush=True)
            except asynclock.DeadlockDetected as exc:
                print(f"deadlock {time.monotonic() - started:.3f} {exc}", flush=True)


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
