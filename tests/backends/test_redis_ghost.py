"""redis:// waiting: a hand-over told late, after its waiter queued again, is not taken for a grant.

A waiter stopped in line (SIGSTOP) may be handed the lock while it cannot run; the handed lease
expires unrenewed, and on resuming its refresh timer can run before its wake channel reads the
old ``"g"`` message. Its take queues it again, and the old message must not end the acquire: the
lock is another's by then, and the new place would later be handed the lock with no acquire left
to take it (a ghost holder until its ttl ran out).
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis.asyncio

import asynclock
from asynclock.abc import Kind
from asynclock.backends.redis import RedisBackend, _queue
from asynclock.backends.redis import _scripts as lua
from asynclock.backends.redis._scripts import Arg
from asynclock.backends.redis._wire import Undo
from asynclock.testing import RedisServer
from tests.contract.backend_redis import connect, lane_of, redis_leftovers, wait_for_queue

pytestmark = pytest.mark.anyio


def stall_waiting(locks: asynclock.LockClient) -> tuple[Callable[[], None], list[bytes]]:
    """Make ``locks`` behave as a process stopped in line: its wake channel keeps what it reads
    (returned), and every take of a waiter after the first waits for the function returned,
    which resumes it: its takes go first, as a resumed process runs its due timers first."""
    backend = locks._backend
    assert isinstance(backend, RedisBackend) and backend._wakes is not None
    wakes = backend._wakes
    lane = lane_of(locks)
    kept: list[bytes] = []
    resumed = anyio.Event()
    takes = 0
    dispatch = wakes._dispatch
    script = lane.script

    def keep(data: bytes) -> None:
        if resumed.is_set():
            dispatch(data)
        else:
            kept.append(data)

    async def stalled_script(
        which: lua.Script, keys: Sequence[str], args: Sequence[Arg], undo: Undo | None = None
    ) -> Any:
        nonlocal takes
        if which is _queue.TAKE and args[-1] == "wait":
            takes += 1
            if takes > 1:
                await resumed.wait()
        return await script(which, keys, args, undo)

    wakes._dispatch = keep  # type: ignore[method-assign]
    lane.script = stalled_script  # type: ignore[method-assign, assignment]
    return resumed.set, kept


async def holder_of(locks: asynclock.LockClient, name: str, kind: Kind) -> str | None:
    """The owner id of the first hold (the client's inspect() shows a digest of it)."""
    return (await locks._backend.inspect(name, kind)).owner


@pytest.mark.parametrize("hold", ["exclusive", "shared", "semaphore"])
async def test_a_stale_hand_over_after_the_waiter_queued_again_neither_grants_nor_strands(
    redis_server: RedisServer, raw_redis: redis.asyncio.Redis, prefix: str, name: str, hold: str
) -> None:
    kind: Kind = "semaphore" if hold == "semaphore" else "lock"
    async with (
        connect(redis_server, prefix) as first,
        # Its place lasts 0.6 s, and so does a lock handed to it while it cannot hear of it.
        connect(redis_server, prefix, waiter_ttl=0.6) as stopped,
        connect(redis_server, prefix) as third,
    ):
        # A shared hold waits behind an exclusive one: the waiters ask for shared holds.
        async def take(client: asynclock.LockClient, shared: bool) -> asynclock.Lease:
            # A ttl of 30 s: the lock it finally gets, renewed at once, outlasts a busy machine.
            if hold == "semaphore":
                return await client.semaphore(name, permits=1).acquire(ttl=30, timeout=10)
            return await client.acquire(name, ttl=30, timeout=10, shared=shared)

        holder = await take(first, shared=False)
        resume, kept = stall_waiting(stopped)
        waiting = asyncio.ensure_future(take(stopped, hold == "shared"))
        (stopped_owner,) = await wait_for_queue(raw_redis, prefix, name, 1, kind)
        # For shared holds an exclusive waiter behind it, so that the stopped one queues again
        # on resuming.
        behind = asyncio.ensure_future(take(first if hold == "shared" else third, False))
        await wait_for_queue(raw_redis, prefix, name, 2, kind)
        await holder.release()
        # Handed to the stopped waiter, which neither hears of it nor renews it: it expires,
        # and the next in line takes the lock.
        assert await holder_of(third, name, kind) == stopped_owner
        with anyio.fail_after(5):
            later = await behind
        assert any(data.startswith(b"g ") for data in kept)
        # The stopped waiter resumes: its take queues it again, behind the holder; only then
        # does it read the hand-over told while it was stopped. (Read before its take, the
        # hand-over has expired: the next test shows that order, for real.)
        resume()
        assert await wait_for_queue(raw_redis, prefix, name, 1, kind) == [stopped_owner]
        await anyio.sleep(0.05)
        for data in kept:
            stopped._backend._wakes._dispatch(data)  # type: ignore[attr-defined]
        await anyio.sleep(0.2)
        # The lock is the third client's: the stale hand-over must not end the acquire.
        assert not waiting.done(), "an acquire returned a grant of a lease that had expired"
        assert await holder_of(third, name, kind) == later.grant.owner
        await later.release()
        # Its place is live: the release hands the lock to it, with a newer token.
        with anyio.fail_after(5):
            got = await waiting
        assert got.token > later.token
        assert await holder_of(third, name, kind) == got.grant.owner
        await got.release()
        # Nothing of the name is left: no lock held for an acquire that is over, no place.
        assert await redis_leftovers(redis_server, prefix, "no such client") == []


#: A client process that waits for the lock once, holds it for a moment and says what it saw.
_WAITER = """
import sys, time, anyio, asynclock

async def main(url, prefix, name):
    async with asynclock.connect(url, prefix=prefix, durability_warning=False) as locks:
        print("ready", flush=True)
        try:
            async with locks.lock(name, ttl=0.6, timeout=10, on_lost="cancel") as lease:
                print("got", time.time(), lease.token, flush=True)
                await anyio.sleep(0.01)
        except asynclock.LockError as exc:
            print("error", type(exc).__name__, flush=True)
    print("done", time.time(), flush=True)

anyio.run(main, *sys.argv[1:])
"""


async def test_a_client_stopped_in_line_past_its_place_leaves_no_holder_when_it_exits(
    redis_server: RedisServer, raw_redis: redis.asyncio.Redis, prefix: str, name: str
) -> None:
    """The same race for real (SIGSTOP in line, handed the lock, resumed after that lease
    expired and another took it); about 1 run in 3 reads the hand-over before its take runs."""
    async with connect(redis_server, prefix) as first, connect(redis_server, prefix) as third:
        holder = await first.acquire(name, ttl=30)
        child = subprocess.Popen(  # noqa: ASYNC220 (starting a process does not block for long)
            [sys.executable, "-c", _WAITER, redis_server.url, prefix, name],
            stdout=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).parents[2],
        )
        try:
            assert child.stdout is not None
            line = await anyio.to_thread.run_sync(child.stdout.readline)
            assert line.strip() == "ready", line
            (stopped_owner,) = await wait_for_queue(raw_redis, prefix, name, 1)
            waiter = asyncio.ensure_future(third.acquire(name, ttl=30, timeout=10))
            await wait_for_queue(raw_redis, prefix, name, 2)
            os.kill(child.pid, signal.SIGSTOP)
            await holder.release()
            assert await holder_of(third, name, "lock") == stopped_owner
            with anyio.fail_after(5):
                later = await waiter
            os.kill(child.pid, signal.SIGCONT)
            # Resumed: it queues again behind the third client's hold, and waits.
            assert await wait_for_queue(raw_redis, prefix, name, 1) == [stopped_owner]
            await anyio.sleep(0.3)
            assert await holder_of(third, name, "lock") == later.grant.owner
            released = time.time()
            await later.release()
            out, _ = await anyio.to_thread.run_sync(
                functools.partial(child.communicate, timeout=20)
            )
        finally:
            if child.poll() is None:
                child.send_signal(signal.SIGCONT)
                child.kill()
                child.wait()
            assert child.stdout is not None
            if not child.stdout.closed:  # the test failed before communicate(): show why
                print("the waiter said:", child.stdout.read())
                child.stdout.close()
        seen = out.split()
        # It held the lock only after the third client released it: its place was live.
        assert seen[0] == "got", out
        assert float(seen[1]) > released, out
        assert int(seen[2]) > later.token, out
        # It exited: nothing of the name is left, at once (no ghost hold, no place).
        assert await redis_leftovers(redis_server, prefix, "no such client") == []
