"""Shared holds, semaphores, elections and extend() on redis:// as the server stores them:
per-hold expiry, hand-over to a group of readers, permits kept while anyone holds or waits,
elections' change channel, a new ttl kept by later renewals. (What every backend must do is in
tests/contract/test_primitives.py.)"""

from __future__ import annotations

import asyncio
import random
import secrets
import uuid
from collections.abc import AsyncIterator, Iterator

import anyio
import pytest
import redis.asyncio

import asynclock
from asynclock.abc import Kind, LockRequest, Renewed
from asynclock.backends.redis import RedisBackend, RedisGrant
from asynclock.backends.redis import _scripts as lua
from asynclock.testing import RedisServer
from tests.backends.test_redis import connect
from tests.contract.backend_redis import redis_leftovers

pytestmark = pytest.mark.anyio


@pytest.fixture
def name() -> str:
    return f"redis-kinds/{uuid.uuid4().hex[:8]}"


@pytest.fixture
def prefix() -> str:
    return f"kinds-{uuid.uuid4().hex[:8]}:"


@pytest.fixture
async def raw(redis_server: RedisServer) -> AsyncIterator[redis.asyncio.Redis]:
    async with redis.asyncio.Redis(host=redis_server.host, port=redis_server.port) as client:
        yield client


def backend_of(locks: asynclock.LockClient) -> RedisBackend:
    backend = locks._backend
    assert isinstance(backend, RedisBackend)
    return backend


def request(
    name: str,
    ttl: float,
    *,
    kind: Kind = "lock",
    shared: bool = False,
    permits: int = 1,
    value: bytes = b"",
) -> LockRequest:
    """A request made by hand: its grant is never renewed (a holder that died, once its ttl
    runs out)."""
    return LockRequest(
        name,
        ttl,
        secrets.token_hex(16),
        lambda _: None,
        kind=kind,
        shared=shared,
        permits=permits,
        value=value,
    )


async def test_a_dead_reader_frees_only_its_own_hold(
    redis_server: RedisServer, raw: redis.asyncio.Redis, prefix: str, name: str
) -> None:
    async with connect(redis_server, prefix) as locks:
        backend = backend_of(locks)
        dead = await backend.try_acquire(request(name, 0.3, shared=True))
        assert dead is not None
        alive = await locks.acquire(name, ttl=5, shared=True)
        holds_key = lua.holds_key(prefix, name)
        assert await raw.zcard(holds_key) == 2
        assert await locks.try_acquire(name, ttl=5) is None  # readers hold it
        await anyio.sleep(0.4)  # the dead reader's hold expired; the live one was kept
        info = await locks.inspect(name)
        assert [holder.token for holder in info.holders] == [alive.token]
        assert info.holders[0].shared
        assert await locks.try_acquire(name, ttl=5) is None  # the live reader still holds
        assert await raw.zcard(holds_key) == 1  # the dead one was pruned by that take
        await alive.release()
        writer = await locks.try_acquire(name, ttl=5)
        assert dead.token is not None
        assert writer is not None and writer.token > alive.token > dead.token
        await writer.release()
        assert await redis_leftovers(redis_server, prefix, "no such client") == []


async def test_a_release_hands_over_to_every_reader_up_to_the_next_writer(
    redis_server: RedisServer, raw: redis.asyncio.Redis, prefix: str, name: str
) -> None:
    """Queue: reader, reader (of two clients), writer, reader. The writer's release lets both
    first readers in by one script; the writer behind them waits for both; the last reader for
    that writer."""
    order: list[str] = []
    async with connect(redis_server, prefix) as first, connect(redis_server, prefix) as second:
        writer = await first.acquire(name, ttl=10)
        queue = lua.queue_key(prefix, name)

        async def take(label: str, locks: asynclock.LockClient, shared: bool) -> None:
            async with locks.lock(name, ttl=10, timeout=10, shared=shared):
                order.append(f"{label} in")
                await anyio.sleep(0.1)
                order.append(f"{label} out")

        async with anyio.create_task_group() as tg:
            for length, (label, locks, shared) in enumerate(
                [
                    ("r1", first, True),
                    ("r2", second, True),
                    ("w", second, False),
                    ("r3", first, True),
                ],
                start=1,
            ):
                tg.start_soon(take, label, locks, shared)
                with anyio.fail_after(5):
                    while await raw.zcard(queue) != length:  # noqa: ASYNC110
                        await anyio.sleep(0.005)
            await writer.release()
    assert set(order[:2]) == {"r1 in", "r2 in"}
    assert order.index("w in") > max(order.index("r1 out"), order.index("r2 out"))
    assert order.index("r3 in") > order.index("w out")


async def test_semaphore_permits_live_with_the_holds_and_go_with_the_last(
    redis_server: RedisServer, raw: redis.asyncio.Redis, prefix: str, name: str
) -> None:
    async with connect(redis_server, prefix) as locks:
        backend = backend_of(locks)
        semaphore = locks.semaphore(name, permits=2)
        dead = await backend.try_acquire(request(name, 0.3, kind="semaphore", permits=2))
        assert dead is not None
        kept = await semaphore.acquire(ttl=5)
        holds_key = lua.holds_key(prefix, name, "semaphore")
        members = await raw.zrange(holds_key, 0, -1)
        assert b"#2" in members and len(members) == 3
        assert await semaphore.try_acquire(ttl=5) is None
        await anyio.sleep(0.4)
        # The dead holder's permit is free again, and only it.
        third = await semaphore.try_acquire(ttl=5)
        assert third is not None
        info = await semaphore.inspect()
        assert info.permits == 2
        assert [holder.owner for holder in info.holders] == [kept.owner, third.owner]
        await kept.release()
        await third.release()
        assert await raw.exists(holds_key) == 0
        assert await redis_leftovers(redis_server, prefix, "no such client") == []
        # Idle: another number of permits starts afresh.
        again = await locks.semaphore(name, permits=5).acquire(ttl=5)
        assert await raw.zrangebyscore(holds_key, "+inf", "+inf") == [b"#5"]
        await again.release()


async def test_a_semaphore_mismatch_is_refused_while_only_a_waiter_remains(
    redis_server: RedisServer, raw: redis.asyncio.Redis, prefix: str, name: str
) -> None:
    async with connect(redis_server, prefix) as first, connect(redis_server, prefix) as second:
        held = await first.semaphore(name, permits=1).acquire(ttl=5)
        async with anyio.create_task_group() as tg:

            async def wait() -> None:
                async with second.semaphore(name, permits=1).lock(ttl=5, timeout=5):
                    await anyio.sleep(0.2)

            tg.start_soon(wait)
            with anyio.fail_after(5):
                while not await raw.exists(lua.queue_key(prefix, name, "semaphore")):  # noqa: ASYNC110
                    await anyio.sleep(0.005)
            with pytest.raises(asynclock.InvalidArgument, match="1 permits"):
                await first.semaphore(name, permits=2).try_acquire(ttl=5)
            await held.release()
    assert await redis_leftovers(redis_server, prefix, "no such client") == []


async def test_extend_sets_the_ttl_that_later_renewals_keep(
    redis_server: RedisServer, raw: redis.asyncio.Redis, prefix: str, name: str
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
        assert 6000 < await raw.pttl(lua.lock_key(prefix, name)) <= 7000
        now_ms = int((await raw.time())[0]) * 1000
        for key, lease in (
            (lua.holds_key(prefix, f"{name}/r"), reader),
            (lua.holds_key(prefix, name, "semaphore"), permit),
        ):
            member = lua.hold_member(lease.token, lease.grant.owner)
            score = await raw.zscore(key, member)
            assert score is not None and 5000 < score - now_ms <= 8000
        await permit.extend(1)  # shorter: the server applies it too
        score = await raw.zscore(
            lua.holds_key(prefix, name, "semaphore"),
            lua.hold_member(permit.token, permit.grant.owner),
        )
        assert score is not None and score - now_ms <= 2500
        for lease in (exclusive, reader, permit):
            await lease.release()


async def test_a_change_of_leader_is_pushed_and_the_channel_left_after(
    redis_server: RedisServer, raw: redis.asyncio.Redis, prefix: str, name: str
) -> None:
    async with connect(redis_server, prefix) as locks, connect(redis_server, prefix) as watcher:
        backend = backend_of(watcher)
        channel = lua.change_channel(prefix, name, "election")
        seen = await backend.inspect(name, "election")
        assert not seen.held

        # Nothing changes: back by the timeout.
        started = anyio.current_time()
        await backend.wait_for_change(name, "election", seen, 0.3)
        assert 0.25 < anyio.current_time() - started < 1.0

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
            assert (await raw.pubsub_numsub(channel))[0][1] == 0  # left after the wait
            started = anyio.current_time()
            await backend.wait_for_change(name, "election", info, 5)
            assert anyio.current_time() - started < 1.0  # the resignation is pushed too
        assert not (await backend.inspect(name, "election")).held


async def test_a_dead_leaders_term_ends_for_observers_when_its_hold_expires(
    redis_server: RedisServer, prefix: str, name: str
) -> None:
    async with connect(redis_server, prefix) as locks, connect(redis_server, prefix) as watcher:
        backend = backend_of(locks)
        dead = await backend.try_acquire(request(name, 0.5, kind="election", value=b"gone"))
        assert dead is not None
        seen: list[asynclock.Leader | None] = []
        with anyio.fail_after(3):
            async for leader in watcher.election(name).observe():
                seen.append(leader)
                if leader is None:
                    break
        assert [leader.value if leader else None for leader in seen] == [b"gone", None]


@pytest.fixture
def own_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


async def test_a_restart_without_persistence_ends_shared_holds_permits_and_terms_at_once(
    own_server: RedisServer, prefix: str, name: str
) -> None:
    async with connect(own_server, prefix) as locks:
        leases = [
            await locks.acquire(name, ttl=30, shared=True),
            await locks.semaphore(name, permits=2).acquire(ttl=30),
        ]
        term = locks.election(name).campaign(b"me", ttl=30)
        leases.append(await term.__aenter__())
        try:
            await anyio.to_thread.run_sync(own_server.restart)
            with anyio.fail_after(5):
                reasons = [await lease.wait_lost() for lease in leases]
            assert all("restarted" in reason for reason in reasons)
        finally:
            # The body "ended" after the loss: the exit logs it and frees nothing (it is gone).
            await term.__aexit__(None, None, None)
        for lease in leases[:2]:
            await lease.release()


async def test_native_cancellation_of_contended_kinds_at_random_moments_strands_nothing(
    redis_server: RedisServer, prefix: str, name: str
) -> None:
    """Readers and writers, permits and candidates, cancelled by ``Task.cancel()`` (1-3 times)
    at random moments of take, wait, body and release (about a third of 960 cycles): afterwards
    every kind is free at once and nothing is left on the server."""
    rng = random.Random(19)

    async def cycle(locks: asynclock.LockClient, index: int) -> None:
        what = index % 4
        if what == 0:
            context = locks.lock(name, ttl=5, timeout=5, shared=True)
        elif what == 1:
            context = locks.lock(name, ttl=5, timeout=5)
        elif what == 2:
            context = locks.semaphore(name, permits=2).lock(ttl=5, timeout=5)
        else:
            context = locks.election(name).campaign(b"c%d" % index, ttl=5, timeout=5)
        async with context:
            await asyncio.sleep(rng.uniform(0, 0.004))

    async with connect(redis_server, prefix) as first, connect(redis_server, prefix) as second:
        with anyio.fail_after(30):
            for round_ in range(120):
                tasks = [
                    asyncio.create_task(cycle((first, second)[i % 2], round_ * 8 + i))
                    for i in range(8)
                ]
                await asyncio.sleep(rng.uniform(0, 0.006))
                for task in tasks:
                    if rng.random() < 0.6:
                        for _ in range(rng.randint(1, 3)):
                            task.cancel()
                            await asyncio.sleep(rng.choice((0, 0, 0.001)))
                await asyncio.gather(*tasks, return_exceptions=True)
            # Free at once for another client, every kind.
            async with connect(redis_server, prefix) as third:
                for context in (
                    third.lock(name, ttl=5, timeout=1),
                    third.semaphore(name, permits=2).lock(ttl=5, timeout=1),
                    third.election(name).campaign(b"last", ttl=5, timeout=1),
                ):
                    async with context:
                        pass
    with anyio.fail_after(5):
        while left := await redis_leftovers(redis_server, prefix, "no such client"):  # noqa: ASYNC110
            await anyio.sleep(0.05)  # clean-ups still in flight may need a moment
    assert left == []


async def test_a_try_with_other_permits_raises_while_a_task_of_the_same_client_waits(
    redis_server: RedisServer, prefix: str, name: str
) -> None:
    async with connect(redis_server, prefix) as locks:
        held = await locks.semaphore(name, permits=1).acquire(ttl=5)
        async with anyio.create_task_group() as tg:
            tg.start_soon(_hold_until_cancelled, locks.semaphore(name, permits=1))
            with anyio.fail_after(5):
                while not backend_of(locks)._wakes.waits_for(f"semaphore {name}"):  # type: ignore[union-attr]  # noqa: ASYNC110
                    await anyio.sleep(0.005)
            assert await locks.semaphore(name, permits=1).try_acquire(ttl=5) is None
            with pytest.raises(asynclock.InvalidArgument, match="1 permits"):
                await locks.semaphore(name, permits=2).try_acquire(ttl=5)
            tg.cancel_scope.cancel()
        await held.release()


async def _hold_until_cancelled(semaphore: asynclock.Semaphore) -> None:
    async with semaphore.lock(ttl=5, timeout=10):
        await anyio.sleep_forever()


async def test_a_watch_returns_when_the_wake_connection_is_killed(
    redis_server: RedisServer, raw: redis.asyncio.Redis, prefix: str, name: str
) -> None:
    client_name = f"watch-{uuid.uuid4().hex[:6]}"
    async with connect(redis_server, prefix, client_name=client_name) as watcher:
        backend = backend_of(watcher)
        seen = await backend.inspect(name, "election")

        async def kill() -> None:
            await anyio.sleep(0.2)
            for entry in await raw.client_list():
                if entry.get("name") == client_name:
                    await raw.client_kill_filter(_id=entry["id"])

        async with anyio.create_task_group() as tg:
            tg.start_soon(kill)
            started = anyio.current_time()
            await backend.wait_for_change(name, "election", seen, 5)
            assert anyio.current_time() - started < 1.0
        # And watching works again on the new connection.
        with anyio.fail_after(5):
            while backend._wakes is None or backend._wakes._conn is None:  # noqa: ASYNC110
                await anyio.sleep(0.01)
        async with anyio.create_task_group() as tg:

            async def campaign() -> None:
                await anyio.sleep(0.2)
                async with watcher.election(name).campaign(b"x", ttl=5, timeout=5):
                    pass

            tg.start_soon(campaign)
            started = anyio.current_time()
            await backend.wait_for_change(name, "election", seen, 5)
            assert anyio.current_time() - started < 1.0


async def test_mixed_readers_and_writers_of_two_clients_never_overlap_wrongly(
    redis_server: RedisServer, prefix: str, name: str
) -> None:
    """30 tasks on two clients, each taking the lock 15 times, shared or not at random: a
    writer is always alone, readers often share, every hold has a token of its own, and
    every task gets in."""
    rng = random.Random(7)
    inside = {"readers": 0, "writers": 0}
    most_readers = 0
    tokens: list[int] = []
    done = 0

    async def worker(locks: asynclock.LockClient) -> None:
        nonlocal most_readers, done
        for _ in range(15):
            shared = rng.random() < 0.7
            async with locks.lock(name, ttl=5, timeout=20, shared=shared) as lease:
                tokens.append(lease.token)
                role = "readers" if shared else "writers"
                inside[role] += 1
                assert inside["writers"] <= 1
                assert not (inside["writers"] and inside["readers"])
                most_readers = max(most_readers, inside["readers"])
                await anyio.sleep(rng.uniform(0, 0.003))
                inside[role] -= 1
        done += 1

    async with connect(redis_server, prefix) as first, connect(redis_server, prefix) as second:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for index in range(30):
                    tg.start_soon(worker, (first, second)[index % 2])
    assert done == 30
    assert most_readers > 1
    assert len(set(tokens)) == len(tokens) == 450
    assert await redis_leftovers(redis_server, prefix, "no such client") == []
