"""``asynclock.integrations.fastapi`` on a real FastAPI app served by uvicorn, called by httpx."""

from __future__ import annotations

from typing import Annotated, Any

import anyio
import httpx
import pytest
from fastapi import FastAPI, Query
from pydantic import BaseModel

import asynclock
from asynclock.integrations.fastapi import lock_dependency, locked

from ._servers import memory, serve_asgi

pytestmark = pytest.mark.anyio


class Payment(BaseModel):
    account: str
    amount: int


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


def gated_app(locks: asynclock.LockClient, gate: Gate) -> FastAPI:
    """Order 8 is never held at the gate."""
    app = FastAPI()

    @app.post("/orders/{order_id}")
    @locked("orders/{order_id}", client=locks)
    async def pay(order_id: int) -> dict[str, Any]:
        if order_id != 8:
            await gate.pass_through(f"decorator {order_id}")
        return {"order": order_id, "token": asynclock.current_token()}

    @app.post("/dep/orders/{order_id}")
    async def pay_with_dependency(
        order_id: int,
        lease: asynclock.Lease = lock_dependency("orders/{order_id}", client=locks),  # noqa: B008
    ) -> dict[str, Any]:
        if order_id != 8:
            await gate.pass_through(f"dependency {order_id}")
        return {"order": order_id, "token": lease.token, "lock": lease.name}

    return app


@pytest.mark.parametrize("prefix", ["", "/dep"])
async def test_busy_lock_answers_423_at_once(locks: asynclock.LockClient, prefix: str) -> None:
    gate = Gate()
    async with serve_asgi(gated_app(locks, gate)) as url, httpx.AsyncClient(base_url=url) as http:
        first: list[httpx.Response] = []
        async with anyio.create_task_group() as task_group:

            async def hold() -> None:
                first.append(await http.post(f"{prefix}/orders/7"))

            task_group.start_soon(hold)
            await gate.entered.wait()
            with anyio.fail_after(2):
                busy = await http.post(f"{prefix}/orders/7")
            other = await http.post(f"{prefix}/orders/8")  # another order: not blocked by 7
            gate.open.set()
    assert busy.status_code == 423
    assert busy.json()["detail"]["error"] == "lock_busy"
    assert busy.json()["detail"]["lock"] == "orders/7"
    assert first[0].status_code == 200
    assert first[0].json()["order"] == 7
    assert other.status_code == 200
    assert len(gate.finished) == 1


@pytest.mark.parametrize("prefix", ["", "/dep"])
async def test_lost_lease_cancels_the_endpoint_and_answers_503(
    locks: asynclock.LockClient, prefix: str
) -> None:
    gate = Gate()
    async with serve_asgi(gated_app(locks, gate)) as url, httpx.AsyncClient(base_url=url) as http:
        answers: list[httpx.Response] = []
        async with anyio.create_task_group() as task_group:

            async def call() -> None:
                answers.append(await http.post(f"{prefix}/orders/3"))

            task_group.start_soon(call)
            await gate.entered.wait()
            memory(locks).expire("orders/3", notify=True)
        # The server is still up: the lost lease did not break it for the next request.
        gate.open.set()
        after = await http.post(f"{prefix}/orders/3")
    assert answers[0].status_code == 503
    detail = answers[0].json()["detail"]
    assert detail["error"] == "lease_lost"
    assert detail["lock"] == "orders/3"
    assert "removed on the server" in detail["message"]
    kind = "dependency" if prefix else "decorator"
    assert gate.cancelled == [f"{kind} 3"]  # the endpoint really was cancelled
    assert gate.finished == [f"{kind} 3"]  # ... and the next request ran to the end
    assert after.status_code == 200


@pytest.mark.parametrize("prefix", ["", "/dep"])
async def test_waiting_mode_serializes_the_endpoint(
    locks: asynclock.LockClient, prefix: str
) -> None:
    app = FastAPI()
    active = 0
    most = 0

    async def critical() -> int:
        nonlocal active, most
        active += 1
        most = max(most, active)
        await anyio.sleep(0.02)
        active -= 1
        return asynclock.current_token()

    @app.post("/accounts/{account}")
    @locked("accounts/{account}", client=locks, timeout=10)
    async def deposit(account: str) -> int:
        return await critical()

    @app.post("/dep/accounts/{account}")
    async def deposit_with_dependency(
        account: str,
        lease: asynclock.Lease = lock_dependency(  # noqa: B008
            "accounts/{account}", client=locks, timeout=10
        ),
    ) -> int:
        return await critical()

    async with serve_asgi(app) as url, httpx.AsyncClient(base_url=url) as http:
        answers: list[httpx.Response] = []
        async with anyio.create_task_group() as task_group:
            for _ in range(6):

                async def call() -> None:
                    answers.append(await http.post(f"{prefix}/accounts/a"))

                task_group.start_soon(call)
    assert [answer.status_code for answer in answers] == [200] * 6
    assert most == 1
    assert sorted(answer.json() for answer in answers) == list(range(1, 7))  # one token each


async def test_waiting_mode_gives_up_with_423_after_the_timeout(
    locks: asynclock.LockClient,
) -> None:
    app = FastAPI()

    @app.post("/jobs/{job}")
    @locked("jobs/{job}", client=locks, timeout=0.2)
    async def run(job: str) -> str:
        return job

    async with serve_asgi(app) as url, httpx.AsyncClient(base_url=url) as http:
        async with locks.lock("jobs/x"):
            started = anyio.current_time()
            busy = await http.post("/jobs/x")
            waited = anyio.current_time() - started
        free = await http.post("/jobs/x")
    assert busy.status_code == 423
    assert 0.2 <= waited < 2
    assert free.status_code == 200


async def test_fastapi_still_sees_the_endpoint_parameters(locks: asynclock.LockClient) -> None:
    app = FastAPI()
    seen: list[str] = []

    @app.post("/shops/{shop_id}/pay")
    @locked("shops/{shop_id}/{payment.account}/{currency}", client=locks, busy_status=409)
    async def pay(
        shop_id: int,
        payment: Payment,
        currency: Annotated[str, Query(max_length=3)] = "EUR",
    ) -> dict[str, Any]:
        seen.append(asynclock.current_lease().name)
        return {"shop": shop_id, "amount": payment.amount, "currency": currency}

    assert pay.__name__ == "pay"
    operation = app.openapi()["paths"]["/shops/{shop_id}/pay"]["post"]
    parameters = {param["name"]: param for param in operation["parameters"]}
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
    assert ok.status_code == 200
    assert ok.json() == {"shop": 5, "amount": 3, "currency": "USD"}
    assert seen == ["shops/5/ab/USD"]
    assert invalid_path.status_code == 422  # FastAPI validated before the lock was touched
    assert invalid_query.status_code == 422
    assert busy.status_code == 409  # busy_status is configurable


async def test_a_lock_name_made_invalid_by_the_request_is_a_400(
    locks: asynclock.LockClient,
) -> None:
    app = FastAPI()

    @app.get("/files")
    @locked("files/{path}", client=locks)
    async def read(path: str) -> str:
        return path

    @app.get("/dep/files")
    async def read_with_dependency(
        path: str,
        lease: asynclock.Lease = lock_dependency("files/{path}", client=locks),  # noqa: B008
    ) -> str:
        return lease.name

    async with serve_asgi(app) as url, httpx.AsyncClient(base_url=url) as http:
        bad = await http.get("/files", params={"path": "a\nb"})
        bad_dependency = await http.get("/dep/files", params={"path": "x" * 600})
        missing = await http.get("/dep/files")  # the dependency runs before validation
        good = await http.get("/dep/files", params={"path": "a/b"})
    assert bad.status_code == 400
    assert bad.json()["detail"]["error"] == "invalid_lock_name"
    assert bad_dependency.status_code == 400
    assert missing.status_code == 400
    assert missing.json()["detail"]["error"] == "missing_lock_name_part"
    assert good.json() == "files/a/b"


async def test_lock_client_can_come_from_the_app_lifespan() -> None:
    from collections.abc import AsyncIterator
    from contextlib import asynccontextmanager

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


def no_client() -> asynclock.LockClient:
    raise AssertionError("the lock client is only needed when a request comes in")


def test_mistakes_are_reported_when_the_endpoint_is_defined() -> None:
    locks = no_client
    with pytest.raises(asynclock.InvalidArgument, match="order_id, which is not a parameter"):

        @locked("orders/{order_id}", client=locks)
        async def typo(orderid: int) -> None: ...

    with pytest.raises(asynclock.InvalidArgument, match="positional field"):
        locked("orders/{}", client=locks)
    with pytest.raises(asynclock.InvalidArgument, match="malformed"):
        locked("orders/{id", client=locks)
    with pytest.raises(asynclock.InvalidArgument, match="ttl"):
        locked("orders/{id}", client=locks, ttl=0)
    with pytest.raises(TypeError, match="async def"):

        @locked("orders/{order_id}", client=locks)  # type: ignore[arg-type]
        def sync(order_id: int) -> None: ...


async def test_the_dependency_refuses_a_sync_endpoint(locks: asynclock.LockClient) -> None:
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
