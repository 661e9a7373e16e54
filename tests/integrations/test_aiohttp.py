"""What only ``asynclock.integrations.aiohttp`` does, on a real aiohttp server: class-based views,
streamed answers, lock names from the query string, its route order. What it does like the
FastAPI integration is in test_web.py."""

from __future__ import annotations

import re
import time

import aiohttp
import anyio
import pytest
from aiohttp import web

import asynclock
from asynclock.integrations.aiohttp import LEASE_LOST_HEADER, locked

from ._memory import memory
from ._servers import no_client, serve_aiohttp

pytestmark = pytest.mark.anyio


async def test_a_view_method_is_locked_like_a_handler(locks: asynclock.LockClient) -> None:
    class Refund(web.View):
        @locked("orders/{order_id}", client=locks)
        async def post(self) -> web.Response:
            return web.json_response({"refund": asynclock.current_lease().name})

    app = web.Application()
    app.router.add_view("/orders/{order_id}/refund", Refund)
    async with serve_aiohttp(app) as url, aiohttp.ClientSession(url) as http:
        async with http.post("/orders/7/refund") as free:
            body = await free.json()
        async with locks.lock("orders/7"):
            async with http.post("/orders/7/refund") as busy:
                pass
    assert body == {"refund": "orders/7"}
    assert busy.status == 423


@pytest.mark.expect_log(r"lease on 'streams/s' lost: the lock was removed on the server")
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


async def test_names_from_the_query_string_and_a_missing_part(locks: asynclock.LockClient) -> None:
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
        async with locks.lock("reports/t/q3"):
            async with http.get("/reports/q3", params={"tenant": "t"}) as busy:
                pass
    assert name == "reports/ä/b/q3"
    assert missing.status == 400
    assert missing_body["error"] == "missing_lock_name_part"
    assert "'tenant'" in missing_body["message"]
    assert busy.status == 409


@pytest.mark.expect_log(r"lease on 'streams/5' (was )?lost")
async def test_a_stream_that_completed_keeps_its_answer_and_only_the_log_reports_the_loss(
    locks: asynclock.LockClient,
) -> None:
    @locked("streams/{name}", client=locks, ttl=0.2)
    async def book(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(status=201)
        await response.prepare(request)  # the headers are sent: no loss header can follow
        time.sleep(0.4)  # noqa: ASYNC251 - blocking the loop is the point: a paused process
        await response.write(b"booked")
        return response

    app = web.Application()
    app.router.add_post("/streams/{name}", book)
    async with serve_aiohttp(app) as url, aiohttp.ClientSession(url) as http:
        async with http.post("/streams/5") as answer:
            body = await answer.read()
    assert answer.status == 201
    assert body == b"booked"
    assert LEASE_LOST_HEADER not in answer.headers


# -- @locked in the wrong order --------------------------------------------------------------------


def test_locked_after_registering_the_handler_fails_at_import() -> None:
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
