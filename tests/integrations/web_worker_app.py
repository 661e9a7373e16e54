"""The worker of test_web_processes.py: a FastAPI or aiohttp app that books orders under a lock,
calls a slow API under a semaphore and runs a leader-only job, one process per worker
(``python -m tests.integrations.web_worker_app fastapi|aiohttp FD``, FD a listening socket the
parent made). Settings come from ``ASYNCLOCK_WEB_*``: LOCKS (the lock URL), RESOURCE (the Redis
of the bookings), PREFIX (of its keys), CLIENT_NAME (of its connection), JOURNAL (a directory
where each worker appends what its bodies and its job did to ``<pid>.jsonl``).

``POST /orders/{order}`` (header ``request-id``) holds ``orders/{order}`` and books the order with
one fenced, strict ``RPUSH <prefix>bookings`` (:class:`asynclock.fencing.RedisGuard`): a holder
whose lease expired while it was stopped cannot book after a newer one did. Headers ``work``
(seconds awaited), ``block`` and ``after`` (seconds of synchronous work before / after the write,
during which the test stops the process) make a body hold its lock longer.

``POST /calls/{call}`` holds one of the PERMITS permits of the semaphore API for ``work`` seconds
(default CALL); the :class:`asynclock.LeaderTask` LEADER runs its job every EVERY seconds while
this worker leads. Both journal their lease's local deadline when they end: the test counts a
holder, or a run, as valid until then at the latest.
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
API, PERMITS, CALL = "partner-api", 3, 0.3  # the semaphore endpoint's, and its body's seconds
LEADER, EVERY, RUN = "jobs/digest", 0.05, 0.02  # the leader-only job's election and its timing
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


class Work:
    """What the worker's endpoints and its job do, and the journal where they say so."""

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

    async def call(self, request_id: str, work: float) -> dict[str, Any]:
        """The semaphore endpoint's body: a slow call to an API that takes PERMITS at once."""
        lease = asynclock.current_lease()
        self._journal.record("entered", request_id, token=lease.token)
        try:
            await anyio.sleep(work)
        finally:
            # Once past, the deadline is where the permit stopped being valid (SIGSTOP, a cut).
            self._journal.record("left", request_id, deadline=lease.deadline)
        return {"request_id": request_id, "token": lease.token, "pid": os.getpid()}

    async def run_job(self, term: asynclock.Lease) -> None:
        """One run of the leader-only job, journaled when it ends, cancelled or not."""
        started = time.monotonic()
        try:
            await anyio.sleep(RUN)
        finally:
            self._journal.record(
                "run", "job", token=term.token, started=started, deadline=term.deadline
            )

    def leader(self, locks: asynclock.LockClient) -> asynclock.LeaderTask:
        return asynclock.LeaderTask(
            locks, LEADER, self.run_job, value=str(os.getpid()).encode(), ttl=TTL, every=EVERY,
            retry_after=0.2,
        )  # fmt: skip

    def _block(self, request_id: str, seconds: float, where: str) -> None:
        if seconds:
            started = time.monotonic()
            time.sleep(seconds)  # it blocks the event loop, as CPU-bound work would
            elapsed = time.monotonic() - started
            self._journal.record("blocked", request_id, where=where, seconds=elapsed)


def fastapi_app() -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # The leader task stops first, then the lock client: the journal's "closed" comes last.
        async with (
            Work.open() as work,
            asynclock.connect(setting("LOCKS")) as locks,
            work.leader(locks),
        ):
            app.state.locks, app.state.work = locks, work
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
        state: Work = app.state.work
        return await state.book(order, request_id, work=work, block=block, after=after)

    @app.post("/calls/{call}")
    @fastapi_locks.locked(
        API, client=lambda: app.state.locks, ttl=TTL, timeout=WAIT, permits=PERMITS
    )
    async def call(
        call: str, request_id: Annotated[str, Header()], work: Annotated[float, Header()] = CALL
    ) -> dict[str, Any]:
        state: Work = app.state.work
        return await state.call(request_id, work)

    @app.get("/health")
    async def health() -> dict[str, int]:
        return {"pid": os.getpid()}

    return app


LOCKS = web.AppKey("locks", asynclock.LockClient)
WORK_KEY = web.AppKey("work", Work)
LEADER_TASK = web.AppKey("leader", asynclock.LeaderTask)


def aiohttp_app() -> web.Application:
    app = web.Application()

    async def resources(app: web.Application) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            app[WORK_KEY] = await stack.enter_async_context(Work.open())
            app[LOCKS] = await stack.enter_async_context(asynclock.connect(setting("LOCKS")))
            yield

    async def lead(app: web.Application) -> None:
        app[LEADER_TASK] = app[WORK_KEY].leader(app[LOCKS])
        await app[LEADER_TASK].start()

    async def resign(app: web.Application) -> None:
        await app[LEADER_TASK].aclose()

    app.cleanup_ctx.append(resources)
    app.on_startup.append(lead)  # after cleanup_ctx's start-up
    # on_shutdown runs before on_cleanup, whose first step closes cleanup_ctx (the lock client).
    app.on_shutdown.append(resign)

    @aiohttp_locks.locked("orders/{order}", client=lambda: app[LOCKS], ttl=TTL, timeout=WAIT)
    async def book(request: web.Request) -> web.Response:
        headers = request.headers
        seconds = {key: float(headers[key]) for key in ("work", "block", "after") if key in headers}
        entry = await app[WORK_KEY].book(
            request.match_info["order"], headers["request-id"], **seconds
        )
        return web.json_response(entry)

    @aiohttp_locks.locked(API, client=lambda: app[LOCKS], ttl=TTL, timeout=WAIT, permits=PERMITS)
    async def call(request: web.Request) -> web.Response:
        work = float(request.headers.get("work", CALL))
        return web.json_response(await app[WORK_KEY].call(request.headers["request-id"], work))

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"pid": os.getpid()})

    app.router.add_post("/orders/{order}", book)
    app.router.add_post("/calls/{call}", call)
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
