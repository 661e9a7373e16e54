"""The semaphore guard: at most N holders' tokens admitted at a time, the oldest evicted."""

from __future__ import annotations

import asyncio
import random
import uuid
from typing import Any

import anyio
import pytest

import asynclock
from asynclock.fencing import MemoryGuard, PermitSlots, PostgresGuard, RedisGuard, StaleToken

pytestmark = pytest.mark.anyio


async def test_admits_up_to_n_tokens_evicts_the_oldest_and_a_leaver_never_comes_back() -> None:
    guard = MemoryGuard(permits=3)
    for token in (1, 2, 3):
        await guard.write("r", token, token=token)
    assert guard.admitted("r") == (1, 2, 3)
    await guard.write("r", "again", token=2)  # a holder may access as often as it likes
    await guard.check("r", 4)  # a fourth permit: the oldest one's lease must have ended
    assert guard.admitted("r") == (2, 3, 4)
    with pytest.raises(StaleToken) as info:
        await guard.write("r", "late", token=1)  # evicted: refused from now on
    assert (info.value.token, info.value.resource) == (1, "r")
    assert await guard.read("r", token=3) == "again"
    assert guard.rejected == 1
    await guard.check("other", 1)  # resources are independent
    assert (guard.admitted("other"), guard.admitted("r")) == ((1,), (2, 3, 4))
    for bad in [0, -1, True, 1.5]:  # permits must be a positive int
        with pytest.raises(asynclock.InvalidArgument):
            MemoryGuard(permits=bad)  # type: ignore[arg-type]
    # A token older than every admitted one is refused when full.
    guard = MemoryGuard(permits=2)
    await guard.check("r", 5)
    await guard.check("r", 6)
    with pytest.raises(StaleToken) as info:
        await guard.check("r", 4)
    assert info.value.highest == 5
    assert guard.admitted("r") == (5, 6)
    # Leaving frees the slot, and the token never comes back.
    guard = MemoryGuard(permits=2)
    await guard.check("r", 1)  # a long-running holder
    for token in range(2, 50):  # short holders come and go beside it
        async with guard.entered("r", token):
            await guard.check("r", 1)
    assert guard.admitted("r") == (1,)
    with pytest.raises(StaleToken):
        await guard.check("r", 7)  # left: not admitted again
    await guard.leave("r", 1)
    await guard.leave("r", 1)  # idempotent
    assert guard.admitted("r") == ()
    # A slot is freed even when the block is cancelled.
    guard = MemoryGuard(permits=2)
    with anyio.move_on_after(0.01):
        async with guard.entered("r", 1):
            await anyio.sleep(1)
    await guard.check("r", 2)
    assert guard.admitted("r") == (2,)


def test_an_evicted_or_departed_token_is_never_admitted_again_and_departed_stay_bounded() -> None:
    """The invariant the safety runs rely on: the tokens whose accesses were accepted around
    any moment are at most N (a token admitted twice was admitted in between)."""
    rng = random.Random(7)
    for _ in range(200):
        permits = rng.randint(1, 4)
        slots = PermitSlots(permits)
        gone: set[int] = set()
        last_ok: dict[int, int] = {}
        first_ok: dict[int, int] = {}
        for step in range(200):
            token = rng.randint(1, 40)
            if rng.random() < 0.2:
                slots.leave(token)
                gone.add(token)
                continue
            before = set(slots.admitted)
            if slots.admit(token) is None:
                assert token not in gone or token in before
                first_ok.setdefault(token, step)
                last_ok[token] = step
            assert len(slots.admitted) <= permits
            gone |= before - set(slots.admitted)
        for step in range(200):
            live = [t for t in first_ok if first_ok[t] <= step <= last_ok[t]]
            assert len(live) <= permits
    # Departed tokens stay bounded and spare a long holder.
    slots = PermitSlots(2)
    assert slots.admit(1) is None
    for token in range(2, 20_000):
        assert slots.admit(token) is None
        slots.leave(token)
    assert len(slots.departed) <= 4096
    assert slots.admitted == [1]  # the long-running holder kept its slot
    assert slots.admit(1) is None


async def test_postgres_semaphore_guard_admits_n_and_evicts_the_oldest(fences: Any) -> None:
    connection, table = fences
    guard = PostgresGuard(permits=2, table=table)
    await guard.create_table(connection)
    await guard.create_table(connection)  # idempotent
    for token in (3, 4, 3):
        assert await guard.check(connection, "r", token) == token
    await guard.check(connection, "r", 5)
    assert await guard.admitted(connection, "r") == (4, 5)
    with pytest.raises(StaleToken) as info:
        async with connection.transaction():
            await guard.check(connection, "r", 3)
    assert info.value.token == 3
    await guard.leave(connection, "r", 4)
    await guard.check(connection, "r", 6)  # the slot 4 left
    assert (await guard.admitted(connection, "r"), await guard.highest(connection, "r")) == (
        (5, 6),
        6,
    )
    with pytest.raises(StaleToken):
        await guard.check(connection, "r", 4)
    assert await guard.admitted(connection, "other") == ()


async def test_redis_semaphore_guard_admits_n_evicts_the_oldest_and_follows_permit_slots(
    raw_redis: Any,
) -> None:
    prefix = f"permits-{uuid.uuid4().hex[:8]}:"
    guard = RedisGuard(raw_redis, permits=2, prefix=prefix)
    assert await guard.call("r", "RPUSH", f"{prefix}log", "from 3", token=3) == 1
    assert await guard.check("r", 4) == 4
    await guard.check("r", 5)  # full: 3 is evicted
    with pytest.raises(StaleToken) as info:
        await guard.call("r", "RPUSH", f"{prefix}log", "late", token=3)
    assert (info.value.token, info.value.highest) == (3, 5)
    assert (await guard.admitted("r"), await guard.highest("r")) == ((4, 5), 5)
    assert await raw_redis.lrange(f"{prefix}log", 0, -1) == [b"from 3"]  # it did not run
    big = 2**63 - 1  # exact beyond Lua's doubles
    await guard.check("r", big - 1)
    await guard.check("r", big)
    with pytest.raises(StaleToken):
        await guard.check("r", big - 2)
    # Random checks and leaves (a left token refused, the oldest evicted), small memory: the
    # script decides as PermitSlots does (at one permit the lock rule holds instead, whose
    # script test_guards.py checks).
    rng = random.Random(11)
    for round_ in range(6):
        prefix = f"permits-{uuid.uuid4().hex[:8]}:"
        permits = rng.randint(2, 3)
        guard = RedisGuard(raw_redis, permits=permits, prefix=prefix, remembered=6)
        slots = PermitSlots(permits, remembered=6)
        for _ in range(150):
            token = rng.randint(1, 60)
            if rng.random() < 0.3:
                slots.leave(token)
                await guard.leave("r", token)
                continue
            expected = slots.admit(token)
            try:
                await guard.check("r", token)
                got = None
            except StaleToken as exc:
                got = exc.highest
            assert got == expected, (round_, token, slots)
            stored = await raw_redis.hmget(f"{prefix}r", "admitted", "floor")
            admitted = [int(each) for each in (stored[0] or b"").split()]
            assert admitted == slots.admitted, (round_, token, slots)
            assert (None if stored[1] is None else int(stored[1])) == slots.floor


async def test_redis_entered_leaves_however_often_its_task_is_cancelled(raw_redis: Any) -> None:
    """The way out awaits Redis: a native Task.cancel(), once or again and again while it
    leaves, still frees the slot (and the token is refused from then on)."""
    guard = RedisGuard(raw_redis, permits=2, prefix=f"permits-{uuid.uuid4().hex[:8]}:")
    for token, cancels in ((1, 1), (2, 50)):
        inside = asyncio.Event()

        async def hold(token: int, inside: asyncio.Event) -> None:
            async with guard.entered("r", token):
                inside.set()
                await asyncio.sleep(10)

        task = asyncio.create_task(hold(token, inside))
        await inside.wait()
        for _ in range(cancels):
            task.cancel()
            await asyncio.sleep(0)
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await guard.admitted("r") == ()
        with pytest.raises(StaleToken):
            await guard.check("r", token)
