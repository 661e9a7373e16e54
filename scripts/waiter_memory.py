"""Python heap per waiting task, on the benchmark's servers and targets (issue #18).

    PYTHONPATH=. .venv/bin/python scripts/waiter_memory.py [--waiters 200] [--runs 3] [backends]

Measured as ``benchmarks/_suite.py`` ``_memory`` measures it (tracemalloc; ``waiters`` tasks
started at once on one client, each in ``locks.lock(name, timeout=60)`` behind a holder; net of
as many bare parked tasks), with one difference: the figure is read once it has settled (the
server counts every waiter, and two reads 0.25 s apart agree within 1 %), not at a fixed 0.5 s.
Under tracemalloc, 200 waiters take 1-3 s to queue on the server backends, so the benchmark's
fixed read catches replies and listings still in flight and varies by 2x from run to run.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import tracemalloc
import uuid
from contextlib import ExitStack
from pathlib import Path

import anyio

from benchmarks._servers import BACKENDS, Endpoint, start_all
from benchmarks._targets import Target, make_target

#: PostgreSQL holds a server connection per waiter today (issue #18): the test server allows 300.
MAX_WAITERS = {"postgres": 250}
SETTLE_LIMIT = 120.0


def _traced() -> int:
    gc.collect()
    return tracemalloc.get_traced_memory()[0]


async def measure(target: Target, tag: str, waiters: int) -> tuple[float, float, float]:
    """(bytes per waiter net of a bare task, bytes per bare task, seconds until settled)."""
    tracemalloc.start()
    try:
        async with target.connect() as locks:
            async with locks.lock(f"{tag}-warm", ttl=target.long_ttl):
                pass
            release = anyio.Event()
            async with anyio.create_task_group() as group:
                before = _traced()
                for _ in range(waiters):
                    group.start_soon(release.wait)
                await anyio.sleep(0.05)
                bare = (_traced() - before) / waiters
                release.set()
            name = f"{tag}-wait"
            holder = await locks.acquire(name, ttl=target.long_ttl, timeout=30)

            async def wait() -> None:
                async with locks.lock(name, ttl=target.long_ttl, timeout=60):
                    pass

            async with anyio.create_task_group() as group:
                before = _traced()
                for _ in range(waiters):
                    group.start_soon(wait)
                started = anyio.current_time()
                with anyio.fail_after(SETTLE_LIMIT):
                    while (count := (await locks.inspect(name)).waiters) is not None:
                        if count >= waiters:
                            break
                        await anyio.sleep(0.05)
                    last = _traced()
                    while True:
                        await anyio.sleep(0.25)
                        now = _traced()
                        if abs(now - last) <= 0.01 * abs(last - before):
                            break
                        last = now
                settled = anyio.current_time() - started
                group.cancel_scope.cancel()
            await holder.release()
    finally:
        tracemalloc.stop()
    return (now - before) / waiters - bare, bare, settled


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "backends", nargs="?", default="memory,sqlite,redis,etcd,zookeeper,postgres"
    )
    parser.add_argument("--waiters", type=int, default=200)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    names = args.backends.split(",")
    with ExitStack() as stack, tempfile.TemporaryDirectory() as work:
        kinds = {kind for name in names if (kind := BACKENDS[name])}
        endpoints, _ = start_all(kinds, {}, stack, lambda line: None)
        for name in names:
            kind = BACKENDS[name]
            endpoint = endpoints.get(kind) if kind else None
            if endpoint is not None and not isinstance(endpoint, Endpoint):
                print(f"{name}: not available: {endpoint}")
                continue
            waiters = min(args.waiters, MAX_WAITERS.get(name, args.waiters))
            for run in range(args.runs):
                tag = uuid.uuid4().hex[:8]
                target = make_target(name, endpoint, Path(work), tag)
                per, bare, settled = anyio.run(measure, target, tag, waiters)
                print(
                    f"{name} run {run + 1}: {per / 1024:.1f} KiB per waiter ({waiters} waiters, "
                    f"settled after {settled:.1f} s; a bare task {bare:.0f} B)",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
