"""The taskiq worker of tests/integrations/test_job_queues.py:
``taskiq worker tests.integrations.jobqueue_taskiq:broker``."""

from __future__ import annotations

from taskiq import TaskiqEvents, TaskiqState

from asynclock.integrations.taskiq import WorkerLocks, locked

from .jobqueue_common import HOLD, LOCK_URL, QUEUE_URL, TEMPLATE, WAIT, Recorder
from .jobqueue_taskiq_redis import RedisListBroker, RedisResultBackend

QUEUE_NAME = "jobqueue"

broker = RedisListBroker(QUEUE_URL, queue_name=QUEUE_NAME).with_result_backend(
    RedisResultBackend(QUEUE_URL)
)
worker_locks = WorkerLocks(LOCK_URL).install(broker)
recorder = Recorder()


@broker.task(task_name="jobqueue.deferring")
@locked(TEMPLATE, ttl=5, timeout=0, defer=HOLD * 10)
async def deferring(account: str, job_id: int) -> str:
    return await recorder.job("deferring", account, job_id)


@broker.task(task_name="jobqueue.waiting")
@locked(TEMPLATE, ttl=5, timeout=WAIT)
async def waiting(account: str, job_id: int) -> str:
    return await recorder.job("waiting", account, job_id)


@broker.on_event(TaskiqEvents.WORKER_STARTUP)
async def open_recorder(state: TaskiqState) -> None:
    await recorder.open()


@broker.on_event(TaskiqEvents.WORKER_SHUTDOWN)
async def close_recorder(state: TaskiqState) -> None:
    await recorder.close()
