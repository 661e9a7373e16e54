"""The workers of tests/integrations/test_job_queues.py, each started by its queue's own command:

* ``arq tests.integrations.jobqueue_workers.ArqSettings``
* ``saq tests.integrations.jobqueue_workers.saq_settings``
* ``taskiq worker tests.integrations.jobqueue_workers:broker``

Each queue has two jobs on the lock per account: "deferring" (``timeout=0``: a busy lock defers
the job in the queue's own way) and "waiting" (waits up to ``WAIT`` for the lock; its batch stops
a worker past the ttl while it holds one, see ``Recorder``). A worker opens
its lock client and the recorder at start-up and closes them at shutdown.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

from arq.connections import RedisSettings
from arq.worker import func
from saq import Queue
from taskiq import TaskiqEvents, TaskiqState

from asynclock.integrations import arq, saq, taskiq

from .jobqueue_common import (
    DB,
    HOLD,
    LOCK_URL,
    PORT,
    QUEUE_URL,
    TEMPLATE,
    WAIT,
    Recorder,
    RedisListBroker,
    RedisResultBackend,
)

recorder = Recorder()
DEFERRING: dict[str, Any] = {"ttl": 5, "timeout": 0, "defer": HOLD * 10}
WAITING: dict[str, Any] = {"ttl": 1, "timeout": WAIT}  # its batch pauses a holder past the ttl

# -- arq ----------------------------------------------------------------------------------------

arq_locks = arq.WorkerLocks(LOCK_URL)


@arq.locked(TEMPLATE, **DEFERRING)
async def arq_deferring(ctx: dict[str, Any], account: str, job_id: int) -> str:
    return await recorder.job("deferring", account, job_id)


@arq.locked(TEMPLATE, **WAITING)
async def arq_waiting(ctx: dict[str, Any], account: str, job_id: int) -> str:
    return await recorder.job("waiting", account, job_id)


async def arq_startup(ctx: dict[str, Any]) -> None:
    await arq_locks.on_startup(ctx)
    await recorder.open()


async def arq_shutdown(ctx: dict[str, Any]) -> None:
    await recorder.close()
    await arq_locks.on_shutdown(ctx)


class ArqSettings:
    functions: ClassVar = [
        func(arq_deferring, name="deferring"),  # type: ignore[arg-type]
        func(arq_waiting, name="waiting"),  # type: ignore[arg-type]
    ]
    redis_settings = RedisSettings(host="127.0.0.1", port=PORT, database=DB)
    on_startup = arq_startup
    on_shutdown = arq_shutdown
    max_jobs = 5
    poll_delay = 0.01
    job_timeout = 60
    keep_result = 600


# -- saq ----------------------------------------------------------------------------------------

# saq logs every retried failure with a traceback; deferrals are expected, other errors are not.
logging.getLogger("saq").addFilter(saq.QuietDeferrals())
saq_locks = saq.WorkerLocks(LOCK_URL)


@saq.locked(TEMPLATE, **DEFERRING)
async def saq_deferring(ctx: Any, *, account: str, job_id: int) -> str:
    return await recorder.job("deferring", account, job_id)


@saq.locked(TEMPLATE, **WAITING)
async def saq_waiting(ctx: Any, *, account: str, job_id: int) -> str:
    return await recorder.job("waiting", account, job_id)


async def saq_startup(ctx: Any) -> None:
    await saq_locks.startup(ctx)
    await recorder.open()


async def saq_shutdown(ctx: Any) -> None:
    await recorder.close()
    await saq_locks.shutdown(ctx)


saq_settings: dict[str, Any] = {
    "queue": Queue.from_url(QUEUE_URL, name="jobqueue"),
    "functions": [("deferring", saq_deferring), ("waiting", saq_waiting)],
    "concurrency": 5,
    "startup": saq_startup,
    "shutdown": saq_shutdown,
}

# -- taskiq -------------------------------------------------------------------------------------

broker = RedisListBroker(QUEUE_URL, queue_name="jobqueue").with_result_backend(
    RedisResultBackend(QUEUE_URL)
)
taskiq.WorkerLocks(LOCK_URL).install(broker)


@broker.task(task_name="jobqueue.deferring")
@taskiq.locked(TEMPLATE, **DEFERRING)
async def taskiq_deferring(account: str, job_id: int) -> str:
    return await recorder.job("deferring", account, job_id)


@broker.task(task_name="jobqueue.waiting")
@taskiq.locked(TEMPLATE, **WAITING)
async def taskiq_waiting(account: str, job_id: int) -> str:
    return await recorder.job("waiting", account, job_id)


@broker.on_event(TaskiqEvents.WORKER_STARTUP)
async def open_recorder(state: TaskiqState) -> None:
    await recorder.open()


@broker.on_event(TaskiqEvents.WORKER_SHUTDOWN)
async def close_recorder(state: TaskiqState) -> None:
    await recorder.close()
