"""saq jobs that hold a lock per account: ``asynclock.integrations.saq``.

    python examples/jobs_saq.py                                         # starts a redis-server
    ASYNCLOCK_REDIS_URL=redis://127.0.0.1:6379/0 python examples/jobs_saq.py

Twelve settlement jobs on three accounts go to a saq queue, and a saq worker runs four at a time.
A job whose account is being settled by another job is not failed: it is scheduled again a moment
later (saq's retry, with one retry added so that the deferral costs the job none of its own). The
worker opens its lock client in ``startup`` and closes it in ``shutdown``. The script prints each
job and how often it was deferred, and exits with status 1 if two jobs on one account overlapped
or a job failed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import uuid
from collections import Counter
from contextlib import ExitStack

from saq import Queue, Worker
from saq.job import TERMINAL_STATUSES, Status
from saq.types import Context

import asynclock
from asynclock.integrations.saq import QuietDeferrals, WorkerLocks, locked

# saq logs each retried failure with its traceback, deferrals included; those are expected here.
logging.getLogger("saq").addFilter(QuietDeferrals())

ACCOUNTS = ["alice", "bob", "carol"]
running: Counter[str] = Counter()
overlaps: list[str] = []


# defer=0: straight back to the end of the queue; a longer deferral waits for saq's scheduler,
# which looks for due jobs once a second.
@locked("accounts/{account}", ttl=10, timeout=0, defer=0)
async def settle(ctx: Context, *, account: str, job_id: int) -> str:
    running[account] += 1
    if running[account] > 1:
        overlaps.append(account)
    try:
        await asyncio.sleep(0.02)  # the settlement, while holding the account's lock
        return f"settled with token {asynclock.current_token()}"
    finally:
        running[account] -= 1


async def demo(redis_url: str) -> bool:
    run = uuid.uuid4().hex[:8]  # keys of their own, so a shared Redis is left as it was
    lock_url = f"{redis_url}?prefix=example-{run}:&durability_warning=false"
    print(f"locks on {redis_url}")
    worker_locks = WorkerLocks(lock_url)
    queue = Queue.from_url(redis_url, name=f"example-saq-{run}")
    await queue.connect()
    try:
        worker = Worker(
            queue,
            functions=[settle],
            startup=worker_locks.startup,
            shutdown=worker_locks.shutdown,
            concurrency=4,
        )
        # The worker sweeps the queue as it starts, and saq's sweep aborts a job that a worker
        # has just taken but not yet marked active. Sweeping now, before any job is queued,
        # holds the worker's sweep off for `lock` seconds, past the end of this demo.
        await queue.sweep(lock=120)
        jobs = []
        for n in range(12):
            job = await queue.enqueue("settle", account=ACCOUNTS[n % len(ACCOUNTS)], job_id=n)
            assert job is not None
            jobs.append(job)
        running_worker = asyncio.create_task(worker.start())
        # Polled, not job.refresh(until_complete=...): that reads the job, then subscribes to its
        # updates, and misses a job that completes in between (it then waits out its timeout).
        async with asyncio.timeout(30):
            for job in jobs:
                while job.status not in TERMINAL_STATUSES:
                    await asyncio.sleep(0.02)
                    await job.refresh()
        await worker.stop()  # shutdown, from another task than the worker's start-up
        await running_worker
        failed = 0
        for job in jobs:
            if job.status is not Status.COMPLETE:
                failed += 1
            deferrals = job.meta.get("asynclock", {}).get("deferrals", 0)
            assert job.kwargs is not None
            print(
                f"job {job.kwargs['job_id']:2} on {job.kwargs['account']:5}: "
                f"{job.result or job.status} (deferrals: {deferrals})"
            )
    finally:
        await queue.disconnect()
    print(f"overlapping jobs on one account: {len(overlaps)}; failed jobs: {failed}")
    return not overlaps and failed == 0


def main() -> int:
    with ExitStack() as stack:
        redis_url = os.environ.get("ASYNCLOCK_REDIS_URL")
        if redis_url is None:
            from asynclock.testing import RedisServer

            redis_url = stack.enter_context(RedisServer()).url
        ok = asyncio.run(demo(redis_url))
    print("as expected" if ok else "NOT as expected")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
