"""A small Redis list broker and result backend for taskiq, for the job-queue tests.

taskiq-redis would be the usual choice, but the installed 1.0.x does not import with taskiq 0.13
(it needs ``taskiq.compat.model_dump``, which 0.13 removed), and the releases that do need
redis-py 6 or later, which arq (below 6) refuses in the same environment. This is the part of its
``ListQueueBroker`` and ``RedisAsyncResultBackend`` the tests need: LPUSH to send, BRPOP to
receive (first in, first out), results pickled under a key per task id.
"""

from __future__ import annotations

import pickle
from collections.abc import AsyncGenerator
from typing import Any, TypeVar

import redis.asyncio
from taskiq import AsyncBroker, AsyncResultBackend, BrokerMessage, TaskiqResult

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
