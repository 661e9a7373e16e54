"""The arq worker of tests/integrations/test_job_queues.py: ``arq tests.integrations.jobqueue_arq.WorkerSettings``."""

from __future__ import annotations

from typing import Any, ClassVar

from arq.connections import RedisSettings

from asynclock.integrations.arq import WorkerLocks, locked

from .jobqueue_common import DB, HOLD, LOCK_URL, PORT, TEMPLATE, WAIT, Recorder

worker_locks = WorkerLocks(LOCK_URL)
recorder = Recorder()


@locked(TEMPLATE, ttl=5, timeout=0, defer=HOLD * 10)
async def deferring(ctx: dict[str, Any], account: str, job_id: int) -> str:
    return await recorder.job("deferring", account, job_id)


@locked(TEMPLATE, ttl=5, timeout=WAIT)
async def waiting(ctx: dict[str, Any], account: str, job_id: int) -> str:
    return await recorder.job("waiting", account, job_id)


async def startup(ctx: dict[str, Any]) -> None:
    await worker_locks.on_startup(ctx)
    await recorder.open()


async def shutdown(ctx: dict[str, Any]) -> None:
    await recorder.close()
    await worker_locks.on_shutdown(ctx)


class WorkerSettings:
    functions: ClassVar = [deferring, waiting]
    redis_settings = RedisSettings(host="127.0.0.1", port=PORT, database=DB)
    on_startup = startup
    on_shutdown = shutdown
    max_jobs = 5
    poll_delay = 0.01
    job_timeout = 60
    keep_result = 600
