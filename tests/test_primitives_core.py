"""The core's side of the primitives on memory://, with its fault hooks: extend() against a
blocked renewal, extend() beside a renewal in flight, shorter ttls, cancellation of extend()."""

from __future__ import annotations

import asyncio

import anyio
import pytest

import asynclock
from asynclock.abc import Kind, LockInfo
from asynclock.backends.memory import MemoryBackend
from tests.contract.harness import until
from tests.integrations._memory import memory, memory_locks
from tests.testing._helpers import cancel_natively

pytestmark = pytest.mark.anyio


async def test_extend_keeps_the_lock_through_a_body_longer_than_the_first_ttl() -> None:
    async with memory_locks() as locks:
        async with locks.lock("job", ttl=0.4) as lease:
            await lease.extend(3.0)
            memory(locks).faults.renew = "hang"  # no background renewal from here on
            await anyio.sleep(1.0)  # 2.5 times the first ttl
            assert lease.held and not lease.lost
            assert memory(locks).holder("job") is not None
            memory(locks).faults.renew = "ok"


@pytest.mark.expect_log(
    r"lease on 'job' lost: no successful renewal before the local deadline \(ttl 0\.3 s\)"
)
async def test_a_shorter_ttl_moves_the_deadline_earlier_and_the_body_is_cancelled_by_it() -> None:
    async with memory_locks() as locks:
        started = anyio.current_time()
        with pytest.raises(asynclock.LeaseLost):
            async with locks.lock("job", ttl=5.0) as lease:
                first_deadline = lease.deadline
                await lease.extend(0.3)
                assert lease.deadline < first_deadline
                memory(locks).faults.renew = "hang"
                await anyio.sleep(5)
        # Cancelled at the new deadline (0.3 s less drift and margin), not the old one.
        assert anyio.current_time() - started < 1.0
        memory(locks).faults.renew = "ok"


async def test_extend_waits_for_a_renewal_in_flight_and_is_never_beside_it() -> None:
    async with memory_locks() as locks:
        lease = await locks.acquire("job", ttl=0.6)
        backend = memory(locks)
        backend.faults.paused = True  # the renewal, when due, waits in the "server"
        await until(lambda: lease.busy, timeout=2)  # the renewal loop sets it
        extended = asyncio.create_task(lease.extend(2.0))
        await anyio.sleep(0.05)
        assert not extended.done()  # waiting for the renewal, not beside it
        backend.faults.paused = False
        await extended
        assert lease.ttl == 2.0 and lease.held
        await lease.release()


@pytest.mark.parametrize("cancels", [1, 3])
async def test_a_cancelled_extend_to_a_shorter_ttl_keeps_the_shorter_deadline(
    cancels: int,
) -> None:
    async with memory_locks() as locks:
        lease = await locks.acquire("job", ttl=10.0)
        backend = memory(locks)
        backend.faults.paused = True  # the extend reaches the "server" and waits there
        sent = anyio.current_time()
        task = asyncio.create_task(lease.extend(1.0))
        await anyio.sleep(0.05)
        await cancel_natively(task, cancels)
        # The server may have applied the shorter ttl: the deadline must not outlast it.
        assert lease.deadline <= sent + 1.0
        assert not lease.busy
        backend.faults.paused = False
        await lease.release()


@pytest.mark.expect_log("lease on 'job' lost: the lock is no longer held by this lease")
async def test_extend_of_a_lease_the_server_dropped_raises_and_cancels_its_body() -> None:
    async with memory_locks() as locks:
        with pytest.raises(asynclock.LeaseLost):
            async with locks.lock("job", ttl=5.0) as lease:
                memory(locks).expire("job")
                await lease.extend(5.0)
                pytest.fail("extend() of a dropped lease returned")


@pytest.mark.expect_log("lease on 'e' lost: the lock was removed on the server")
async def test_a_leader_dropped_on_the_server_is_cancelled_and_observers_see_it() -> None:
    async with memory_locks() as locks:
        seen: list[asynclock.Leader | None] = []

        async def observe() -> None:
            async for leader in locks.election("e").observe():
                seen.append(leader)  # noqa: PERF401 (read while it runs)

        async with anyio.create_task_group() as tg:
            tg.start_soon(observe)
            await until(lambda: bool(seen), timeout=2)
            with pytest.raises(asynclock.LeaseLost):
                async with locks.election("e").campaign(b"me", ttl=5.0):
                    await until(lambda: bool(seen) and seen[-1] is not None, timeout=2)
                    memory(locks).expire("e", notify=True, kind="election")
                    await anyio.sleep(5)
            await until(lambda: seen[-1] is None, timeout=2)  # pushed, not polled
            tg.cancel_scope.cancel()
        assert [leader.value if leader else None for leader in seen] == [None, b"me", None]


async def test_inspect_shows_holders_by_public_owner_and_bad_permits_or_kinds_are_refused() -> None:
    async with memory_locks() as locks:
        for bad in (0, -1, 10_001):
            with pytest.raises(asynclock.InvalidArgument, match="between 1 and"):
                locks.semaphore("s", permits=bad)
        with pytest.raises(asynclock.InvalidArgument, match="int"):
            locks.semaphore("s", permits=2.0)  # type: ignore[arg-type]
        with pytest.raises(asynclock.InvalidArgument):
            await locks.inspect("s", "queue")  # type: ignore[arg-type]
        # Readers, permits and the leader, each by its public owner.
        readers = [await locks.acquire("r", ttl=5, shared=True) for _ in range(2)]
        info = await locks.inspect("r")
        assert [holder.owner for holder in info.holders] == [reader.owner for reader in readers]
        semaphore = locks.semaphore("s", permits=4)
        permit = await semaphore.acquire(ttl=5)
        assert (await semaphore.inspect()).permits == 4
        async with locks.election("e").campaign(b"leader-a", ttl=5) as term:
            assert (await locks.inspect("e", "election")).owner == term.owner
        for lease in (*readers, permit):
            await lease.release()
        assert (await semaphore.inspect()).permits is None


class ClosingUnderALook(MemoryBackend):
    """A look at the server that is still waiting when the client closes its connections
    fails, as a Redis connection closed under a read does."""

    async def wait_for_change(self, name: str, kind: Kind, seen: LockInfo, timeout: float) -> None:
        self.closed = anyio.Event()
        await self.closed.wait()
        raise asynclock.BackendUnavailable("Connection closed by server.")

    async def aclose(self) -> None:
        self.closed.set()
        await super().aclose()


async def test_observe_ends_when_the_client_closes_its_connections_under_a_look() -> None:
    client = asynclock.LockClient(
        ClosingUnderALook("closing"), drift=0.01, margin=None, connect_timeout=5, release_timeout=5
    )
    seen: list[asynclock.Leader | None] = []
    async with anyio.create_task_group() as tg:
        async with client as locks:

            async def observe() -> None:
                async for leader in locks.election("e").observe():
                    seen.append(leader)  # noqa: PERF401 (read by the test while it runs)

            tg.start_soon(observe)
            await until(lambda: len(seen) == 1)
    assert seen == [None]
