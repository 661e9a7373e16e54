"""The embedded backend's shared holds, semaphores, elections and extend(), through its Backend
calls, in one process and across real OS processes."""

from __future__ import annotations

import asyncio
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import closing
from pathlib import Path

import anyio
import pytest

import asynclock
from asynclock.abc import Kind, LockRequest, Lost, Renewed
from asynclock.backends.sqlite import SQLiteBackend
from asynclock.backends.sqlite.backend import SQLiteGrant

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[2]


def request(
    name: str,
    *,
    ttl: float = 5.0,
    kind: Kind = "lock",
    shared: bool = False,
    permits: int = 1,
    value: bytes = b"",
) -> LockRequest:
    return LockRequest(
        name,
        ttl,
        uuid.uuid4().hex,
        lambda reason: None,
        kind=kind,
        shared=shared,
        permits=permits,
        value=value,
    )


def rows(path: Path) -> list[tuple[str, ...]]:
    """Every hold and waiter row in the file, live or not."""
    with closing(sqlite3.connect(path)) as db:
        return [
            *db.execute("SELECT 'lock', name FROM asynclock_locks"),
            *db.execute("SELECT kind, name FROM asynclock_holds"),
            *db.execute("SELECT 'queue', kind, name FROM asynclock_queue"),
        ]


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "locks.db"


@pytest.fixture
async def store(path: Path) -> AsyncIterator[SQLiteBackend]:
    async with SQLiteBackend(str(path)) as backend:
        yield backend
    assert rows(path) == [], "rows left behind"


@pytest.fixture
async def other(path: Path) -> AsyncIterator[SQLiteBackend]:
    """A second client of the same file (as another process would be)."""
    async with SQLiteBackend(str(path)) as backend:
        yield backend


async def wait_until_queued(backend: SQLiteBackend, name: str, count: int, kind: Kind) -> None:
    with anyio.fail_after(5):
        while (await backend.inspect(name, kind)).waiters != count:  # noqa: ASYNC110
            await anyio.sleep(0.005)


# -- shared holds ---------------------------------------------------------------------------


async def test_readers_share_and_exclude_a_writer(
    store: SQLiteBackend, other: SQLiteBackend
) -> None:
    readers = [await store.try_acquire(request("rw", shared=True)) for _ in range(3)]
    readers.append(await other.try_acquire(request("rw", shared=True)))
    assert all(readers)
    assert await other.try_acquire(request("rw")) is None
    info = await store.inspect("rw")
    assert info.held and len(info.holders) == 4 and all(h.shared for h in info.holders)
    tokens = [holder.token or 0 for holder in info.holders]
    assert tokens == sorted(tokens) and info.token == tokens[0]
    for reader in readers:
        assert reader is not None
        await (store if reader in readers[:3] else other).release(reader)
    writer = await other.try_acquire(request("rw"))
    assert writer is not None and writer.token is not None
    assert writer.token > max(tokens)
    assert await store.try_acquire(request("rw", shared=True)) is None
    await other.release(writer)


async def test_a_waiting_writer_holds_back_later_readers(
    store: SQLiteBackend, other: SQLiteBackend
) -> None:
    reader = await store.try_acquire(request("wp", shared=True))
    assert reader is not None
    order: list[str] = []
    async with anyio.create_task_group() as tg:

        async def take(who: str, backend: SQLiteBackend, shared: bool) -> None:
            grant = await backend.acquire(request("wp", shared=shared))
            order.append(who)
            await anyio.sleep(0.05)
            await backend.release(grant)

        tg.start_soon(take, "writer", other, False)
        await wait_until_queued(store, "wp", 1, "lock")
        # The writer waits in the other client: a new reader here neither gets in at once...
        assert await store.try_acquire(request("wp", shared=True)) is None
        # ...nor before the writer when it waits.
        tg.start_soon(take, "reader", store, True)
        await wait_until_queued(store, "wp", 2, "lock")
        await anyio.sleep(0.1)
        assert order == []
        await store.release(reader)
    assert order == ["writer", "reader"]


async def test_tokens_rise_across_shared_and_exclusive_holds(store: SQLiteBackend) -> None:
    tokens: list[int] = []
    for shared in (True, False, True, True, False):
        grant = await store.acquire(request("tok", shared=shared))
        tokens.append(grant.token or 0)
        await store.release(grant)
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)


# -- semaphores -----------------------------------------------------------------------------


async def test_a_semaphore_has_n_permits_each_its_own_lease(
    store: SQLiteBackend, other: SQLiteBackend
) -> None:
    permits = [await store.try_acquire(request("s", kind="semaphore", permits=3)) for _ in range(3)]
    assert all(permits)
    assert await other.try_acquire(request("s", kind="semaphore", permits=3)) is None
    # The lock "s" is another namespace.
    lock = await other.try_acquire(request("s"))
    assert lock is not None
    info = await store.inspect("s", "semaphore")
    assert info.permits == 3 and len(info.holders) == 3 and info.kind == "semaphore"
    assert len({h.owner for h in info.holders}) == 3
    first = permits[0]
    assert isinstance(first, SQLiteGrant)
    # Each permit renews and releases on its own.
    assert isinstance((await store.renew([first]))[0], Renewed)
    await store.release(first)
    fourth = await other.try_acquire(request("s", kind="semaphore", permits=3))
    assert fourth is not None
    for grant in permits[1:]:
        assert grant is not None
        await store.release(grant)
    await other.release(fourth)
    await other.release(lock)
    assert (await store.inspect("s", "semaphore")).permits is None


async def test_permits_that_differ_are_refused_and_leave_nothing(
    path: Path, store: SQLiteBackend, other: SQLiteBackend
) -> None:
    held = await store.acquire(request("m", kind="semaphore", permits=2))
    before = rows(path)
    with pytest.raises(asynclock.InvalidArgument, match=r"has 2 permits.*asked for 3"):
        await other.try_acquire(request("m", kind="semaphore", permits=3))
    with pytest.raises(asynclock.InvalidArgument, match="has 2 permits"):
        await other.acquire(request("m", kind="semaphore", permits=5))
    assert rows(path) == before
    await store.release(held)
    # Nobody holds or waits: any number starts afresh.
    grant = await other.acquire(request("m", kind="semaphore", permits=5))
    await other.release(grant)


async def test_semaphore_waiters_are_served_in_order_across_clients(
    store: SQLiteBackend, other: SQLiteBackend
) -> None:
    holders = [await store.acquire(request("q", kind="semaphore", permits=2)) for _ in range(2)]
    tokens: dict[int, int | None] = {}

    async def wait(index: int, backend: SQLiteBackend) -> None:
        grant = await backend.acquire(request("q", kind="semaphore", permits=2))
        tokens[index] = grant.token  # in the order of the grants (the two clients' threads
        await anyio.sleep(0.02)  # may hand their results back in either order)
        await backend.release(grant)

    async with anyio.create_task_group() as tg:
        for index in range(6):
            tg.start_soon(wait, index, (store, other)[index % 2])
            await wait_until_queued(store, "q", index + 1, "semaphore")
        for grant in holders:
            await store.release(grant)
    # FIFO: a waiter is only overtaken by one that could be granted at the same moment, that
    # is one fewer than the permits behind it at most.
    for early in range(6):
        for late in range(early + 2, 6):
            assert (tokens[early] or 0) < (tokens[late] or 0), tokens


# -- elections ------------------------------------------------------------------------------


async def test_an_election_keeps_the_leaders_value(
    store: SQLiteBackend, other: SQLiteBackend
) -> None:
    assert not (await store.inspect("e", "election")).held
    term = await store.acquire(request("e", kind="election", value=b"node-1"))
    assert await other.try_acquire(request("e", kind="election", value=b"node-2")) is None
    info = await other.inspect("e", "election")
    assert info.held and info.kind == "election" and info.value == b"node-1"
    assert info.token == term.token and info.owner == term.owner
    assert [h.value for h in info.holders] == [b"node-1"]
    async with anyio.create_task_group() as tg:
        terms: list[SQLiteGrant] = []

        async def campaign() -> None:
            terms.append(await other.acquire(request("e", kind="election", value=b"node-2")))

        tg.start_soon(campaign)
        await wait_until_queued(store, "e", 1, "election")
        await store.release(term)
    info = await store.inspect("e", "election")
    assert info.value == b"node-2" and info.token is not None and term.token is not None
    assert info.token > term.token
    await other.release(terms[0])


async def test_wait_for_change_returns_at_a_local_release(store: SQLiteBackend) -> None:
    term = await store.acquire(request("c", kind="election", value=b"x"))
    seen = await store.inspect("c", "election")
    async with anyio.create_task_group() as tg:
        tg.start_soon(store.release, term)
        started = anyio.current_time()
        await store.wait_for_change("c", "election", seen, 5.0)
    assert anyio.current_time() - started < 1.0
    started = anyio.current_time()
    await store.wait_for_change("c", "election", seen, 0.05)
    assert anyio.current_time() - started < 1.0


# -- extend ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["lock", "shared", "semaphore", "election"])
async def test_extend_changes_the_ttl_of_one_lease_and_renewals_keep_it(
    store: SQLiteBackend, kind: str
) -> None:
    asked = (
        request("x", ttl=1.0, shared=True)
        if kind == "shared"
        else request("x", ttl=1.0, kind=kind, permits=2)  # type: ignore[arg-type]
    )
    grant = await store.acquire(asked)
    outcome = await store.extend(grant, 30.0)
    assert isinstance(outcome, Renewed) and outcome.ttl == 30.0
    assert isinstance((await store.renew([grant]))[0], Renewed)
    info = await store.inspect("x", grant.kind)
    assert info.expires_in is not None and 25 < info.expires_in <= 30
    assert isinstance(await store.extend(grant, 0.5), Renewed)
    info = await store.inspect("x", grant.kind)
    assert info.expires_in is not None and info.expires_in <= 0.5
    await anyio.sleep(0.6)
    assert isinstance(await store.extend(grant, 30.0), Lost)
    await store.release(grant)


# -- cancellation ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["lock", "shared", "semaphore", "election"])
async def test_a_cancelled_waiter_leaves_no_row(
    path: Path, store: SQLiteBackend, other: SQLiteBackend, kind: str
) -> None:
    def ask() -> LockRequest:
        if kind == "shared":
            return request("z", shared=True)
        return request("z", kind=kind)  # type: ignore[arg-type]

    blocker = await store.acquire(request("z", kind=ask().kind))
    for _ in range(3):
        with anyio.move_on_after(0.05):
            await other.acquire(ask())
    await store.release(blocker)
    assert rows(path) == []


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_native_cancellation_of_waiters_leaves_no_row(
    path: Path, store: SQLiteBackend, other: SQLiteBackend
) -> None:
    blocker = await store.acquire(request("n", kind="semaphore", permits=1))
    for round_ in range(30):
        task = asyncio.ensure_future(other.acquire(request("n", kind="semaphore", permits=1)))
        await asyncio.sleep(0.001 * (round_ % 7))
        for _ in range(1 + round_ % 3):
            task.cancel()
            await asyncio.sleep(0)
        with pytest.raises(asyncio.CancelledError):
            await task
    await store.release(blocker)
    assert rows(path) == []


# -- across processes -------------------------------------------------------------------------

_WORKER = textwrap.dedent(
    """
    import sys, uuid, anyio
    from asynclock.abc import LockRequest
    from asynclock.backends.sqlite import SQLiteBackend

    async def main(path, name, kind, ttl, extra):
        async with SQLiteBackend(path) as backend:
            grant = await backend.acquire(LockRequest(
                name, ttl, uuid.uuid4().hex, lambda reason: None, kind=kind,
                shared=extra == "shared", permits=int(extra) if kind == "semaphore" else 1,
                value=extra.encode() if kind == "election" else b""))
            print("held", grant.token, flush=True)
            if sys.argv[6] == "renew":
                while True:
                    await anyio.sleep(ttl / 3)
                    await backend.renew([grant])
            await anyio.sleep_forever()

    anyio.run(main, sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), sys.argv[5])
    """
)


Spawn = Callable[..., subprocess.Popen[str]]


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    started: list[subprocess.Popen[str]] = []

    def start(*args: str) -> subprocess.Popen[str]:
        process = subprocess.Popen(
            [sys.executable, "-c", _WORKER, *args], cwd=ROOT, stdout=subprocess.PIPE, text=True
        )
        started.append(process)
        return process

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait()
        if process.stdout is not None:
            process.stdout.close()


def held_line(process: subprocess.Popen[str]) -> int:
    assert process.stdout is not None
    line = process.stdout.readline().split()
    assert line and line[0] == "held", line
    return int(line[1])


async def test_a_killed_process_frees_exactly_its_permit_within_its_ttl(
    path: Path, store: SQLiteBackend, spawn: Spawn
) -> None:
    ttl = 1.0
    crashing = spawn(str(path), "p", "semaphore", str(ttl), "3", "none")
    living = spawn(str(path), "p", "semaphore", str(ttl), "3", "renew")
    await anyio.to_thread.run_sync(held_line, crashing)
    await anyio.to_thread.run_sync(held_line, living)
    mine = await store.acquire(request("p", ttl=10, kind="semaphore", permits=3))
    assert await store.try_acquire(request("p", ttl=ttl, kind="semaphore", permits=3)) is None
    crashing.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    with anyio.fail_after(5):
        freed = await store.acquire(request("p", ttl=10, kind="semaphore", permits=3))
    assert time.monotonic() - killed_at <= ttl + 0.3
    await store.renew([mine, freed])
    # The living process kept its permit: the semaphore is full again.
    assert await store.try_acquire(request("p", ttl=ttl, kind="semaphore", permits=3)) is None
    assert len((await store.inspect("p", "semaphore")).holders) == 3
    living.send_signal(signal.SIGKILL)
    await store.release(mine)
    await store.release(freed)
    await anyio.sleep(ttl + 0.1)
    with closing(sqlite3.connect(path)) as db, db:
        db.execute("DELETE FROM asynclock_holds WHERE expires_at <= ?", (time.monotonic(),))


async def test_a_writer_waiting_in_another_process_holds_back_readers_here(
    path: Path, store: SQLiteBackend, spawn: Spawn
) -> None:
    reader = await store.acquire(request("x", shared=True))
    writer = spawn(str(path), "x", "lock", "5", "exclusive", "renew")
    await wait_until_queued(store, "x", 1, "lock")
    assert await store.try_acquire(request("x", shared=True)) is None
    await store.release(reader)
    token = await anyio.to_thread.run_sync(held_line, writer)
    assert reader.token is not None and token > reader.token
    info = await store.inspect("x")
    assert info.held and not info.holders[0].shared
    writer.send_signal(signal.SIGKILL)
    await anyio.to_thread.run_sync(writer.wait)
    with closing(sqlite3.connect(path)) as db, db:
        db.execute("DELETE FROM asynclock_locks")


async def test_the_leader_of_another_process_is_seen_and_replaced_when_it_dies(
    path: Path, store: SQLiteBackend, spawn: Spawn
) -> None:
    leader = spawn(str(path), "el", "election", "1", "first", "renew")
    first = await anyio.to_thread.run_sync(held_line, leader)
    info = await store.inspect("el", "election")
    assert info.value == b"first" and info.token == first
    leader.send_signal(signal.SIGKILL)
    with anyio.fail_after(5):
        term = await store.acquire(request("el", ttl=1.0, kind="election", value=b"second"))
    assert term.token is not None and term.token > first
    assert (await store.inspect("el", "election")).value == b"second"
    await store.release(term)


# -- files and processes of earlier versions --------------------------------------------------

_OLD_SCHEMA = """
CREATE TABLE asynclock_locks (name TEXT PRIMARY KEY, owner TEXT NOT NULL,
    token INTEGER NOT NULL, boot_id TEXT NOT NULL, expires_at REAL NOT NULL);
CREATE TABLE asynclock_tokens (name TEXT PRIMARY KEY, last INTEGER NOT NULL);
CREATE TABLE asynclock_waiters (key TEXT PRIMARY KEY, value TEXT NOT NULL,
    boot_id TEXT NOT NULL, expires_at REAL NOT NULL);
"""


async def test_an_earlier_versions_file_and_exclusive_row_are_honoured(path: Path) -> None:
    """A file made by an earlier version gains the new tables; an exclusive lock taken by a
    process of that version (its row, its counter) excludes writers and readers alike, and
    tokens go on from its counter."""
    from asynclock.backends.sqlite._store import BOOT_ID

    with closing(sqlite3.connect(path)) as db, db:
        db.executescript(_OLD_SCHEMA)
        db.execute("INSERT INTO asynclock_tokens VALUES ('old', 41)")
        db.execute(
            "INSERT INTO asynclock_locks VALUES ('old', 'an-old-process', 41, ?, ?)",
            (BOOT_ID, time.monotonic() + 0.5),
        )
    async with SQLiteBackend(str(path)) as backend:
        assert await backend.try_acquire(request("old")) is None
        assert await backend.try_acquire(request("old", shared=True)) is None
        info = await backend.inspect("old")
        assert info.held and info.owner == "an-old-process" and info.token == 41
        with anyio.fail_after(5):
            grant = await backend.acquire(request("old", shared=True))
        assert grant.token == 42
        await backend.release(grant)
    assert rows(path) == []


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_every_kind_runs_on_trio(store: SQLiteBackend, other: SQLiteBackend) -> None:
    reader = await store.acquire(request("t", shared=True))
    permit = await store.acquire(request("t", kind="semaphore", permits=2))
    term = await other.acquire(request("t", kind="election", value=b"v"))
    async with anyio.create_task_group() as tg:
        tg.start_soon(other.acquire, request("t"))
        await wait_until_queued(store, "t", 1, "lock")
        assert await store.try_acquire(request("t", shared=True)) is None
        tg.cancel_scope.cancel()
    assert isinstance(await store.extend(permit, 10.0), Renewed)
    assert (await store.inspect("t", "election")).value == b"v"
    for backend, grant in ((store, reader), (store, permit), (other, term)):
        await backend.release(grant)


async def test_try_acquire_with_other_permits_is_refused_while_this_client_waits(
    store: SQLiteBackend,
) -> None:
    full = await store.acquire(request("pw", kind="semaphore", permits=1))
    async with anyio.create_task_group() as tg:
        tg.start_soon(store.acquire, request("pw", kind="semaphore", permits=1))
        await wait_until_queued(store, "pw", 1, "semaphore")
        # Not a plain "taken" because a task of this client waits: the numbers differ.
        with pytest.raises(asynclock.InvalidArgument, match="has 1 permits"):
            await store.try_acquire(request("pw", kind="semaphore", permits=4))
        assert await store.try_acquire(request("pw", kind="semaphore", permits=1)) is None
        tg.cancel_scope.cancel()
    await store.release(full)


# -- contention across processes, through the client ---------------------------------------

_CONTENDER = textwrap.dedent(
    """
    import sys, time, anyio, asynclock

    async def main(url, mode, tasks, rounds):
        async with asynclock.connect(url) as locks:
            async def one(index):
                for _ in range(rounds):
                    if mode == "semaphore":
                        hold = locks.semaphore("s", permits=2).lock(ttl=5, timeout=60)
                    elif mode == "election":
                        hold = locks.election("e").campaign(value=b"v", ttl=5, timeout=60)
                    else:
                        hold = locks.lock("rw", ttl=5, timeout=60, shared=index % 3 != 0)
                    async with hold as lease:
                        start = time.monotonic()
                        await anyio.sleep(0.005)
                        end = time.monotonic()
                    kind = "r" if lease.shared else "w"
                    print(kind, lease.token, repr(start), repr(end), flush=True)

            async with anyio.create_task_group() as tg:
                for index in range(tasks):
                    tg.start_soon(one, index)

    anyio.run(main, sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    """
)


def contend(path: Path, mode: str, processes: int, tasks: int, rounds: int) -> list[list[str]]:
    started = [
        subprocess.Popen(
            [sys.executable, "-c", _CONTENDER, f"sqlite://{path}", mode, str(tasks), str(rounds)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(processes)
    ]
    lines = []
    for process in started:
        out, _ = process.communicate(timeout=90)
        assert process.returncode == 0
        lines += [line.split() for line in out.splitlines()]
    assert len(lines) == processes * tasks * rounds
    return lines


def most_at_once(holds: list[tuple[float, float]]) -> int:
    # CLOCK_MONOTONIC is one clock for all processes on the host, so holds are comparable.
    edges = sorted([(start, 1) for start, _ in holds] + [(end, -1) for _, end in holds])
    at_once = most = 0
    for _, step in edges:
        at_once += step
        most = max(most, at_once)
    return most


@pytest.mark.parametrize("mode", ["semaphore", "election", "rw"])
def test_processes_contending_keep_the_rules(path: Path, mode: str) -> None:
    lines = contend(path, mode, processes=3, tasks=4, rounds=5)
    holds = [(float(start), float(end)) for _, _, start, end in lines]
    tokens = sorted(int(token) for _, token, _, _ in lines)
    assert len(set(tokens)) == len(tokens)
    if mode == "semaphore":
        assert most_at_once(holds) == 2, "two permits, so two at once (and never three)"
    elif mode == "election":
        assert most_at_once(holds) == 1
        # One leader at a time, each term's token above the one before.
        by_start = sorted(lines, key=lambda line: float(line[2]))
        assert [int(line[1]) for line in by_start] == tokens
    else:
        writes = [(float(s), float(e)) for kind, _, s, e in lines if kind == "w"]
        assert writes and most_at_once(holds) > 1, "readers share"
        for start, end in writes:
            # A writer overlaps no other hold.
            others = [(s, e) for s, e in holds if (s, e) != (start, end)]
            assert all(e <= start or s >= end for s, e in others)
    assert rows(path) == []


async def test_a_stopped_waiter_holds_up_the_queue_for_waiter_ttl_at_most(
    path: Path, store: SQLiteBackend, spawn: Spawn
) -> None:
    """Its row lapses; when it runs again it takes a new place at the back (and gets in)."""
    from asynclock.backends.sqlite._store import WAITER_TTL

    holder = await store.acquire(request("st"))
    waiter = spawn(str(path), "st", "lock", "5", "exclusive", "renew")
    await wait_until_queued(store, "st", 1, "lock")
    waiter.send_signal(signal.SIGSTOP)
    try:
        await store.release(holder)
        stopped_at = time.monotonic()
        with anyio.fail_after(WAITER_TTL + 3):
            grant = await store.acquire(request("st"))
        assert time.monotonic() - stopped_at <= WAITER_TTL + 0.5
    finally:
        waiter.send_signal(signal.SIGCONT)
    await anyio.sleep(0.2)  # the waiter polls again: behind us now
    assert (await store.inspect("st")).waiters == 1
    await store.release(grant)
    assert await anyio.to_thread.run_sync(held_line, waiter) > (grant.token or 0)
    waiter.send_signal(signal.SIGKILL)
    await anyio.to_thread.run_sync(waiter.wait)
    with closing(sqlite3.connect(path)) as db, db:
        db.execute("DELETE FROM asynclock_locks")
