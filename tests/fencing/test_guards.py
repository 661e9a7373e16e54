"""Fencing guards refuse stale tokens atomically with the access, on real PostgreSQL and Redis."""

from __future__ import annotations

import uuid
from typing import Any

import anyio
import pytest

import asynclock
from asynclock.fencing import (
    MAX_TOKEN,
    MemoryGuard,
    PostgresGuard,
    RedisGuard,
    StaleToken,
)
from asynclock.testing import PostgresServer

pytestmark = pytest.mark.anyio


async def test_memory_guards_refuse_older_tokens_and_take_the_current_one() -> None:
    guard = MemoryGuard()
    await guard.write("r", "from 7", token=7)
    await guard.write("r", "from 7 again", token=7)  # the same holder may write again
    with pytest.raises(StaleToken) as info:
        await guard.write("r", "from 6", token=6)
    assert (info.value.token, info.value.highest, info.value.resource) == (6, 7, "r")
    assert await guard.read("r", token=8) == "from 7 again"
    assert guard.rejected == 1
    await guard.leave("r", 8)  # one permit: nothing to free, an older token stays refused
    with pytest.raises(StaleToken):
        await guard.check("r", 7)
    assert (guard.admitted("r"), guard.admitted("x"), guard.highest("x")) == ((8,), (), None)
    with pytest.raises(asynclock.InvalidArgument, match="strict=True needs permits=1"):
        MemoryGuard(permits=2, strict=True)
    strict = MemoryGuard(strict=True)  # each token once
    await strict.check("r", 3)
    with pytest.raises(StaleToken):
        await strict.check("r", 3)
    # DESIGN §5, a read through the guard fences a read-modify-write: B (token 6) is paused,
    # C (token 7) reads, B's late write is refused.
    await guard.write("balance", 100, token=5)
    value = await guard.read("balance", token=7)  # C reads with the newer token
    with pytest.raises(StaleToken):
        await guard.write("balance", 0, token=6)  # B wakes up and writes: refused
    await guard.write("balance", value + 1, token=7)
    assert await guard.read("balance", token=7) == 101
    # Guards take the token of the lock held in this context.
    guard = MemoryGuard()
    async with asynclock.connect("memory://guards-in-context") as locks:
        stale = await locks.acquire("job")  # token 1, then lost behind its back
        await stale.release()
        async with locks.lock("job") as lease:  # token 2
            await guard.write("out", "new")
            assert guard.highest("out") == lease.token
        with pytest.raises(StaleToken):
            await guard.write("out", "old", token=stale.token)
        with pytest.raises(asynclock.NotHeld):
            await guard.write("out", "nobody")
        # A semaphore's holder that never left the guard is evicted by newer permits.
        permits = MemoryGuard(permits=2)
        sem = locks.semaphore("renderers", permits=2)
        crashed = await sem.acquire(ttl=5)
        await permits.check("out", crashed.token)
        await crashed.release()  # as its ttl would: it never told the guard
        async with sem.lock(ttl=5) as second, sem.lock(ttl=5) as third:
            assert crashed.token < second.token < third.token
            async with permits.entered("out", second.token), permits.entered("out", third.token):
                assert permits.admitted("out") == (second.token, third.token)
                with pytest.raises(StaleToken):
                    await permits.write("out", "late", token=crashed.token)
    for bad in [-1, MAX_TOKEN + 1, True, "5"]:
        with pytest.raises(asynclock.InvalidArgument):
            await MemoryGuard().check("r", bad)  # type: ignore[arg-type]


async def test_postgres_guard_refuses_a_stale_write_and_rolls_it_back_and_unsafe_identifiers(
    fences: Any,
) -> None:
    connection, table = fences
    guard = PostgresGuard(table=table)
    await guard.create_table(connection)
    await guard.create_table(connection)  # idempotent
    await connection.execute("CREATE TEMP TABLE resource (id int PRIMARY KEY, v text)")
    await connection.execute("INSERT INTO resource VALUES (1, 'initial')")
    async with connection.transaction():
        await guard.check(connection, "orders/1", 10)
        await connection.execute("UPDATE resource SET v = 'by 10' WHERE id = 1")
    with pytest.raises(StaleToken) as info:
        async with connection.transaction():
            await connection.execute("UPDATE resource SET v = 'by 9' WHERE id = 1")
            await guard.check(connection, "orders/1", 9)
    assert (info.value.token, info.value.highest) == (9, 10)
    assert await connection.fetchval("SELECT v FROM resource WHERE id = 1") == "by 10"
    await guard.leave(connection, "orders/1", 10)  # one permit: nothing to free
    assert await guard.admitted(connection, "orders/1") == (10,)
    assert await guard.highest(connection, "orders/1") == 10
    # Unsafe identifiers and bad permits are refused.
    with pytest.raises(asynclock.InvalidArgument, match="identifier"):
        PostgresGuard(table="fences; DROP TABLE x")
    with pytest.raises(asynclock.InvalidArgument):
        PostgresGuard(permits=2, table="x; drop")
    with pytest.raises(asynclock.InvalidArgument):
        PostgresGuard(permits=0)


@pytest.mark.parametrize("permits", [1, 2])
async def test_postgres_guards_serialize_transactions_in_flight(
    fences: Any, postgres_server: PostgresServer, permits: int
) -> None:
    """A newer holder's check waits for the older transaction to commit (the guard's row is
    held until then), so check+write stay atomic; then the older token is refused."""
    import asyncpg

    connection, table = fences
    guard = PostgresGuard(permits=permits, table=table)
    await guard.create_table(connection)
    other = await asyncpg.connect(postgres_server.dsn)
    try:
        events: list[str] = []
        older = connection.transaction()
        await older.start()
        await guard.check(connection, "r", 6)

        async def newer() -> None:
            async with other.transaction():
                await guard.check(other, "r", 7)
                events.append("newer checked")

        async with anyio.create_task_group() as tg:
            tg.start_soon(newer)
            await anyio.sleep(0.3)
            events.append("older commits")
            await older.commit()
        assert events == ["older commits", "newer checked"]
        await guard.check(connection, "r", 8)  # with two permits, 6 is evicted only now
        with pytest.raises(StaleToken):
            await guard.check(connection, "r", 6)
    finally:
        await other.close()


async def test_redis_guard_runs_the_command_only_for_a_fresh_token_beyond_float_precision(
    raw_redis: Any,
) -> None:
    prefix = f"test:{uuid.uuid4().hex[:8]}:"
    guard = RedisGuard(raw_redis, prefix=prefix)
    key = prefix + "value"
    assert await guard.call("r", "SET", key, "by 5", token=5) == b"OK"
    with pytest.raises(StaleToken) as info:
        await guard.call("r", "SET", key, "by 4", token=4)
    assert (info.value.token, info.value.highest) == (4, 5)
    assert await raw_redis.get(key) == b"by 5"
    assert await guard.call("r", "GET", key, token=5) == b"by 5"
    await guard.leave("r", 5)  # one permit: nothing to free
    assert (await guard.admitted("r"), await guard.highest("none")) == ((5,), None)
    big = 2**60 + 1
    await guard.check("big", big)
    with pytest.raises(StaleToken):
        await guard.check("big", big - 1)  # equal as doubles, but older
    await guard.check("big", big)
    strict = RedisGuard(raw_redis, prefix=prefix, strict=True)
    with pytest.raises(StaleToken):
        await strict.check("big", big)
    await raw_redis.delete(key, prefix + "r", prefix + "big")
