"""Real servers for the integration tests: uvicorn and aiohttp on 127.0.0.1, in the test's task."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import uvicorn
from aiohttp import web

import asynclock
from asynclock.abc import Grant, LockRequest
from asynclock.backends.memory import MemoryBackend


@asynccontextmanager
async def serve_asgi(app: Any) -> AsyncIterator[str]:
    """Serve ``app`` with uvicorn on a free port; yield its base URL; shut it down cleanly."""
    config = uvicorn.Config(
        app, host="127.0.0.1", port=0, log_level="warning", ws="none", lifespan="off"
    )
    server = uvicorn.Server(config)
    async with anyio.create_task_group() as task_group:
        task_group.start_soon(server.serve)
        with anyio.fail_after(10):
            while not server.started:
                if server.should_exit:
                    raise RuntimeError("uvicorn did not start")
                await anyio.sleep(0.005)
        port = server.servers[0].sockets[0].getsockname()[1]
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            server.should_exit = True


@asynccontextmanager
async def serve_aiohttp(app: web.Application) -> AsyncIterator[str]:
    """Serve ``app`` with aiohttp on a free port; yield its base URL; clean up."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def memory_locks() -> AsyncIterator[asynclock.LockClient]:
    async with asynclock.connect(f"memory://integrations-{uuid.uuid4().hex[:8]}") as locks:
        yield locks


def memory(locks: asynclock.LockClient) -> MemoryBackend:
    backend = locks._backend
    assert isinstance(backend, MemoryBackend)
    return backend


class FailingMemory(MemoryBackend):
    """The memory backend, except that every acquire raises ``fail()`` while it is set.

    Stands for a lock server that is down (``BackendUnavailable``), hangs (``BackendTimeout``),
    or for anything else an acquire can raise, so each answer of the integrations is reached
    through the real client.
    """

    fail: Callable[[], asynclock.LockError] | None = None

    async def try_acquire(self, request: LockRequest) -> Grant | None:
        await anyio.lowlevel.checkpoint()
        if self.fail is not None:
            raise self.fail()
        return await super().try_acquire(request)

    async def acquire(self, request: LockRequest) -> Grant:
        await anyio.lowlevel.checkpoint()
        if self.fail is not None:
            raise self.fail()
        return await super().acquire(request)


@asynccontextmanager
async def failing_locks() -> AsyncIterator[tuple[asynclock.LockClient, FailingMemory]]:
    backend = FailingMemory(f"failing-{uuid.uuid4().hex[:8]}")
    client = asynclock.LockClient(
        backend, drift=0.01, margin=None, connect_timeout=5.0, release_timeout=1.0
    )
    async with client:
        yield client, backend
