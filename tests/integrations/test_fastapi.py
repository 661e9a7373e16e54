"""``asynclock.integrations.fastapi`` on a real FastAPI app served by uvicorn, called by httpx."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from typing import Annotated, Any
from urllib.parse import unquote

import anyio
import httpx
import pytest
from anyio.abc import TaskStatus
from fastapi import APIRouter, Depends, FastAPI, Query, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel

import asynclock
from asynclock.integrations.fastapi import (
    LEASE_LOST_HEADER,
    LeaseLossHeaders,
    lock_dependency,
    locked,
)

from ._servers import failing_locks, memory, serve_asgi

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


# -- every lock error has a documented answer ----------------------------------------------------


def failing_app(locks: asynclock.LockClient) -> FastAPI:
    app = FastAPI()

    @app.post("/orders/{order_id}")
    @locked("orders/{order_id}", client=locks, retry_after=7)
    async def pay(order_id: int) -> dict[str, Any]:
        return {"order": order_id}

    @app.post("/dep/orders/{order_id}")
    async def pay_with_dependency(
        order_id: int,
        lease: asynclock.Lease = lock_dependency(  # noqa: B008
            "orders/{order_id}", client=locks, retry_after=7, timeout=0.3
        ),
    ) -> dict[str, Any]:
        return {"order": order_id}

    return app


@pytest.mark.parametrize(
    ("fail", "status", "error"),
    [
        (
            lambda: asynclock.BackendUnavailable("redis://x: connection refused"),
            503,
            "lock_unavailable",
        ),
        (
            lambda: asynclock.BackendTimeout("redis://x did not answer within 1 s"),
            503,
            "lock_unavailable",
        ),
        (lambda: asynclock.DeadlockDetected("orders/1", []), 409, "deadlock"),
    ],
    ids=["unavailable", "timeout", "deadlock"],
)
@pytest.mark.parametrize("prefix", ["", "/dep"])
async def test_lock_errors_while_acquiring_are_answered_never_500(
    prefix: str,
    fail: Callable[[], asynclock.LockError],
    status: int,
    error: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with failing_locks() as (locks, backend):
        async with serve_asgi(failing_app(locks)) as url, httpx.AsyncClient(base_url=url) as http:
            backend.fail = fail
            with caplog.at_level(logging.WARNING, logger="asynclock"):
                refused = await http.post(f"{prefix}/orders/1")
            backend.fail = None
            after = await http.post(f"{prefix}/orders/1")  # the server is back: served again
    assert refused.status_code == status
    assert refused.json()["detail"]["error"] == error
    assert refused.json()["detail"]["lock"] == "orders/1"
    assert refused.headers["retry-after"] == "7"
    if error == "lock_unavailable":
        assert any("answered 503 for the lock 'orders/1'" in r.message for r in caplog.records)
    assert after.status_code == 200


@pytest.mark.parametrize("prefix", ["", "/dep"])
async def test_busy_answer_says_when_to_retry(locks: asynclock.LockClient, prefix: str) -> None:
    async with serve_asgi(failing_app(locks)) as url, httpx.AsyncClient(base_url=url) as http:
        async with locks.lock("orders/2"):
            busy = await http.post(f"{prefix}/orders/2")
    assert busy.status_code == 423
    assert busy.headers["retry-after"] == "7"


async def test_a_lost_lease_answer_does_not_invite_a_retry(locks: asynclock.LockClient) -> None:
    gate = Gate()
    async with serve_asgi(gated_app(locks, gate)) as url, httpx.AsyncClient(base_url=url) as http:
        answers: list[httpx.Response] = []
        async with anyio.create_task_group() as task_group:

            async def call() -> None:
                answers.append(await http.post("/orders/4"))

            task_group.start_soon(call)
            await gate.entered.wait()
            memory(locks).expire("orders/4", notify=True)
    assert answers[0].status_code == 503
    assert "retry-after" not in answers[0].headers  # its effects may be partial
    assert "retry" not in answers[0].json()["detail"]["message"]


# -- a body that completed keeps its response -------------------------------------------------------


def pausing_app(locks: asynclock.LockClient, done: list[str]) -> FastAPI:
    """Each endpoint blocks the event loop past its 0.2 s ttl, then returns: no checkpoint in
    between, so the loss is only known once the body has completed (a paused process)."""
    app = FastAPI()
    app.add_middleware(LeaseLossHeaders)

    def pause(what: str) -> None:
        time.sleep(0.4)  # blocking the loop is the point: a paused process
        done.append(what)

    @app.post("/plain/{order_id}")
    @locked("orders/{order_id}", client=locks, ttl=0.2)
    async def plain(order_id: int) -> dict[str, Any]:
        pause("plain")
        return {"booked": order_id}

    @app.post("/response/{order_id}")
    @locked("orders/{order_id}", client=locks, ttl=0.2)
    async def returns_a_response(order_id: int) -> JSONResponse:
        pause("response")
        return JSONResponse({"booked": order_id}, status_code=201)

    @app.post("/own/{order_id}")
    @locked("orders/{order_id}", client=locks, ttl=0.2)
    async def own_response_parameter(order_id: int, response: Response) -> dict[str, Any]:
        response.headers["x-own"] = "kept"
        pause("own")
        return {"booked": order_id}

    @app.post("/dep/{order_id}")
    async def dependency(
        order_id: int,
        lease: asynclock.Lease = lock_dependency("orders/{order_id}", client=locks, ttl=0.2),  # noqa: B008
    ) -> dict[str, Any]:
        pause("dependency")
        return {"booked": order_id}

    return app


@pytest.mark.parametrize(
    ("path", "status"), [("plain", 200), ("response", 201), ("own", 200), ("dep", 200)]
)
async def test_a_body_that_completed_keeps_its_response_and_reports_the_loss(
    locks: asynclock.LockClient, path: str, status: int
) -> None:
    done: list[str] = []
    async with (
        serve_asgi(pausing_app(locks, done)) as url,
        httpx.AsyncClient(base_url=url, timeout=10) as http,
    ):
        answer = await http.post(f"/{path}/5")
        free = await locks.try_acquire("orders/5", ttl=1.0)  # and the lock was released
    assert answer.status_code == status  # not 503 "retry": the booking is done
    assert answer.json() == {"booked": 5}
    assert len(done) == 1
    reason = unquote(answer.headers[LEASE_LOST_HEADER])
    assert "no successful renewal before the local deadline" in reason
    if path == "own":
        assert answer.headers["x-own"] == "kept"
    assert free is not None
    await free.release()


async def test_the_dependency_reports_the_loss_only_through_the_middleware(
    locks: asynclock.LockClient,
) -> None:
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


async def test_a_completed_body_whose_lease_held_has_no_loss_header(
    locks: asynclock.LockClient,
) -> None:
    async with (
        serve_asgi(pausing_app(locks, [])) as url,
        httpx.AsyncClient(base_url=url) as http,
    ):
        ok = await http.post("/orders/1", json={})  # no such route: 404, no header
    assert LEASE_LOST_HEADER not in ok.headers
    app = FastAPI()

    @app.get("/fine")
    @locked("fine", client=locks)
    async def fine() -> str:
        return "ok"

    async with serve_asgi(app) as url, httpx.AsyncClient(base_url=url) as http:
        answer = await http.get("/fine")
    assert answer.status_code == 200
    assert LEASE_LOST_HEADER not in answer.headers


# -- errors that are not ours pass through --------------------------------------------------------


async def test_errors_of_locks_the_endpoint_took_itself_propagate(
    locks: asynclock.LockClient,
) -> None:
    app = FastAPI()

    @app.post("/transfer/{a}/{b}")
    @locked("accounts/{a}", client=locks)
    async def transfer(a: str, b: str) -> str:
        async with locks.lock(f"accounts/{b}", timeout=0):
            return "moved"

    async with locks.lock("accounts/y"):
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://app"
        ) as http:
            with pytest.raises(asynclock.AcquireTimeout, match="accounts/y"):
                await http.post("/transfer/x/y")


# -- @locked in the wrong order --------------------------------------------------------------------


def test_locked_above_the_route_decorator_fails_at_import() -> None:
    locks = no_client
    app = FastAPI()
    router = APIRouter()
    with pytest.raises(asynclock.InvalidArgument, match=r"below\* the route decorator") as info:

        @locked("orders/{order_id}", client=locks)
        @app.post("/orders/{order_id}")
        async def pay(order_id: int) -> None: ...

    assert "POST /orders/{order_id}" in str(info.value)
    with pytest.raises(asynclock.InvalidArgument, match=re.escape("GET /items/{item}")):

        @locked("items/{item}", client=locks)
        @router.get("/items/{item}")
        async def item(item: str) -> None: ...

    async def registered(order_id: int) -> None: ...

    app.add_api_route("/later/{order_id}", registered, methods=["PUT"])
    with pytest.raises(asynclock.InvalidArgument, match=re.escape("PUT /later/{order_id}")):
        locked("orders/{order_id}", client=locks)(registered)


def test_options_are_checked_when_the_endpoint_is_defined() -> None:
    with pytest.raises(asynclock.InvalidArgument, match="unknown option tll; the options are"):
        locked("a", client=no_client, tll=3)  # type: ignore[call-arg]
    with pytest.raises(asynclock.InvalidArgument, match="retry_after must be whole seconds"):
        lock_dependency("a", client=no_client, retry_after=0.5)  # type: ignore[arg-type]
    with pytest.raises(asynclock.InvalidArgument, match="busy_status must be an HTTP error"):
        locked("a", client=no_client, busy_status=200)


@pytest.mark.parametrize("prefix", ["", "/dep"])
async def test_a_body_that_returned_before_its_cancellation_landed_keeps_its_response(
    locks: asynclock.LockClient, prefix: str
) -> None:
    # The loss is signalled while the body runs, but the body returns without another
    # checkpoint, so it is never stopped: its work is done and its answer stands.
    app = FastAPI()
    app.add_middleware(LeaseLossHeaders)

    @app.post("/orders/{order_id}")
    @locked("orders/{order_id}", client=locks)
    async def pay(order_id: int) -> int:
        memory(locks).expire(f"orders/{order_id}", notify=True)
        return order_id

    @app.post("/dep/orders/{order_id}")
    async def pay_with_dependency(
        order_id: int,
        lease: asynclock.Lease = lock_dependency("orders/{order_id}", client=locks),  # noqa: B008
    ) -> int:
        memory(locks).expire(lease.name, notify=True)
        return order_id

    async with serve_asgi(app) as url, httpx.AsyncClient(base_url=url) as http:
        answer = await http.post(f"{prefix}/orders/9")
    assert answer.status_code == 200
    assert answer.json() == 9
    assert unquote(answer.headers[LEASE_LOST_HEADER]) == "the lock was removed on the server"


async def test_a_request_chosen_as_deadlock_victim_gets_409() -> None:
    # The request holds a (its dependency), then waits for b, which another task holds while
    # it waits for a: the request starts waiting last, so it is the victim (the youngest), and
    # its endpoint never runs.
    async with asynclock.connect(
        "memory://fastapi-deadlock", deadlock_detection=True, deadlock_interval=0.05
    ) as locks:
        request_holds_a = anyio.Event()
        other_waits = anyio.Event()
        ran: list[str] = []

        async def after_the_other_waits() -> None:
            request_holds_a.set()
            await other_waits.wait()

        app = FastAPI()

        @app.post("/move/{x}")
        @locked("b/{x}", client=locks, timeout=5)
        async def move(
            x: str,
            lease: asynclock.Lease = lock_dependency("a/{x}", client=locks),  # noqa: B008
            _: None = Depends(after_the_other_waits),
        ) -> str:
            ran.append(x)
            return x

        async def other(*, task_status: TaskStatus[None]) -> None:
            async with locks.lock("b/1"):
                task_status.started()
                await request_holds_a.wait()

                async def let_the_request_go_on() -> None:
                    await anyio.sleep(0.2)  # the other task has been waiting for a a while
                    other_waits.set()

                async with anyio.create_task_group() as task_group:
                    task_group.start_soon(let_the_request_go_on)
                    async with locks.lock("a/1", timeout=10):
                        ran.append("other")

        async with serve_asgi(app) as url, httpx.AsyncClient(base_url=url, timeout=10) as http:
            async with anyio.create_task_group() as task_group:
                await task_group.start(other)
                answer = await http.post("/move/1")
    assert answer.status_code == 409
    assert answer.json()["detail"]["error"] == "deadlock"
    assert "deadlock while waiting for 'b/1'" in answer.json()["detail"]["message"]
    assert answer.headers["retry-after"] == "1"
    assert ran == ["other"]  # the other task went on once the request let go of a
