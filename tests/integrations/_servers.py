"""Real uvicorn and aiohttp servers (in the test's task), lock clients, the web tests' apps,
what the web scenarios read from each HTTP answer, and worker processes."""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import signal
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import anyio
import httpx
import uvicorn
from aiohttp import web
from anyio.abc import TaskGroup
from fastapi import FastAPI, Header

import asynclock
from asynclock.abc import Grant, LockRequest
from asynclock.backends.memory import MemoryBackend
from asynclock.integrations import aiohttp as aiohttp_locks
from asynclock.integrations import fastapi as fastapi_locks
from asynclock.testing import RedisServer
from tests.contract.backend_redis import redis_leftovers


@asynccontextmanager
async def serve_asgi(app: Any) -> AsyncIterator[str]:
    # Idle connections stay open for the whole test, as aiohttp's do (75 s): uvicorn's 5 s
    # default closes them, and a request sent on one as it closes gets no answer (httpx's
    # ReadError, seen after a handler blocked the loop), an HTTP race, not the locks'.
    server = uvicorn.Server(
        uvicorn.Config(
            app, host="127.0.0.1", port=0, log_level="warning", ws="none", lifespan="off",
            timeout_keep_alive=120,
        )
    )  # fmt: skip
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
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


class FailingMemory(MemoryBackend):
    """The memory backend whose acquires raise ``fail()`` while it is set: a lock server that is
    down, hangs, or answers anything else an acquire can raise, reached through the real client."""

    fail: Callable[[], asynclock.LockError] | None = None

    async def _check(self) -> None:
        await anyio.lowlevel.checkpoint()
        if self.fail is not None:
            raise self.fail()

    async def try_acquire(self, request: LockRequest) -> Grant | None:
        await self._check()
        return await super().try_acquire(request)

    async def acquire(self, request: LockRequest) -> Grant:
        await self._check()
        return await super().acquire(request)


@asynccontextmanager
async def failing_locks() -> AsyncIterator[tuple[asynclock.LockClient, FailingMemory]]:
    backend = FailingMemory(f"failing-{uuid.uuid4().hex[:8]}")
    client = asynclock.LockClient(
        backend, drift=0.01, margin=None, connect_timeout=5.0, release_timeout=1.0
    )
    async with client:
        yield client, backend


class Gate:
    """Holds a handler inside its critical section until the test opens the gate."""

    def __init__(self) -> None:
        self.entered = anyio.Event()
        self.open = anyio.Event()
        self.cancelled: list[str] = []
        self.finished: list[str] = []

    async def pass_through(self, who: str) -> None:
        self.entered.set()
        try:
            await self.open.wait()
        except anyio.get_cancelled_exc_class():
            self.cancelled.append(who)
            raise
        self.finished.append(who)


Process = subprocess.Popen[bytes]
#: A handler's work, given the order id of ``POST /orders/{order_id}``; it returns the JSON answer.
Body = Callable[[str], Awaitable[Any]]
#: The request's ``request-id`` header, for a body to read (the web scenarios number requests).
REQUEST_ID: ContextVar[str] = ContextVar("REQUEST_ID")


def _fastapi_decorated(locks: asynclock.LockClient, body: Body, **options: Any) -> FastAPI:
    app = FastAPI()  # no LeaseLossHeaders: @locked sets the loss header itself

    @app.post("/orders/{order_id}")
    @fastapi_locks.locked("orders/{order_id}", client=locks, **options)
    async def pay(order_id: str, request_id: Annotated[str, Header()] = "") -> Any:
        REQUEST_ID.set(request_id)
        return await body(order_id)

    return app


def _fastapi_dependency(locks: asynclock.LockClient, body: Body, **options: Any) -> FastAPI:
    app = FastAPI()
    app.add_middleware(fastapi_locks.LeaseLossHeaders)
    dependency = fastapi_locks.lock_dependency("orders/{order_id}", client=locks, **options)

    @app.post("/orders/{order_id}")
    async def pay(order_id: str, lease: asynclock.Lease = dependency) -> Any:
        assert lease.name == f"orders/{order_id}"
        return await body(order_id)

    return app


def _aiohttp(locks: asynclock.LockClient, body: Body, **options: Any) -> web.Application:
    @aiohttp_locks.locked("orders/{order_id}", client=locks, **options)
    async def pay(request: web.Request) -> web.Response:
        REQUEST_ID.set(request.headers.get("request-id", ""))
        return web.json_response(await body(request.match_info["order_id"]))

    app = web.Application()
    app.router.add_post("/orders/{order_id}", pay)
    return app


@dataclass(frozen=True)
class Web:
    """One way to lock a handler: ``serve(app(locks, body, **options))`` serves
    ``POST /orders/{order_id}`` under the lock ``orders/{order_id}``."""

    name: str
    app: Callable[..., Any]
    serve: Callable[[Any], AbstractAsyncContextManager[str]]


WEBS = [
    Web("fastapi", _fastapi_decorated, serve_asgi),
    Web("fastapi-dependency", _fastapi_dependency, serve_asgi),
    Web("aiohttp", _aiohttp, serve_aiohttp),
]


def no_client() -> asynclock.LockClient:
    raise AssertionError("the lock client is only needed when a request comes in")


def error_body(response: httpx.Response, web: str | None = None) -> dict[str, Any]:
    """The error an answer carries: FastAPI puts it under "detail" (an HTTPException), aiohttp
    at the top; with ``web`` (a :class:`Web`'s name), that it is where that framework puts it."""
    body: dict[str, Any] = response.json()
    if web is not None:
        fastapi = web.startswith("fastapi")
        assert ("detail" in body) is fastapi, body
        return body["detail"] if fastapi else body
    detail = body.get("detail")
    return detail if isinstance(detail, dict) else body


@dataclass(frozen=True)
class Answer:
    """One request of a web scenario, as its checks read it."""

    request_id: str
    worker: int
    status: int | None  # None: no answer (the client's error is in ``failure``)
    error: str | None = None
    retry_after: str | None = None
    lease_lost: str | None = None
    body: dict[str, Any] | None = None
    failure: str | None = None
    sent: float = 0.0
    endpoint: str = "orders"


#: The orders the web scenarios' clients book, in turn.
ORDERS = 10
#: A locked handler's documented answers (status, error).
DOCUMENTED = {(200, None), (423, "lock_busy"), (409, "deadlock")} | {
    (503, error) for error in ("lease_lost", "lock_unavailable")
}
#: The answers that promise "nothing was done, retry later".
RETRY_AFTER = {"lock_busy", "deadlock", "lock_unavailable"}


@dataclass
class Traffic:
    """A web scenario's requests to the instances ``http`` and their answers: numbered ones from
    each :meth:`client` (``POST /orders/o<n % ORDERS>``, header ``request-id: <n>``) until ``over``
    is set, and those its faults send; ``began`` and ``ended`` are when the faults did."""

    http: list[httpx.AsyncClient] = field(default_factory=list)
    answers: list[Answer] = field(default_factory=list)
    over: anyio.Event = field(default_factory=anyio.Event)
    numbers: Iterator[int] = field(default_factory=itertools.count)
    began: float = 0.0
    ended: float = 0.0

    async def reach(self, stack: AsyncExitStack, url: str, clients: int, timeout: float) -> None:
        """One more instance, at ``url``: an HTTP client with a connection for each client."""
        limits = httpx.Limits(max_connections=clients)
        client = httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits)
        self.http.append(await stack.enter_async_context(client))

    async def post(
        self, instance: int, order: str, request_id: str, endpoint: str = "orders", **headers: str
    ) -> Answer:
        """``POST /<endpoint>/<order>``; ``headers`` (and ``endpoint``) may come from hold_long."""
        sent = time.monotonic()
        try:
            response = await self.http[instance].post(
                f"/{endpoint}/{order}", headers={"request-id": request_id, **headers}
            )
        except httpx.TransportError as exc:
            failure = type(exc).__name__
            answer = Answer(
                request_id, instance, None, failure=failure, sent=sent, endpoint=endpoint
            )
        else:
            ok = response.status_code == 200
            answer = Answer(
                request_id, instance, response.status_code,
                None if ok else error_body(response).get("error"),
                response.headers.get("retry-after"), response.headers.get("asynclock-lease-lost"),
                response.json() if ok else None, sent=sent, endpoint=endpoint,
            )  # fmt: skip
        self.answers.append(answer)
        return answer

    async def warm_up(self, least: float, within: float = 10.0) -> None:
        """Wait ``least`` seconds, and on until an order was booked (a 200): the faults begin on
        a service that has worked (on a loaded host its workers may take longer than ``least``
        to start and answer; a CI run saw none booked in 1.5 s)."""
        await anyio.sleep(least)
        with anyio.fail_after(within):
            while not any(answer.status == 200 for answer in self.answers):  # noqa: ASYNC110
                await anyio.sleep(0.02)

    async def client(self, pace: float, endpoint: str = "orders") -> None:
        """Each numbered request to the next instance, ``pace`` seconds after the last answer."""
        while not self.over.is_set():
            number = next(self.numbers)
            await self.post(number % len(self.http), f"o{number % ORDERS}", str(number), endpoint)
            await anyio.sleep(pace)

    async def hold_long(
        self,
        tasks: TaskGroup,
        instance: int,
        order: str,
        holding: Callable[[str], bool],
        name: str = "",
        **headers: str,
    ) -> str:
        """Send ``<name or order>-<attempt>`` requests for ``order`` until ``holding(request id)``
        says one's body holds its lease (or got to where the caller waits for it), and return its
        id. A take may be answered first (423, or 503 for a handshake slower than op_timeout on a
        loaded host): one more answer, and another goes."""
        for attempt in itertools.count():
            request_id = f"{name or order}-{attempt}"
            tasks.start_soon(functools.partial(self.post, instance, order, request_id, **headers))
            while not holding(request_id):
                if self.answered(request_id):
                    break
                await anyio.sleep(0.01)
            else:
                return request_id
        raise AssertionError("unreachable")

    def answered(self, request_id: str) -> bool:
        return any(answer.request_id == request_id for answer in self.answers)

    def check_answers(self) -> None:
        """What every web scenario's answers show: each request answered, only documented
        answers (never a 500), ``Retry-After`` with each that promises nothing was done and never
        with ``lease_lost`` (the body was stopped part way: its effects may be partial), the
        outage felt, and orders booked before the faults and again after them."""
        answers = self.answers
        failures = [answer for answer in answers if answer.status is None]
        assert failures == [], failures
        undocumented = [a for a in answers if (a.status, a.error) not in DOCUMENTED]
        assert undocumented == [], undocumented
        for answer in answers:
            if answer.error in RETRY_AFTER:
                assert answer.retry_after == "1", answer
            elif answer.error == "lease_lost":
                assert answer.retry_after is None, answer
        assert any(answer.error == "lock_unavailable" for answer in answers)
        ok = [answer.sent for answer in answers if answer.status == 200]
        assert any(sent < self.began for sent in ok), "no order booked before the faults"
        assert any(sent > self.ended for sent in ok), "no order booked after the faults"


async def assert_no_leftovers(redis_server: RedisServer, prefix: str, client_name: str) -> None:
    """Within 5 s, every lock key under ``prefix`` released or expired and every connection
    named ``client_name`` closed."""
    with anyio.move_on_after(5):
        while leftovers := await redis_leftovers(redis_server, prefix, client_name):  # noqa: ASYNC110
            await anyio.sleep(0.1)
    assert leftovers == []


ROOT = Path(__file__).resolve().parents[2]


def start_process(command: list[str], env: dict[str, str], log: Path, **popen: Any) -> Process:
    """``command`` run from the repository in a process group of its own, output to ``log``."""
    with log.open("ab") as output:
        return subprocess.Popen(
            command, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=output,
            stderr=subprocess.STDOUT, start_new_session=True, **popen,
        )  # fmt: skip


def signal_group(process: Process, signum: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signum)


async def stop_processes(processes: list[Process], grace: float) -> None:
    """SIGTERM each process's group (after SIGCONT, in case it is stopped), SIGKILL it after
    ``grace`` seconds: nothing of a group (taskiq's manager's children) outlives the test."""
    for process in processes:
        signal_group(process, signal.SIGCONT)
        signal_group(process, signal.SIGTERM)
    # Awaited, not blocking: a worker's lock client may be reaching Redis through this loop.
    with anyio.move_on_after(grace, shield=True):
        while any(process.poll() is None for process in processes):  # noqa: ASYNC110
            await anyio.sleep(0.05)
    for process in processes:
        signal_group(process, signal.SIGKILL)
        process.wait()
