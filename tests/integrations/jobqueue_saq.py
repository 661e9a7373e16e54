"""The saq worker of tests/integrations/test_job_queues.py: ``saq tests.integrations.jobqueue_saq.settings``."""

from __future__ import annotations

import logging
from typing import Any

from saq import Queue
from saq.types import Context

from asynclock.integrations.saq import QuietDeferrals, WorkerLocks, locked

from .jobqueue_common import HOLD, LOCK_URL, QUEUE_URL, TEMPLATE, WAIT, Recorder

QUEUE_NAME = "jobqueue"

# saq logs every retried failure with a traceback; deferrals are expected, other errors are not.
logging.getLogger("saq").addFilter(QuietDeferrals())

worker_locks = WorkerLocks(LOCK_URL)
recorder = Recorder()


@locked(TEMPLATE, ttl=5, timeout=0, defer=HOLD * 10)
async def deferring(ctx: Context, *, account: str, job_id: int) -> str:
    return await recorder.job("deferring", account, job_id)


@locked(TEMPLATE, ttl=5, timeout=WAIT)
async def waiting(ctx: Context, *, account: str, job_id: int) -> str:
    return await recorder.job("waiting", account, job_id)


async def startup(ctx: Context) -> None:
    await worker_locks.startup(ctx)
    await recorder.open()


async def shutdown(ctx: Context) -> None:
    await recorder.close()
    await worker_locks.shutdown(ctx)


settings: dict[str, Any] = {
    "queue": Queue.from_url(QUEUE_URL, name=QUEUE_NAME),
    "functions": [deferring, waiting],
    "concurrency": 5,
    "startup": startup,
    "shutdown": shutdown,
}
