"""redis:// waiting: the release hands the lock over, waiters share their client's connections."""

from __future__ import annotations

import asyncio
import random
import uuid
from contextlib import suppress

import anyio
import anyio.lowlevel
import pytest
import redis.asyncio
from redis.crc import key_slot

from asynclock.abc import Renewed
from asynclock.backends.redis import _scripts as lua
from asynclock.backends.redis._wire import MAX_BUSY
from asynclock.testing import RedisServer
from tests.contract.backend_redis import (
    connect,
    connections_named,
    kill_connections,
    lane_of,
    wait_for_queue,
)

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("name", ["plain", "with}brace", "{tagged}", "a{b}c"])
def test_every_key_of_a_name_is_in_one_cluster_slot(name: str) -> None:
    for prefix in ("asynclock:", "app{x}:"):
        keys = [key for kind in lua.KIND_SPACE for key in lua.fair_keys(prefix, name, kind)]
        # Five keys per kind, none shared between kinds (each kind is a namespace).
        assert len(set(keys)) == 5 * len(lua.KIND_SPACE)
        assert len({key_slot(key.encode()) for key in keys}) == 1, keys


@pytest.mark.parametrize("waiter_in", ["another client", "the same client"])
async def test_a_release_hands_the_lock_over_with_its_token_in_one_script_call(
    own_redis_server: RedisServer, prefix: str, name: str, waiter_in: str
) -> None:
    """Told on the other client's wake channel, or by the release's reply to a waiter of the
    releasing client (which runs before the releasing task goes on)."""
    async with (
        redis.asyncio.Redis(host=own_redis_server.host, port=own_redis_server.port) as raw,
        connect(own_redis_server, prefix) as first,
        connect(own_redis_server, prefix) as other,
    ):
        second = other if waiter_in == "another client" else first
        holder = await first.acquire(name, ttl=30)
        waiter = asyncio.ensure_future(second.acquire(name, ttl=20, timeout=10))
        await wait_for_queue(raw, prefix, name, 1)
        await raw.config_resetstat()
        released = anyio.current_time()
        await holder.release()
        returned = anyio.current_time()
        if waiter_in == "the same client":
            assert waiter.done(), "the releasing task went on before the new holder ran"
        with anyio.fail_after(2):
            lease = await waiter
        # One script call between the release and the waiter holding the lock: the RELEASE.
        assert (await raw.info("commandstats"))["cmdstat_evalsha"]["calls"] == 1
        assert lease.token > holder.token
        assert await raw.get(lua.lock_key(prefix, name)) == lease.grant.owner.encode()
        assert await raw.get(lua.token_key(prefix, name)) == str(lease.token).encode()
        # The waiter's place (waiter_ttl 5 s) was shorter than its ttl: the lock starts with
        # what was left of the place, and its first renewal gives it the full ttl.
        assert 3.0 <= lease.ttl <= 5.0
        assert 3000 < await raw.pttl(lua.lock_key(prefix, name)) <= 5000
        # Its lease counts from a moment before the hand-over (so before the release's reply
        # came), and not long before it.
        assert released - 0.2 < lease.grant.valid_from <= returned
        assert await raw.zcard(lua.queue_key(prefix, name)) == 0
        (outcome,) = await second._backend.renew([lease.grant])
        assert isinstance(outcome, Renewed) and outcome.ttl == 20
        assert 19000 < await raw.pttl(lua.lock_key(prefix, name)) <= 20000
        await lease.release()


async def test_a_thousand_waiters_in_one_client_share_a_handful_of_connections(
    redis_server: RedisServer, raw_redis: redis.asyncio.Redis, prefix: str, name: str
) -> None:
    """(That they get the lock in the order they queued: tests/contract/test_scale.py.)"""
    client_name = f"many-{uuid.uuid4().hex[:6]}"
    count = 1000
    async with (
        connect(redis_server, prefix) as holder_client,
        connect(redis_server, prefix, client_name=client_name) as locks,
    ):
        holder = await holder_client.acquire(name, ttl=30)

        async def waiter() -> None:
            async with locks.lock(name, ttl=30, timeout=60):
                pass

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for _ in range(count):
                    tg.start_soon(waiter)
                # Bounded by the test's own minute: queueing takes long on a loaded machine.
                await wait_for_queue(raw_redis, prefix, name, count, within=60)
                # Every task waits, and the client holds its lane (at most MAX_BUSY calls in
                # flight) and its one wake channel.
                assert await connections_named(redis_server, client_name) <= MAX_BUSY + 1
                await holder.release()
        assert await connections_named(redis_server, client_name) <= MAX_BUSY + 1


async def test_a_waiter_cancelled_as_the_lock_is_handed_to_it_passes_it_on(
    redis_server: RedisServer, raw_redis: redis.asyncio.Redis, prefix: str, name: str
) -> None:
    rng = random.Random(7)
    async with (
        connect(redis_server, prefix) as first,
        connect(redis_server, prefix) as second,
        connect(redis_server, prefix) as third,
    ):
        for _ in range(20):
            holder = await first.acquire(name, ttl=30)
            cancelled = asyncio.ensure_future(second.acquire(name, ttl=30, timeout=10))
            await wait_for_queue(raw_redis, prefix, name, 1)
            behind = asyncio.ensure_future(third.acquire(name, ttl=30, timeout=10))
            await wait_for_queue(raw_redis, prefix, name, 2)
            release = asyncio.ensure_future(holder.release())
            await asyncio.sleep(rng.uniform(0, 0.0008))
            cancelled.cancel()
            with anyio.fail_after(2):
                with suppress(asyncio.CancelledError):
                    # Its acquire may have returned before the cancellation reached it.
                    await (await cancelled).release()
                lease = await behind
                await release
            assert await raw_redis.get(lua.lock_key(prefix, name)) == lease.grant.owner.encode()
            await lease.release()
        assert await raw_redis.zcard(lua.queue_key(prefix, name)) == 0


async def test_a_wake_lost_while_the_wake_channel_reconnects_is_found_by_a_take(
    redis_server: RedisServer, raw_redis: redis.asyncio.Redis, prefix: str, name: str
) -> None:
    """Pub/Sub keeps nothing for a connection that is down: the waiter looks again when the
    wake channel is back."""
    client_name = f"wake-{uuid.uuid4().hex[:6]}"
    async with (
        connect(redis_server, prefix) as first,
        connect(redis_server, prefix, client_name=client_name) as second,
    ):
        holder = await first.acquire(name, ttl=30)
        waiter = asyncio.ensure_future(second.acquire(name, ttl=30, timeout=10))
        await wait_for_queue(raw_redis, prefix, name, 1)
        # Only the wake channel is open now (the take's connection is idle: kill it too).
        assert await kill_connections(redis_server, client_name) >= 1
        await holder.release()  # published to nobody
        released = anyio.current_time()
        lease = await waiter
        # The reconnect's poke, not the place's refresh (1.7 s).
        assert anyio.current_time() - released < 1.0
        await lease.release()


async def test_a_hand_over_across_clients_starts_a_short_lease_from_a_recent_moment(
    redis_server: RedisServer, prefix: str, name: str
) -> None:
    """The lease counts from the channel's last answered ping, not the waiter's take 0.5 s ago
    (a short ttl would be half spent)."""
    async with connect(redis_server, prefix) as first, connect(redis_server, prefix) as second:
        holder = await first.acquire(name, ttl=5)
        waiter = asyncio.ensure_future(second.acquire(name, ttl=0.3, timeout=10))
        await anyio.sleep(0.5)
        released = anyio.current_time()
        await holder.release()
        lease = await waiter
        # Pings every 0.03 s (a tenth of the waiter's place, 0.3 s), with room for a busy
        # machine; not the 0.1-0.5 s since its last take.
        assert released - 0.1 < lease.grant.valid_from <= anyio.current_time()
        assert not lease.lost
        await lease.release()


async def test_the_lane_keeps_at_most_max_busy_calls_in_flight_and_cancelled_turns_pass_on(
    redis_server: RedisServer, prefix: str
) -> None:
    async with connect(redis_server, prefix) as locks:
        lane = lane_of(locks)
        most = 0
        scopes = [anyio.CancelScope() for _ in range(200)]

        async def call(index: int) -> None:
            nonlocal most
            with scopes[index]:
                assert await lane.call("ECHO", str(index)) == str(index).encode()
                most = max(most, lane.connections)

        async with anyio.create_task_group() as tg:
            for index in range(200):
                tg.start_soon(call, index)
            await anyio.lowlevel.checkpoint()
            for scope in scopes[100:150]:  # some still wait for their turn, some are sent
                scope.cancel()
        assert most <= MAX_BUSY
        assert lane._busy == 0 and not lane._turns
        assert await lane.call("PING") in (b"PONG", "PONG", True)
