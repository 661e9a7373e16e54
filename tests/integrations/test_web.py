"""What the web integrations do alike (FastAPI's decorator and dependency, aiohttp's decorator), on
real servers called over HTTP; what only one does is in test_fastapi.py and test_aiohttp.py."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

import anyio
import httpx
import pytest

import asynclock
from asynclock.integrations import aiohttp as aiohttp_locks
from asynclock.integrations import fastapi as fastapi_locks
from asynclock.integrations.fastapi import LEASE_LOST_HEADER
from tests.loud import ExpectedLogs

from ._memory import memory
from ._servers import WEBS, Gate, Web, error_body, failing_locks, no_client

pytestmark = pytest.mark.anyio


@pytest.fixture(params=WEBS, ids=[web.name for web in WEBS])
def web(request: pytest.FixtureRequest) -> Web:
    chosen: Web = request.param
    return chosen


async def token_of(order: str) -> dict[str, Any]:
    return {"order": order, "token": asynclock.current_token()}


async def test_a_busy_lock_answers_423_at_once_and_the_handlers_own_locks_are_its_own(
    web: Web, locks: asynclock.LockClient
) -> None:
    app = web.app(locks, token_of)
    async with web.serve(app) as url, httpx.AsyncClient(base_url=url) as http:
        async with locks.lock("orders/7"):
            with anyio.fail_after(2):
                busy = await http.post("/orders/7")
            other = await http.post("/orders/8")  # another order: not blocked by 7
        free = await http.post("/orders/7")
        missing = await http.post("/nowhere")
        invalid = await http.post("/orders/a%0Ab")  # a lock name with a control character
    # A lease that held, and a request that took none (a 404), have no loss to report.
    assert LEASE_LOST_HEADER not in free.headers
    assert missing.status_code == 404
    assert LEASE_LOST_HEADER not in missing.headers
    assert busy.status_code == 423
    assert error_body(busy, web.name)["error"] == "lock_busy"
    assert error_body(busy, web.name)["lock"] == "orders/7"
    assert busy.headers["retry-after"] == "1"  # the default
    assert other.json()["order"] == "8"
    assert free.json()["order"] == "7"
    assert invalid.status_code == 400
    assert error_body(invalid, web.name)["error"] == "invalid_lock_name"

    # Errors of locks the handler took itself are not answered as its own.
    async def transfer(order: str) -> str:
        async with locks.lock("accounts/y", timeout=0):
            return "moved"

    async with web.serve(web.app(locks, transfer)) as url, httpx.AsyncClient(base_url=url) as http:
        async with locks.lock("accounts/y"):
            answer = await http.post("/orders/1")
    # The framework's own answer to the handler's AcquireTimeout (a TimeoutError: aiohttp says
    # 504), not the integration's 423 for orders/1.
    assert answer.status_code in {500, 504}
    assert "lock_busy" not in answer.text


@pytest.mark.expect_log(r"lease on 'orders/3' lost: the lock was removed on the server")
async def test_a_lost_lease_cancels_the_handler_and_answers_503_without_inviting_a_retry(
    web: Web, locks: asynclock.LockClient
) -> None:
    gate = Gate()

    async def gated(order: str) -> str:
        await gate.pass_through(order)
        return order

    async with web.serve(web.app(locks, gated)) as url, httpx.AsyncClient(base_url=url) as http:
        answers: list[httpx.Response] = []

        async def call() -> None:
            answers.append(await http.post("/orders/3"))

        async with anyio.create_task_group() as task_group:
            task_group.start_soon(call)
            await gate.entered.wait()
            memory(locks).expire("orders/3", notify=True)
        # The server is still up: the lost lease did not break it for the next request.
        gate.open.set()
        after = await http.post("/orders/3")
    lost = answers[0]
    assert lost.status_code == 503
    error = error_body(lost, web.name)
    assert error["error"] == "lease_lost"
    assert error["lock"] == "orders/3"
    assert "removed on the server" in error["message"]
    # Its effects may be partial: no invitation to retry.
    assert "retry-after" not in lost.headers
    assert "retry" not in error["message"]
    assert gate.cancelled == ["3"]  # the handler really was cancelled
    assert gate.finished == ["3"]  # ... and the next request ran to the end
    assert after.status_code == 200


async def test_waiting_mode_serializes_the_handler_and_gives_up_with_423_after_its_timeout(
    web: Web, locks: asynclock.LockClient
) -> None:
    active = most = 0

    async def deposit(order: str) -> int:
        nonlocal active, most
        active += 1
        most = max(most, active)
        await anyio.sleep(0.02)
        active -= 1
        return asynclock.current_token()

    answers: list[httpx.Response] = []
    async with (
        web.serve(web.app(locks, deposit, timeout=10)) as url,
        httpx.AsyncClient(base_url=url) as http,
    ):

        async def call() -> None:
            answers.append(await http.post("/orders/a"))

        async with anyio.create_task_group() as task_group:
            for _ in range(6):
                task_group.start_soon(call)
    async with (
        web.serve(web.app(locks, deposit, timeout=0.2)) as url,
        httpx.AsyncClient(base_url=url) as http,
    ):
        async with locks.lock("orders/a"):
            started = anyio.current_time()
            busy = await http.post("/orders/a")
            waited = anyio.current_time() - started
    assert [answer.status_code for answer in answers] == [200] * 6
    assert most == 1
    assert sorted(answer.json() for answer in answers) == list(range(1, 7))  # one token each
    assert busy.status_code == 423
    assert 0.2 <= waited < 2


@pytest.mark.parametrize(
    ("fail", "status", "error"),
    [
        (lambda: asynclock.BackendUnavailable("redis://x: refused"), 503, "lock_unavailable"),
        (lambda: asynclock.BackendTimeout("redis://x: no answer in 1 s"), 503, "lock_unavailable"),
        (lambda: asynclock.DeadlockDetected("orders/1", []), 409, "deadlock"),
    ],
    ids=["unavailable", "timeout", "deadlock"],
)
@pytest.mark.parametrize("timeout", [0, 0.3])
async def test_lock_errors_while_acquiring_are_answered_never_500(
    web: Web,
    timeout: float,
    fail: Callable[[], asynclock.LockError],
    status: int,
    error: str,
    expected_logs: ExpectedLogs,
) -> None:
    if error == "lock_unavailable":
        expected_logs.expect(r"answered 503 for the lock 'orders/1'")
    async with failing_locks() as (locks, backend):
        app = web.app(locks, token_of, timeout=timeout, retry_after=7)
        async with web.serve(app) as url, httpx.AsyncClient(base_url=url) as http:
            backend.fail = fail
            refused = await http.post("/orders/1")
            backend.fail = None
            after = await http.post("/orders/1")  # the server is back: served again
            async with locks.lock("orders/1"):
                busy = await http.post("/orders/1")
    assert refused.status_code == status
    assert error_body(refused, web.name)["error"] == error
    assert error_body(refused, web.name)["lock"] == "orders/1"
    assert refused.headers["retry-after"] == "7"
    assert after.status_code == 200
    assert busy.status_code == 423
    assert busy.headers["retry-after"] == "7"


@pytest.mark.expect_log(r"lease on 'orders/5' (was )?lost")
@pytest.mark.expect_log(r"lease on 'orders/9' (was )?lost")
async def test_a_body_that_completed_before_its_loss_landed_keeps_its_response_and_reports_it(
    web: Web, locks: asynclock.LockClient
) -> None:
    async def book(order: str) -> dict[str, str]:
        if order == "5":
            # Blocks the event loop past the ttl, then returns without a checkpoint: the loss
            # is only known once the body has completed (a paused process).
            time.sleep(0.4)  # noqa: ASYNC251 - blocking the loop is the point
        else:
            # Signalled while the body runs, which returns without another checkpoint.
            memory(locks).expire(f"orders/{order}", notify=True)
        return {"booked": order}

    app = web.app(locks, book, ttl=0.2)
    async with web.serve(app) as url, httpx.AsyncClient(base_url=url, timeout=10) as http:
        answer = await http.post("/orders/5")
        free = await locks.try_acquire("orders/5", ttl=1.0)  # and the lock was released
        signalled = await http.post("/orders/9")
    assert answer.status_code == 200  # not 503 "retry": the booking is done
    assert answer.json() == {"booked": "5"}
    reason = unquote(answer.headers[LEASE_LOST_HEADER])
    assert "no successful renewal before the local deadline" in reason
    assert free is not None
    await free.release()
    assert signalled.status_code == 200
    assert signalled.json() == {"booked": "9"}
    assert unquote(signalled.headers[LEASE_LOST_HEADER]) == "the lock was removed on the server"


def test_mistakes_are_reported_when_the_handler_is_defined() -> None:
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("orders/{}", {}, "positional field"),
        ("orders/{id", {}, "malformed"),
        ("orders/{id}", {"ttl": 0}, "ttl"),
        ("orders/{id}", {"timeout": -1}, "timeout"),
        ("a", {"tll": 3}, "unknown option tll; the options are"),
        ("a", {"busy_status": 200}, "busy_status must be an HTTP error"),
        ("a", {"retry_after": 0.5}, "retry_after must be whole seconds"),
    ]

    def sync(id: str) -> None: ...

    decorators: list[Callable[..., Any]] = [fastapi_locks.locked, aiohttp_locks.locked]
    for locked in decorators:
        for template, options, message in cases:
            with pytest.raises(asynclock.InvalidArgument, match=message):
                locked(template, client=no_client, **options)
        with pytest.raises(TypeError, match="async def"):
            locked("orders/{id}", client=no_client)(sync)


@pytest.mark.expect_log(r"lease on 'orders/api' lost: the lock was removed on the server")
async def test_a_semaphore_endpoint_lets_permits_requests_in_and_answers_the_next_423(
    web: Web, locks: asynclock.LockClient
) -> None:
    """``permits=N``: up to N requests run the handler at once; the next is busy (423, with
    ``Retry-After``) while they do; a lost permit is a 503 ``lease_lost``, as for a lock."""
    inside = 0
    most = 0
    entered = anyio.Event()
    release = anyio.Event()

    async def call_api(order: str) -> str:
        nonlocal inside, most
        inside += 1
        most = max(most, inside)
        if inside == 2:
            entered.set()
        try:
            await release.wait()
        finally:
            inside -= 1
        return order

    app = web.app(locks, call_api, permits=2)
    async with web.serve(app) as url, httpx.AsyncClient(base_url=url) as http:
        answers: list[httpx.Response] = []

        async def call() -> None:
            answers.append(await http.post("/orders/api"))

        async with anyio.create_task_group() as task_group:
            task_group.start_soon(call)
            task_group.start_soon(call)
            with anyio.fail_after(5):
                await entered.wait()
            busy = await http.post("/orders/api")
            held = await locks.semaphore("orders/api", permits=2).inspect()
            memory(locks).expire("orders/api", notify=True, kind="semaphore")
        release.set()
        after = await http.post("/orders/api")
    assert [answer.status_code for answer in answers] == [503, 503]
    for lost in answers:
        assert error_body(lost, web.name)["error"] == "lease_lost"
        assert "semaphore permit of 'orders/api' was lost" in error_body(lost, web.name)["message"]
    assert most == 2 and len(held.holders) == 2
    assert busy.status_code == 423
    assert error_body(busy, web.name)["error"] == "lock_busy"
    assert "all its 2 permits in use" in error_body(busy, web.name)["message"]
    assert busy.headers["retry-after"] == "1"
    assert after.status_code == 200
    with pytest.raises(asynclock.InvalidArgument, match="permits"):
        web.app(locks, call_api, permits=0)
