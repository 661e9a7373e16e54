"""What the job-queue worker processes share: the job body that records what it did, in Redis.

Imported by the worker processes (jobqueue_arq.py, jobqueue_saq.py, jobqueue_taskiq.py), which
read their settings from the environment the test gives them:

* ``JOBQUEUE_PORT``: the Redis server's port (127.0.0.1), for the queue and for the records;
* ``JOBQUEUE_DB``: the Redis database of the queue and the records;
* ``JOBQUEUE_LOCKS``: the asynclock URL the jobs' locks use.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final, cast

import redis.asyncio

import asynclock

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


def active_key(account: str) -> str:
    return f"jobqueue:active:{account}"


class Recorder:
    """Records each job's start and end (system-wide monotonic clock, so comparable across
    processes), how many jobs of its key were active with it, and its lease's token."""

    def __init__(self) -> None:
        self._redis: redis.asyncio.Redis | None = None

    async def open(self) -> None:
        self._redis = redis.asyncio.Redis.from_url(QUEUE_URL)
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
        # An independent check besides the intervals: more than one job of a key active at once.
        active = await client.incr(active_key(account))
        try:
            await asyncio.sleep(HOLD)
        finally:
            await client.decr(active_key(account))
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
        await call(client, "RPUSH", records_key(mode), json.dumps(record))
        return f"job {job_id} done"
