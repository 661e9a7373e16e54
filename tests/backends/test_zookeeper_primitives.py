"""ZooKeeper: shared holds, semaphores and elections as the tree shows them (namespaces, node
names, watches, sessions), through the backend's own calls; and an election through a leader
kill on an ensemble."""

from __future__ import annotations

import asyncio
import contextlib
import random
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
import anyio.to_thread
import pytest
from aiozk import ZKClient

import asynclock
from asynclock.abc import LockInfo, LockRequest
from asynclock.backends.zookeeper import ZooKeeperBackend, ZooKeeperGrant
from asynclock.testing import FaultProxy, ZooKeeperEnsemble, ZooKeeperServer
from tests.backends.test_zookeeper import (
    assert_session_state_clean,
    backend_of,
    children,
    until,
    wait_until_children,
    watched_paths,
)
from tests.contract.backend_zookeeper import delete_tree, zk_admin, znodes_under

pytestmark = pytest.mark.anyio


@pytest.fixture
def chroot() -> str:
    return f"/prim-{uuid.uuid4().hex[:10]}"


@pytest.fixture
async def admin(zookeeper_server: ZooKeeperServer, chroot: str) -> AsyncIterator[ZKClient]:
    async with zk_admin(zookeeper_server.address) as client:
        yield client
        await delete_tree(client, chroot)


@asynccontextmanager
async def backend(url: str, **options: object) -> AsyncIterator[ZooKeeperBackend]:
    async with asynclock.connect(url, **options) as locks:  # type: ignore[arg-type]
        yield backend_of(locks)


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


async def test_the_three_kinds_of_one_name_are_three_parents(
    zookeeper_server: ZooKeeperServer, chroot: str, admin: ZKClient
) -> None:
    async with backend(f"{zookeeper_server.url}{chroot}") as zk:
        lock = await zk.try_acquire(ask("a"))
        permit = await zk.try_acquire(ask("a", kind="semaphore", permits=2))
        term = await zk.try_acquire(ask("a", kind="election", value=b"me:8080"))
        assert lock is not None and permit is not None and term is not None
        assert token(lock) < token(permit) < token(term)
        tree = {path.rpartition("/")[0] for path in await znodes_under(admin, chroot)}
        assert tree == {chroot, f"{chroot}/a", f"{chroot}/%semaphore-a", f"{chroot}/%election-a"}
        assert "-sem2-" in permit.path and "-lock-" in term.path
        assert await admin.get_data(term.path) == b"me:8080"
        # A lock named like another kind's parent is still the lock of that name.
        odd = await zk.try_acquire(ask("%semaphore-a"))
        assert odd is not None and odd.path.startswith(f"{chroot}/%25semaphore-a/")
        for grant in (lock, permit, term, odd):
            await zk.release(grant)
    assert await znodes_under(admin, chroot) == []


async def test_readers_share_and_a_waiting_writer_holds_back_later_readers(
    zookeeper_server: ZooKeeperServer, chroot: str, admin: ZKClient
) -> None:
    url = f"{zookeeper_server.url}{chroot}"
    async with backend(url) as zk, backend(url) as other:
        first = await zk.try_acquire(ask("rw", shared=True))
        second = await other.try_acquire(ask("rw", shared=True))
        assert first is not None and second is not None and first.kind == "read"
        assert await zk.try_acquire(ask("rw")) is None  # readers exclude a writer
        async with anyio.create_task_group() as tg:
            written: list[ZooKeeperGrant] = []

            async def write() -> None:
                written.append(await other.acquire(ask("rw")))

            tg.start_soon(write)
            await wait_until_children(admin, f"{chroot}/rw", 3)
            # A reader that comes after the waiting writer does not get in.
            assert await zk.try_acquire(ask("rw", shared=True)) is None
            info = await zk.inspect("rw")
            assert [h.token for h in info.holders] == [first.token, second.token]
            assert all(h.shared for h in info.holders) and info.waiters == 1
            assert (info.owner, info.token) == (first.owner, first.token)
            await zk.release(first)
            await zk.release(second)
        (writer,) = written
        assert token(writer) > token(second)
        later = await zk.try_acquire(ask("rw", shared=True))
        assert later is None
        await other.release(writer)
        later = await zk.try_acquire(ask("rw", shared=True))
        assert later is not None and token(later) > token(writer)
        await zk.release(later)


async def test_semaphore_waiters_watch_the_n_nodes_ahead_and_enter_in_order(
    zookeeper_server: ZooKeeperServer, chroot: str, admin: ZKClient
) -> None:
    url = f"{zookeeper_server.url}{chroot}"
    parent = f"{chroot}/%semaphore-pool"
    async with backend(url) as zk, backend(url) as other:
        holders = [await zk.acquire(ask("pool", kind="semaphore", permits=3)) for _ in range(3)]
        assert await other.try_acquire(ask("pool", kind="semaphore", permits=3)) is None
        entered: list[int] = []
        grants: dict[int, ZooKeeperGrant] = {}

        async def wait(index: int) -> None:
            grant = await (zk, other)[index % 2].acquire(ask("pool", kind="semaphore", permits=3))
            grants[index] = grant
            entered.append(index)

        async with anyio.create_task_group() as tg:
            for index in range(6):
                tg.start_soon(wait, index)
                await wait_until_children(admin, parent, 4 + index)
            # Nobody watches the queue; each waiter watches the 3 nodes just ahead of it.
            queue = [f"{parent}/{child}" for child in await children(admin, parent)]
            watched = watched_paths(zookeeper_server)
            assert parent not in watched
            for position in range(3, 9):
                for ahead in queue[position - 3 : position]:
                    assert ahead in watched
            assert queue[-1] not in watched
            info = await zk.inspect("pool", "semaphore")
            assert (info.permits, info.waiters) == (3, 6)
            assert [h.token for h in info.holders] == [g.token for g in holders]
            # A holder in the middle leaves: the first waiter, and only it, gets in.
            await zk.release(holders[1])
            await until(lambda: entered == [0])
            await anyio.sleep(0.1)
            assert entered == [0]
            for grant in (holders[0], holders[2]):
                await zk.release(grant)
            await until(lambda: entered == [0, 1, 2])
            for index in (0, 1, 2):
                await (zk, other)[index % 2].release(grants[index])
        assert entered == list(range(6))
        assert sorted(token(grants[i]) for i in range(6)) == [token(grants[i]) for i in range(6)]
        for index in (3, 4, 5):
            await (zk, other)[index % 2].release(grants[index])
        assert await zk.inspect("pool", "semaphore") == LockInfo(
            "pool", held=False, waiters=0, kind="semaphore"
        )


async def test_another_number_of_permits_is_refused_and_leaves_nothing(
    zookeeper_server: ZooKeeperServer, chroot: str, admin: ZKClient
) -> None:
    url = f"{zookeeper_server.url}{chroot}"
    parent = f"{chroot}/%semaphore-pool"
    async with backend(url) as zk, backend(url) as other:
        held = await zk.acquire(ask("pool", kind="semaphore", permits=2))
        for attempt in (other.try_acquire, other.acquire):
            with pytest.raises(asynclock.InvalidArgument, match=r"has 2 permits.*asked for 3"):
                await attempt(ask("pool", kind="semaphore", permits=3))
            assert len(await children(admin, parent)) == 1
        # A waiter with the right number is not disturbed, and the name's lock is unrelated.
        assert await other.try_acquire(ask("pool", kind="semaphore", permits=2)) is not None
        assert await other.try_acquire(ask("pool")) is not None
        await zk.release(held)
    async with backend(url) as zk:
        # Nobody holds or waits: any number starts afresh.
        fresh = await zk.try_acquire(ask("pool", kind="semaphore", permits=5))
        assert fresh is not None and fresh.kind == "sem5"
        await zk.release(fresh)


async def test_a_vanished_holders_session_frees_exactly_its_permits(
    zookeeper_server: ZooKeeperServer, chroot: str, admin: ZKClient
) -> None:
    direct = f"{zookeeper_server.url}{chroot}"
    parent = f"{chroot}/%semaphore-pool"
    lost: list[str] = []
    async with FaultProxy(zookeeper_server.host, zookeeper_server.port) as proxy:
        async with (
            backend(f"zookeeper://{proxy.address}{chroot}") as crashing,
            backend(direct) as zk,
        ):
            gone = [
                await crashing.acquire(ask("pool", lost.append, kind="semaphore", permits=3, ttl=2))
                for _ in range(2)
            ]
            kept = await zk.acquire(ask("pool", kind="semaphore", permits=3, ttl=2))
            async with anyio.create_task_group() as tg:
                entered: list[ZooKeeperGrant] = []

                async def wait() -> None:
                    entered.append(
                        await zk.acquire(ask("pool", kind="semaphore", permits=3, ttl=2))
                    )

                tg.start_soon(wait)
                tg.start_soon(wait)
                await wait_until_children(admin, parent, 5)
                proxy.blackhole()  # the holder hangs: the server expires its session
                with anyio.fail_after(6):
                    await until(lambda: len(entered) == 2, timeout=6)
            assert {g.path.rpartition("/")[2] for g in gone}.isdisjoint(
                await children(admin, parent)
            )
            # Exactly its two permits went: the other holder keeps its own.
            assert (await zk.renew([kept]))[0].__class__.__name__ == "Renewed"
            assert len(await children(admin, parent)) == 3
            for grant in (kept, *entered):
                await zk.release(grant)
            proxy.pass_through()
            await until(lambda: len(lost) == 2, timeout=10)


async def test_election_value_token_and_a_change_feed_on_the_leaders_node(
    zookeeper_server: ZooKeeperServer, chroot: str, admin: ZKClient
) -> None:
    url = f"{zookeeper_server.url}{chroot}"
    woke: list[float] = []
    async with backend(url) as zk, backend(url) as other:

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
            leader = await zk.acquire(ask("boss", kind="election", value=b"a"))
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
                await wait_until_children(admin, f"{chroot}/%election-boss", 2)
            assert woke.pop() >= 0.45
            # ...the leader leaving is.
            async with anyio.create_task_group() as feed:
                feed.start_soon(watch, info, 5.0)
                await anyio.sleep(0.2)
                await zk.release(leader)
            assert woke.pop() < 1.0
        now = await zk.inspect("boss", "election")
        assert (now.value, now.token) == (b"b", next_up[0].token)
        assert token(now) > token(leader)
        # A stale view returns at once.
        started = anyio.current_time()
        await zk.wait_for_change("boss", "election", info, 5.0)
        assert anyio.current_time() - started < 0.5
        await other.release(next_up[0])
        # The feed leaves no watch callbacks behind.
        for client in (zk, other):
            assert all(s["watches"] == 0 for s in client.extra_info()["sessions"].values())


class Fenced:
    """A resource in the test's process that accepts a write only with a token at least as
    high as every token it accepted before (what a fencing guard does)."""

    def __init__(self) -> None:
        self.highest = 0
        self.accepted: list[tuple[int, str]] = []
        self.refused: list[tuple[int, str]] = []

    def write(self, token: int, who: str) -> None:
        if token < self.highest:
            self.refused.append((token, who))
            return
        self.highest = token
        self.accepted.append((token, who))


async def test_an_election_survives_a_server_leader_kill_with_one_leader_at_a_time(
    zookeeper_ensemble: ZooKeeperEnsemble,
) -> None:
    """5 candidates on 3 clients campaign in turn while the ensemble's leader is killed twice:
    the sessions move to another member, no term is lost, and the terms' tokens keep rising
    at the resource, one leader at a time."""
    chroot = f"/prim-{uuid.uuid4().hex[:10]}"
    url = f"{zookeeper_ensemble.url}{chroot}"
    resource = Fenced()
    leading: set[str] = set()
    most = 0
    terms: list[int] = []
    stop = anyio.Event()

    async def candidate(locks: asynclock.LockClient, me: str) -> None:
        nonlocal most
        election = locks.election("leader")
        while not stop.is_set():
            async with election.campaign(me.encode(), ttl=4, timeout=30) as term:
                leading.add(me)
                most = max(most, len(leading))
                terms.append(term.token)
                resource.write(term.token, me)
                await anyio.sleep(0.05)
                resource.write(term.token, me)
                leading.discard(me)

    async def terms_after(count: int) -> None:
        target = len(terms) + count
        await until(lambda: len(terms) >= target, timeout=10)

    clients = [asynclock.connect(url, op_timeout=3) for _ in range(3)]
    try:
        async with clients[0], clients[1], clients[2], anyio.create_task_group() as tg:
            for index in range(5):
                tg.start_soon(candidate, clients[index % 3], f"candidate-{index}")
            for _ in range(2):
                await terms_after(3)
                killed = await anyio.to_thread.run_sync(zookeeper_ensemble.kill_leader)
                try:
                    await terms_after(3)  # elected again, with the new ZooKeeper leader
                finally:
                    await anyio.to_thread.run_sync(killed.restart)
            stop.set()
        for locks in clients:
            for info in backend_of(locks).extra_info()["sessions"].values():
                assert info["reconnects"] >= 1
    finally:
        async with zk_admin(zookeeper_ensemble.address) as client:
            await delete_tree(client, chroot)
    assert most == 1
    assert terms == sorted(terms) and len(set(terms)) == len(terms) >= 9
    assert resource.refused == []
    assert len(resource.accepted) == 2 * len(terms)


async def test_native_cancels_of_semaphore_waiters_and_observers_leave_nothing(
    zookeeper_server: ZooKeeperServer, chroot: str, admin: ZKClient
) -> None:
    """Cancelled natively 1-3 times at random moments (over a 30 ms one-way delay, so that a
    cancel often lands on a request in flight): no node, watch callback or listener is left,
    and the permits work at once."""
    rng = random.Random(19)
    parent = f"{chroot}/%semaphore-pool"
    async with FaultProxy(zookeeper_server.host, zookeeper_server.port) as proxy:
        async with (
            asynclock.connect(f"{zookeeper_server.url}{chroot}") as holder,
            asynclock.connect(f"zookeeper://{proxy.address}{chroot}", op_timeout=3) as victim,
        ):
            pool = holder.semaphore("pool", permits=2)
            held = [await pool.acquire(ttl=10) for _ in range(2)]
            election = victim.election("boss")
            proxy.delay(30)
            for _ in range(12):
                tasks: list[asyncio.Task[object]] = [
                    asyncio.create_task(victim.semaphore("pool", permits=2).acquire(ttl=10)),
                    asyncio.create_task(_observe(election, changes=0)),
                    asyncio.create_task(_observe(election, changes=1)),
                ]
                await asyncio.sleep(rng.uniform(0, 0.15))
                for task in tasks:
                    for _ in range(rng.randint(1, 3)):
                        task.cancel()
                        await asyncio.sleep(rng.uniform(0, 0.02))
                for task in tasks:
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                assert len(await children(admin, parent)) == 2
            proxy.pass_through()
            assert_session_state_clean(victim)
            await held[0].release()
            again = await victim.semaphore("pool", permits=2).try_acquire(ttl=10)
            assert again is not None
            await again.release()
            await held[1].release()


async def _observe(election: asynclock.Election, *, changes: int) -> None:
    """Reads the current leader, then waits for ``changes`` changes (which never come)."""
    seen = 0
    async for _ in election.observe():
        if seen == changes:
            return
        seen += 1


async def test_a_change_feed_on_a_semaphore_or_lock_watches_the_parents_children(
    zookeeper_server: ZooKeeperServer, chroot: str, admin: ZKClient
) -> None:
    url = f"{zookeeper_server.url}{chroot}"
    async with backend(url) as zk, backend(url) as other:
        permit = await zk.acquire(ask("pool", kind="semaphore", permits=2))
        seen = await other.inspect("pool", "semaphore")
        started = anyio.current_time()
        await other.wait_for_change("pool", "semaphore", seen, 0.3)  # nothing changes
        assert anyio.current_time() - started >= 0.25
        async with anyio.create_task_group() as tg:
            tg.start_soon(other.wait_for_change, "pool", "semaphore", seen, 5.0)
            await anyio.sleep(0.1)
            second = await zk.acquire(ask("pool", kind="semaphore", permits=2))
        assert anyio.current_time() - started < 2.0
        # A stale view returns at once; so does one of a lock that is gone.
        with anyio.fail_after(1):
            await other.wait_for_change("pool", "semaphore", seen, 5.0)
            lock = await zk.acquire(ask("rw", shared=True))
            held = await other.inspect("rw")
            await zk.release(lock)
            await other.wait_for_change("rw", "lock", held, 5.0)
        for grant in (permit, second):
            await zk.release(grant)
        assert all(s["watches"] == 0 for s in other.extra_info()["sessions"].values())
