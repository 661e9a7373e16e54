"""The fault contract: what every backend does when the server, the network or the client fails.

Written once, run against every real backend (see tests/contract/conftest.py):

(a) server paused past the ttl while a body runs: the body is cancelled before the ttl, the
    ``async with`` raises LeaseLost promptly, and the lock is usable once the server returns;
(b) every connection reset between holds: the next acquire succeeds without an error;
(c) client processes SIGSTOPped past their ttl under contention, with fenced writes: no error
    but LeaseLost / AcquireTimeout, no stale write accepted, the lock usable throughout and
    after the last pause;
(d) native ``Task.cancel()`` (and ``asyncio.timeout``) delivered 1-3 times at random moments of
    acquire, release and ``async with`` exit, 1,000 cycles: the lock is free for another client
    within 100 ms of the cancelled task ending, nothing is left on the server, no task runs on;
(e) the server restarted between holds: tokens still strictly increase, and locks work again
    within a few seconds;
(g) the network to the server partitioned while a lease is held: the client's connection state
    goes SUSPENDED, then LOST at the lease's deadline, then RECONNECTED once the server answers.

Measurements go to the file named by ``ASYNCLOCK_FAULT_REPORT`` (JSON lines), when it is set.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import random
import signal
import sqlite3
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, ExitStack, asynccontextmanager, suppress
from pathlib import Path

import anyio
import pytest

import asynclock
from asynclock import ConnectionState
from asynclock.abc import Kind
from asynclock.testing import FaultProxy
from asynclock.testing._forked import PIPE, ForkedPython
from tests.contract.fault_worker import open_resource, pause_schedule
from tests.contract.harness import (
    BackendUnderTest,
    report,
    wait_until_free,
    warm_up_for_wait_until_free,
)
from tests.contract.kinds import holds
from tests.loud import ExpectedLogs

pytestmark = pytest.mark.anyio

#: Native-cancellation cycles per backend.
CANCEL_CYCLES = int(os.environ.get("ASYNCLOCK_CANCEL_CYCLES", "1000"))
#: Client pauses per backend, each of 1.3 ttl, spread over PAUSE_WORKERS worker processes of
#: which PAUSED_AT_ONCE are stopped at a time: the two others contend with each other and with
#: the stopped ones' leases. Six at a time, the 30 pauses take 6 pause lengths, not 15.
CLIENT_PAUSES = 30
PAUSE_WORKERS = 8
PAUSED_AT_ONCE = 6


#: Tests that reach the servers through a fault proxy (see :func:`proxied`).
_THROUGH_A_PROXY = pytest.mark.not_on(
    "memory",
    "sqlite",
    "sentinel",
    "cluster",
    reason="no connection to a server, or (sentinel, cluster) none that a proxy can stand in "
    "front of: the sentinels and the slot map name the servers' own addresses",
)


@asynccontextmanager
async def proxied(
    backend: BackendUnderTest,
) -> AsyncIterator[tuple[list[FaultProxy], asynclock.LockClient]]:
    """A client of ``backend`` that reaches each of its servers through a fault proxy."""
    async with AsyncExitStack() as stack:
        proxies = [
            await stack.enter_async_context(FaultProxy(server.host, server.port))
            for server in backend.servers
        ]
        async with backend.connect_via([proxy.address for proxy in proxies]) as locks:
            yield proxies, locks


# -- (a) ------------------------------------------------------------------------------------


@pytest.mark.expect_log(r"lease on '.*' lost: no successful renewal before the local deadline")
# The release cannot reach a paused server; whether it gives up before the server answers again
# depends on how long the store's own timeouts make it wait.
@pytest.mark.allow_log(r"releasing '.*' on .* did not complete .*retrying in the background")
async def test_server_paused_past_the_ttl_cancels_the_body_and_exits_promptly(
    backend: BackendUnderTest, name: str
) -> None:
    ttl = backend.ttl
    async with backend.connect() as locks, backend.connect() as other:
        with ExitStack() as hang:
            with pytest.raises(asynclock.LeaseLost):
                async with locks.lock(name, ttl=ttl):
                    hang.enter_context(backend.hung(locks))
                    hung_at = anyio.current_time()
                    try:
                        await anyio.sleep(ttl * 5)
                    finally:
                        cancelled_at = anyio.current_time()
            exited_at = anyio.current_time()
            # The body ended before the server could expire the lock, and the `async with`
            # did not wait for the release on a server that does not answer.
            assert cancelled_at - hung_at < ttl
            assert exited_at - cancelled_at < 0.5
            await anyio.sleep(max(0.0, hung_at + ttl * 1.5 - anyio.current_time()))
        # The server answers again: the lock is free for another client soon after.
        free_after = await wait_until_free(backend, other, name, within=ttl + 5)
    report(
        "server_paused",
        backend,
        cancel_after_hang=round(cancelled_at - hung_at, 3),
        cancel_to_exit=round(exited_at - cancelled_at, 3),
        free_after_resume=round(free_after, 3),
    )


# -- (b) ------------------------------------------------------------------------------------


@_THROUGH_A_PROXY
async def test_connections_reset_between_holds_do_not_fail_the_next_acquire(
    backend: BackendUnderTest, name: str
) -> None:
    async with proxied(backend) as (proxies, locks):
        tokens: list[int] = []
        for _ in range(4):
            with anyio.fail_after(backend.ttl * 10):
                async with locks.lock(name, ttl=backend.ttl * 5) as lease:
                    if locks.capabilities.fencing:
                        tokens.append(lease.token)
            for proxy in proxies:
                proxy.reset()
            await anyio.sleep(0.05)
        assert tokens == sorted(set(tokens))


# -- (g) ------------------------------------------------------------------------------------


@_THROUGH_A_PROXY
@pytest.mark.expect_log(r"lease on '.*' lost")
# ZooKeeper also says its session is gone when the cut outlasts the session's timeout.
@pytest.mark.allow_log(r"ZooKeeper session \S+ is gone \(no ZooKeeper server answered")
async def test_connection_state_follows_a_partition_and_its_end(
    backend: BackendUnderTest, name: str
) -> None:
    async with proxied(backend) as (proxies, locks):
        changes = locks.state_changes()
        assert locks.state is ConnectionState.CONNECTED
        lease = await locks.acquire(name, ttl=backend.ttl)
        partitioned_at = anyio.current_time()
        for proxy in proxies:
            proxy.blackhole()
        with anyio.fail_after(backend.ttl * 3):
            suspended = await anext(changes)
            lost = await anext(changes)
        assert (suspended.previous, suspended.state) == (
            ConnectionState.CONNECTED,
            ConnectionState.SUSPENDED,
        )
        assert lost.state is ConnectionState.LOST
        assert lease.lost
        # Suspected when the first renewal (at ttl/3) goes unanswered, well before the deadline.
        assert suspended.at - partitioned_at < backend.ttl * 0.6
        for proxy in proxies:
            proxy.pass_through()
            proxy.reset()
        with anyio.fail_after(backend.ttl * 10):
            while not locks.state.connected:
                with suppress(asynclock.LockError):
                    again = await locks.try_acquire(name, ttl=backend.ttl)
                    if again is not None:
                        await again.release()
                await anyio.sleep(0.05)
        reconnected = await anext(changes)
        assert (reconnected.previous, reconnected.state) == (
            ConnectionState.LOST,
            ConnectionState.RECONNECTED,
        )
        assert locks.state.connected
        await lease.release()
        # The hold cut off by the partition ends on the server at its own expiry (ZooKeeper
        # keeps the node of a session it has not expired yet): then the lock is free, and the
        # client's close leaves nothing behind.
        await wait_until_free(backend, locks, name, within=backend.ttl * 10)
    closed = await anext(changes)
    assert closed.state is ConnectionState.CLOSED
    with pytest.raises(StopAsyncIteration):
        await anext(changes)
    report(
        "connection_state",
        backend,
        suspended_after=round(suspended.at - partitioned_at, 3),
        lost_after=round(lost.at - partitioned_at, 3),
    )


# -- (c) ------------------------------------------------------------------------------------


@pytest.mark.not_on("memory", reason="in-process only")
async def test_client_processes_paused_past_their_ttl_keep_the_resource_safe(
    backend: BackendUnderTest, name: str, tmp_path: Path
) -> None:
    ttl = backend.ttl
    resource = tmp_path / "resource.db"
    stop_file = tmp_path / "last-resume"
    open_resource(str(resource)).close()
    fenced = backend.name != "redlock"  # Redlock has no token: only the error kinds are checked
    pause = ttl * 1.3
    step = pause / PAUSED_AT_ONCE
    schedule = pause_schedule(CLIENT_PAUSES, PAUSED_AT_ONCE)
    # A guard only: each worker stops once it has taken the lock after the last resume.
    seconds = schedule[-1][0] * step + ttl * 10 + 5
    workers = []
    for index in range(PAUSE_WORKERS):
        config = {
            "worker": index,
            "url": backend.url,
            "options": backend.options,
            "name": name,
            "ttl": ttl,
            "fenced": fenced,
            "resource": str(resource),
            "seconds": seconds,
            "stop_file": str(stop_file),
        }
        workers.append(
            ForkedPython(
                "tests.contract.fault_worker",
                [json.dumps(config)],
                stdout=PIPE,
                cwd=Path(__file__).parents[2],
            )
        )
    try:
        for worker in workers:
            assert worker.stdout is not None
            line = await anyio.to_thread.run_sync(worker.stdout.readline)
            assert line.strip() == "ready", line
        started = time.time()
        began = anyio.current_time()
        for at, resume, pause_number in schedule:
            await anyio.sleep(max(0.0, began + at * step - anyio.current_time()))
            # Pause i stops worker i % PAUSE_WORKERS, which has run since its own last resume.
            pid = workers[pause_number % PAUSE_WORKERS].pid
            if resume:
                os.kill(pid, signal.SIGCONT)
            else:
                await backend.stop_client(pid)
        last_resume = time.time()
        stop_file.with_suffix(".tmp").write_text(repr(last_resume))
        stop_file.with_suffix(".tmp").replace(stop_file)
        results = []
        for worker in workers:
            out, _ = await anyio.to_thread.run_sync(
                functools.partial(worker.communicate, timeout=60)
            )
            assert worker.returncode == 0, out
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for worker in workers:
            worker.close()
    # Every worker has closed its client; a grant the last resumes left to nobody (a Redis
    # hand-over to a waiter that was stopped in line, say) runs out by its ttl.
    async with backend.connect() as locks:
        free_after = await wait_until_free(backend, locks, name, within=ttl * 2 + 1)
    errors = [error for result in results for error in result["errors"]]
    assert errors == []
    # The lock stayed usable: every worker took it, also after the last pause.
    for result in results:
        assert result["acquired"] > 0
        assert max(result["acquired_at"]) > last_resume, f"worker {result['worker']} starved"
    db = sqlite3.connect(resource)
    try:
        accepted = db.execute("SELECT token, value FROM accepted ORDER BY rowid").fetchall()
        (final,) = db.execute("SELECT value FROM counter").fetchone()
    finally:
        db.close()
    if fenced:
        # No stale write accepted, no update lost: every accepted write carried a token no
        # lower than the one before, and added one to what the previous write left.
        tokens = [token for token, _ in accepted]
        assert tokens == sorted(tokens)
        assert [value for _, value in accepted] == list(range(1, len(accepted) + 1))
        assert final == len(accepted)
    report(
        "client_paused",
        backend,
        pauses=CLIENT_PAUSES,
        seconds=round(time.time() - started, 1),
        accepted=len(accepted),
        refused=sum(result["refused"] for result in results),
        lost=sum(result["lost"] for result in results),
        timeouts=sum(result["timeouts"] for result in results),
        free_after_exit=round(free_after, 3),
    )


# -- (d) ------------------------------------------------------------------------------------


# 1,000 cycles of round trips: 5-18 s a backend beside the other workers.
@pytest.mark.timeout(300)
async def test_native_cancellation_at_random_moments_strands_nothing(
    backend: BackendUnderTest, name: str
) -> None:
    ttl = backend.ttl * 10
    rng = random.Random(1234)
    tasks_before = asyncio.all_tasks()
    async with backend.connect() as locks, backend.connect() as other:
        # The moments are drawn within a warm acquire + release: the first one also opens
        # connections (PostgreSQL: 12 ms against 1), and most cancels then fell in the body.
        await (await locks.acquire(name, ttl=ttl)).release()
        started = anyio.current_time()
        lease = await locks.acquire(name, ttl=ttl)
        await lease.release()
        round_trip = max(anyio.current_time() - started, 0.0005)
        stranded: list[str] = []
        waited: list[float] = []
        for cycle in range(CANCEL_CYCLES):
            blocker = None
            if cycle % 4 == 3:  # cancel a waiter queued behind another holder
                blocker = await other.acquire(name, ttl=ttl, timeout=ttl)
            body = rng.uniform(0, round_trip)
            use_timeout = cycle % 5 == 4

            entered: list[bool] = []  # whether the cancels came after the acquire

            async def hold(
                body: float = body, use_timeout: bool = use_timeout, entered: list[bool] = entered
            ) -> None:
                if use_timeout:
                    async with asyncio.timeout(rng.uniform(0, 3 * round_trip)):
                        async with locks.lock(name, ttl=ttl):
                            entered.append(True)
                            await asyncio.sleep(body)
                else:
                    async with locks.lock(name, ttl=ttl):
                        entered.append(True)
                        await asyncio.sleep(body)

            task = asyncio.create_task(hold())
            cancels = rng.choice((0, 1, 1, 2, 3)) if use_timeout else rng.choice((1, 1, 2, 3))
            for _ in range(cancels):
                await asyncio.sleep(rng.uniform(0, 2 * round_trip))
                task.cancel()
            with suppress(asyncio.CancelledError, TimeoutError):
                await task
            if blocker is not None:
                await blocker.release()
            ended = anyio.current_time()
            while True:
                probe = await other.try_acquire(name, ttl=ttl)
                if probe is not None:
                    waited.append(anyio.current_time() - ended)
                    await probe.release()
                    break
                if anyio.current_time() - ended > 0.1:
                    # Let it free itself (its ttl), so that the next cycles still count. When
                    # it did says which it was: a late undo (soon) or a strand (at the ttl).
                    late = await wait_until_free(backend, other, name, within=ttl * 2)
                    stranded.append(
                        f"cycle {cycle} ({cancels} cancels, timeout={use_timeout}, "
                        f"body entered: {bool(entered)}): free "
                        f"{anyio.current_time() - ended:.3f} s after the task ended "
                        f"({late:.3f} s after the last probe; ttl {ttl:g} s)"
                    )
                    break
                await anyio.sleep(0.005)
    # Closing the clients ended every task they started (sessions, watches, retries).
    await anyio.sleep(0.05)
    left_running = [
        task.get_name() for task in asyncio.all_tasks() - tasks_before if not task.done()
    ]
    report(
        "native_cancel",
        backend,
        cycles=CANCEL_CYCLES,
        stranded=len(stranded),
        free_after_p99_ms=round(sorted(waited)[int(len(waited) * 0.99) - 1] * 1000, 2),
    )
    assert stranded == []
    assert left_running == []


# -- (e) ------------------------------------------------------------------------------------


@pytest.mark.not_on("memory", "sqlite", reason="no server to restart")
async def test_server_restart_between_holds_keeps_tokens_rising(
    backend: BackendUnderTest, name: str
) -> None:
    fencing = backend.name != "redlock"
    tokens: list[int] = []
    async with backend.connect() as locks:
        for _ in range(3):
            async with locks.lock(name, ttl=backend.ttl * 5) as lease:
                if fencing:
                    tokens.append(lease.token)
        for server in backend.servers:
            await anyio.to_thread.run_sync(server.restart)
        restarted = anyio.current_time()
        # The client that was open across the restart takes the lock again within seconds.
        with anyio.fail_after(15):
            while True:
                try:
                    async with locks.lock(name, ttl=backend.ttl * 5, timeout=2) as lease:
                        if fencing:
                            tokens.append(lease.token)
                    break
                except (asynclock.BackendUnavailable, asynclock.AcquireTimeout):
                    await anyio.sleep(0.1)
        recovered = anyio.current_time() - restarted
        for _ in range(2):
            async with locks.lock(name, ttl=backend.ttl * 5) as lease:
                if fencing:
                    tokens.append(lease.token)
    async with backend.connect() as fresh:
        async with fresh.lock(name, ttl=backend.ttl * 5) as lease:
            if fencing:
                tokens.append(lease.token)
    assert tokens == sorted(set(tokens)), f"tokens repeated or went back: {tokens}"
    report("server_restart", backend, recovered_after=round(recovered, 3), tokens=tokens)
    assert recovered < 10


async def test_a_client_closed_by_native_cancellation_leaves_nothing_behind(
    backend: BackendUnderTest, name: str, kind: Kind
) -> None:
    """The client's own exit (releasing what it holds, closing the backend) runs to its end
    when the task that owns it is cancelled natively, once or several times."""
    ttl = backend.ttl * 10
    async with backend.connect() as other:
        for cancels in (1, 2, 3):
            holding = asyncio.Event()

            async def own_a_client(holding: asyncio.Event = holding) -> None:
                async with backend.connect() as locks:
                    await holds(locks, kind).acquire(name, ttl=ttl)
                    await holds(locks, kind).acquire(f"{name}/2", ttl=ttl)
                    holding.set()
                    await asyncio.sleep(60)

            task = asyncio.create_task(own_a_client())
            with anyio.fail_after(10):
                await holding.wait()
            for _ in range(cancels):
                task.cancel()
                await asyncio.sleep(0.001)
            with suppress(asyncio.CancelledError):
                await task
            for each in (name, f"{name}/2"):
                probe = await holds(other, kind).try_acquire(each, ttl=ttl)
                assert probe is not None, f"{each!r} still held after {cancels} cancels"
                await probe.release()


async def test_a_started_client_closed_or_started_under_native_cancellation_leaves_nothing(
    backend: BackendUnderTest, name: str
) -> None:
    """(f) for ``start()`` / ``aclose()``: an ``aclose()`` from another task, cancelled natively
    once or several times, still releases and closes; so does a ``start()`` cancelled while it
    opens. No task of the client is left running."""
    ttl = backend.ttl * 10
    before = set(asyncio.all_tasks())
    freed: list[float] = []
    async with backend.connect() as other:
        await warm_up_for_wait_until_free(backend, other)
        for cancels in (1, 2, 3):
            locks = await backend.connect().start()
            await locks.acquire(name, ttl=ttl)
            closing = asyncio.create_task(locks.aclose())
            for _ in range(cancels):
                await asyncio.sleep(0)
                closing.cancel()
            with suppress(asyncio.CancelledError):
                await closing
            # Free at once, or within (d)'s 100 ms: a PostgreSQL release cut short mid-statement
            # ends its connection, and the server frees that session's locks as it notices.
            freed.append(await wait_until_free(backend, other, name, within=0.1))
            starting = asyncio.create_task(backend.connect().start())
            for _ in range(cancels):
                await asyncio.sleep(0)
                starting.cancel()
            with suppress(asyncio.CancelledError):
                started = await starting
                await started.aclose()  # it won the race and opened: close it
    await asyncio.sleep(0.01)
    assert {task for task in asyncio.all_tasks() - before if not task.done()} == set()
    report("started_client_cancelled", backend, free_after=[round(each, 4) for each in freed])


@_THROUGH_A_PROXY
async def test_connecting_waits_for_a_slow_server_within_connect_timeout_not_op_timeout(
    backend: BackendUnderTest, name: str, expected_logs: ExpectedLogs
) -> None:
    """A server too busy to answer within ``op_timeout`` while the client connects (many
    replicas of a service starting at once, a loaded host) is waited for; one that never
    answers fails the connect at ``connect_timeout``, with the option named."""
    # Redlock goes on once a majority of masters answered, and names the ones that had not
    # within a short grace: each master's connection comes back on its own retry schedule
    # after the cut, and beside a CPU hog the last one can miss the grace (fresh-clone run 48).
    expected_logs.allow(r"1 of 3 masters did not answer .*; locking goes on with the majority")
    async with AsyncExitStack() as stack:
        proxies = [
            await stack.enter_async_context(FaultProxy(server.host, server.port))
            for server in backend.servers
        ]
        addresses = [proxy.address for proxy in proxies]
        for proxy in proxies:
            proxy.cut(1.2)
        started = anyio.current_time()
        async with backend.connect_via(addresses, op_timeout=0.4, connect_timeout=10) as locks:
            assert anyio.current_time() - started >= 1.0
            async with locks.lock(name, ttl=backend.ttl):
                pass
        for proxy in proxies:
            proxy.blackhole()
        started = anyio.current_time()
        with pytest.raises(asynclock.BackendTimeout, match="connect_timeout"):
            async with backend.connect_via(addresses, op_timeout=0.4, connect_timeout=1.0):
                pytest.fail("connected through a proxy that relays nothing")
        assert anyio.current_time() - started < 2.0
