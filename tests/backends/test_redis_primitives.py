"""Shared holds, semaphores, elections and extend() on redis:// as the server stores them:
per-hold expiry, hand-over to a group of readers, elections' change channel, a new ttl kept by
later renewals. (What every backend must do is in tests/contract/test_primitives.py.)"""

from __future__ import annotations

import asyncio
import secrets
import uuid
from typing import Any

import anyio
import pytest
import redis.asyncio

import asynclock
from asynclock.abc import LockRequest, Renewed
from asynclock.backends.redis import RedisGrant
from asynclock.backends.redis import _scripts as lua
from asynclock.testing import RedisServer
from tests.contract.backend_redis import (
    backend_of,
    connect,
    kill_connections,
    redis_leftovers,
    wait_for_queue,
)
from tests.contract.harness import hold_until_cancelled, until

pytestmark = pytest.mark.anyio


def request(name: str, ttl: float, **fields: Any) -> LockRequest:
    """A request made by hand: its grant is never renewed (a holder that died, once its ttl
    runs out)."""
    return LockRequest(name, ttl, secrets.token_hex(16), lambda _: None, **fields)


async def test_a_dead_hold_expires_alone_a_readers_beside_a_live_one_and_a_leaders_for_observers(
    redis_server: RedisServer, raw_redis: redis.asyncio.Redis, prefix: str, name: str
) -> None:
    async with connect(redis_server, prefix) as locks, connect(redis_server, prefix) as watcher:
        backend = backend_of(locks)
        dead = await backend.try_acquire(request(name, 0.3, shared=True))
        assert dead is not None
        alive = await locks.acquire(name, ttl=5, shared=True)
        holds_key = lua.holds_key(prefix, name)
        assert await raw_redis.zcard(holds_key) == 2
        assert await locks.try_acquire(name, ttl=5) is None  # readers hold it
        await anyio.sleep(0.4)  # the dead reader's hold expired; the live one was kept
        info = await locks.inspect(name)
        assert [holder.token for holder in info.holders] == [alive.token]
        assert info.holders[0].shared
        assert await locks.try_acquire(name, ttl=5) is None  # the live reader still holds
        assert await raw_redis.zcard(holds_key) == 1  # the dead one was pruned by that take
        await alive.release()
        writer = await locks.try_acquire(name, ttl=5)
        assert dead.token is not None
        assert writer is not None and writer.token > alive.token > dead.token
        await writer.release()
        assert await redis_leftovers(redis_server, prefix, "no such client") == []
        # A dead leader's term ends for observers when its hold expires.
        term = await backend.try_acquire(request(name, 0.5, kind="election", value=b"gone"))
        assert term is not None
        seen: list[asynclock.Leader | None] = []
        with anyio.fail_after(3):
            async for leader in watcher.election(name).observe():
                seen.append(leader)
                if leader is None:
                    break
        assert [leader.value if leader else None for leader in seen] == [b"gone", None]


async def test_a_release_hands_over_to_every_reader_up_to_the_next_writer(
    redis_server: RedisServer, raw_redis: redis.asyncio.Redis, prefix: str, name: str
) -> None:
    """Queue: reader, reader (of two clients), writer, reader. The writer's release lets both
    first readers in by one script; the writer behind them waits for both; the last reader for
    that writer."""
    order: list[str] = []
    async with connect(redis_server, prefix) as first, connect(redis_server, prefix) as second:
        writer = await first.acquire(name, ttl=10)

        async def take(label: str, locks: asynclock.LockClient, shared: bool) -> None:
            async with locks.lock(name, ttl=10, timeout=10, shared=shared):
                order.append(f"{label} in")
                await anyio.sleep(0.1)
                order.append(f"{label} out")

        queue = [("r1", first, True), ("r2", second, True)]
        queue += [("w", second, False), ("r3", first, True)]
        async with anyio.create_task_group() as tg:
            for length, (label, locks, shared) in enumerate(queue, start=1):
                tg.start_soon(take, label, locks, shared)
                await wait_for_queue(raw_redis, prefix, name, length)
            await writer.release()
    assert set(order[:2]) == {"r1 in", "r2 in"}
    assert order.index("w in") > max(order.index("r1 out"), order.index("r2 out"))
    assert order.index("r3 in") > order.index("w out")


async def test_extend_sets_the_ttl_that_later_renewals_keep(
    redis_server: RedisServer, raw_redis: redis.asyncio.Redis, prefix: str, name: str
) -> None:
    async with connect(redis_server, prefix) as locks:
        backend = backend_of(locks)
        exclusive = await locks.acquire(name, ttl=2)
        reader = await locks.acquire(f"{name}/r", ttl=2, shared=True)
        permit = await locks.semaphore(name, permits=3).acquire(ttl=2)
        for lease in (exclusive, reader, permit):
            await lease.extend(7)
            assert lease.ttl == 7
        grants = [lease.grant for lease in (exclusive, reader, permit)]
        assert all(isinstance(grant, RedisGrant) for grant in grants)
        outcomes = await backend.renew(grants)  # type: ignore[arg-type]
        assert all(isinstance(o, Renewed) and o.ttl == 7 for o in outcomes)
        assert 6000 < await raw_redis.pttl(lua.lock_key(prefix, name)) <= 7000
        now_ms = int((await raw_redis.time())[0]) * 1000
        for key, lease in (
            (lua.holds_key(prefix, f"{name}/r"), reader),
            (lua.holds_key(prefix, name, "semaphore"), permit),
        ):
            member = lua.hold_member(lease.token, lease.grant.owner)
            score = await raw_redis.zscore(key, member)
            assert score is not None and 5000 < score - now_ms <= 8000
        await permit.extend(1)  # shorter: the server applies it too
        score = await raw_redis.zscore(
            lua.holds_key(prefix, name, "semaphore"),
            lua.hold_member(permit.token, permit.grant.owner),
        )
        assert score is not None and score - now_ms <= 2500
        for lease in (exclusive, reader, permit):
            await lease.release()


async def test_a_change_of_leader_is_pushed_also_after_the_wake_connection_was_killed(
    redis_server: RedisServer, raw_redis: redis.asyncio.Redis, prefix: str, name: str
) -> None:
    client_name = f"watch-{uuid.uuid4().hex[:6]}"
    async with (
        connect(redis_server, prefix) as locks,
        connect(redis_server, prefix, client_name=client_name) as watcher,
    ):
        backend = backend_of(watcher)
        channel = lua.change_channel(prefix, name, "election")
        seen = await backend.inspect(name, "election")
        assert not seen.held

        # Nothing changes: back by the timeout.
        started = anyio.current_time()
        await backend.wait_for_change(name, "election", seen, 0.3)
        assert 0.25 < anyio.current_time() - started < 1.0

        # The wake connection killed: the wait returns, and watching resumes on a new one.
        started = anyio.current_time()
        waiting = asyncio.ensure_future(backend.wait_for_change(name, "election", seen, 5))
        await anyio.sleep(0.2)
        await kill_connections(redis_server, client_name)
        await waiting
        assert anyio.current_time() - started < 1.0
        await until(lambda: backend._wakes is not None and backend._wakes._conn is not None)

        async def campaign() -> None:
            await anyio.sleep(0.2)
            async with locks.election(name).campaign(b"node-1", ttl=5, timeout=5):
                await anyio.sleep(0.3)

        async with anyio.create_task_group() as tg:
            tg.start_soon(campaign)
            started = anyio.current_time()
            await backend.wait_for_change(name, "election", seen, 5)
            # Pushed: well before the timeout, and long before a poll would have come.
            assert anyio.current_time() - started < 1.0
            info = await backend.inspect(name, "election")
            assert info.held and info.value == b"node-1"
            assert (await raw_redis.pubsub_numsub(channel))[0][1] == 0  # left after the wait
            started = anyio.current_time()
            await backend.wait_for_change(name, "election", info, 5)
            assert anyio.current_time() - started < 1.0  # the resignation is pushed too
        assert not (await backend.inspect(name, "election")).held


async def test_a_try_with_other_permits_raises_while_a_task_of_the_same_client_waits(
    redis_server: RedisServer, prefix: str, name: str
) -> None:
    async with connect(redis_server, prefix) as locks:
        held = await locks.semaphore(name, permits=1).acquire(ttl=5)
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                hold_until_cancelled, locks.semaphore(name, permits=1).lock(ttl=5, timeout=10)
            )
            await until(lambda: backend_of(locks)._wakes.waits_for(f"semaphore {name}"))  # type: ignore[union-attr]
            assert await locks.semaphore(name, permits=1).try_acquire(ttl=5) is None
            with pytest.raises(asynclock.InvalidArgument, match="1 permits"):
                await locks.semaphore(name, permits=2).try_acquire(ttl=5)
            tg.cancel_scope.cancel()
        await held.release()
