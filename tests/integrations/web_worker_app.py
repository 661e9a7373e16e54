"""The worker of test_web_processes.py: a FastAPI or aiohttp app that books orders under a lock,
one process per worker (``python -m tests.integrations.web_worker_app fastapi|aiohttp FD``, FD
a listening socket the parent made). Settings come from ``ASYNCLOCK_WEB_*``: LOCKS (the lock
URL), RESOURCE (the Redis of the bookings), PREFIX (of its keys), CLIENT_NAME (of its connection),
JOURNAL (a directory where each worker appends what its bodies did to ``<pid>.jsonl``).

``POST /orders/{order}`` (header ``request-id``) holds ``orders/{order}`` and books the order with
one fenced, strict ``RPUSH <prefix>bookings`` (:class:`asynclock.fencing.RedisGuard`): a holder
whose lease expired while it was stopped cannot book after a newer one did. Headers ``work``
(seconds awaited), ``block`` and ``after`` (seconds of synchronous work before / after the write,
during which the test stops the process) make a body hold its lock longer.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Annotated, Any, Self

import anyio
import redis.asyncio
import uvicorn
from aiohttp import web
from fastapi import FastAPI, Header

import asynclock
from asynclock.fencing import RedisGuard
from asynclock.integrations import aiohttp as aiohttp_locks
from asynclock.integrations import fastapi as fastapi_locks

TTL = 1.0  # short: a stopped worker loses its leases within the scenario
WAIT = 0.3  # for a busy order, before a 423
WORK = 0.01  # the default body's work before it books: outages find bodies in flight
FRAMEWORKS = ("fastapi", "aiohttp")
KEEP_ALIVE = 120  # seconds an idle HTTP connection stays open: longer than any scenario


def setting(name: str) -> str:
    return os.environ[f"ASYNCLOCK_WEB_{name}"]


class Journal:
    """One JSON line per step, written with plain ``os.write`` (no await): a cancellation cannot
    lose or split a line, so the test tells a body that returned from one stopped part way."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / f"{os.getpid()}.jsonl"
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def record(self, event: str, request_id: str, **fields: object) -> None:
        line = {"event": event, "request_id": request_id, "pid": os.getpid(), **fields}
        line["at"] = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process
        os.write(self._fd, (json.dumps(line) + "\n").encode())

    def close(self) -> None:
        os.close(self._fd)


class Bookings:
    def __init__(self, client: redis.asyncio.Redis, journal: Journal) -> None:
        self._key = f"{setting('PREFIX')}bookings"
        self._guard = RedisGuard(client, prefix=f"{setting('PREFIX')}fence:", strict=True)
        self._journal = journal

    @classmethod
    @asynccontextmanager
    async def open(cls) -> AsyncIterator[Self]:
        journal = Journal(Path(setting("JOURNAL")))
        client = redis.asyncio.Redis.from_url(
            setting("RESOURCE"), client_name=setting("CLIENT_NAME")
        )
        try:
            yield cls(client, journal)
        finally:
            await client.aclose()
            # The last line: whatever was opened inside this block is closed by now.
            journal.record("closed", "-")
            journal.close()

    async def book(
        self,
        order: str,
        request_id: str,
        *,
        work: float = WORK,
        block: float = 0.0,
        after: float = 0.0,
    ) -> dict[str, Any]:
        token = asynclock.current_token()
        self._journal.record("holding", request_id, order=order, token=token)
        try:
            if work:
                await anyio.sleep(work)
            # Synchronous work (no checkpoint): a stop that lands here lets the body go on to
            # its write after SIGCONT, with the token of a lease that has expired.
            self._block(request_id, block, "before")
            entry = {"request_id": request_id, "order": order, "token": token, "pid": os.getpid()}
            self._journal.record("write", request_id, order=order, token=token)
            await self._guard.call(f"orders/{order}", "RPUSH", self._key, json.dumps(entry))
            self._journal.record("booked", request_id)
        except asynclock.StaleToken as exc:
            self._journal.record("stale", request_id, token=exc.token, highest=exc.highest)
            raise
        except BaseException as exc:
            # Recorded, not handled: the cancellation (or error) goes on as it came.
            self._journal.record("stopped", request_id, error=type(exc).__name__)
            raise
        # Nothing below awaits, so a body that got here returns: its work is complete. A stop
        # in this synchronous work lets it return after its lease expired.
        self._block(request_id, after, "after")
        self._journal.record("returned", request_id, token=token)
        return entry

    def _block(self, request_id: str, seconds: float, where: str) -> None:
        if seconds:
            started = time.monotonic()
            time.sleep(seconds)  # it blocks the event loop, as CPU-bound work would
            elapsed = time.monotonic() - started
            self._journal.record("blocked", request_id, where=where, seconds=elapsed)


def fastapi_app() -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # The lock client closes first, so the journal's "closed" comes after both.
        async with Bookings.open() as bookings, asynclock.connect(setting("LOCKS")) as locks:
            app.state.locks = locks
            app.state.bookings = bookings
            yield

    app = FastAPI(lifespan=lifespan)

    @app.post("/orders/{order}")
    @fastapi_locks.locked("orders/{order}", client=lambda: app.state.locks, ttl=TTL, timeout=WAIT)
    async def book(
        order: str,
        request_id: Annotated[str, Header()],
        work: Annotated[float, Header()] = WORK,
        block: Annotated[float, Header()] = 0.0,
        after: Annotated[float, Header()] = 0.0,
    ) -> dict[str, Any]:
        bookings: Bookings = app.state.bookings
        return await bookings.book(order, request_id, work=work, block=block, after=after)

    @app.get("/health")
    async def health() -> dict[str, int]:
        return {"pid": os.getpid()}

    return app


LOCKS = web.AppKey("locks", asynclock.LockClient)
BOOKINGS = web.AppKey("bookings", Bookings)


def aiohttp_app() -> web.Application:
    app = web.Application()

    async def resources(app: web.Application) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            app[BOOKINGS] = await stack.enter_async_context(Bookings.open())
            app[LOCKS] = await stack.enter_async_context(asynclock.connect(setting("LOCKS")))
            yield

    app.cleanup_ctx.append(resources)

    @aiohttp_locks.locked("orders/{order}", client=lambda: app[LOCKS], ttl=TTL, timeout=WAIT)
    async def book(request: web.Request) -> web.Response:
        headers = request.headers
        entry = await app[BOOKINGS].book(
            request.match_info["order"],
            headers["request-id"],
            work=float(headers.get("work", WORK)),
            block=float(headers.get("block", 0.0)),
            after=float(headers.get("after", 0.0)),
        )
        return web.json_response(entry)

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"pid": os.getpid()})

    app.router.add_post("/orders/{order}", book)
    app.router.add_get("/health", health)
    return app


def main(framework: str, fd: int) -> None:
    sock = socket.socket(fileno=fd)  # a listening TCP socket; family and type from the descriptor
    if framework == "fastapi":
        # Idle connections stay open, as aiohttp's do (75 s): uvicorn's 5 s default closes them,
        # and a request sent on one as it closes gets no answer, an HTTP race, not the locks'.
        app = fastapi_app()
        uvicorn.Server(
            uvicorn.Config(
                app, log_level="warning", ws="none", lifespan="on", timeout_keep_alive=KEEP_ALIVE
            )
        ).run(sockets=[sock])
    else:
        # run_app turns SIGTERM into a graceful exit that runs cleanup_ctx.
        web.run_app(aiohttp_app(), sock=sock, print=None, access_log=None)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
