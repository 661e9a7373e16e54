"""Fencing tokens across services: header parsing, the outgoing hooks and the checking middlewares
(ASGI on uvicorn, aiohttp), end to end through httpx and aiohttp clients."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import anyio
import httpx
import pytest
from aiohttp import web
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse

import asynclock
from asynclock import fencing
from asynclock.abc import Capabilities
from asynclock.backends.memory import MemoryBackend
from asynclock.fencing import (
    FencingMiddleware,
    MemoryGuard,
    aiohttp_client_middleware,
    aiohttp_fencing_middleware,
    httpx_request_hook,
    incoming_token,
    parse_lock_name,
    parse_token,
)
from asynclock.integrations.aiohttp import FENCING_RESOURCE, FENCING_TOKEN
from asynclock.integrations.fastapi import locked

from ._memory import memory
from ._servers import serve_aiohttp, serve_asgi

pytestmark = pytest.mark.anyio


# "\u0663" (ARABIC-INDIC DIGIT THREE) and "\uff11" (FULLWIDTH ONE) are isdigit(), not ASCII.
NOT_DECIMAL = ["-1", "+1", " 1", "1 ", "1.0", "1e3", "0x10", "1_000", "\u0663", "\uff11", "abc"]


@pytest.mark.parametrize(
    ("parse", "value", "why"),
    [
        (parse_token, "", "empty"),
        *[(parse_token, value, "not a decimal integer") for value in NOT_DECIMAL],
        (parse_token, "1,2", "several values"),
        (parse_token, "1, 2", "several values"),
        (parse_token, str(2**63), "larger than 2\\*\\*63-1"),
        (parse_token, "9" * 5000, "larger than 2\\*\\*63-1"),  # longer than int() would parse
        (parse_lock_name, "", "empty"),
        # "caf\u00e9": raw non-ASCII (latin-1 decoded header bytes)
        *[(parse_lock_name, v, "not percent-encoded") for v in ["%zz", "50%", "caf\u00e9", "a b"]],
        (parse_lock_name, "%FF%FE", "UTF-8"),
        (parse_lock_name, "%0A", "control character"),
        (parse_lock_name, "x" * 513, "bytes long"),
    ],
)
def test_bad_tokens_and_lock_names_are_refused(
    parse: Callable[[str], object], value: str, why: str
) -> None:
    with pytest.raises(asynclock.InvalidArgument, match=why):
        parse(value)


def test_tokens_and_lock_names_survive_the_header_round_trip_and_names_are_checked() -> None:
    for value, token in [("7", 7), ("007", 7), (str(2**63 - 1), 2**63 - 1), ("0" * 30 + "5", 5)]:
        assert parse_token(value) == token
    assert parse_token("0") == 0
    for name in ["orders/42", "ünïcödé/✓", "a b,c;d%e", "100%", "x" * 512]:
        encoded = fencing.encode_lock_name(name)
        assert encoded.isascii()
        assert "/" not in encoded and "," not in encoded and " " not in encoded
        assert parse_lock_name(encoded) == name
    with pytest.raises(asynclock.InvalidArgument, match="HTTP header name"):
        httpx_request_hook(header="Fencing Token")
    with pytest.raises(asynclock.InvalidArgument, match="HTTP header name"):
        aiohttp_client_middleware(lock_header="")


async def test_fencing_headers_and_the_httpx_hook_follow_the_lock_held_if_it_has_a_token(
    locks: asynclock.LockClient,
) -> None:
    assert fencing.fencing_headers() == {}
    async with locks.lock("orders/ä 1") as outer:
        assert fencing.fencing_headers() == {
            "Fencing-Token": str(outer.token),
            "Fencing-Lock": "orders%2F%C3%A4%201",
        }
        async with locks.lock("inner") as inner:
            assert fencing.fencing_headers()["Fencing-Token"] == str(inner.token)
            assert fencing.fencing_headers("orders/ä 1")["Fencing-Token"] == str(outer.token)
        assert fencing.fencing_headers("inner") == {}
        assert fencing.fencing_headers(header="X-Fence", lock_header=None) == {
            "X-Fence": str(outer.token)
        }
    lease = await locks.acquire("manual")
    assert fencing.fencing_headers()["Fencing-Token"] == str(lease.token)
    await lease.release()
    assert fencing.fencing_headers() == {}
    # The httpx hook adds headers only while a lock is held.
    seen: list[httpx.Headers] = []
    async with recording_client(seen, header="X-Fence", lock_header="X-Lock") as http:
        await http.get("http://service/")
        async with locks.lock("a/b") as lease:
            await http.get("http://service/")
            await http.get("http://service/", headers={"X-Fence": "99"})  # explicit one wins
    assert "x-fence" not in seen[0]
    assert seen[1]["x-fence"] == str(lease.token)
    assert seen[1]["x-lock"] == "a%2Fb"
    assert seen[2].get_list("x-fence") == ["99"]
    assert "x-lock" not in seen[2]
    # A lease without a token sends nothing and does not crash.
    client = asynclock.LockClient(
        NoTokenBackend("no-token"), drift=0.01, margin=None, connect_timeout=5, release_timeout=5
    )
    async with client as no_tokens, recording_client(seen) as http:
        async with no_tokens.lock("redlock-ish"):
            with pytest.raises(asynclock.UnsupportedFeature):
                asynclock.current_token()
            await http.get("http://service/")
    assert "fencing-token" not in seen[3]
    assert "fencing-lock" not in seen[3]


def recording_client(seen: list[httpx.Headers], **hook: Any) -> httpx.AsyncClient:
    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers)
        return httpx.Response(200)

    hooks = {"request": [httpx_request_hook(**hook)]}
    return httpx.AsyncClient(transport=httpx.MockTransport(answer), event_hooks=hooks)


class NoTokenBackend(MemoryBackend):  # no sound tokens, as Redlock
    capabilities = Capabilities.every(fencing=False, cross_process=False)


@dataclass
class Seen:
    token: int | None
    state: int | None
    resource: str | None


def asgi_service(guard: fencing.Guard | None, seen: list[Seen], **options: Any) -> Any:
    app = FastAPI()

    @app.post("/{path:path}")
    async def write(request: Request) -> JSONResponse:
        record = Seen(incoming_token(), request.state.fencing_token, request.state.fencing_resource)
        seen.append(record)
        return JSONResponse({"token": record.token, "resource": record.resource})

    app.add_middleware(FencingMiddleware, guard=guard, **options)
    return app


def aiohttp_service(guard: fencing.Guard | None, seen: list[Seen], **options: Any) -> Any:
    async def write(request: web.Request) -> web.Response:
        record = Seen(incoming_token(), request[FENCING_TOKEN], request[FENCING_RESOURCE])
        seen.append(record)
        return web.json_response({"token": record.token, "resource": record.resource})

    app = web.Application(middlewares=[aiohttp_fencing_middleware(guard=guard, **options)])
    app.router.add_post("/{path:.*}", write)
    return app


@dataclass
class Service:
    url: str
    seen: list[Seen]


ServiceMaker = Callable[..., AbstractAsyncContextManager[Service]]


@pytest.fixture(
    params=[(asgi_service, serve_asgi), (aiohttp_service, serve_aiohttp)],
    ids=["uvicorn", "aiohttp"],
)
def service(request: pytest.FixtureRequest) -> ServiceMaker:
    make, serve = request.param

    @asynccontextmanager
    async def start(guard: fencing.Guard | None, **options: Any) -> AsyncIterator[Service]:
        seen: list[Seen] = []
        async with serve(make(guard, seen, **options)) as url:
            yield Service(url, seen)

    return start


Post = Callable[..., Awaitable[tuple[int, Any]]]


@pytest.fixture(params=["httpx", "aiohttp"])
async def post(request: pytest.FixtureRequest) -> AsyncIterator[Post]:
    if request.param == "httpx":
        async with httpx.AsyncClient(event_hooks={"request": [httpx_request_hook()]}) as http:

            async def post_httpx(url: str, **kwargs: Any) -> tuple[int, Any]:
                answer = await http.post(url, **kwargs)
                return answer.status_code, answer.json()

            yield post_httpx
    else:
        async with aiohttp.ClientSession(middlewares=(aiohttp_client_middleware(),)) as session:

            async def post_aiohttp(url: str, **kwargs: Any) -> tuple[int, Any]:
                async with session.post(url, **kwargs) as answer:
                    return answer.status, await answer.json()

            yield post_aiohttp


async def test_a_stale_token_from_a_paused_holder_is_refused_after_a_newer_one(
    locks: asynclock.LockClient, service: ServiceMaker, post: Post
) -> None:
    guard = MemoryGuard()
    async with service(guard) as b:
        resumed = anyio.Event()
        paused_answer: list[tuple[int, Any]] = []
        async with anyio.create_task_group() as task_group:

            async def paused_holder(*, task_status: anyio.abc.TaskStatus[int]) -> None:
                # Loss is only flagged: the holder does not know, as after a long GC pause.
                async with locks.lock("orders/1", on_lost="flag") as lease:
                    first = await post(f"{b.url}/orders")
                    assert first == (200, {"token": lease.token, "resource": "orders/1"})
                    task_status.started(lease.token)
                    await resumed.wait()
                    paused_answer.append(await post(f"{b.url}/orders"))

            old = await task_group.start(paused_holder)
            memory(locks).expire("orders/1")  # the server let the lease go; nobody was told
            async with locks.lock("orders/1", timeout=1) as newer:
                assert newer.token > old
                assert await post(f"{b.url}/orders") == (
                    200,
                    {"token": newer.token, "resource": "orders/1"},
                )
            resumed.set()
    status, body = paused_answer[0]
    assert status == 409
    assert body["error"] == "stale_fencing_token"
    assert (body["token"], body["highest"], body["resource"]) == (old, newer.token, "orders/1")
    assert guard.highest("orders/1") == newer.token
    assert [record.token for record in b.seen] == [old, newer.token]  # the app never saw the 409


async def test_tokens_from_a_locked_service_pass_missing_ones_get_428_and_options_apply(
    locks: asynclock.LockClient, service: ServiceMaker
) -> None:
    async with httpx.AsyncClient() as http:
        async with service(MemoryGuard()) as optional:
            answer = await http.post(f"{optional.url}/x")
            assert (answer.status_code, answer.json()) == (200, {"token": None, "resource": None})
        async with service(MemoryGuard(), required=True) as required:
            answer = await http.post(f"{required.url}/x")
            assert answer.status_code == 428
            assert answer.json()["error"] == "fencing_token_required"
            answer = await http.post(f"{required.url}/x", headers={"Fencing-Token": "3"})
            assert answer.status_code == 200
    assert required.seen == [Seen(3, 3, "/x")]  # the path is the resource without Fencing-Lock
    guard = MemoryGuard()
    async with httpx.AsyncClient() as http:
        async with service(guard, header="X-Fence", lock_header=None) as custom:
            ok = await http.post(
                f"{custom.url}/p", headers={"X-Fence": "5", "Fencing-Lock": "ignored"}
            )
            stale = await http.post(f"{custom.url}/p", headers={"X-Fence": "4"})
            ignored = await http.post(f"{custom.url}/p", headers={"Fencing-Token": "1"})
        async with service(guard, resource=_tenant_of) as by_resource:
            tenant = await http.post(
                f"{by_resource.url}/p",
                headers={"Fencing-Token": "1", "X-Tenant": "t1", "Fencing-Lock": "other"},
            )
        async with service(None) as unguarded:
            unchecked = [
                await http.post(f"{unguarded.url}/p", headers={"Fencing-Token": token})
                for token in ("9", "2")
            ]
    assert ok.json() == {"token": 5, "resource": "/p"}
    assert stale.status_code == 409
    assert ignored.json() == {"token": None, "resource": None}
    assert tenant.json() == {"token": 1, "resource": "tenant/t1"}
    # With guard=None the app checks in its own transaction: both reach it, with their tokens.
    assert [answer.json()["token"] for answer in unchecked] == [9, 2]
    # Service A (FastAPI + @locked, calling B with httpx) holds the lock; B sees its token.
    async with (
        service(MemoryGuard()) as b,
        httpx.AsyncClient(event_hooks={"request": [httpx_request_hook()]}) as http,
    ):
        a = FastAPI()

        @a.post("/invoices/{invoice_id}")
        @locked("invoices/{invoice_id}", client=locks)
        async def bill(invoice_id: int) -> dict[str, Any]:
            answer = await http.post(f"{b.url}/ledger/{invoice_id}")
            return {"mine": asynclock.current_token(), "b": answer.json()}

        async with serve_asgi(a) as a_url, httpx.AsyncClient(base_url=a_url) as outside:
            first = (await outside.post("/invoices/5")).json()
            second = (await outside.post("/invoices/5")).json()
    assert first["b"] == {"token": first["mine"], "resource": "invoices/5"}
    assert second["b"] == {"token": second["mine"], "resource": "invoices/5"}
    assert second["mine"] > first["mine"]
    assert b.seen[0].state == first["mine"]  # scope["state"] / request[...] carry it as well


def _tenant_of(request: Any) -> str:  # an ASGI scope or an aiohttp request
    if isinstance(request, web.BaseRequest):
        return "tenant/" + request.headers["X-Tenant"]
    headers = dict(request["headers"])
    return "tenant/" + bytes(headers[b"x-tenant"]).decode()


@pytest.mark.parametrize(
    "headers",
    [
        *[
            [("Fencing-Token", token)]
            for token in ["abc", "-1", "+1", "1.5", str(2**63), "9" * 400]
        ],
        *[[("Fencing-Token", token)] for token in ["", "1, 2"]],
        [("Fencing-Token", "1"), ("Fencing-Token", "2")],
        *[[("Fencing-Token", "1"), ("Fencing-Lock", name)] for name in ["%zz", "%FF", ""]],
        [("Fencing-Token", "1"), ("Fencing-Lock", "a"), ("Fencing-Lock", "b")],
        # Raw non-ASCII bytes: Arabic-Indic digit one, and an unencoded lock name.
        [(b"Fencing-Token", "\u0661".encode())],
        [(b"Fencing-Token", b"1"), (b"Fencing-Lock", "é".encode())],
    ],
    ids=lambda headers: "+".join(f"{key!s}={value[:12]!r}" for key, value in headers),
)
async def test_bad_headers_are_a_400_not_a_crash_and_the_token_does_not_leak_past_a_request(
    service: ServiceMaker, headers: list[tuple[str, str]] | list[tuple[bytes, bytes]]
) -> None:
    guard = MemoryGuard()
    assert incoming_token() is None
    async with service(guard) as b, httpx.AsyncClient() as http:
        answer = await http.post(f"{b.url}/x", headers=headers)
        await http.post(f"{b.url}/x", headers={"Fencing-Token": "1"})
        await http.post(f"{b.url}/x")
    assert answer.status_code == 400
    assert answer.json()["error"] == "invalid_fencing_header"
    assert "Fencing-" in answer.json()["detail"]  # names the header at fault
    assert b.seen == [Seen(1, 1, "/x"), Seen(None, None, None)]  # the app saw only good ones
    assert guard.highest("/x") == 1
    assert incoming_token() is None
