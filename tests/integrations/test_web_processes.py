"""The web scenario as a user runs it: three worker processes, a lock-server cut, a stopped worker.

For each framework, three worker processes (``tests/integrations/web_worker_app.py``, one port
each, so that the test can aim a request at the worker it will stop) book orders in one fenced
resource on Redis, call a slow API behind a semaphore of 3 permits, and run a leader-only job (a
:class:`asynclock.LeaderTask` started by their lifespan / start-up hook). Their lock client
reaches the session's Redis through a :class:`~asynclock.testing.FaultProxy`; the resource is
reached directly, so the cut is an outage of the *lock server* only. Concurrent httpx clients,
each pausing PACE between its requests, book over 10 orders and call the API from before the
first fault until TAIL after the last. During the run:

1. a long body holds its lock when the proxy cuts the link for 1.5 s: the lock server is
   unreachable, requests get 503 ``lock_unavailable``, the long body is cancelled (503
   ``lease_lost``);
2. the worker that leads is stopped (SIGSTOP) while one of its bodies holds a permit and another
   holds ``orders/o3``, inside synchronous work before its write; another worker takes the order
   over and books it, three bodies of the others take all the permits, and another worker leads;
   after more than the ttl the stopped worker continues (SIGCONT) and sends its write with the
   expired lease's token, which the resource refuses;
3. a worker is stopped while one of its bodies is in synchronous work after its write, before it
   returns; after more than the ttl it continues and returns: the core's rule keeps that answer
   (200, with ``Asynclock-Lease-Lost``), since its work is done.

Then: only documented answers (no 500), ``Retry-After`` where promised, the resource's record
shows no order booked twice by one acquisition or with an older token, every 200 is a booking
and every returned body a 200, and a booking whose request was answered 503 ``lease_lost`` is
one whose body was stopped after its write had been sent (the core's rule: ``LeaseLost`` means the
body did not finish; such an answer carries no ``Retry-After``, since its effects may be partial).

A permit holder, and a run of the job, counts as valid from when its body began until it ended
or its lease's local deadline passed, whichever came first (the deadline only moves forward while
the lease is held; the server expires it later): never more than 3 valid holders at once, and
never two valid runs at once (a run begun after its term's deadline, by a leader that was stopped,
is valid for no time at all), with tokens that never go down.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import signal
import socket
import sys
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import redis.asyncio
from anyio.abc import TaskGroup

from asynclock.testing import FaultProxy, RedisServer

from ._servers import (
    ROOT,
    Answer,
    Process,
    Traffic,
    assert_no_leftovers,
    signal_group,
    start_process,
    stop_processes,
)
from .web_worker_app import FRAMEWORKS, PERMITS, TTL

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

WORKER = [sys.executable, "-m", "tests.integrations.web_worker_app"]
WORKERS = 3
#: Concurrent clients, each waiting PACE after every answer before its next request, so that
#: the offered load (at most 30 requests/s) stays well under what this process can serve: its
#: one event loop runs the clients and the fault proxy of every worker's lock client. As fast
#: as they could, 24 clients saturated it: the workers' 0.3 s handshakes through the proxy
#: timed out, the quick 503s made the clients faster still, and a run was 96 %
#: ``lock_unavailable`` (1,185 of 1,232).
CLIENTS = 6
PACE = 0.2
#: Concurrent clients of the semaphore endpoint: more than its permits, each call 0.3 s (so at
#: most 8 requests/s more).
CALLERS = 4
#: Requests before the first fault, and after the last one, each this long.
WARMUP = TAIL = 1.5
#: A request to a worker that does not answer within this long counts as timed out.
CLIENT_TIMEOUT = 8.0
CUT = 1.5
#: The stopped worker stays stopped at least this long: more than the ttl.
STOP = 2.0 * TTL
#: The order the stopped worker (the leader) holds.
PAUSED_ORDER = "o3"
#: The order and the worker of the body that is stopped after its write, before it returns.
FINISHED_ORDER, FINISHER = "o7", 0
#: Seconds of synchronous work in the body that is stopped: the window for the SIGSTOP.
BLOCK = 0.6


@dataclass
class Worker:
    process: Process
    url: str
    log: Path


@asynccontextmanager
async def running(framework: str, env: dict[str, str], logs: Path) -> AsyncIterator[list[Worker]]:
    """The workers, each on a listening socket made here and passed down, once each answers
    (its lifespan has opened the lock client by then)."""
    workers: list[Worker] = []
    try:
        for number in range(WORKERS):
            # One at a time, so that a failed start still stops the ones already running.
            log = logs / f"worker-{number}.log"
            with socket.create_server(("127.0.0.1", 0), backlog=512) as listener:
                url = f"http://127.0.0.1:{listener.getsockname()[1]}"
                command = [*WORKER, framework, str(listener.fileno())]
                process = start_process(command, env, log, pass_fds=[listener.fileno()])
            workers.append(Worker(process, url, log))
        async with httpx.AsyncClient(timeout=1.0) as probe:
            for worker in workers:
                with anyio.fail_after(30):
                    while True:
                        assert worker.process.poll() is None, f"exited: {worker.log.read_text()}"
                        with contextlib.suppress(httpx.TransportError):
                            if (await probe.get(f"{worker.url}/health")).status_code == 200:
                                break
                        await anyio.sleep(0.05)
        yield workers
    finally:
        await stop_processes([worker.process for worker in workers], grace=10)


@dataclass
class Run(Traffic):
    """Everything one scenario produced."""

    #: The resource's record, in the order the writes were accepted.
    bookings: list[dict[str, Any]] = field(default_factory=list)
    #: request id -> the journal's events for it, in order.
    steps: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))
    #: The request whose body was stopped, its worker (the leader), and when the stop and the
    #: continue were sent; the call that held a permit there, and those that then took them all.
    paused: str | None = None
    stopped_pid: int = 0
    stopped_call: str = ""
    takers: list[str] = field(default_factory=list)
    chosen_at: float = 0.0
    stopped_at: float = 0.0
    continued_at: float = 0.0
    takeover: str | None = None
    long: str = "long"
    #: The workers' exit codes and logs.
    exits: list[int | None] = field(default_factory=list)
    #: Workers whose journal ends with "closed": their lifespan / cleanup_ctx closed the clients.
    closed: int = 0
    logs: list[str] = field(default_factory=list)
    #: The request whose body was stopped after its write (it returns after SIGCONT).
    finished: str | None = None
    #: The fenced commands the resource received from the stopped worker's body (MONITOR).
    received: list[str] = field(default_factory=list)

    def events(self, request_id: str) -> list[str]:
        return [step["event"] for step in self.steps.get(request_id, [])]


async def scenario(redis_server: RedisServer, framework: str, directory: Path) -> Run:
    tag = uuid.uuid4().hex[:8]
    prefix, client_name = f"web-procs-{tag}:", f"asynclock-web-procs-{tag}"
    # The resource's keys (bookings, fences) under a prefix of their own: they stay by design.
    resource = f"web-procs-{tag}-resource:"
    journal_dir = directory / "journal"
    journal_dir.mkdir()
    run = Run()
    async with AsyncExitStack() as stack:
        proxy = await stack.enter_async_context(FaultProxy(redis_server.host, redis_server.port))
        env = dict(
            os.environ,
            PYTHONPATH=str(ROOT),
            # waiter_ttl=1: a waiter of the stopped worker first in the order's fair queue keeps
            # its place that long without a refresh (5 s by default), and until it is gone
            # nobody else may take the free lock (see docs/backends/redis.md).
            ASYNCLOCK_WEB_LOCKS=(
                f"redis://{proxy.address}/0?prefix={prefix}&client_name={client_name}"
                "&op_timeout=0.3&waiter_ttl=1&durability_warning=false"
            ),
            ASYNCLOCK_WEB_RESOURCE=redis_server.url,
            ASYNCLOCK_WEB_PREFIX=resource,
            ASYNCLOCK_WEB_CLIENT_NAME=client_name,
            ASYNCLOCK_WEB_JOURNAL=str(journal_dir),
        )
        workers = await stack.enter_async_context(running(framework, env, directory))
        for worker in workers:
            await run.reach(stack, worker.url, CLIENTS + CALLERS + 2, CLIENT_TIMEOUT)
        started = time.monotonic()
        await drive(run, workers, proxy, journal_dir, redis_server)
        print(f"\n{framework}: {len(run.answers)} answers in {time.monotonic() - started:.1f} s")
        # Shut the workers down (their clients release and close), then nothing may be left.
        await stack.aclose()
    run.exits = [worker.process.returncode for worker in workers]
    run.logs = [worker.log.read_text() for worker in workers]
    for path in sorted(journal_dir.glob("*.jsonl")):
        steps = [json.loads(line) for line in path.read_text().splitlines()]
        run.closed += steps[-1]["event"] == "closed"
        for step in steps:
            run.steps[step["request_id"]].append(step)
    async with redis.asyncio.Redis(host=redis_server.host, port=redis_server.port) as raw:
        # redis-py types its commands as "awaitable or not"; on the asyncio client they await.
        items: list[bytes] = await raw.lrange(f"{resource}bookings", 0, -1)  # type: ignore[misc]
        run.bookings = [json.loads(item) for item in items]
        await assert_no_leftovers(redis_server, prefix, client_name)
        # What stays by design (token counters, fences, the bookings) belongs to this test.
        ours = [key async for key in raw.scan_iter(match=f"web-procs-{tag}*", count=1000)]
        if ours:
            await raw.delete(*ours)
        assert [key async for key in raw.scan_iter(match=f"web-procs-{tag}*", count=1000)] == []
    return run


async def drive(
    run: Run,
    workers: list[Worker],
    proxy: FaultProxy,
    journal_dir: Path,
    redis_server: RedisServer,
) -> None:
    def journal(worker: int) -> str:
        path = journal_dir / f"{workers[worker].process.pid}.jsonl"
        return path.read_text() if path.exists() else ""

    def journaled(worker: int, event: str, request_id: str) -> bool:
        # The journal's lines begin with the event and the request id (json.dumps keeps order).
        return json.dumps({"event": event, "request_id": request_id})[:-1] + "," in journal(worker)

    def leader() -> int | None:
        """The worker that leads in a settled term: its job ran within the last 0.2 s, in a term
        renewed since its grant (its deadline moved on between two runs) with a third of the ttl
        left at least. The stop comes after two more requests to it: a term just granted as the
        cut ends, or about to lapse, would leave the test stopping a worker that no longer leads."""
        latest: tuple[float, int] | None = None
        for worker in range(WORKERS):
            runs = [
                json.loads(line)
                for line in journal(worker).splitlines()
                if '"event": "run"' in line
            ]
            if runs and (latest is None or runs[-1]["at"] > latest[0]):
                last = runs[-1]
                renewed = any(
                    run["token"] == last["token"] and run["deadline"] < last["deadline"]
                    for run in runs
                )
                now = time.monotonic()
                settled = renewed and last["deadline"] > now + TTL / 3 and last["at"] > now - 0.2
                latest = (last["at"], worker if settled else -1)
        return None if latest is None or latest[1] < 0 else latest[1]

    async def hold_a_permit(worker: int, name: str, seconds: float) -> str:
        holding = functools.partial(journaled, worker, "entered")
        with anyio.fail_after(5):
            return await run.hold_long(
                task_group, worker, name, holding, endpoint="calls", work=str(seconds)
            )

    async def take_the_order(worker: int) -> None:
        # Once the stopped holder's key expires on Redis, another worker takes the order.
        with anyio.fail_after(5):
            for attempt in range(1000):
                if (await run.post(worker, PAUSED_ORDER, f"takeover-{attempt}")).status == 200:
                    run.takeover = f"takeover-{attempt}"
                    return
                await anyio.sleep(0.02)

    async def take_the_permits(stopped: int) -> None:
        # Once the stopped holder's permit expires, bodies of the other workers hold all of them
        # at once (each long enough for the last to come in), before it continues.
        for number in range(PERMITS):
            worker = (stopped + 1 + number % 2) % WORKERS
            run.takers.append(await hold_a_permit(worker, f"taker{number}", 2 * STOP))

    async def cut_the_lock_server(task_group: TaskGroup) -> None:
        # A body holds its lease when the cut begins: its renewals go unanswered, so it is
        # cancelled at its local deadline, within the cut.
        with anyio.fail_after(30):
            holding = functools.partial(journaled, 0, "holding")
            run.long = await run.hold_long(task_group, 0, "long", holding, work="3")
        proxy.cut(CUT)
        await anyio.sleep(CUT)

    async def watch_the_resource(request_id: str, ready: anyio.Event) -> None:
        # MONITOR shows each command as the resource receives it: the evidence that the
        # stopped worker's write arrived (and, with the bookings, that it was refused).
        with anyio.CancelScope() as scope:
            async with (
                redis.asyncio.Redis(host=redis_server.host, port=redis_server.port) as raw,
                raw.monitor() as monitor,
            ):
                ready.set()
                task_group.start_soon(cancel_when_answered, request_id, scope)
                async for info in monitor.listen():
                    if request_id in info["command"] and "EVAL" in info["command"]:
                        run.received.append(info["command"])

    async def cancel_when_answered(request_id: str, scope: anyio.CancelScope) -> None:
        while not run.answered(request_id):  # noqa: ASYNC110
            await anyio.sleep(0.05)
        await anyio.sleep(0.2)  # MONITOR lines lag the commands a little
        scope.cancel()

    async def stop_when(worker: int, order: str, name: str, event: str, **headers: str) -> str:
        """Send requests until one's body journals ``event`` (it then blocks its worker in
        synchronous work), and stop that worker there."""
        with anyio.fail_after(5):
            holding = functools.partial(journaled, worker, event)
            request_id = await run.hold_long(task_group, worker, order, holding, name, **headers)
        signal_group(workers[worker].process, signal.SIGSTOP)
        return request_id

    async def stop_a_holder() -> None:
        # The leader is stopped, holding a permit, and an order's lock whose body is inside the
        # synchronous work before its write.
        with anyio.fail_after(5):
            while (stopped := leader()) is None:  # noqa: ASYNC110
                await anyio.sleep(0.02)
        run.stopped_pid = workers[stopped].process.pid
        run.chosen_at = time.monotonic()
        run.stopped_call = await hold_a_permit(stopped, "stopped-call", 10)
        run.paused = await stop_when(
            stopped, PAUSED_ORDER, "paused", "holding", work="0", block=str(BLOCK)
        )
        run.stopped_at = time.monotonic()
        watching = anyio.Event()
        task_group.start_soon(watch_the_resource, run.paused, watching)
        try:
            with anyio.fail_after(5):
                await watching.wait()
            async with anyio.create_task_group() as takeovers:  # while it is stopped
                takeovers.start_soon(take_the_order, (stopped + 1) % WORKERS)
                takeovers.start_soon(take_the_permits, stopped)
            await anyio.sleep(max(0.0, run.stopped_at + STOP - time.monotonic()))
        finally:
            signal_group(workers[stopped].process, signal.SIGCONT)
            run.continued_at = time.monotonic()

    async def stop_a_finished_body() -> None:
        # Its body has booked and is inside the synchronous work after the write when the
        # process stops: after SIGCONT it returns although its lease expired meanwhile.
        run.finished = await stop_when(
            FINISHER, FINISHED_ORDER, "finished", "booked", work="0", after=str(BLOCK)
        )
        try:
            await anyio.sleep(STOP)
        finally:
            signal_group(workers[FINISHER].process, signal.SIGCONT)

    async def faults() -> None:
        await run.warm_up(WARMUP)
        run.began = time.monotonic()
        await cut_the_lock_server(task_group)
        await stop_a_holder()
        await stop_a_finished_body()
        run.ended = time.monotonic()
        await anyio.sleep(TAIL)
        run.over.set()

    with anyio.fail_after(45):
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(faults)
            for _ in range(CLIENTS):
                task_group.start_soon(run.client, PACE)
            for _ in range(CALLERS):
                task_group.start_soon(run.client, PACE, "calls")


def check(run: Run, framework: str) -> Counter[str]:
    outcomes = Counter(
        f"{answer.status} {answer.error or 'ok'}"
        if answer.status
        else f"no answer {answer.failure}"
        for answer in run.answers
    )
    by_id = {answer.request_id: answer for answer in run.answers}
    assert len(by_id) == len(run.answers)
    flagged = sum(1 for answer in run.answers if answer.status == 200 and answer.lease_lost)
    booked = {booking["request_id"]: booking for booking in run.bookings}
    lost_booked = sorted(
        rid for rid, answer in by_id.items() if answer.error == "lease_lost" and rid in booked
    )
    print(
        f"{framework}: {dict(sorted(outcomes.items()))}; {len(run.bookings)} bookings; "
        f"{flagged} answered 200 with Asynclock-Lease-Lost; "
        f"{len(lost_booked)} answered 503 lease_lost although their write was accepted; "
        f"paused {run.paused}: {run.events(run.paused or '')}, its stale write "
        f"{'reached the resource' if run.received else 'was never sent'}"
    )

    run.check_answers()

    # The resource's record: one booking per acquisition, and per order the tokens only rise,
    # so no two holders ever booked an order at once and no expired lease's write got in.
    assert len(booked) == len(run.bookings), "a request booked twice"
    highest: dict[str, int] = {}
    for booking in run.bookings:
        assert booking["token"] > highest.get(booking["order"], 0), booking
        highest[booking["order"]] = booking["token"]

    for request_id, answer in by_id.items():
        events = run.events(request_id)
        made = booked.get(request_id)
        if answer.endpoint == "calls":
            # A call answered 200 or lease_lost entered and left; any other did nothing.
            done = answer.status == 200 or answer.error == "lease_lost"
            assert events == (["entered", "left"] if done else []), (answer, events)
        elif answer.status == 200:
            # A 200 is a booking, the one the body made and returned.
            assert made is not None and answer.body == made, (answer, made)
            assert events[-1] == "returned", (answer, events)
        elif answer.error == "lease_lost":
            # LeaseLost means the body did not finish: it was stopped, never returned. If its
            # write was accepted first (sent before the loss, its reply awaited when the body
            # was cancelled), that booking is partial work, answered without "retry".
            assert "returned" not in events, (answer, events)
            assert events[-1] in ("stopped", "stale"), (answer, events)
            if made is not None:
                assert "write" in events, (answer, events)
        else:
            # Busy, unavailable, deadlock: nothing was done.
            assert made is None and events == [], (answer, events)
    for request_id, steps in run.steps.items():
        # A body that returned keeps its answer (with the loss header if the lease was lost).
        if steps[-1]["event"] == "returned":
            assert by_id[request_id].status == 200, (by_id[request_id], steps)

    long = by_id[run.long]
    assert (long.status, long.error) == (503, "lease_lost"), (long, run.events(run.long))
    assert run.long not in booked

    # The stopped worker's body: stopped inside its synchronous work for longer than the ttl,
    # another worker booked the order meanwhile, and the write it then began with the expired
    # lease's token was refused by the resource, if it got there. It usually does (MONITOR
    # shows it); sometimes the cancellation lands first, at redis-py's check of the pooled
    # connection (an await before the command is sent), and the write never leaves.
    assert run.paused is not None and run.takeover is not None
    paused, steps = by_id[run.paused], run.steps[run.paused]
    assert run.continued_at - run.stopped_at > TTL
    blocked = next(step for step in steps if step["event"] == "blocked")
    assert blocked["seconds"] > TTL, steps
    write = next(step for step in steps if step["event"] == "write")
    assert write["at"] > run.stopped_at + TTL, steps  # sent after SIGCONT
    assert booked[run.takeover]["token"] > write["token"]
    assert len(run.received) <= 1, run.received
    assert run.paused not in booked, "the resource accepted the stopped worker's stale write"
    assert (paused.status, paused.error) == (503, "lease_lost"), (paused, steps)

    # The body stopped after its write returned after SIGCONT, past its lease's deadline: its
    # answer stands (its work is done), with the loss beside it, not "retry".
    assert run.finished is not None
    finished, steps = by_id[run.finished], run.steps[run.finished]
    blocked = next(step for step in steps if step["event"] == "blocked")
    assert blocked["where"] == "after" and blocked["seconds"] > TTL, steps
    assert finished.status == 200 and run.finished in booked, (finished, steps)
    assert finished.lease_lost is not None and "deadline" in finished.lease_lost, finished

    check_permits(run, by_id)
    check_leader(run)

    # The workers shut down cleanly on SIGTERM: each closed its clients (the journal's last
    # line), exited by itself (0; uvicorn re-raises the SIGTERM it handled once it has shut
    # down, hence -15), and none logged a traceback (a 500 would).
    assert all(code in (0, -signal.SIGTERM) for code in run.exits), run.exits
    assert run.closed == WORKERS, run.closed
    for log in run.logs:
        assert "Traceback" not in log, log
    return outcomes


def most_at_once(intervals: list[tuple[float, float]]) -> int:
    """The most intervals that overlap at one instant (one that ends as another starts: not)."""
    edges = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    return max(itertools.accumulate(change for _, change in edges), default=0)


def check_permits(run: Run, by_id: dict[str, Answer]) -> None:
    """Never more than PERMITS valid holders at once; and while the stopped worker was stopped,
    its holder's permit expired and three others held them all, so that counting its holder to
    the end, past its deadline, would find more holders than permits."""
    valid, raw = [], []
    for request_id, answer in by_id.items():
        if answer.endpoint == "calls" and run.events(request_id):
            entered, left = run.steps[request_id]
            valid.append((entered["at"], min(left["at"], left["deadline"])))
            raw.append((entered["at"], left["at"]))
    print(
        f"{len(valid)} calls held a permit; most at once {most_at_once(raw)}, valid {most_at_once(valid)}"
    )
    assert most_at_once(valid) == PERMITS
    assert most_at_once(raw) > PERMITS
    stopped = by_id[run.stopped_call]
    assert (stopped.status, stopped.error) == (503, "lease_lost"), stopped
    taken = max(run.steps[taker][0]["at"] for taker in run.takers)
    assert run.stopped_at < taken < run.continued_at, (run.stopped_at, taken, run.continued_at)


def check_leader(run: Run) -> None:
    """The job's valid runs never overlap and their tokens never go down; the stopped worker
    led until it was stopped, and another worker ran the job while it was stopped."""
    runs = sorted(
        (step["started"], min(step["at"], step["deadline"]), step["token"], step["pid"])
        for step in run.steps["job"]
    )
    valid = [job for job in runs if job[0] < job[1]]
    print(
        f"{len(runs)} runs of the job, {len(runs) - len(valid)} begun after their term's deadline"
    )
    # The terms, seconds from the first fault: which worker led when, around the stop.
    terms: dict[int, list[float]] = {}
    for start, end, token, pid in runs:
        span = terms.setdefault(token, [pid, start - run.began, end - run.began, 0])
        span[2], span[3] = end - run.began, span[3] + 1
    print(
        f"chose {run.stopped_pid} at {run.chosen_at - run.began:.3f} s, stopped it at "
        f"{run.stopped_at - run.began:.3f} s; terms (pid, first start, last end, runs):"
    )
    for token, span in sorted(terms.items(), key=lambda item: item[1][1]):
        print(f"  {token}: {span[0]} {span[1]:.3f} {span[2]:.3f} {span[3]}")
    for before, after in itertools.pairwise(valid):
        assert before[1] <= after[0] and before[2] <= after[2], (before, after)
    before_stop = [job for job in valid if job[0] < run.stopped_at]
    assert before_stop[-1][3] == run.stopped_pid, (
        run.stopped_at,
        run.stopped_pid,
        before_stop[-6:],
    )
    assert any(
        pid != run.stopped_pid and run.stopped_at < start < run.continued_at
        for start, _, _, pid in valid
    )


@pytest.mark.parametrize("framework", FRAMEWORKS)
async def test_three_worker_processes_through_a_lock_server_cut_and_a_stopped_worker(
    redis_server: RedisServer, framework: str, tmp_path: Path
) -> None:
    run = await scenario(redis_server, framework, tmp_path)
    check(run, framework)
