"""The PostgreSQL backend's shared holds, semaphores and elections, through its Backend methods
against a real server: what the contract suite cannot see (the lane, the two queues, pg_locks,
the holders' table, NOTIFY, terminated sessions, permissions)."""

from __future__ import annotations

import uuid
from typing import Any

import anyio
import pytest

import asynclock
from asynclock.abc import Kind, LockRequest, Lost, Renewed
from asynclock.backends.postgres import PostgresBackend, PostgresGrant
from asynclock.backends.postgres._kinds import kind_key
from tests.contract.backend_postgres import Pg, start_holder, until

pytestmark = pytest.mark.anyio


def request(
    name: str, *, ttl: float = 5.0, lost: list[str] | None = None, **fields: Any
) -> LockRequest:
    """A request of ``name``; ``fields``: kind, shared, permits, value."""
    on_lost = lost.append if lost is not None else lambda reason: None
    return LockRequest(name, ttl, uuid.uuid4().hex, on_lost, **fields)


async def until_waiting(backend: PostgresBackend, name: str, kind: Kind, count: int) -> None:
    async def waiting() -> bool:
        return (await backend.inspect(name, kind)).waiters == count

    await until(waiting, 5)


# -- shared holds ---------------------------------------------------------------------------------


async def test_readers_taking_at_once_all_get_in_their_rows_show_and_a_writer_keeps_none(
    pg: Pg,
) -> None:
    # Readers sharing and excluding writers: the contract's (test_primitives.py).
    async with pg.backend() as one, pg.backend() as two:
        # A second reader's try while the first one's take is still on the (new) lane goes to a
        # connection of its own, as after it: not refused as if a writer held the lock.
        grants: list[PostgresGrant | None] = []

        async def take() -> None:
            grants.append(await one.try_acquire(request(pg.name, shared=True)))

        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(take)
        assert len(grants) == 3
        for grant in grants:
            assert grant is not None
            await one.release(grant)
        first = await one.try_acquire(request(pg.name, shared=True))
        # Same client, same ttl: the lane holds it shared already, so a connection of its own.
        second = await one.try_acquire(request(pg.name, shared=True))
        third = await two.try_acquire(request(pg.name, shared=True))
        assert first is not None and second is not None and third is not None
        assert first.lane is not None and second.lane is None
        info = await two.inspect(pg.name)
        assert [(h.shared, h.token, h.owner) for h in info.holders] == [
            (True, g.token, g.owner) for g in (first, second, third)
        ]
        assert (info.owner, info.token) == (first.owner, first.token)
        for grant in (first, second, third):
            await (one if grant is not third else two).release(grant)
        writer = await two.try_acquire(request(pg.name))
        assert writer is not None
        info = await one.inspect(pg.name)
        assert info.held and info.holders == () and info.owner is None
        await two.release(writer)
    await pg.nothing_left()


async def test_a_waiting_writer_is_not_jumped_by_later_readers_in_the_queue_table(pg: Pg) -> None:
    """The contract checks it through the server's queue; here every waiter is in the table."""
    order: list[str] = []
    async with pg.backend(max_waiting=0) as one, pg.backend(max_waiting=0) as two:
        reader = await one.try_acquire(request(pg.name, shared=True))
        assert reader is not None

        async def take(backend: PostgresBackend, label: str, shared: bool) -> None:
            grant = await backend.acquire(request(pg.name, shared=shared))
            order.append(label)
            await anyio.sleep(0.05)
            await backend.release(grant)

        async with anyio.create_task_group() as tg:
            tg.start_soon(take, two, "writer", False)
            await until_waiting(one, pg.name, "lock", 1)
            # A waiting writer: new readers neither try past it nor wait ahead of it.
            assert await one.try_acquire(request(pg.name, shared=True)) is None
            assert await two.try_acquire(request(pg.name, shared=True)) is None
            tg.start_soon(take, one, "reader 1", True)
            tg.start_soon(take, two, "reader 2", True)
            await until_waiting(one, pg.name, "lock", 3)
            await one.release(reader)
        assert order[0] == "writer"
        assert sorted(order[1:]) == ["reader 1", "reader 2"]
    await pg.nothing_left()


# -- semaphores -----------------------------------------------------------------------------------


async def test_other_permits_are_refused_while_held_or_waited_for_and_a_permit_ends_alone(
    pg: Pg,
) -> None:
    """The contract checks a held semaphore; here one another client waits for, then holds
    until told (a waiter that let go at once left a free semaphore to the second check)."""
    name = pg.name
    async with pg.backend() as one, pg.backend() as two:
        first = await one.try_acquire(request(name, kind="semaphore", permits=1))
        assert first is not None
        waiter_in = anyio.Event()
        waiter_may_go = anyio.Event()

        async def wait() -> None:
            grant = await two.acquire(request(name, kind="semaphore", permits=1))
            waiter_in.set()
            await waiter_may_go.wait()  # holds until the refusal below was checked
            await two.release(grant)

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait)
            await until_waiting(one, name, "semaphore", 1)
            with pytest.raises(asynclock.InvalidArgument, match="has 1 permits"):
                await one.try_acquire(request(name, kind="semaphore", permits=5))
            await one.release(first)  # the waiter, with 1, takes it and holds
            with anyio.fail_after(5):
                await waiter_in.wait()
            with pytest.raises(asynclock.InvalidArgument, match="has 1 permits"):
                await one.try_acquire(request(name, kind="semaphore", permits=5))
            waiter_may_go.set()
        # Nobody holds or waits: any number starts afresh.
        fresh = await one.try_acquire(request(name, kind="semaphore", permits=5))
        assert fresh is not None
        await one.release(fresh)
        # A terminated permit frees exactly that permit.
        lost: list[str] = []
        victim = await one.try_acquire(request(name, kind="semaphore", permits=2, lost=lost))
        keeper = await two.try_acquire(request(name, kind="semaphore", permits=2))
        assert victim is not None and keeper is not None
        assert victim.key != keeper.key  # each permit is a slot of its own
        await pg.admin.execute("SELECT pg_terminate_backend($1, 5000)", victim.pid)
        await until(lambda: lost, 5)
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
    await pg.nothing_left()


async def test_a_permit_taken_after_other_takes_queued_before_it_starts_its_lease_then(
    pg: Pg,
) -> None:
    """Takes of one semaphore are serialised by a transaction lock; one that waits there longer
    than its ttl (20 contending takes did, under load) gets a lease that starts with its take,
    not one that expired before its body began."""
    async with pg.backend() as one:
        await pg.admin.execute("BEGIN")
        await pg.admin.execute("SELECT pg_advisory_xact_lock($1)", kind_key(pg.name, "semaphore"))
        async with anyio.create_task_group() as tg:
            grants: list[PostgresGrant | None] = []

            async def take() -> None:
                grants.append(await one.try_acquire(request(pg.name, ttl=1.0, kind="semaphore")))

            tg.start_soon(take)
            await anyio.sleep(1.2)  # a ttl and more
            released_at = anyio.current_time()
            await pg.admin.execute("COMMIT")
        (grant,) = grants
        assert grant is not None and grant.valid_from > released_at
        await one.release(grant)
    await pg.nothing_left()


# -- elections ------------------------------------------------------------------------------------


async def test_a_hand_over_is_shown_and_notified_and_a_crashed_leaders_row_never_shown(
    pg: Pg,
) -> None:
    """The waiting candidate leads on a connection of its own, whose release NOTIFYs observers
    too: its key is the NOTIFY's only use of the parameter, which asyncpg then typed as text and
    refused an int for (the release failed with a warning, closed the connection, and observers
    heard nothing)."""
    name = pg.name
    key = kind_key(name, "election")
    heard: list[str] = []
    async with pg.backend() as one, pg.backend() as two:
        term = await one.try_acquire(request(name, kind="election", value=b"node-1"))
        assert term is not None
        # What the leader's term shows: the contract's (test_primitives.py).
        assert await two.try_acquire(request(name, kind="election", value=b"node-2")) is None
        grants: list[PostgresGrant] = []

        async def campaign() -> None:
            grants.append(await two.acquire(request(name, kind="election", value=b"node-2")))

        async with anyio.create_task_group() as tg:
            tg.start_soon(campaign)
            await until_waiting(one, name, "election", 1)
            await one.release(term)
        (second,) = grants
        assert second.lane is None  # it waited in the server's queue: a dedicated connection
        assert second.token is not None and term.token is not None and second.token > term.token
        info = await one.inspect(name, "election")
        assert info.value == b"node-2" and info.token == second.token
        await pg.admin.add_listener("asynclock public", lambda *args: heard.append(args[3]))
        await two.release(second)
        await until(lambda: str(key) in heard, 5)  # asyncpg calls the listener
        assert not (await one.inspect(name, "election")).held
        # A crashed leader's row is never shown.
        crashed = await one.try_acquire(request(name, kind="election", value=b"gone"))
        assert crashed is not None
        await pg.admin.execute("SELECT pg_terminate_backend($1, 5000)", crashed.pid)
        with anyio.fail_after(5):
            while (await two.inspect(name, "election")).held:  # noqa: ASYNC110
                await anyio.sleep(0.01)
        info = await two.inspect(name, "election")
        assert info.value is None and info.owner is None
        # The stale row was deleted by the inspect that found no leader.
        assert not await pg.admin.fetchval(
            "SELECT count(*) FROM asynclock_holders WHERE held = $1", key
        )
        nxt = await two.try_acquire(request(name, kind="election", value=b"next"))
        assert nxt is not None
        assert (await one.inspect(name, "election")).value == b"next"
        await two.release(nxt)
        await one.release(crashed)
    await pg.nothing_left()


async def test_wait_for_change_returns_at_a_change_and_by_the_timeout(pg: Pg) -> None:
    name = pg.name
    async with pg.backend() as one, pg.backend() as observer:
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
    await pg.nothing_left()


async def test_observers_never_see_a_leader_whose_take_has_not_committed(pg: Pg) -> None:
    """A hand-over grants the waiting candidate the lock when the leader unlocks, a moment
    before its take commits the leader's row: an observer woken by the release must not see
    a leader without a value then."""
    seen: list[asynclock.Leader | None] = []
    async with pg.connect() as one, pg.connect() as two, pg.connect() as watcher:

        async def observe() -> None:
            async for leader in watcher.election(pg.name).observe():
                seen.append(leader)  # noqa: PERF401 (read while it runs)

        async def candidate(locks: asynclock.LockClient, value: bytes, terms: int) -> None:
            for _ in range(terms):
                async with locks.election(pg.name).campaign(value, ttl=5, timeout=10):
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


# -- sessions that end, users who may not -------------------------------------------------------


@pytest.mark.expect_log(r"permission denied for schema .*need the table .*asynclock_holders")
async def test_a_user_who_may_not_create_the_holders_table_still_locks_exclusively(
    pg: Pg,
) -> None:
    """An upgrade must not break a locked-down deployment that made the sequence and the queue
    table as their owner: only the new kinds need the new table, and they say so."""
    role, schema = f"locker_{uuid.uuid4().hex[:8]}", f"s_{uuid.uuid4().hex[:8]}"
    await pg.admin.execute(f"CREATE SCHEMA {schema}")
    async with PostgresBackend.from_url(pg.server.url, {"schema": schema}) as owner:
        assert owner._holders_ready  # made them all (as a superuser)
    await pg.admin.execute(f"DROP TABLE {schema}.asynclock_holders")
    await pg.admin.execute(
        f"CREATE ROLE {role} LOGIN; GRANT USAGE ON SCHEMA {schema} TO {role};"
        f" GRANT USAGE ON SEQUENCE {schema}.asynclock_token_seq TO {role};"
        f" GRANT SELECT, INSERT, UPDATE, DELETE ON {schema}.asynclock_waiters TO {role}"
    )
    url = f"postgresql://{role}@{pg.server.address}/postgres"
    async with asynclock.connect(url, schema=schema) as locks:
        async with locks.lock(pg.name, ttl=5) as lease:
            assert lease.token is not None
        with pytest.raises(asynclock.UnsupportedFeature, match="CREATE UNLOGGED TABLE"):
            await locks.try_acquire(pg.name, ttl=5, shared=True)
        with pytest.raises(asynclock.UnsupportedFeature, match="asynclock_holders"):
            await locks.semaphore(pg.name, permits=2).try_acquire(ttl=5)
        with pytest.raises(asynclock.UnsupportedFeature, match="asynclock_holders"):
            async with locks.election(pg.name).campaign(b"x", ttl=5, timeout=1):
                pass


async def test_a_killed_reader_frees_the_lock_at_once_and_its_row_goes_with_the_next_readers(
    pg: Pg,
) -> None:
    """Nobody releases a killed process's hold: its session ends with its socket, and a later
    reader's take deletes its row (once its session is gone), so nothing stays on the server."""
    rows = "SELECT count(*) FROM asynclock_holders WHERE held = $1"
    process, _ = await start_holder(pg.server.url, pg.name, shared=True)
    async with process, pg.connect() as locks:
        assert await pg.holders()
        assert await pg.admin.fetchval(rows, kind_key(pg.name, "lock")) == 1
        process.kill()
        killed_at = anyio.current_time()
        await process.wait()
        await pg.until_free(2)
        assert anyio.current_time() - killed_at < 1.0
        with anyio.fail_after(5):
            while True:
                lease = await locks.acquire(pg.name, ttl=5, shared=True, timeout=5)
                await lease.release()
                if not await pg.admin.fetchval(rows, kind_key(pg.name, "lock")):
                    break
                await anyio.sleep(0.02)
