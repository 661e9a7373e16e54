"""One contender process: ``python -m benchmarks._worker CONFIG_JSON``.

It connects, says ``{"ready": true}`` on stdout, then for each line ``{"started", "ended",
"hold", "grace"}`` on stdin takes the lock in turn between those monotonic times (one clock for
every process on a Linux host) and answers with its holds; ``{"exit": true}`` ends it.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import anyio
import anyio.to_thread

import asynclock


def _say(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


async def _main(config: dict[str, Any]) -> None:
    name: str = config["name"]
    ttl = float(config["ttl"])
    async with asynclock.connect(config["url"], **config["options"]) as locks:
        _say({"ready": True})
        while True:
            line = await anyio.to_thread.run_sync(sys.stdin.readline)
            if not line:
                return
            order = json.loads(line)
            if order.get("exit"):
                return
            started, ended = float(order["started"]), float(order["ended"])
            hold, grace = float(order["hold"]), float(order["grace"])
            holds: list[tuple[float, float]] = []
            failures = 0
            await anyio.sleep(max(0.0, started - time.monotonic()))
            with anyio.move_on_at(anyio.current_time() + (ended + grace - time.monotonic())):
                while time.monotonic() < ended:
                    try:
                        async with locks.lock(
                            name, ttl=ttl, timeout=max(0.05, ended + grace - time.monotonic())
                        ):
                            acquired = time.monotonic()
                            if hold:
                                await anyio.sleep(hold)
                            released = time.monotonic()
                    except asynclock.AcquireTimeout:
                        failures += 1
                        continue
                    holds.append((acquired, released))
            _say({"holds": holds, "failed_attempts": failures})


def main() -> None:
    config = json.loads(sys.argv[1])
    try:
        anyio.run(_main, config)
    except Exception as exc:
        _say({"error": f"{type(exc).__name__}: {exc}"})
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
