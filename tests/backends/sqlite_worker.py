"""A separate OS process for the embedded backend's cross-process tests.

Usage: python -m tests.backends.sqlite_worker DB MODE [ARGS]
  count COUNTER_FILE N   increment a counter file N times under the lock (read, sleep, write)
                         and print "hold <token> <start> <end>" per hold
  hold NAME TTL          take NAME, print "held <token>", then hold it until killed; print
                         "lost <reason>" if the lease is lost
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import anyio

import asynclock


async def count(url: str, counter: Path, times: int) -> None:
    async with asynclock.connect(url) as locks:
        for _ in range(times):
            async with locks.lock("counter", ttl=5) as lease:
                start = time.monotonic()
                value = int(counter.read_text() or "0")  # noqa: ASYNC240 - a deliberate race
                await anyio.sleep(0.001)
                counter.write_text(str(value + 1))  # noqa: ASYNC240
                end = time.monotonic()
            print(f"hold {lease.token} {start!r} {end!r}", flush=True)


async def hold(url: str, name: str, ttl: float) -> None:
    async with asynclock.connect(url) as locks:
        try:
            async with locks.lock(name, ttl=ttl) as lease:
                print(f"held {lease.token}", flush=True)
                await anyio.sleep_forever()
        except asynclock.LeaseLost as exc:
            print(f"lost {exc.reason}", flush=True)


def main() -> None:
    db, mode, *args = sys.argv[1:]
    url = f"sqlite://{db}"
    if mode == "count":
        anyio.run(count, url, Path(args[0]), int(args[1]))
    elif mode == "hold":
        anyio.run(hold, url, args[0], float(args[1]))
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
