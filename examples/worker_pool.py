"""A plain asyncio worker pool whose jobs hold a lock per account: ``@asynclock.locked``.

    python examples/worker_pool.py                            # embedded SQLite backend
    ASYNCLOCK_URL=redis://127.0.0.1:6379 python examples/worker_pool.py

Four workers take jobs from an ``asyncio.Queue``. Jobs on different accounts run in parallel; jobs
on the same account never overlap, also across processes and hosts when the backend is shared
(run the script twice against one Redis). A job that raises (``LeaseLost`` included, when its
lease is lost and the job is cancelled) is recorded as failed, never as done. The script prints
each job and exits with status 1 if two jobs on one account overlapped.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from collections import Counter

import asynclock

ACCOUNTS = ["alice", "bob", "carol"]


async def demo(lock_url: str) -> bool:
    running: Counter[str] = Counter()
    overlaps: list[str] = []
    most_at_once = 0
    done: list[int] = []
    failed: dict[int, str] = {}

    async with asynclock.connect(lock_url) as locks:

        @asynclock.locked("accounts/{account}", client=locks, ttl=10, timeout=30)
        async def settle(account: str, job_id: int) -> None:
            nonlocal most_at_once
            running[account] += 1
            if running[account] > 1:
                overlaps.append(account)
            most_at_once = max(most_at_once, sum(running.values()))
            try:
                print(f"job {job_id:2} settles {account:5} with token {asynclock.current_token()}")
                await asyncio.sleep(0.05)
                if job_id == 7:
                    raise RuntimeError("the bank refused the transfer")
            finally:
                running[account] -= 1

        queue: asyncio.Queue[tuple[str, int]] = asyncio.Queue()
        for job_id in range(12):
            queue.put_nowait((ACCOUNTS[job_id % len(ACCOUNTS)], job_id))

        async def worker() -> None:
            while not queue.empty():
                account, job_id = queue.get_nowait()
                try:
                    await settle(account, job_id)
                except Exception as exc:  # LeaseLost, AcquireTimeout, the job's own errors
                    failed[job_id] = f"{type(exc).__name__}: {exc}"
                else:
                    done.append(job_id)

        async with asyncio.TaskGroup() as workers:
            for _ in range(4):
                workers.create_task(worker())

    print(f"done: {sorted(done)}")
    print(f"failed: {failed}")
    print(f"most jobs at once: {most_at_once}; overlapping jobs on one account: {len(overlaps)}")
    return not overlaps and len(done) == 11 and list(failed) == [7] and most_at_once > 1


def main() -> int:
    with tempfile.TemporaryDirectory() as directory:
        lock_url = os.environ.get("ASYNCLOCK_URL") or f"sqlite://{directory}/locks.db"
        print(f"locks on {lock_url}")
        ok = asyncio.run(demo(lock_url))
    print("as expected" if ok else "NOT as expected")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
