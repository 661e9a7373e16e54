"""What only the FastAPI integration does (endpoint parameters, dependency, middleware, lifespan,
route order), served by uvicorn and called by httpx; what it shares with aiohttp is in test_web.py."""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any
from urllib.parse import unquote

import httpx
import pytest
from fastapi import APIRouter, FastAPI, Query, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel

import asynclock
from asynclock.integrations.fastapi import (
    LEASE_LOST_HEADER,
    LeaseLossHeaders,
    lock_dependency,
    locked,
)

from ._servers import no_client, serve_asgi

pytestmark = pytest.mark.anyio


class Payment(BaseModel):
    account: str
    amount: int


async def test_fastapi_sees_the_endpoint_parameters_and_a_lock_name_they_make_invalid_is_a_400(
    locks: asynclock.LockClient,
) -> None:
    app = FastAPI()
    seen: list[str] = []

    @app.post("/shops/{shop_id}/pay")
    @locked("shops/{shop_id}/{payment.account}/{currency}", client=locks, busy_status=409)
    async def pay(
        shop_id: int, payment: Payment, currency: Annotated[str, Query(max_length=3)] = "EUR"
    ) -> dict[str, Any]:
        seen.append(asynclock.current_lease().name)
        return {"shop": shop_id, "amount": payment.amount, "currency": currency}

    @app.get("/dep/files")
    async def read_with_dependency(
        path: str,
        lease: asynclock.Lease = lock_dependency("files/{path}", client=locks),  # noqa: B008
    ) -> str:
        return lease.name

    assert pay.__name__ == "pay"
    operation = app.openapi()["paths"]["/shops/{shop_id}/pay"]["post"]
    parameters = {param["name"]: param for param in operation["parameters"]}
    assert set(parameters) == {"shop_id", "currency"}  # the hidden Response is not one
    assert parameters["shop_id"]["in"] == "path"
    assert parameters["shop_id"]["schema"]["type"] == "integer"
    assert parameters["currency"]["in"] == "query"
    assert "requestBody" in operation

    async with serve_asgi(app) as url, httpx.AsyncClient(base_url=url) as http:
        ok = await http.post(
            "/shops/5/pay", params={"currency": "USD"}, json={"account": "ab", "amount": 3}
        )
        invalid_path = await http.post("/shops/five/pay", json={"account": "ab", "amount": 3})
        invalid_query = await http.post(
            "/shops/5/pay", params={"currency": "EURO"}, json={"account": "a", "amount": 1}
        )
        async with locks.lock("shops/5/ab/EUR"):
            busy = await http.post("/shops/5/pay", json={"account": "ab", "amount": 3})
        missing = await http.get("/dep/files")  # the dependency runs before validation
        good = await http.get("/dep/files", params={"path": "a/b"})
    assert ok.status_code == 200
    assert ok.json() == {"shop": 5, "amount": 3, "currency": "USD"}
    assert seen == ["shops/5/ab/USD"]
    assert invalid_path.status_code == 422  # FastAPI validated before the lock was touched
    assert invalid_query.status_code == 422
    assert busy.status_code == 409  # busy_status is configurable
    assert missing.status_code == 400
    assert missing.json()["detail"]["error"] == "missing_lock_name_part"
    assert good.json() == "files/a/b"


@pytest.mark.expect_log(r"lease on 'orders/6' (was )?lost")
async def test_the_client_from_the_lifespan_and_the_dependency_refusing_sync_and_reporting_loss(
    locks: asynclock.LockClient,
) -> None:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with asynclock.connect("memory://fastapi-lifespan") as locks:
            app.state.locks = locks
            yield

    app = FastAPI(lifespan=lifespan)

    @app.get("/items/{item}")
    @locked("items/{item}", client=lambda: app.state.locks)
    async def item(item: str) -> int:
        return asynclock.current_token()

    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://app"
        ) as http:
            answers = [(await http.get("/items/a")).json() for _ in range(2)]
    assert answers == [1, 2]
    # The dependency refuses a sync endpoint.
    app = FastAPI()

    @app.get("/sync/{x}")
    def sync(
        x: str,
        lease: asynclock.Lease = lock_dependency("x/{x}", client=locks),  # noqa: B008
    ) -> str:
        return x

    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app, raise_app_exceptions=True), base_url="http://app"
    ) as http:
        with pytest.raises(TypeError, match="async def"):
            await http.get("/sync/1")
    # The dependency reports the loss only through the middleware.
    app = FastAPI()

    @app.post("/dep/{order_id}")
    async def dependency(
        order_id: int,
        lease: asynclock.Lease = lock_dependency("orders/{order_id}", client=locks, ttl=0.2),  # noqa: B008
    ) -> int:
        time.sleep(0.4)  # noqa: ASYNC251 - a paused process
        return order_id

    async with serve_asgi(app) as url, httpx.AsyncClient(base_url=url, timeout=10) as http:
        answer = await http.post("/dep/6")
    assert answer.status_code == 200
    assert LEASE_LOST_HEADER not in answer.headers  # FastAPI built the response already


@pytest.mark.expect_log(r"lease on 'orders/5' (was )?lost")
@pytest.mark.parametrize(("path", "status"), [("response", 201), ("own", 200)])
async def test_a_completed_body_keeps_the_response_it_made_and_reports_the_loss(
    locks: asynclock.LockClient, path: str, status: int
) -> None:
    # Each endpoint blocks the loop past its ttl (a paused process), then returns unchecked.
    app = FastAPI()
    app.add_middleware(LeaseLossHeaders)

    @app.post("/response/{order_id}")
    @locked("orders/{order_id}", client=locks, ttl=0.2)
    async def returns_a_response(order_id: int) -> JSONResponse:
        time.sleep(0.4)  # noqa: ASYNC251 - blocking the loop is the point: a paused process
        return JSONResponse({"booked": order_id}, status_code=201)

    @app.post("/own/{order_id}")
    @locked("orders/{order_id}", client=locks, ttl=0.2)
    async def own_response_parameter(order_id: int, response: Response) -> dict[str, Any]:
        response.headers["x-own"] = "kept"
        time.sleep(0.4)  # noqa: ASYNC251 - blocking the loop is the point: a paused process
        return {"booked": order_id}

    async with serve_asgi(app) as url, httpx.AsyncClient(base_url=url, timeout=10) as http:
        answer = await http.post(f"/{path}/5")
    assert answer.status_code == status
    assert answer.json() == {"booked": 5}
    assert "no successful renewal" in unquote(answer.headers[LEASE_LOST_HEADER])
    if path == "own":
        assert answer.headers["x-own"] == "kept"


def test_a_typo_or_locked_above_the_route_decorator_fails_at_import() -> None:
    with pytest.raises(asynclock.InvalidArgument, match="order_id, which is not a parameter"):

        @locked("orders/{order_id}", client=no_client)
        async def typo(orderid: int) -> None: ...

    with pytest.raises(asynclock.InvalidArgument, match="retry_after must be whole seconds"):
        lock_dependency("a", client=no_client, retry_after=0.5)  # type: ignore[arg-type]
    app = FastAPI()
    router = APIRouter()
    with pytest.raises(asynclock.InvalidArgument, match=r"below\* the route decorator") as info:

        @locked("orders/{order_id}", client=no_client)
        @app.post("/orders/{order_id}")
        async def pay(order_id: int) -> None: ...

    assert "POST /orders/{order_id}" in str(info.value)
    with pytest.raises(asynclock.InvalidArgument, match=re.escape("GET /items/{item}")):

        @locked("items/{item}", client=no_client)
        @router.get("/items/{item}")
        async def item(item: str) -> None: ...

    async def registered(order_id: int) -> None: ...

    app.add_api_route("/later/{order_id}", registered, methods=["PUT"])
    with pytest.raises(asynclock.InvalidArgument, match=re.escape("PUT /later/{order_id}")):
        locked("orders/{order_id}", client=no_client)(registered)
