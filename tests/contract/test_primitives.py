"""The primitives' contract: shared locks, semaphores, elections, extend() and inspect(), run
against every real backend that has them (and the refusal, by name, on those that do not)."""

from __future__ import annotations

import functools
import random

import anyio
import pytest

import asynclock
from tests.contract.harness import BackendUnderTest, cancel_while_waiting, until

pytestmark = pytest.mark.anyio

#: What each contract backend offers (a backend that loses one must say so here, not skip).
EXPECTED = {
    "memory": {"shared_locks", "semaphores", "elections", "ttl_change"},
    "sqlite": {"shared_locks", "semaphores", "elections", "ttl_change"},
    "postgres": {"shared_locks", "semaphores", "elections"},
    "pgbouncer": {"shared_locks", "semaphores", "elections"},
    "pgbouncer_transaction": set(),
    "redis": {"shared_locks", "semaphores", "elections", "ttl_change"},
    "valkey": {"shared_locks", "semaphores", "elections", "ttl_change"},
    "sentinel": {"shared_locks", "semaphores", "elections", "ttl_change"},
    "cluster": {"shared_locks", "semaphores", "elections", "ttl_change"},
    "etcd": {"shared_locks", "semaphores", "elections", "ttl_change"},
    "zookeeper": {"shared_locks", "semaphores", "elections"},
    "redlock": {"ttl_change"},
}
PRIMITIVES = ("shared_locks", "semaphores", "elections", "ttl_change")


async def test_capabilities_are_as_documented(backend: BackendUnderTest) -> None:
    async with backend.connect() as locks:
        have = {name for name in PRIMITIVES if getattr(locks.capabilities, name)}
    assert have == EXPECTED[backend.name]


async def test_missing_primitives_are_refused_by_name(backend: BackendUnderTest, name: str) -> None:
    async with backend.connect() as locks:
        if not locks.capabilities.shared_locks:
            with pytest.raises(asynclock.UnsupportedFeature, match="shared"):
                locks.lock(name, shared=True)
            with pytest.raises(asynclock.UnsupportedFeature, match="shared"):
                await locks.try_acquire(name, shared=True)
        if not locks.capabilities.semaphores:
            with pytest.raises(asynclock.UnsupportedFeature, match="semaphores"):
                locks.semaphore(name, permits=2)
        if not locks.capabilities.elections:
            with pytest.raises(asynclock.UnsupportedFeature, match="elections"):
                locks.election(name)
        if not locks.capabilities.ttl_change:
            lease = await locks.acquire(name, ttl=backend.ttl * 5)
            with pytest.raises(asynclock.UnsupportedFeature, match="ttl"):
                await lease.extend(backend.ttl * 6)
            await lease.extend(backend.ttl * 5)  # its own ttl: a renewal now
            assert lease.held
            await lease.release()


# -- shared (read) locks ------------------------------------------------------------------


@pytest.mark.needs("shared_locks")
async def test_many_readers_hold_at_once_and_exclude_writers(
    backend: BackendUnderTest, name: str
) -> None:
    ttl = backend.ttl * 5
    async with backend.connect() as first, backend.connect() as second:
        readers = [await first.acquire(name, ttl=ttl, shared=True) for _ in range(2)]
        readers.append(await second.acquire(name, ttl=ttl, shared=True, timeout=5))
        assert all(reader.shared for reader in readers)
        assert await second.try_acquire(name, ttl=ttl) is None
        info = await second.inspect(name)
        assert info.held
        if info.holders:
            assert sorted(str(holder.owner) for holder in info.holders) == sorted(
                reader.owner for reader in readers
            )
            assert all(holder.shared for holder in info.holders)
        for reader in readers:
            await reader.release()
        writer = await second.try_acquire(name, ttl=ttl)
        assert writer is not None and not writer.shared
        assert await first.try_acquire(name, ttl=ttl, shared=True) is None
        assert await first.try_acquire(name, ttl=ttl) is None
        await writer.release()


@pytest.mark.needs("shared_locks")
async def test_a_waiting_writer_gets_in_before_readers_that_came_after_it(
    backend: BackendUnderTest, name: str
) -> None:
    ttl = backend.ttl * 5
    order: list[str] = []
    async with backend.connect() as first, backend.connect() as second, backend.connect() as third:
        reader = await first.acquire(name, ttl=ttl, shared=True)

        async def write() -> None:
            async with second.lock(name, ttl=ttl, timeout=10):
                order.append("writer")
                await anyio.sleep(0.05)

        async def read_later() -> None:
            async with third.lock(name, ttl=ttl, timeout=10, shared=True):
                order.append("late reader")

        async with anyio.create_task_group() as tg:
            tg.start_soon(write)
            await anyio.sleep(0.3)  # the writer queues behind the reader
            # A writer waits: new readers queue behind it, they do not join the reader.
            assert await third.try_acquire(name, ttl=ttl, shared=True) is None
            tg.start_soon(read_later)
            await anyio.sleep(0.3)
            assert order == []
            await reader.release()
    assert order == ["writer", "late reader"]


@pytest.mark.needs("shared_locks")
async def test_tokens_increase_across_shared_and_exclusive_holds(
    backend: BackendUnderTest, name: str
) -> None:
    ttl = backend.ttl * 5
    tokens: list[int] = []
    async with backend.connect() as first, backend.connect() as second:
        for index in range(3):
            readers = [
                await first.acquire(name, ttl=ttl, shared=True),
                await second.acquire(name, ttl=ttl, shared=True, timeout=5),
            ]
            tokens += [reader.token for reader in readers]
            for reader in readers:
                await reader.release()
            locks = first if index % 2 else second
            async with locks.lock(name, ttl=ttl, timeout=5) as writer:
                tokens.append(writer.token)
                assert asynclock.current_token(name) == writer.token
    assert tokens == sorted(tokens)
    assert len(set(tokens)) == len(tokens)


@pytest.mark.needs("shared_locks")
async def test_cancelling_shared_acquires_leaves_nothing_behind(
    backend: BackendUnderTest, name: str
) -> None:
    ttl = backend.ttl * 5
    async with backend.connect() as locks, backend.connect() as other:
        writer = await other.acquire(name, ttl=ttl)
        for cancels in (1, 3):
            await cancel_while_waiting(locks.lock(name, ttl=ttl, shared=True), cancels)
        await writer.release()
        # The cancelled readers are gone: a writer gets in at once.
        again = await other.acquire(name, ttl=ttl, timeout=5)
        await again.release()


# -- semaphores ---------------------------------------------------------------------------


@pytest.mark.needs("semaphores")
async def test_a_semaphore_of_3_never_has_more_than_3_bodies_and_lets_all_20_in(
    backend: BackendUnderTest, name: str
) -> None:
    inside = 0
    most = 0
    done = 0

    async def worker(locks: asynclock.LockClient) -> None:
        nonlocal inside, most, done
        async with locks.semaphore(name, permits=3).lock(ttl=backend.ttl * 5, timeout=30):
            inside += 1
            most = max(most, inside)
            await anyio.sleep(random.uniform(0.005, 0.02))
            inside -= 1
            done += 1

    async with backend.connect() as first, backend.connect() as second:
        with anyio.fail_after(40):
            async with anyio.create_task_group() as tg:
                for index in range(20):
                    tg.start_soon(worker, (first, second)[index % 2])
    assert done == 20
    assert 1 <= most <= 3


@pytest.mark.needs("semaphores")
async def test_each_permit_is_a_lease_of_its_own(backend: BackendUnderTest, name: str) -> None:
    ttl = backend.ttl * 5
    async with backend.connect() as first, backend.connect() as second:
        semaphore = first.semaphore(name, permits=2)
        one = await semaphore.acquire(ttl=ttl)
        two = await second.semaphore(name, permits=2).acquire(ttl=ttl, timeout=5)
        assert one.kind == two.kind == "semaphore"
        assert one.owner != two.owner
        if first.capabilities.fencing:
            assert two.token > one.token
        assert await semaphore.try_acquire(ttl=ttl) is None
        info = await semaphore.inspect()
        assert info.held and info.kind == "semaphore"
        assert info.permits in (None, 2)
        if info.holders:
            assert {holder.owner for holder in info.holders} == {one.owner, two.owner}
        await one.release()
        assert two.held  # releasing one permit leaves the other alone
        three = await semaphore.try_acquire(ttl=ttl)
        assert three is not None
        if first.capabilities.fencing:
            assert three.token > two.token
        await two.release()
        await three.release()
        assert not (await semaphore.inspect()).held


@pytest.mark.needs("semaphores")
async def test_a_semaphore_asked_for_with_other_permits_is_refused(
    backend: BackendUnderTest, name: str
) -> None:
    ttl = backend.ttl * 5
    async with backend.connect() as first, backend.connect() as second:
        held = await first.semaphore(name, permits=3).acquire(ttl=ttl)
        with pytest.raises(asynclock.InvalidArgument, match="3 permits"):
            await second.semaphore(name, permits=4).try_acquire(ttl=ttl)
        with pytest.raises(asynclock.InvalidArgument, match="3 permits"):
            await second.semaphore(name, permits=4).acquire(ttl=ttl, timeout=1)
        await held.release()
        # Idle again: another size may start afresh.
        again = await second.semaphore(name, permits=4).acquire(ttl=ttl, timeout=5)
        await again.release()


@pytest.mark.needs("semaphores", "elections")
async def test_semaphores_locks_and_elections_are_separate_namespaces(
    backend: BackendUnderTest, name: str
) -> None:
    ttl = backend.ttl * 5
    async with backend.connect() as locks:
        async with locks.lock(name, ttl=ttl):
            permit = await locks.semaphore(name, permits=1).try_acquire(ttl=ttl)
            assert permit is not None
            async with locks.election(name).campaign(b"x", ttl=ttl, timeout=2):
                assert (await locks.inspect(name)).held
            await permit.release()


@pytest.mark.needs("semaphores", "fifo")
async def test_semaphore_waiters_are_served_in_order(backend: BackendUnderTest, name: str) -> None:
    ttl = backend.ttl * 5
    order: list[tuple[int, int]] = []
    async with backend.connect() as first, backend.connect() as second:
        held = [await first.semaphore(name, permits=2).acquire(ttl=ttl) for _ in range(2)]

        async def wait(index: int) -> None:
            locks = (first, second)[index % 2]
            async with locks.semaphore(name, permits=2).lock(ttl=ttl, timeout=20) as permit:
                # The order of the grants is the server's: two permits handed over in one
                # step may reach their clients in either order, the tokens say which came first.
                order.append((permit.token, index))
                await anyio.sleep(0.05)

        async with anyio.create_task_group() as tg:
            for index in range(4):
                tg.start_soon(wait, index)
                # Each queues after the one before, as the server counts them (a pause of
                # 0.15 s was not always enough for a take on a loaded machine: PostgreSQL).
                with anyio.fail_after(10):
                    while (await first.semaphore(name, permits=2).inspect()).waiters != index + 1:  # noqa: ASYNC110
                        await anyio.sleep(0.01)
            for lease in held:
                await lease.release()
    assert [index for _, index in sorted(order)] == [0, 1, 2, 3]


@pytest.mark.needs("semaphores")
@pytest.mark.expect_log(r"lease on '.*' lost: test: lost")
async def test_a_lost_permit_cancels_only_its_own_body(
    backend: BackendUnderTest, name: str
) -> None:
    ttl = backend.ttl * 5
    async with backend.connect() as first, backend.connect() as second:
        keeper = await second.semaphore(name, permits=2).acquire(ttl=ttl)
        with pytest.raises(asynclock.LeaseLost):
            async with first.semaphore(name, permits=2).lock(ttl=ttl) as permit:
                permit._mark_lost("test: lost")  # as a renewal proving loss would
                await anyio.sleep(5)
        assert keeper.held and not keeper.lost
        await keeper.release()


# -- elections ----------------------------------------------------------------------------


@pytest.mark.needs("elections")
async def test_leader_shows_the_value_and_token_of_the_term(
    backend: BackendUnderTest, name: str
) -> None:
    ttl = backend.ttl * 5
    async with backend.connect() as first, backend.connect() as second:
        assert await second.election(name).leader() is None
        async with first.election(name).campaign(b"host-a:8080", ttl=ttl) as term:
            assert term.kind == "election" and term.value == b"host-a:8080"
            leader = await second.election(name).leader()
            assert leader == asynclock.Leader(
                b"host-a:8080", term.token if first.capabilities.fencing else None, term.owner
            )
            info = await second.inspect(name, "election")
            assert info.held and info.value == b"host-a:8080"
            with pytest.raises(asynclock.AcquireTimeout):
                async with second.election(name).campaign(b"host-b", ttl=ttl, timeout=0.2):
                    pytest.fail("two leaders")
        assert await second.election(name).leader() is None


@pytest.mark.needs("elections")
async def test_observe_sees_every_change_of_leader_in_order(
    backend: BackendUnderTest, name: str
) -> None:
    ttl = backend.ttl * 5
    seen: list[asynclock.Leader | None] = []
    async with backend.connect() as locks, backend.connect() as watcher:

        async def observe() -> None:
            async for leader in watcher.election(name).observe():
                seen.append(leader)  # noqa: PERF401 (read by the test while it runs)

        async with anyio.create_task_group() as tg:
            tg.start_soon(observe)
            await until(lambda: len(seen) == 1)
            for value in (b"a", b"b", b"c"):
                async with locks.election(name).campaign(value, ttl=ttl, timeout=5):
                    await until(functools.partial(_leads, seen, value))
                await until(lambda: seen[-1] is None)
            tg.cancel_scope.cancel()
    assert seen[0] is None
    values = [leader.value for leader in seen if leader is not None]
    assert values == [b"a", b"b", b"c"]
    if locks.capabilities.fencing:
        tokens = [leader.token for leader in seen if leader is not None and leader.token]
        assert tokens == sorted(tokens) and len(set(tokens)) == 3


def _leads(seen: list[asynclock.Leader | None], value: bytes) -> bool:
    return seen[-1] is not None and seen[-1].value == value


@pytest.mark.needs("elections")
async def test_observe_ends_when_the_client_closes(backend: BackendUnderTest, name: str) -> None:
    async with backend.connect() as locks:
        seen = []
        async with anyio.create_task_group() as tg:

            async def observe() -> None:
                async for leader in locks.election(name).observe():
                    seen.append(leader)  # noqa: PERF401 (read by the test while it runs)

            tg.start_soon(observe)
            await until(lambda: len(seen) == 1)
            with anyio.fail_after(5):
                await locks.aclose()
    assert seen == [None]


@pytest.mark.needs("elections")
async def test_campaign_checks_its_value(backend: BackendUnderTest, name: str) -> None:
    async with backend.connect() as locks:
        with pytest.raises(asynclock.InvalidArgument, match="bytes"):
            locks.election(name).campaign("text")  # type: ignore[arg-type]
        with pytest.raises(asynclock.InvalidArgument, match="limit"):
            locks.election(name).campaign(b"x" * (64 * 1024 + 1))


# -- extend() -----------------------------------------------------------------------------


@pytest.mark.needs("ttl_change")
async def test_extend_moves_the_deadline_by_the_renewal_rule(
    backend: BackendUnderTest, name: str
) -> None:
    ttl = backend.ttl * 5
    async with backend.connect() as locks:
        async with locks.lock(name, ttl=ttl) as lease:
            before = anyio.current_time()
            await lease.extend(ttl * 3)
            assert lease.ttl == ttl * 3
            # From the send time, less drift and margin: as a background renewal moves it.
            assert before + ttl * 3 * 0.9 - 1.5 <= lease.deadline <= anyio.current_time() + ttl * 3
            await lease.extend(ttl)
            assert lease.ttl == ttl
            assert lease.deadline <= anyio.current_time() + ttl
            info = await locks.inspect(name)
            assert info.expires_in is None or info.expires_in <= ttl + 0.5


@pytest.mark.expect_log(r"lease on '.*' lost")
async def test_extending_a_lost_lease_raises_lease_lost_and_a_released_one_not_held(
    backend: BackendUnderTest, name: str
) -> None:
    ttl = backend.ttl * 5
    async with backend.connect() as locks:
        lease = await locks.acquire(name, ttl=ttl, on_lost="flag")
        await backend.revoke(name)
        with pytest.raises(asynclock.LeaseLost):
            with anyio.fail_after(ttl):
                await lease.extend(ttl)
                await lease.wait_lost()  # a backend that only learns of it later
                await lease.extend(ttl)
        assert lease.lost
        await lease.release()
        released = await locks.acquire(name, ttl=ttl)
        await released.release()
        with pytest.raises(asynclock.NotHeld, match="was released"):
            await released.extend(ttl)


async def test_extend_checks_its_ttl(backend: BackendUnderTest, name: str) -> None:
    async with backend.connect() as locks:
        async with locks.lock(name, ttl=backend.ttl * 5) as lease:
            with pytest.raises(asynclock.InvalidArgument):
                await lease.extend(0)
            with pytest.raises(asynclock.InvalidArgument):
                await lease.extend("10")  # type: ignore[arg-type]
            assert lease.held
