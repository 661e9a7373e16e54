"""lock_all: canonical order, all or nothing, one body cancelled when any lease is lost."""

from __future__ import annotations

import random
import uuid
from pathlib import Path

import anyio
import pytest

import asynclock
from tests.integrations._memory import memory, memory_locks

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["memory", "sqlite"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "memory":
        return f"memory://lock-all-{uuid.uuid4().hex[:8]}"
    return f"sqlite://{tmp_path}/locks.db"


async def test_opposite_orders_cannot_deadlock(url: str) -> None:
    """10 tasks ask for overlapping sets in random orders; every one finishes."""
    names = ["a", "b", "c", "d"]
    inside: dict[str, int] = dict.fromkeys(names, 0)
    done = 0

    async def worker(locks: asynclock.LockClient, seed: int) -> None:
        nonlocal done
        rng = random.Random(seed)
        for _ in range(5):
            wanted = rng.sample(names, rng.randint(2, 4))
            async with locks.lock_all(wanted, ttl=10) as leases:
                assert [lease.name for lease in leases] == sorted(wanted)
                for name in wanted:
                    inside[name] += 1
                    assert inside[name] == 1
                await anyio.sleep(0.001)
                for name in wanted:
                    inside[name] -= 1
        done += 1

    async with asynclock.connect(url) as first, asynclock.connect(url) as second:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for seed in range(10):
                    tg.start_soon(worker, first if seed % 2 else second, seed)
    assert done == 10


@pytest.mark.parametrize("how", ["timeout", "cancellation"])
async def test_a_timeout_or_cancellation_releases_what_was_taken(url: str, how: str) -> None:
    async with asynclock.connect(url) as locks, asynclock.connect(url) as other:
        blocker = await other.acquire("b")
        if how == "timeout":
            with pytest.raises(asynclock.AcquireTimeout, match="'b'"):
                async with locks.lock_all(["c", "b", "a"], timeout=0.3):
                    pytest.fail("entered without every lock")
        else:
            with anyio.move_on_after(0.2):
                async with locks.lock_all(["a", "b"]):
                    pytest.fail("entered without every lock")
        # "a" was taken before "b" timed out or the wait was cancelled, and must be free again.
        probe = await other.try_acquire("a")
        assert probe is not None
        await probe.release()
        await blocker.release()


@pytest.mark.expect_log("lease on 'y' lost: the lock was removed on the server")
async def test_tokens_are_visible_a_loss_cancels_the_body_and_bad_sets_are_refused() -> None:
    async with memory_locks() as locks:
        with pytest.raises(asynclock.InvalidArgument, match="at least one"):
            locks.lock_all([])
        with pytest.raises(asynclock.InvalidArgument, match="empty"):
            locks.lock_all(["a", ""])
        with pytest.raises(asynclock.LeaseLost) as info:
            async with locks.lock_all(["x", "y"], ttl=30) as (x, y):
                assert asynclock.current_token("x") == x.token
                assert asynclock.current_token("y") == y.token
                memory(locks).expire("y", notify=True)
                await anyio.sleep(10)
        assert info.value.name == "y"
        assert x.released and y.released
        assert await locks.try_acquire("x") is not None
