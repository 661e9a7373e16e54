"""The PostgreSQL backend's shared holds, semaphores and elections, through its Backend methods
against a real server: what the contract suite cannot see (the lane, the two queues, pg_locks,
the holders' table, terminated sessions)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, suppress
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import pytest
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream

import asynclock
from asynclock.abc import Kind, LockRequest, Lost, Renewed
from asynclock.backends.postgres import PostgresBackend, PostgresGrant
from asynclock.backends.postgres._kinds import kind_key, permits_class, split
from asynclock.testing import PostgresServer

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[2]

#: A permit or a term in a process of its own: prints "held", then "lost" if its body is
#: cancelled.
HOLDER = """
import sys, anyio, asynclock

async def main(url, kind, name, ttl):
    async with asynclock.connect(url) as locks:
        if kind == "semaphore":
            hold = locks.semaphore(name, permits=2).lock(ttl=float(ttl))
        elif kind == "shared":
            hold = locks.lock(name, ttl=float(ttl), shared=True)
        else:
            hold = locks.election(name).campaign(b"child", ttl=float(ttl))
        try:
            async with hold:
                print("held", flush=True)
                await anyio.sleep(60)
        except asynclock.LeaseLost:
            print("lost", flush=True)

anyio.run(main, *sys.argv[1:])
"""

LEFTOVERS = """
SELECT
  (SELECT count(*) FROM pg_locks AS l JOIN pg_stat_activity AS a ON a.pid = l.pid
   WHERE l.locktype = 'advisory' AND a.application_name = $1),
  (SELECT count(*) FROM asynclock_holders WHERE application_name = $1),
  (SELECT count(*) FROM asynclock_waiters WHERE key = ANY($2::bigint[]))
"""


@pytest.fixture
def name() -> str:
    return f"pgp/{uuid.uuid4().hex[:12]}"


@pytest.fixture
def app() -> str:
    return f"asynclock-prim-{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def admin(postgres_server: PostgresServer) -> AsyncIterator[asyncpg.Connection]:
    connection = await asyncpg.connect(postgres_server.dsn)
    try:
        yield connection
    finally:
        await connection.close()


@pytest.fixture
def connect(postgres_server: PostgresServer, app: str) -> Callable[..., PostgresBackend]:
    def make(**options: Any) -> PostgresBackend:
        return PostgresBackend.from_url(f"{postgres_server.url}?application_name={app}", options)

    return make


def request(
    name: str,
    *,
    ttl: float = 5.0,
    kind: Kind = "lock",
    shared: bool = False,
    permits: int = 1,
    value: bytes = b"",
    lost: list[str] | None = None,
) -> LockRequest:
    return LockRequest(
        name=name,
        ttl=ttl,
        owner=uuid.uuid4().hex,
        on_lost=(lost.append if lost is not None else lambda reason: None),
        kind=kind,
        shared=shared,
        permits=permits,
        value=value,
    )


async def nothing_left(admin: asyncpg.Connection, app: str, *names: str) -> None:
    keys = [kind_key(n, "semaphore") for n in names] + [kind_key(n, "election") for n in names]
    left: tuple[int, ...] = ()
    with anyio.move_on_after(5):
        while True:
            left = tuple(await admin.fetchrow(LEFTOVERS, app, keys))
            if left == (0, 0, 0):
                return
            await anyio.sleep(0.02)
    pytest.fail(f"left on the server (advisory locks, holders' rows, places): {left}")


# -- shared holds ---------------------------------------------------------------------------------


async def test_readers_share_and_a_writer_excludes_them(
    connect: Callable[..., PostgresBackend], name: str, admin: asyncpg.Connection, app: str
) -> None:
    async with connect() as one, connect() as two:
        first = await one.try_acquire(request(name, shared=True))
        # Same client, same ttl: the lane holds it shared already, so a connection of its own.
        second = await one.try_acquire(request(name, shared=True))
        third = await two.try_acquire(request(name, shared=True))
        assert first is not None and second is not None and third is not None
        assert first.lane is not None and second.lane is None
        assert first.token is not None and second.token is not None and third.token is not None
        assert first.token < second.token < third.token
        assert await one.try_acquire(request(name)) is None
        assert await two.try_acquire(request(name)) is None
        info = await two.inspect(name)
        assert info.held and len(info.holders) == 3
        assert all(holder.shared for holder in info.holders)
        assert [holder.token for holder in info.holders] == [
            g.token for g in (first, second, third)
        ]
        assert [holder.owner for holder in info.holders] == [
            g.owner for g in (first, second, third)
        ]
        assert (info.owner, info.token) == (first.owner, first.token)
        for grant in (first, second, third):
            await (one if grant is not third else two).release(grant)
        writer = await two.try_acquire(request(name))
        assert writer is not None and writer.token is not None and writer.token > third.token
        assert await one.try_acquire(request(name, shared=True)) is None
        info = await one.inspect(name)
        # An exclusive hold keeps no row: held, without an owner or token.
        assert info.held and info.holders == () and info.owner is None
        await two.release(writer)
    await nothing_left(admin, app, name)


async def test_readers_of_one_client_taking_at_once_all_get_in(
    connect: Callable[..., PostgresBackend], name: str, admin: asyncpg.Connection, app: str
) -> None:
    """A second reader's try while the first one's take is still on the lane goes to a
    connection of its own, as after it: not refused as if a writer held the lock."""
    async with connect() as one:
        grants: list[PostgresGrant | None] = []

        async def take() -> None:
            grants.append(await one.try_acquire(request(name, shared=True)))

        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(take)
        assert len(grants) == 3 and all(grant is not None for grant in grants)
        for grant in grants:
            assert grant is not None
            await one.release(grant)
    await nothing_left(admin, app, name)


@pytest.mark.parametrize("max_waiting", [8, 0])
async def test_a_waiting_writer_is_not_jumped_by_later_readers(
    connect: Callable[..., PostgresBackend],
    name: str,
    max_waiting: int,
    admin: asyncpg.Connection,
    app: str,
) -> None:
    """Through the server's queue (max_waiting=8) and through the queue table (0)."""
    order: list[str] = []
    async with connect(max_waiting=max_waiting) as one, connect(max_waiting=max_waiting) as two:
        reader = await one.try_acquire(request(name, shared=True))
        assert reader is not None

        async def take(backend: PostgresBackend, label: str, shared: bool) -> None:
            grant = await backend.acquire(request(name, shared=shared))
            order.append(label)
            await anyio.sleep(0.05)
            await backend.release(grant)

        async with anyio.create_task_group() as tg:
            tg.start_soon(take, two, "writer", False)
            with anyio.fail_after(5):
                while (await one.inspect(name)).waiters != 1:  # noqa: ASYNC110
                    await anyio.sleep(0.01)
            # A waiting writer: new readers neither try past it nor wait ahead of it.
            assert await one.try_acquire(request(name, shared=True)) is None
            assert await two.try_acquire(request(name, shared=True)) is None
            tg.start_soon(take, one, "reader 1", True)
            tg.start_soon(take, two, "reader 2", True)
            with anyio.fail_after(5):
                while (await one.inspect(name)).waiters != 3:  # noqa: ASYNC110
                    await anyio.sleep(0.01)
            await one.release(reader)
        assert order[0] == "writer"
        assert sorted(order[1:]) == ["reader 1", "reader 2"]
    await nothing_left(admin, app, name)


async def test_a_cancelled_shared_take_leaves_nothing(
    connect: Callable[..., PostgresBackend], name: str, admin: asyncpg.Connection, app: str
) -> None:
    async with connect() as one, connect() as two:
        writer = await two.try_acquire(request(name))
        assert writer is not None
        for delay in (0.0, 0.001, 0.005, 0.02):
            with anyio.move_on_after(delay):
                await one.acquire(request(name, shared=True))
                pytest.fail("got a shared hold while a writer holds")
        await two.release(writer)
        with anyio.fail_after(5):
            while (await one.inspect(name)).held or (await one.inspect(name)).waiters:  # noqa: ASYNC110
                await anyio.sleep(0.01)
    await nothing_left(admin, app, name)


# -- semaphores -----------------------------------------------------------------------------------


async def test_a_semaphore_admits_n_holders_each_its_own_lease(
    connect: Callable[..., PostgresBackend], name: str, admin: asyncpg.Connection, app: str
) -> None:
    async with connect() as one, connect() as two:
        grants = [
            await backend.try_acquire(request(name, kind="semaphore", permits=3))
            for backend in (one, two, one)
        ]
        assert all(grant is not None for grant in grants)
        held = [grant for grant in grants if grant is not None]
        tokens = [grant.token or 0 for grant in held]
        assert tokens == sorted(tokens) and len(set(tokens)) == 3
        assert len({grant.key for grant in held}) == 3  # three slots
        assert await two.try_acquire(request(name, kind="semaphore", permits=3)) is None
        # The lock "name" and the election "name" are other things.
        lock = await two.try_acquire(request(name))
        assert lock is not None
        await two.release(lock)
        info = await two.inspect(name, "semaphore")
        assert info.held and info.permits == 3 and info.waiters == 0
        assert [holder.owner for holder in info.holders] == [grant.owner for grant in held]
        assert [holder.token for holder in info.holders] == tokens
        assert (await two.inspect(name)).held is False
        outcomes = await one.renew([held[0], held[2]])
        assert all(isinstance(outcome, Renewed) for outcome in outcomes)
        await one.release(held[0])
        again = await two.try_acquire(request(name, kind="semaphore", permits=3))
        assert again is not None and again.token is not None and again.token > max(tokens)
        for backend, grant in ((two, held[1]), (one, held[2]), (two, again)):
            await backend.release(grant)
        info = await one.inspect(name, "semaphore")
        assert not info.held and info.permits is None
    await nothing_left(admin, app, name)


async def test_another_number_of_permits_is_refused_while_held_or_waited_for(
    connect: Callable[..., PostgresBackend], name: str, admin: asyncpg.Connection, app: str
) -> None:
    async with connect() as one, connect() as two:
        first = await one.try_acquire(request(name, kind="semaphore", permits=1))
        assert first is not None
        with pytest.raises(asynclock.InvalidArgument, match=r"has 1 permits.*asked for 2"):
            await two.try_acquire(request(name, kind="semaphore", permits=2))
        with pytest.raises(asynclock.InvalidArgument):
            await two.acquire(request(name, kind="semaphore", permits=2))
        async with anyio.create_task_group() as tg:

            async def wait() -> None:
                grant = await two.acquire(request(name, kind="semaphore", permits=1))
                await two.release(grant)

            tg.start_soon(wait)
            with anyio.fail_after(5):
                while (await one.inspect(name, "semaphore")).waiters != 1:  # noqa: ASYNC110
                    await anyio.sleep(0.01)
            await one.release(first)  # only the waiter, with 1, is left
            with pytest.raises(asynclock.InvalidArgument, match="has 1 permits"):
                await one.try_acquire(request(name, kind="semaphore", permits=5))
        # Nobody holds or waits: any number starts afresh.
        fresh = await one.try_acquire(request(name, kind="semaphore", permits=5))
        assert fresh is not None
        await one.release(fresh)
    await nothing_left(admin, app, name)


async def test_semaphore_waiters_are_served_in_order_and_never_more_than_n(
    connect: Callable[..., PostgresBackend], name: str, admin: asyncpg.Connection, app: str
) -> None:
    inside = 0
    most = 0
    served: list[int] = []
    go = anyio.Event()
    async with connect() as one, connect() as two:

        async def work(index: int) -> None:
            nonlocal inside, most
            backend = (one, two)[index % 2]
            grant = await backend.acquire(request(name, kind="semaphore", permits=3))
            inside += 1
            most = max(most, inside)
            served.append(index)
            if index < 3:
                await go.wait()
            await anyio.sleep(0.02)
            inside -= 1
            await backend.release(grant)

        async def waiting() -> int:
            return (await one.inspect(name, "semaphore")).waiters or 0

        async with anyio.create_task_group() as tg:
            for index in range(20):
                tg.start_soon(work, index)
                # Each arrives after the one before it is in (the first three) or waits.
                with anyio.fail_after(5):
                    while len(served) + await waiting() <= index:  # noqa: ASYNC110
                        await anyio.sleep(0.005)
            go.set()
    assert most == 3
    assert served[:3] == [0, 1, 2]
    assert served[3:] == list(range(3, 20))
    await nothing_left(admin, app, name)


async def test_a_terminated_permit_frees_exactly_that_permit(
    connect: Callable[..., PostgresBackend], name: str, admin: asyncpg.Connection, app: str
) -> None:
    lost: list[str] = []
    async with connect() as one, connect() as two:
        victim = await one.try_acquire(request(name, kind="semaphore", permits=2, lost=lost))
        keeper = await two.try_acquire(request(name, kind="semaphore", permits=2))
        assert victim is not None and keeper is not None
        await admin.execute("SELECT pg_terminate_backend($1, 5000)", victim.pid)
        with anyio.fail_after(5):
            while not lost:  # noqa: ASYNC110
                await anyio.sleep(0.01)
        (outcome,) = await one.renew([victim])
        assert isinstance(outcome, Lost)
        (outcome,) = await two.renew([keeper])
        assert isinstance(outcome, Renewed)
        assert len((await two.inspect(name, "semaphore")).holders) == 1
        again = await one.try_acquire(request(name, kind="semaphore", permits=2))
        assert again is not None
        assert await one.try_acquire(request(name, kind="semaphore", permits=2)) is None
        await one.release(victim)  # already gone: silent
        await one.release(again)
        await two.release(keeper)
    await nothing_left(admin, app, name)


async def test_a_silent_permit_holder_loses_only_its_permit_after_its_ttl(
    connect: Callable[..., PostgresBackend], name: str, admin: asyncpg.Connection, app: str
) -> None:
    lost: list[str] = []
    async with connect() as one, connect() as two:
        silent = await one.try_acquire(
            request(name, kind="semaphore", permits=2, ttl=0.5, lost=lost)
        )
        keeper = await two.try_acquire(request(name, kind="semaphore", permits=2, ttl=0.5))
        assert silent is not None and keeper is not None
        # Only the keeper renews; the server ends the silent one's session after its ttl.
        with anyio.fail_after(3):
            while not lost:
                (outcome,) = await two.renew([keeper])
                assert isinstance(outcome, Renewed)
                await anyio.sleep(0.1)
        taken = await two.try_acquire(request(name, kind="semaphore", permits=2, ttl=0.5))
        assert taken is not None
        await two.release(taken)
        await two.release(keeper)
        await one.release(silent)
    await nothing_left(admin, app, name)


async def test_cancelled_semaphore_acquires_leave_nothing(
    connect: Callable[..., PostgresBackend], name: str, admin: asyncpg.Connection, app: str
) -> None:
    async with connect() as one, connect() as two:
        holder = await two.try_acquire(request(name, kind="semaphore", permits=1))
        assert holder is not None
        for delay in (0.0, 0.001, 0.003, 0.01, 0.05):
            with anyio.move_on_after(delay):
                await one.acquire(request(name, kind="semaphore", permits=1))
                pytest.fail("got a second permit of one")
        await two.release(holder)
        # Cancels that land just as a permit comes free.
        for delay in (0.0, 0.001, 0.002, 0.004, 0.008):
            with anyio.move_on_after(delay):
                grant = await one.acquire(request(name, kind="semaphore", permits=1))
                await one.release(grant)
    await nothing_left(admin, app, name)


# -- elections ------------------------------------------------------------------------------------


async def test_the_leader_and_its_value_are_shown_and_terms_rise(
    connect: Callable[..., PostgresBackend], name: str, admin: asyncpg.Connection, app: str
) -> None:
    async with connect() as one, connect() as two:
        assert not (await two.inspect(name, "election")).held
        term = await one.try_acquire(request(name, kind="election", value=b"node-1"))
        assert term is not None
        info = await two.inspect(name, "election")
        assert info.held and info.value == b"node-1" and info.kind == "election"
        assert info.token == term.token and info.owner == term.owner
        assert len(info.holders) == 1 and info.holders[0].value == b"node-1"
        # The lock of the same name is another thing.
        assert not (await two.inspect(name)).held
        assert await two.try_acquire(request(name, kind="election", value=b"node-2")) is None

        async def campaign() -> PostgresGrant:
            return await two.acquire(request(name, kind="election", value=b"node-2"))

        async with anyio.create_task_group() as tg:
            grants: list[PostgresGrant] = []

            async def run() -> None:
                grants.append(await campaign())

            tg.start_soon(run)
            with anyio.fail_after(5):
                while (await one.inspect(name, "election")).waiters != 1:  # noqa: ASYNC110
                    await anyio.sleep(0.01)
            await one.release(term)
        (second,) = grants
        assert second.token is not None and term.token is not None and second.token > term.token
        info = await one.inspect(name, "election")
        assert info.value == b"node-2" and info.token == second.token
        await two.release(second)
        assert not (await one.inspect(name, "election")).held
    await nothing_left(admin, app, name)


async def test_a_crashed_leaders_row_is_never_shown(
    connect: Callable[..., PostgresBackend], name: str, admin: asyncpg.Connection, app: str
) -> None:
    async with connect() as one, connect() as two:
        term = await one.try_acquire(request(name, kind="election", value=b"gone"))
        assert term is not None
        await admin.execute("SELECT pg_terminate_backend($1, 5000)", term.pid)
        with anyio.fail_after(5):
            while (await two.inspect(name, "election")).held:  # noqa: ASYNC110
                await anyio.sleep(0.01)
        info = await two.inspect(name, "election")
        assert info.value is None and info.owner is None
        # The stale row was deleted by the inspect that found no leader.
        assert not await admin.fetchval(
            "SELECT count(*) FROM asynclock_holders WHERE held = $1",
            kind_key(name, "election"),
        )
        nxt = await two.try_acquire(request(name, kind="election", value=b"next"))
        assert nxt is not None
        assert (await one.inspect(name, "election")).value == b"next"
        await two.release(nxt)
        await one.release(term)
    await nothing_left(admin, app, name)


async def test_wait_for_change_returns_at_a_change_and_by_the_timeout(
    connect: Callable[..., PostgresBackend], name: str, admin: asyncpg.Connection, app: str
) -> None:
    async with connect() as one, connect() as observer:
        seen = await observer.inspect(name, "election")
        started = anyio.current_time()
        await observer.wait_for_change(name, "election", seen, 0.3)
        assert 0.25 < anyio.current_time() - started < 1.0

        async def lead_later() -> None:
            await anyio.sleep(0.2)
            grant = await one.try_acquire(request(name, kind="election", value=b"v"))
            assert grant is not None
            await anyio.sleep(0.2)
            await one.release(grant)

        async with anyio.create_task_group() as tg:
            tg.start_soon(lead_later)
            started = anyio.current_time()
            await observer.wait_for_change(name, "election", seen, 5)
            assert anyio.current_time() - started < 0.45  # the NOTIFY, not the poll
            seen = await observer.inspect(name, "election")
            assert seen.value == b"v"
            started = anyio.current_time()
            await observer.wait_for_change(name, "election", seen, 5)
            assert anyio.current_time() - started < 0.45
            assert not (await observer.inspect(name, "election")).held
        # A change before the call (seen is stale) returns at once.
        started = anyio.current_time()
        await observer.wait_for_change(name, "election", seen, 5)
        assert anyio.current_time() - started < 0.2
        # Cancelled: nothing stays registered.
        with anyio.move_on_after(0.05):
            await observer.wait_for_change(name, "election", seen, 5)
        assert not observer._queue.observers
    await nothing_left(admin, app, name)


async def test_permits_class_and_keys_are_in_their_own_spaces(name: str) -> None:
    keys = {kind_key(name, kind) for kind in ("lock", "semaphore", "election")}
    assert len(keys) == 3
    assert -(2**31) <= permits_class(name) < 2**31
    assert all(0 <= part < 2**32 for part in split(kind_key(name, "election")))


# -- holders in processes of their own ------------------------------------------------------------


async def start_holder(url: str, kind: str, name: str, ttl: float) -> tuple[Process, Any]:
    process = await anyio.open_process(
        [sys.executable, "-c", HOLDER, url, kind, name, str(ttl)], cwd=ROOT, stderr=None
    )
    assert process.stdout is not None
    output = BufferedByteReceiveStream(process.stdout)
    with anyio.fail_after(20):
        assert await output.receive_until(b"\n", 100) == b"held"
    return process, output


async def test_a_killed_permit_holder_frees_exactly_its_permit_at_once(
    postgres_server: PostgresServer, name: str
) -> None:
    async with asynclock.connect(postgres_server.url) as locks:
        semaphore = locks.semaphore(name, permits=2)
        keeper = await semaphore.acquire(ttl=30)
        process, _ = await start_holder(postgres_server.url, "semaphore", name, 30.0)
        async with process:
            assert await semaphore.try_acquire(ttl=30) is None
            process.kill()
            killed_at = anyio.current_time()
            await process.wait()
            with anyio.fail_after(2):
                while (again := await semaphore.try_acquire(ttl=30)) is None:  # noqa: ASYNC110
                    await anyio.sleep(0.01)
        assert anyio.current_time() - killed_at < 1.0
        assert keeper.held and not keeper.lost
        info = await semaphore.inspect()
        assert len(info.holders) == 2 and info.permits == 2
        await again.release()
        await keeper.release()


async def test_a_paused_leader_is_replaced_after_its_ttl_and_stops_when_it_resumes(
    postgres_server: PostgresServer, name: str
) -> None:
    ttl = 1.5
    process, output = await start_holder(postgres_server.url, "election", name, ttl)
    async with process, asynclock.connect(postgres_server.url) as other:
        election = other.election(name)
        first = await election.leader()
        assert first is not None and first.value == b"child"
        try:
            os.kill(process.pid, signal.SIGSTOP)
            stopped_at = anyio.current_time()
            async with election.campaign(b"parent", ttl=10, timeout=ttl + 2) as term:
                assert anyio.current_time() - stopped_at >= ttl * 2 / 3
                assert first.token is not None and term.token is not None
                assert term.token > first.token
                leader = await election.leader()
                assert leader is not None and leader.value == b"parent"
                os.kill(process.pid, signal.SIGCONT)
                with anyio.fail_after(5):
                    assert await output.receive_until(b"\n", 100) == b"lost"
                assert not term.lost
        finally:
            os.kill(process.pid, signal.SIGCONT)
        with anyio.fail_after(10):
            assert await process.wait() == 0


async def test_a_user_who_may_not_create_the_holders_table_still_locks_exclusively(
    postgres_server: PostgresServer, admin: asyncpg.Connection, name: str, caplog: Any
) -> None:
    """An upgrade must not break a locked-down deployment that made the sequence and the queue
    table as their owner: only the new kinds need the new table, and they say so."""
    role, schema = f"locker_{uuid.uuid4().hex[:8]}", f"s_{uuid.uuid4().hex[:8]}"
    await admin.execute(f"CREATE SCHEMA {schema}")
    async with PostgresBackend.from_url(postgres_server.url, {"schema": schema}) as owner:
        assert owner._holders_ready  # made them all (as a superuser)
    await admin.execute(f"DROP TABLE {schema}.asynclock_holders")
    await admin.execute(f"CREATE ROLE {role} LOGIN")
    await admin.execute(f"GRANT USAGE ON SCHEMA {schema} TO {role}")
    await admin.execute(f"GRANT USAGE ON SEQUENCE {schema}.asynclock_token_seq TO {role}")
    await admin.execute(
        f"GRANT SELECT, INSERT, UPDATE, DELETE ON {schema}.asynclock_waiters TO {role}"
    )
    url = f"postgresql://{role}@{postgres_server.address}/postgres"
    async with asynclock.connect(url, schema=schema) as locks:
        assert "asynclock_holders" in caplog.text
        async with locks.lock(name, ttl=5) as lease:
            assert lease.token is not None
        with pytest.raises(asynclock.UnsupportedFeature, match="CREATE UNLOGGED TABLE"):
            await locks.try_acquire(name, ttl=5, shared=True)
        with pytest.raises(asynclock.UnsupportedFeature, match="asynclock_holders"):
            await locks.semaphore(name, permits=2).try_acquire(ttl=5)
        with pytest.raises(asynclock.UnsupportedFeature, match="asynclock_holders"):
            async with locks.election(name).campaign(b"x", ttl=5, timeout=1):
                pass


async def test_observers_never_see_a_leader_whose_take_has_not_committed(
    postgres_server: PostgresServer, name: str
) -> None:
    """A hand-over grants the waiting candidate the lock when the leader unlocks, a moment
    before its take commits the leader's row: an observer woken by the release must not see
    a leader without a value then."""
    seen: list[asynclock.Leader | None] = []
    async with (
        asynclock.connect(postgres_server.url) as one,
        asynclock.connect(postgres_server.url) as two,
        asynclock.connect(postgres_server.url) as watcher,
    ):

        async def observe() -> None:
            async for leader in watcher.election(name).observe():
                seen.append(leader)  # noqa: PERF401 (read while it runs)

        async def candidate(locks: asynclock.LockClient, value: bytes, terms: int) -> None:
            for _ in range(terms):
                async with locks.election(name).campaign(value, ttl=5, timeout=10):
                    await anyio.sleep(0.01)

        async with anyio.create_task_group() as tg:
            tg.start_soon(observe)
            async with anyio.create_task_group() as candidates:
                candidates.start_soon(candidate, one, b"one", 15)
                candidates.start_soon(candidate, two, b"two", 15)
            await anyio.sleep(0.1)
            tg.cancel_scope.cancel()
    leaders = [leader for leader in seen if leader is not None]
    assert leaders, seen
    assert all(leader.value in (b"one", b"two") and leader.token for leader in leaders), seen
    tokens = [leader.token or 0 for leader in leaders]
    assert tokens == sorted(tokens)


async def test_a_paused_permit_holder_loses_only_its_permit_and_stops_when_it_resumes(
    postgres_server: PostgresServer, name: str
) -> None:
    ttl = 1.5
    process, output = await start_holder(postgres_server.url, "semaphore", name, ttl)
    async with process, asynclock.connect(postgres_server.url) as other:
        semaphore = other.semaphore(name, permits=2)
        try:
            async with semaphore.lock(ttl=ttl) as keeper:
                os.kill(process.pid, signal.SIGSTOP)
                stopped_at = anyio.current_time()
                async with semaphore.lock(ttl=ttl, timeout=ttl + 2) as freed:
                    assert anyio.current_time() - stopped_at >= ttl * 2 / 3
                    os.kill(process.pid, signal.SIGCONT)
                    with anyio.fail_after(5):
                        assert await output.receive_until(b"\n", 100) == b"lost"
                    assert not freed.lost
                assert keeper.held and not keeper.lost  # renewed all along
        finally:
            os.kill(process.pid, signal.SIGCONT)
        with anyio.fail_after(10):
            assert await process.wait() == 0


@pytest.mark.parametrize("kind", ["shared", "semaphore", "election"])
async def test_native_cancels_at_random_moments_strand_nothing(
    postgres_server: PostgresServer, admin: asyncpg.Connection, app: str, name: str, kind: str
) -> None:
    """Task.cancel() once to three times, at random moments of a take (its transaction, its
    statement, its commit, a wait behind a holder): every hold ends, nothing is left."""
    rng = random.Random(19)
    url = f"{postgres_server.url}?application_name={app}"

    def hold_of(locks: asynclock.LockClient) -> asynclock.LockContext:
        if kind == "shared":
            return locks.lock(name, ttl=5, shared=True)
        if kind == "semaphore":
            return locks.semaphore(name, permits=1).lock(ttl=5)
        return locks.election(name).campaign(b"v", ttl=5)

    async def free(other: asynclock.LockClient) -> bool:
        if kind == "shared":  # free of readers: a writer gets in
            lease = await other.try_acquire(name, ttl=5)
        elif kind == "semaphore":
            lease = await other.semaphore(name, permits=1).try_acquire(ttl=5)
        else:
            return not (await other.inspect(name, "election")).held
        if lease is None:
            return False
        await lease.release()
        return True

    async with asynclock.connect(url) as locks, asynclock.connect(url) as other:

        async def body() -> None:
            async with hold_of(locks):
                await asyncio.sleep(rng.uniform(0, 0.002))

        def blocker_of() -> asynclock.LockContext:
            if kind == "shared":
                return other.lock(name, ttl=5)  # a writer
            if kind == "semaphore":
                return other.semaphore(name, permits=1).lock(ttl=5)
            return other.election(name).campaign(b"b", ttl=5)

        for cycle in range(120):
            async with AsyncExitStack() as stack:
                if cycle % 4 == 3:  # cancel a waiter behind a holder
                    await stack.enter_async_context(blocker_of())
                task = asyncio.create_task(body())
                for _ in range(rng.choice((1, 1, 2, 3))):
                    await asyncio.sleep(rng.uniform(0, 0.004))
                    task.cancel()
                with suppress(asyncio.CancelledError):
                    await task
            with anyio.fail_after(5):
                while not await free(other):  # noqa: ASYNC110 (the server's state)
                    await anyio.sleep(0.005)
    await nothing_left(admin, app, name)


async def test_the_row_of_a_killed_reader_goes_with_the_next_readers(
    postgres_server: PostgresServer, admin: asyncpg.Connection, name: str
) -> None:
    """Nobody releases a killed process's hold: a later reader's take deletes its row (once
    its session is gone), so nothing stays on the server."""
    process, _ = await start_holder(postgres_server.url, "shared", name, 30.0)
    async with process, asynclock.connect(postgres_server.url) as locks:
        rows = "SELECT count(*) FROM asynclock_holders WHERE held = $1"
        assert await admin.fetchval(rows, kind_key(name, "lock")) == 1
        process.kill()
        await process.wait()
        with anyio.fail_after(5):
            while True:
                lease = await locks.acquire(name, ttl=5, shared=True, timeout=5)
                await lease.release()
                if not await admin.fetchval(rows, kind_key(name, "lock")):
                    break
                await anyio.sleep(0.02)
