"""ZooKeeper: shared holds, semaphores and elections as the tree shows them (namespaces, node
names, watches, sessions), through the backend's own calls; and an election through a leader
kill on an ensemble."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import anyio
import pytest

from asynclock.abc import LockInfo, LockRequest
from asynclock.backends.zookeeper import ZooKeeperGrant
from tests.contract.backend_zookeeper import Zk, backend_of, until, watched_paths

pytestmark = pytest.mark.anyio


def ask(name: str, lost: Callable[[str], None] | None = None, **fields: object) -> LockRequest:
    """A request as the core makes it (a fresh owner secret each time)."""
    return LockRequest(
        name=name,
        ttl=float(fields.pop("ttl", 5.0)),  # type: ignore[arg-type]
        owner=uuid.uuid4().hex,
        on_lost=lost or (lambda reason: None),
        **fields,  # type: ignore[arg-type]
    )


def token(grant: ZooKeeperGrant | LockInfo) -> int:
    assert grant.token is not None
    return grant.token


async def test_the_three_kinds_of_one_name_are_three_parents(zk: Zk) -> None:
    async with zk.backend() as one:
        lock = await one.try_acquire(ask("a"))
        permit = await one.try_acquire(ask("a", kind="semaphore", permits=2))
        term = await one.try_acquire(ask("a", kind="election", value=b"me:8080"))
        assert lock is not None and permit is not None and term is not None
        assert token(lock) < token(permit) < token(term)
        tree = {path.rpartition("/")[0] for path in await zk.tree()}
        assert tree == {
            zk.chroot,
            f"{zk.chroot}/a",
            f"{zk.chroot}/%semaphore-a",
            f"{zk.chroot}/%election-a",
        }
        assert "-sem2-" in permit.path and "-lock-" in term.path
        assert await zk.admin.get_data(term.path) == b"me:8080"
        # A lock named like another kind's parent is still the lock of that name.
        odd = await one.try_acquire(ask("%semaphore-a"))
        assert odd is not None and odd.path.startswith(f"{zk.chroot}/%25semaphore-a/")
        for grant in (lock, permit, term, odd):
            await one.release(grant)
    assert await zk.tree() == []


async def test_semaphore_waiters_watch_the_n_nodes_ahead_and_enter_in_order(zk: Zk) -> None:
    parent = f"{zk.chroot}/%semaphore-pool"
    async with zk.backend() as one, zk.backend() as other:
        holders = [await one.acquire(ask("pool", kind="semaphore", permits=3)) for _ in range(3)]
        assert await other.try_acquire(ask("pool", kind="semaphore", permits=3)) is None
        entered: list[int] = []
        grants: dict[int, ZooKeeperGrant] = {}

        async def wait(index: int) -> None:
            grant = await (one, other)[index % 2].acquire(ask("pool", kind="semaphore", permits=3))
            grants[index] = grant
            entered.append(index)

        async with anyio.create_task_group() as tg:
            for index in range(6):
                tg.start_soon(wait, index)
                await zk.wait_for_children("%semaphore-pool", 4 + index)
            # Nobody watches the queue; each waiter watches the 3 nodes just ahead of it.
            queue = [f"{parent}/{child}" for child in await zk.children("%semaphore-pool")]
            watched = watched_paths(zk.server)
            assert parent not in watched
            for position in range(3, 9):
                for ahead in queue[position - 3 : position]:
                    assert ahead in watched
            assert queue[-1] not in watched
            info = await one.inspect("pool", "semaphore")
            assert (info.permits, info.waiters) == (3, 6)
            assert [h.token for h in info.holders] == [g.token for g in holders]
            # A holder in the middle leaves: the first waiter, and only it, gets in.
            await one.release(holders[1])
            await until(lambda: entered == [0])
            await anyio.sleep(0.1)
            assert entered == [0]
            for grant in (holders[0], holders[2]):
                await one.release(grant)
            await until(lambda: entered == [0, 1, 2])
            for index in (0, 1, 2):
                await (one, other)[index % 2].release(grants[index])
        assert entered == list(range(6))
        assert sorted(token(grants[i]) for i in range(6)) == [token(grants[i]) for i in range(6)]
        for index in (3, 4, 5):
            await (one, other)[index % 2].release(grants[index])
        assert await one.inspect("pool", "semaphore") == LockInfo(
            "pool", held=False, waiters=0, kind="semaphore"
        )


async def test_election_value_token_and_a_change_feed_on_the_leaders_node(zk: Zk) -> None:
    woke: list[float] = []
    async with zk.backend() as one, zk.backend() as other:

        async def watch(seen: LockInfo, timeout: float) -> None:
            started = anyio.current_time()
            await other.wait_for_change("boss", "election", seen, timeout)
            woke.append(anyio.current_time() - started)

        idle = await other.inspect("boss", "election")
        assert idle == LockInfo("boss", held=False, waiters=0, kind="election")
        # Nothing there yet (no parent even): a candidate appearing is a change.
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch, idle, 5.0)
            await anyio.sleep(0.2)
            leader = await one.acquire(ask("boss", kind="election", value=b"a"))
        assert woke.pop() < 1.0
        info = await other.inspect("boss", "election")
        assert (info.held, info.value, info.token, info.owner) == (
            True,
            b"a",
            leader.token,
            leader.owner,
        )
        assert [h.value for h in info.holders] == [b"a"]
        next_up: list[ZooKeeperGrant] = []

        async def campaign() -> None:
            next_up.append(await other.acquire(ask("boss", kind="election", value=b"b")))

        async with anyio.create_task_group() as tg:
            # A candidate joining the queue is not a change of leader: nobody wakes...
            async with anyio.create_task_group() as feed:
                feed.start_soon(watch, info, 0.5)
                await anyio.sleep(0.1)
                tg.start_soon(campaign)
                await zk.wait_for_children("%election-boss", 2)
            assert woke.pop() >= 0.45
            # ...the leader leaving is.
            async with anyio.create_task_group() as feed:
                feed.start_soon(watch, info, 5.0)
                await anyio.sleep(0.2)
                await one.release(leader)
            assert woke.pop() < 1.0
        now = await one.inspect("boss", "election")
        assert (now.value, now.token) == (b"b", next_up[0].token)
        assert token(now) > token(leader)
        # A stale view returns at once.
        started = anyio.current_time()
        await one.wait_for_change("boss", "election", info, 5.0)
        assert anyio.current_time() - started < 0.5
        await other.release(next_up[0])
        # The feed leaves no watch callbacks behind.
        for client in (one, other):
            assert all(s["watches"] == 0 for s in client.extra_info()["sessions"].values())


async def test_a_change_feed_on_a_semaphore_or_lock_watches_the_parents_children(zk: Zk) -> None:
    async with zk.backend() as one, zk.backend() as other:
        permit = await one.acquire(ask("pool", kind="semaphore", permits=2))
        seen = await other.inspect("pool", "semaphore")
        started = anyio.current_time()
        await other.wait_for_change("pool", "semaphore", seen, 0.3)  # nothing changes
        assert anyio.current_time() - started >= 0.25
        async with anyio.create_task_group() as tg:
            tg.start_soon(other.wait_for_change, "pool", "semaphore", seen, 5.0)
            await anyio.sleep(0.1)
            second = await one.acquire(ask("pool", kind="semaphore", permits=2))
        assert anyio.current_time() - started < 2.0
        # A stale view returns at once; so does one of a lock that is gone.
        with anyio.fail_after(1):
            await other.wait_for_change("pool", "semaphore", seen, 5.0)
            lock = await one.acquire(ask("rw", shared=True))
            held = await other.inspect("rw")
            await one.release(lock)
            await other.wait_for_change("rw", "lock", held, 5.0)
        for grant in (permit, second):
            await one.release(grant)
        assert all(s["watches"] == 0 for s in other.extra_info()["sessions"].values())


async def test_a_change_feed_ends_quietly_when_its_client_closes_during_a_request(zk: Zk) -> None:
    """The client closing under a watch's request (the session ends first) is the end of the
    feed, not an error: Election.observe() ends when its client closes."""
    async with zk.proxied() as (proxy, locks):
        one = backend_of(locks)
        seen = await one.inspect("boss", "election")
        proxy.delay(100)  # the watch's first request is on its way when the client closes
        async with anyio.create_task_group() as tg:
            tg.start_soon(one.wait_for_change, "boss", "election", seen, 10.0)
            await anyio.sleep(0.05)
            with anyio.fail_after(5):
                await locks.aclose()
