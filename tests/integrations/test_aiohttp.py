"""``asynclock.integrations.aiohttp`` on a real aiohttp server, with aiohttp clients."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from urllib.parse import unquote

import aiohttp
import anyio
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

import asynclock
from asynclock.integrations.aiohttp import LEASE_LOST_HEADER, locked

from ._servers import failing_locks, memory, serve_aiohttp

pytestmark = pytest.mark.anyio


class Gate:
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


def gated_app(locks: asynclock.LockClient, gate: Gate) -> web.Application:
    """Order 8 is never held at the gate."""
    routes = web.RouteTableDef()

    @routes.post("/orders/{order_id}")
    @locked("orders/{order_id}", client=locks)
    async def pay(request: web.Request) -> web.Response:
        order = request.match_info["order_id"]
        if order != "8":
            await gate.pass_through(order)
        return web.json_response({"order": order, "token": asynclock.current_token()})

    class Refund(web.View):
        @locked("orders/{order_id}", client=locks)
        async def post(self) -> web.Response:
            return web.json_response({"refund": asynclock.current_lease().name})

    routes.view("/orders/{order_id}/refund")(Refund)
    app = web.Application()
    app.add_routes(routes)
    return app


async def test_busy_lock_answers_423_at_once(locks: asynclock.LockClient) -> None:
    gate = Gate()
    async with serve_aiohttp(gated_app(locks, gate)) as url, aiohttp.ClientSession(url) as http:
        first: list[tuple[int, object]] = []
        async with anyio.create_task_group() as task_group:

            async def hold() -> None:
                async with http.post("/orders/7") as answer:
                    first.append((answer.status, await answer.json()))

            task_group.start_soon(hold)
            await gate.entered.wait()
            with anyio.fail_after(2):
                async with http.post("/orders/7") as busy:
                    busy_body = await busy.json()
                async with http.post("/orders/7/refund") as busy_view:
                    pass
                async with http.post("/orders/8") as other:
                    other_body = await other.json()
            gate.open.set()
    assert busy.status == 423
    assert busy_body["error"] == "lock_busy"
    assert busy_body["lock"] == "orders/7"
    assert busy_view.status == 423  # a web.View method is wrapped the same way
    assert other.status == 200
    assert other_body["order"] == "8"
    assert first == [(200, {"order": "7", "token": 1})]


async def test_lost_lease_cancels_the_handler_and_answers_503(
    locks: asynclock.LockClient,
) -> None:
    gate = Gate()
    async with serve_aiohttp(gated_app(locks, gate)) as url, aiohttp.ClientSession(url) as http:
        answers: list[tuple[int, dict[str, str]]] = []
        async with anyio.create_task_group() as task_group:

            async def call() -> None:
                async with http.post("/orders/3") as answer:
                    answers.append((answer.status, await answer.json()))

            task_group.start_soon(call)
            await gate.entered.wait()
            memory(locks).expire("orders/3", notify=True)
        gate.open.set()
        async with http.post("/orders/3") as after:
            pass
    status, body = answers[0]
    assert status == 503
    assert body["error"] == "lease_lost"
    assert body["lock"] == "orders/3"
    assert gate.cancelled == ["3"]
    assert gate.finished == ["3"]
    assert after.status == 200


async def test_a_lost_lease_after_streaming_began_drops_the_response(
    locks: asynclock.LockClient,
) -> None:
    entered = anyio.Event()

    @locked("streams/{name}", client=locks)
    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b"first part\n")
        entered.set()
        await anyio.sleep(30)
        return response

    app = web.Application()
    app.router.add_get("/streams/{name}", stream)
    async with serve_aiohttp(app) as url, aiohttp.ClientSession(url) as http:
        async with http.get("/streams/s") as answer:
            assert answer.status == 200
            assert await answer.content.readline() == b"first part\n"
            await entered.wait()
            memory(locks).expire("streams/s", notify=True)
            with pytest.raises(aiohttp.ClientPayloadError):
                await answer.read()  # cut short: never mistaken for a complete answer


async def test_waiting_mode_serializes_the_handler(locks: asynclock.LockClient) -> None:
    active = 0
    most = 0

    @locked("accounts/{account}", client=locks, timeout=10)
    async def deposit(request: web.Request) -> web.Response:
        nonlocal active, most
        active += 1
        most = max(most, active)
        await anyio.sleep(0.02)
        active -= 1
        return web.json_response(asynclock.current_token())

    app = web.Application()
    app.router.add_post("/accounts/{account}", deposit)
    async with serve_aiohttp(app) as url, aiohttp.ClientSession(url) as http:
        answers: list[tuple[int, int]] = []
        async with anyio.create_task_group() as task_group:
            for _ in range(6):

                async def call() -> None:
                    async with http.post("/accounts/a") as answer:
                        answers.append((answer.status, await answer.json()))

                task_group.start_soon(call)
    assert sorted(answers) == [(200, token) for token in range(1, 7)]
    assert most == 1


async def test_name_from_the_query_string_and_bad_names(locks: asynclock.LockClient) -> None:
    @locked("reports/{tenant}/{report}", client=locks, busy_status=409)
    async def report(request: web.Request) -> web.Response:
        return web.json_response(asynclock.current_lease().name)

    app = web.Application()
    app.router.add_get("/reports/{report}", report)
    async with serve_aiohttp(app) as url, aiohttp.ClientSession(url) as http:
        async with http.get("/reports/q3", params={"tenant": "ä/b"}) as ok:
            name = await ok.json()
        async with http.get("/reports/q3") as missing:
            missing_body = await missing.json()
        async with http.get("/reports/q3", params={"tenant": "a\x01"}) as invalid:
            invalid_body = await invalid.json()
        async with locks.lock("reports/t/q3"):
            async with http.get("/reports/q3", params={"tenant": "t"}) as busy:
                pass
    assert name == "reports/ä/b/q3"
    assert missing.status == 400
    assert missing_body["error"] == "missing_lock_name_part"
    assert "'tenant'" in missing_body["message"]
    assert invalid.status == 400
    assert invalid_body["error"] == "invalid_lock_name"
    assert busy.status == 409


def test_mistakes_are_reported_when_the_handler_is_defined() -> None:
    def no_client() -> asynclock.LockClient:
        raise AssertionError("not needed")

    with pytest.raises(asynclock.InvalidArgument, match="positional field"):
        locked("orders/{0}", client=no_client)
    with pytest.raises(asynclock.InvalidArgument, match="timeout"):
        locked("orders/{id}", client=no_client, timeout=-1)
    with pytest.raises(TypeError, match="async def"):

        @locked("orders/{id}", client=no_client)  # type: ignore[arg-type]
        def sync(request: web.Request) -> web.Response:
            return web.Response()


# -- every lock error has a documented answer ----------------------------------------------------


@pytest.mark.parametrize(
    ("fail", "status", "error"),
    [
        (lambda: asynclock.BackendUnavailable("redis://x: refused"), 503, "lock_unavailable"),
        (lambda: asynclock.BackendTimeout("redis://x: no answer in 1 s"), 503, "lock_unavailable"),
        (lambda: asynclock.DeadlockDetected("orders/1", []), 409, "deadlock"),
    ],
    ids=["unavailable", "timeout", "deadlock"],
)
@pytest.mark.parametrize("timeout", [0, 1])
async def test_lock_errors_while_acquiring_are_answered_never_500(
    fail: Callable[[], asynclock.LockError],
    status: int,
    error: str,
    timeout: float,
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with failing_locks() as (locks, backend):

        @locked("orders/{order_id}", client=locks, timeout=timeout, retry_after=7)
        async def pay(request: web.Request) -> web.Response:
            return web.json_response({"order": request.match_info["order_id"]})

        app = web.Application()
        app.router.add_post("/orders/{order_id}", pay)
        async with serve_aiohttp(app) as url, aiohttp.ClientSession(url) as http:
            backend.fail = fail
            with caplog.at_level(logging.WARNING, logger="asynclock"):
                async with http.post("/orders/1") as refused:
                    body = await refused.json()
            backend.fail = None
            async with http.post("/orders/1") as after:
                pass
    assert refused.status == status
    assert body["error"] == error
    assert body["lock"] == "orders/1"
    assert refused.headers["Retry-After"] == "7"
    if error == "lock_unavailable":
        assert any("answered 503 for the lock 'orders/1'" in r.message for r in caplog.records)
    assert after.status == 200


async def test_busy_says_when_to_retry_and_lost_does_not(locks: asynclock.LockClient) -> None:
    gate = Gate()
    async with serve_aiohttp(gated_app(locks, gate)) as url, aiohttp.ClientSession(url) as http:
        async with locks.lock("orders/8"):
            async with http.post("/orders/8") as busy:
                pass
        lost: list[tuple[int, dict[str, str], str | None]] = []
        async with anyio.create_task_group() as task_group:

            async def call() -> None:
                async with http.post("/orders/3") as answer:
                    lost.append(
                        (answer.status, await answer.json(), answer.headers.get("Retry-After"))
                    )

            task_group.start_soon(call)
            await gate.entered.wait()
            memory(locks).expire("orders/3", notify=True)
    assert busy.status == 423
    assert busy.headers["Retry-After"] == "1"  # the default
    status, body, retry_after = lost[0]
    assert status == 503
    assert body["error"] == "lease_lost"
    assert retry_after is None  # its effects may be partial: no invitation to retry
    assert "retry" not in body["message"]


# -- a body that completed keeps its response -------------------------------------------------------


@pytest.mark.parametrize("kind", ["json", "stream"])
async def test_a_body_that_completed_keeps_its_response_and_reports_the_loss(
    locks: asynclock.LockClient, kind: str
) -> None:
    @locked("orders/{order_id}", client=locks, ttl=0.2)
    async def book(request: web.Request) -> web.StreamResponse:
        if kind == "stream":
            # Headers already sent: the answer stands, and only the log reports the loss.
            response = web.StreamResponse(status=201)
            await response.prepare(request)
            time.sleep(0.4)  # noqa: ASYNC251 - blocking the loop is the point: a paused process
            await response.write(b"booked")
            return response
        time.sleep(0.4)  # noqa: ASYNC251 - blocking the loop is the point: a paused process
        return web.json_response({"booked": request.match_info["order_id"]}, status=201)

    app = web.Application()
    app.router.add_post("/orders/{order_id}", book)
    async with serve_aiohttp(app) as url, aiohttp.ClientSession(url) as http:
        async with http.post("/orders/5") as answer:
            body = await answer.read()
        free = await locks.try_acquire("orders/5", ttl=1.0)
    assert answer.status == 201  # not 503 "retry": the booking is done
    if kind == "json":
        assert body == b'{"booked": "5"}'
        reason = unquote(answer.headers[LEASE_LOST_HEADER])
        assert "no successful renewal before the local deadline" in reason
    else:
        assert body == b"booked"
        assert LEASE_LOST_HEADER not in answer.headers
    assert free is not None
    await free.release()


async def test_errors_of_locks_the_handler_took_itself_propagate(
    locks: asynclock.LockClient,
) -> None:
    @locked("accounts/{a}", client=locks)
    async def transfer(request: web.Request) -> web.Response:
        async with locks.lock(f"accounts/{request.match_info['b']}", timeout=0):
            return web.Response(text="moved")

    app = web.Application()
    app.router.add_post("/transfer/{a}/{b}", transfer)
    request = make_mocked_request("POST", "/transfer/x/y", match_info={"a": "x", "b": "y"}, app=app)
    async with locks.lock("accounts/y"):
        with pytest.raises(asynclock.AcquireTimeout, match="accounts/y"):
            await transfer(request)


# -- @locked in the wrong order --------------------------------------------------------------------


def test_locked_after_registering_the_handler_fails_at_import() -> None:
    def no_client() -> asynclock.LockClient:
        raise AssertionError("not needed")

    routes = web.RouteTableDef()
    with pytest.raises(asynclock.InvalidArgument, match=r"below\* the route decorator") as info:

        @locked("orders/{order_id}", client=no_client)
        @routes.post("/orders/{order_id}")
        async def pay(request: web.Request) -> web.Response:
            return web.Response()

    assert "POST /orders/{order_id}" in str(info.value)

    async def refund(request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_put("/orders/{order_id}/refund", refund)
    with pytest.raises(asynclock.InvalidArgument, match=re.escape("PUT /orders/{order_id}/refund")):
        locked("orders/{order_id}", client=no_client)(refund)

    # The right order: the route holds the wrapper, and the wrapper's function is free.
    @routes.post("/ok/{order_id}")
    @locked("orders/{order_id}", client=no_client)
    async def ok(request: web.Request) -> web.Response:
        return web.Response()

    last = routes[-1]
    assert isinstance(last, web.RouteDef)
    assert last.handler is ok


async def test_a_body_that_returned_before_its_cancellation_landed_keeps_its_response(
    locks: asynclock.LockClient,
) -> None:
    # The loss is signalled while the body runs, but the body returns without another
    # checkpoint, so it is never stopped: its work is done and its answer stands.
    @locked("orders/{order_id}", client=locks)
    async def pay(request: web.Request) -> web.Response:
        memory(locks).expire(f"orders/{request.match_info['order_id']}", notify=True)
        return web.Response(text="paid")

    app = web.Application()
    app.router.add_post("/orders/{order_id}", pay)
    async with serve_aiohttp(app) as url, aiohttp.ClientSession(url) as http:
        async with http.post("/orders/9") as answer:
            text = await answer.text()
    assert answer.status == 200
    assert text == "paid"
    assert unquote(answer.headers[LEASE_LOST_HEADER]) == "the lock was removed on the server"
