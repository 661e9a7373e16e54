"""taskiq tasks that hold a lock per account: ``asynclock.integrations.taskiq``.

    python examples/jobs_taskiq.py                                      # starts a redis-server
    ASYNCLOCK_REDIS_URL=redis://127.0.0.1:6379/0 python examples/jobs_taskiq.py

Twelve settlement tasks on three accounts are sent at once. A task whose account is being settled
by another task is not failed: it waits a moment without the lock and requeues itself (same task
id, so ``wait_result()`` gets the result of the run that held the lock). ``WorkerLocks`` opens the
lock client on ``WORKER_STARTUP`` and closes it on ``WORKER_SHUTDOWN``. The locks are on Redis;
the broker here is taskiq's ``InMemoryBroker``, so that the script runs on its own: with a Redis
broker and ``taskiq worker`` processes the task code is the same. The script prints each task and
how often it was deferred, and exits with status 1 if two tasks on one account overlapped or a
task failed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import uuid
from collections import Counter
from contextlib import ExitStack

from taskiq import InMemoryBroker

import asynclock
from asynclock.integrations.taskiq import WorkerLocks, locked

# taskiq warns "skipped setting result" for every requeued run; here those are the deferrals.
logging.getLogger("taskiq.receiver.receiver").setLevel(logging.ERROR)

ACCOUNTS = ["alice", "bob", "carol"]
running: Counter[str] = Counter()
overlaps: list[str] = []
broker = InMemoryBroker()


@broker.task
@locked("accounts/{account}", ttl=10, timeout=0, defer=0.02)
async def settle(account: str, job_id: int) -> str:
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
    print(f"locks on {redis_url}")
    WorkerLocks(f"{redis_url}?prefix=example-{run}:&durability_warning=false").install(broker)
    await broker.startup()  # WORKER_STARTUP: the lock client opens
    failed = 0
    try:
        sent = [await settle.kiq(ACCOUNTS[n % len(ACCOUNTS)], n) for n in range(12)]
        for n, task in enumerate(sent):
            result = await task.wait_result(timeout=30)
            failed += result.is_err
            deferrals = result.labels.get("X-Taskiq-requeue", 0)
            print(
                f"job {n:2} on {ACCOUNTS[n % len(ACCOUNTS)]:5}: "
                f"{result.error or result.return_value} (deferrals: {deferrals})"
            )
        await broker.wait_all()
    finally:
        await broker.shutdown()  # WORKER_SHUTDOWN: the lock client closes
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
