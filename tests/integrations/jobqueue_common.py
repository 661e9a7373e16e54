"""What the job-queue workers (jobqueue_workers.py) and their test share: the job body that
records what it did in Redis, and a small Redis broker for taskiq.

The workers read their settings from the environment the test gives them:

* ``JOBQUEUE_PORT``: the Redis server's port (127.0.0.1), for the queue and for the records;
* ``JOBQUEUE_DB``: the Redis database of the queue and the records;
* ``JOBQUEUE_LOCKS``: the asynclock URL the jobs' locks use.
"""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import signal
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, Final, TypeVar, cast

import redis.asyncio
from taskiq import AsyncBroker, AsyncResultBackend, BrokerMessage, TaskiqResult

import asynclock
from asynclock.fencing import RedisGuard

PORT: Final = int(os.environ.get("JOBQUEUE_PORT", "6379"))
DB: Final = int(os.environ.get("JOBQUEUE_DB", "8"))
LOCK_URL: Final = os.environ.get("JOBQUEUE_LOCKS", "memory://jobqueue")
QUEUE_URL: Final = f"redis://127.0.0.1:{PORT}/{DB}"

#: How long each job holds its lock, in seconds ("a few ms").
HOLD: Final = 0.003
#: The lock name every job takes: one per account.
TEMPLATE: Final = "jobqueue/{account}"
#: How long a waiting job waits for its lock before it is deferred after all.
WAIT: Final = 10.0


async def call(client: redis.asyncio.Redis, *args: str | int | float) -> Any:
    """One Redis command: redis-py types its list and set commands as sync-or-async, which
    strict mypy refuses to await."""
    command = cast(Callable[..., Awaitable[Any]], client.execute_command)
    return await command(*args)


def records_key(mode: str) -> str:
    return f"jobqueue:records:{mode}"


#: Each worker process adds its pid here once its start-up hooks have run.
READY_KEY: Final = "jobqueue:ready"
#: In the "waiting" batch, the worker that runs this job stops itself (SIGSTOP) while it holds
#: the job's lock, after writing its pid under PAUSED_KEY; the test resumes it past the ttl.
PAUSED_JOB: Final = 100
PAUSED_KEY: Final = "jobqueue:paused"


def runs_key(mode: str) -> str:
    return f"jobqueue:runs:{mode}"


class Recorder:
    """Records each job's start and end (system-wide monotonic clock, so comparable across
    processes), how many jobs of its key were active with it, its lease's token, and how often
    it ran."""

    def __init__(self) -> None:
        self._redis: redis.asyncio.Redis | None = None

    async def open(self) -> None:
        self._redis = redis.asyncio.Redis.from_url(QUEUE_URL)
        self._guard = RedisGuard(self._redis, prefix="jobqueue:fence:")
        await call(self._redis, "SADD", READY_KEY, os.getpid())

    async def close(self) -> None:
        client, self._redis = self._redis, None
        if client is not None:
            await client.aclose()

    async def job(self, mode: str, account: str, job_id: int) -> str:
        """The body of every test job; it runs while the job holds its lock."""
        client = self._redis
        assert client is not None, "the worker's start-up did not open the recorder"
        start = time.monotonic()
        run = await call(client, "HINCRBY", runs_key(mode), job_id, 1)
        # An independent check besides the intervals: more than one job of a key active at once.
        active_key = f"jobqueue:active:{account}"
        active = await client.incr(active_key)
        try:
            if (mode, job_id, run) == ("waiting", PAUSED_JOB, 1):
                await client.set(PAUSED_KEY, os.getpid())
                os.kill(os.getpid(), signal.SIGSTOP)
            await asyncio.sleep(HOLD)
        finally:
            await client.decr(active_key)
        end = time.monotonic()
        record = {
            "job": job_id,
            "account": account,
            "start": start,
            "end": end,
            "active": active,
            "pid": os.getpid(),
            "token": asynclock.current_token(),
        }
        # Fenced, and once per job: a holder past its lease is refused (StaleToken, so its job
        # runs again), and a job whose write went through writes nothing if it runs again.
        await self._guard.call(account, "HSETNX", records_key(mode), job_id, json.dumps(record))
        return f"job {job_id} done"


# taskiq-redis would be the usual choice, but the installed 1.0.x does not import with taskiq 0.13
# (it needs ``taskiq.compat.model_dump``, which 0.13 removed), and the releases that do need
# redis-py 6 or later, which arq (below 6) refuses in the same environment. This is the part of
# its ``ListQueueBroker`` and ``RedisAsyncResultBackend`` the tests need: LPUSH to send, BRPOP to
# receive (first in, first out), results pickled under a key per task id.

T = TypeVar("T")


class RedisListBroker(AsyncBroker):
    """Messages in one Redis list: LPUSH to send, BRPOP to receive."""

    def __init__(self, url: str, *, queue_name: str) -> None:
        super().__init__()
        self.url = url
        self.queue_name = queue_name
        self._redis = redis.asyncio.Redis.from_url(url)

    async def kick(self, message: BrokerMessage) -> None:
        await self._redis.lpush(self.queue_name, message.message)

    async def listen(self) -> AsyncGenerator[bytes, None]:
        while True:
            popped = await self._redis.brpop([self.queue_name], timeout=1)
            if popped is not None:
                yield popped[1]

    async def shutdown(self) -> None:
        await super().shutdown()
        await self._redis.aclose()


class RedisResultBackend(AsyncResultBackend[T]):
    """Each task's result, pickled, under ``<prefix><task id>``."""

    def __init__(self, url: str, *, prefix: str = "jobqueue:result:", ttl: int = 600) -> None:
        self.prefix = prefix
        self.ttl = ttl
        self._redis = redis.asyncio.Redis.from_url(url)

    async def shutdown(self) -> None:
        await self._redis.aclose()

    async def set_result(self, task_id: str, result: TaskiqResult[T]) -> None:
        await self._redis.set(self.prefix + task_id, pickle.dumps(result), ex=self.ttl)

    async def is_result_ready(self, task_id: str) -> bool:
        return bool(await self._redis.exists(self.prefix + task_id))

    async def get_result(self, task_id: str, with_logs: bool = False) -> TaskiqResult[T]:
        stored: Any = await self._redis.get(self.prefix + task_id)
        if stored is None:
            raise KeyError(task_id)
        result: TaskiqResult[T] = pickle.loads(stored)  # our own test data
        return result
