"""arq jobs that hold a lock per account: ``asynclock.integrations.arq``.

    python examples/jobs_arq.py                                         # starts a redis-server
    ASYNCLOCK_REDIS_URL=redis://127.0.0.1:6379/0 python examples/jobs_arq.py

Twelve settlement jobs on three accounts go to an arq queue, and an arq worker runs four at a
time. A job whose account is being settled by another job is not failed: it raises arq's
``Retry`` and comes back a moment later (on its last try it waits for the lock instead). The
worker opens its lock client in ``on_startup`` and closes it in ``on_shutdown``. The script
prints each job and how often it was deferred, and exits with status 1 if two jobs on one account
overlapped or a job failed.
"""

from __future__ import annotations

import asyncio
import os
import sys
import uuid
import warnings
from collections import Counter
from contextlib import ExitStack
from typing import Any

from arq import Worker, create_pool
from arq.connections import RedisSettings

import asynclock
from asynclock.integrations.arq import WorkerLocks, locked

# arq 0.28's Worker.close() calls redis-py's deprecated close(); not ours to fix here.
warnings.filterwarnings("ignore", "Call to deprecated close", DeprecationWarning)

ACCOUNTS = ["alice", "bob", "carol"]
running: Counter[str] = Counter()
overlaps: list[str] = []


@locked("accounts/{account}", ttl=10, timeout=0, defer=0.05)
async def settle(ctx: dict[str, Any], account: str, job_id: int) -> str:
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
    settings = RedisSettings.from_dsn(redis_url)
    queue = f"example-arq-{run}"
    pool = await create_pool(settings, default_queue_name=queue)
    try:
        jobs = [await pool.enqueue_job("settle", ACCOUNTS[n % len(ACCOUNTS)], n) for n in range(12)]
        worker = Worker(
            functions=[settle],  # type: ignore[list-item]
            queue_name=queue,
            redis_settings=settings,
            on_startup=worker_locks.on_startup,
            on_shutdown=worker_locks.on_shutdown,
            max_jobs=4,
            burst=True,  # stop when the queue is empty (a real worker runs until stopped)
            handle_signals=False,
            poll_delay=0.01,
            keep_result=60,
        )
        # As `arq` does: the worker's main loop in one task, its shutdown in another.
        await asyncio.create_task(worker.main())
        await worker.close()
        failed = 0
        for job in jobs:
            assert job is not None
            info = await job.result_info()
            assert info is not None
            if not info.success:
                failed += 1
            print(
                f"job {info.args[1]:2} on {info.args[0]:5}: {info.result} "
                f"(deferrals: {info.job_try - 1})"
            )
    finally:
        await pool.aclose()
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
