"""``asynclock.integrations.aiohttp`` on a real aiohttp server, with aiohttp clients."""

from __future__ import annotations

import aiohttp
import anyio
import pytest
from aiohttp import web

import asynclock
from asynclock.integrations.aiohttp import locked

from ._servers import memory, serve_aiohttp

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
