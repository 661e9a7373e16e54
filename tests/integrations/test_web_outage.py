"""Scenarios: FastAPI (uvicorn) and aiohttp under load against a real Redis, with outages.

Two instances of each app book orders in one shared ledger: instance A reaches Redis through a
:class:`~asynclock.testing.FaultProxy`, instance B directly. Concurrent clients, each pausing
PACE between its requests, book over 10 orders from before the first fault until TAIL after the
last; in the middle, A's link to Redis is cut for 1.5 s, then the Redis server
itself is frozen (SIGSTOP) for 1.3 s, then one of A's handlers blocks the event loop past its ttl
after it has booked (a paused process). Every answer must be one of the documented ones (no
500), no order is ever booked by two holders at once or with an older fencing token, an answer
is 200 exactly when its body completed (so no "lease_lost" for committed work), and
``Retry-After`` comes with every busy and lock-unavailable answer.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest

import asynclock
from asynclock.integrations.fastapi import LEASE_LOST_HEADER
from asynclock.testing import FaultProxy, RedisServer

from ._servers import REQUEST_ID, WEBS, Traffic, Web, assert_no_leftovers

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

TTL = 1.0
#: Concurrent clients, each waiting PACE after every answer before its next request, so that
#: the offered load (at most 40 requests/s) stays well under what this one event loop can
#: serve: it runs the clients, both apps, both lock clients and the fault proxy. Saturated
#: (32 clients as fast as they could, and 16 every 20 ms still served only 60-80 requests/s),
#: timers fired late, the proxied instance's 0.3 s handshakes failed from before the first
#: fault on, and a run timed out.
CLIENTS = 8
PACE = 0.2
#: Requests before the first fault, and after the last one, each this long.
WARMUP = TAIL = 1.5
#: The request whose handler blocks the loop past its ttl after booking, on its own order.
PAUSED = "paused"
#: Requests whose body is still running when an outage begins: it must lose its lease.
LONG = "long"


@dataclass
class Ledger:
    """The protected resource: bookings per order, watching for overlaps and stale tokens."""

    active: Counter[str] = field(default_factory=Counter)
    highest: dict[str, int] = field(default_factory=dict)
    #: request id -> (order, token), for every booking made: the body's last step.
    booked: dict[str, tuple[str, int]] = field(default_factory=dict)
    #: request ids whose body has begun its write.
    writing: set[str] = field(default_factory=set)
    overlaps: int = 0
    stale: int = 0

    async def book(self, order: str) -> dict[str, Any]:
        """The handlers' body."""
        token, request_id = asynclock.current_token(), REQUEST_ID.get()
        self.active[order] += 1
        self.writing.add(request_id)
        try:
            if self.active[order] > 1:
                self.overlaps += 1
            # The write in flight: a lost lease cancels it here. The "long" ones outlast each
            # outage, so that an outage finds a body holding its lease.
            await anyio.sleep(3.0 if request_id.startswith(LONG) else 0.01)
            if token <= self.highest.get(order, 0):
                self.stale += 1
            self.highest[order] = token
            self.booked[request_id] = (order, token)
        finally:
            self.active[order] -= 1
        if request_id == PAUSED:
            time.sleep(TTL * 1.6)  # noqa: ASYNC251 - a process paused past its ttl, its work done
        return {"token": token}


@dataclass
class Run(Traffic):
    ledger: Ledger = field(default_factory=Ledger)
    #: The long requests whose body held its lease when a fault began.
    longs: list[str] = field(default_factory=list)


async def run_scenario(redis_server: RedisServer, web: Web) -> Run:
    tag = uuid.uuid4().hex[:8]
    prefix, client_name = f"web-outage-{tag}:", f"asynclock-web-{tag}"
    options = (
        f"/0?prefix={prefix}&client_name={client_name}&op_timeout=0.3&durability_warning=false"
    )
    run = Run()
    async with AsyncExitStack() as stack:
        proxy = await stack.enter_async_context(FaultProxy(redis_server.host, redis_server.port))
        locks_a = await stack.enter_async_context(
            asynclock.connect(f"redis://{proxy.address}{options}")
        )
        locks_b = await stack.enter_async_context(
            asynclock.connect(f"redis://{redis_server.host}:{redis_server.port}{options}")
        )
        for locks in (locks_a, locks_b):
            app = web.app(locks, run.ledger.book, ttl=TTL, timeout=0.3)
            await run.reach(stack, await stack.enter_async_context(web.serve(app)), CLIENTS, 20)

        async def long_body(instance: int, order: str) -> None:
            writing = run.ledger.writing
            run.longs.append(await run.hold_long(task_group, instance, order, writing.__contains__))

        async def run_faults() -> None:
            await run.warm_up(WARMUP)
            run.began = time.monotonic()
            await long_body(0, f"{LONG}-a")
            # Instance A cannot reach Redis; B goes on. A's renewals fail, so the long body's
            # lease reaches its local deadline (at most 0.33 + 0.89 s after the last renewal)
            # within the cut: it is cancelled.
            proxy.cut(1.5)
            await anyio.sleep(1.5)
            await long_body(1, f"{LONG}-b")
            redis_server.pause()  # nobody can reach Redis
            try:
                await anyio.sleep(1.3)
            finally:
                redis_server.resume()
            # Its take may be answered 503 or 423 before its body runs (op_timeout 0.3 s on a
            # loaded host), or its lease lost before it booked (Redis just came back): nothing
            # was done, so that answer is dropped and it asks again, as the long requests do:
            # the scenario needs a body that books and is then paused.
            for _ in range(20):
                paused = await run.post(0, "booked-then-paused", PAUSED)
                if PAUSED in run.ledger.booked or paused.error not in (
                    "lock_unavailable",
                    "lock_busy",
                    "lease_lost",
                ):
                    break
                run.answers.remove(paused)
            run.ended = time.monotonic()
            await anyio.sleep(TAIL)
            run.over.set()

        # A guard against a hang, not a bound on speed.
        with anyio.fail_after(45):
            async with anyio.create_task_group() as task_group:
                task_group.start_soon(run_faults)
                for _ in range(CLIENTS):
                    task_group.start_soon(run.client, PACE)
    await assert_no_leftovers(redis_server, prefix, client_name)
    return run


# The faults decide which of the orders' leases are lost, and which releases wait for Redis.
@pytest.mark.allow_log(r"lease on 'orders/o\d+' (was )?lost")
@pytest.mark.allow_log(
    r"releasing 'orders/(o\d+|long-[ab]|booked-then-paused)' on redis://\S+ did not complete"
)
@pytest.mark.expect_log(r"answered 503 for the lock 'orders/o\d+': taking lock")
@pytest.mark.allow_log(r"answered 503 for the lock 'orders/(long-[ab]|booked-then-paused)': taking")
@pytest.mark.expect_log(r"lease on 'orders/long-[ab]' lost: no successful renewal")
@pytest.mark.expect_log(r"lease on 'orders/booked-then-paused' (was )?lost")
@pytest.mark.parametrize("web", [WEBS[0], WEBS[2]], ids=["fastapi", "aiohttp"])  # the decorators
async def test_a_web_app_through_a_redis_outage_and_a_paused_process(
    redis_server: RedisServer, web: Web
) -> None:
    run = await run_scenario(redis_server, web)
    answers, ledger = run.answers, run.ledger
    outcomes = Counter(f"{answer.status} {answer.error or 'ok'}" for answer in answers)
    reported = sum(1 for answer in answers if answer.status == 200 and answer.lease_lost)
    print(
        f"\n{len(answers)} answers: {dict(outcomes)}; {len(ledger.booked)} bookings; "
        f"{reported} answered 200 with {LEASE_LOST_HEADER}"
    )
    # Every request answered once (the client's numbered ones, and the paused one).
    numbered = sorted(int(a.request_id) for a in answers if a.request_id.isdigit())
    assert numbered == list(range(len(numbered)))
    assert [a.request_id for a in answers].count(PAUSED) == 1
    run.check_answers()
    assert set(outcomes) <= {"200 ok", "423 lock_busy", "503 lease_lost", "503 lock_unavailable"}
    # No double booking: never two holders at once, never an older token after a newer one.
    assert ledger.overlaps == 0
    assert ledger.stale == 0
    # 200 exactly for the bodies that completed: no "lease_lost" (or anything else) for
    # committed work, and no 200 for work that was stopped.
    assert {answer.request_id for answer in answers if answer.status == 200} == set(ledger.booked)
    # The process paused past its ttl after booking kept its answer, with the loss beside it.
    paused = next(answer for answer in answers if answer.request_id == PAUSED)
    assert paused.status == 200
    assert paused.lease_lost is not None
    assert "deadline" in paused.lease_lost
    # The bodies running when each outage began were stopped, and said so.
    assert len(run.longs) == 2
    for long in run.longs:
        answer = next(answer for answer in answers if answer.request_id == long)
        assert (answer.status, answer.error) == (503, "lease_lost"), answer
