"""What only the embedded backend has: one file shared by processes (its queue, its rows, files
of earlier versions, rows of an earlier boot), a hold per lease of each kind, trio.

What every backend does (shared locks, semaphores, elections, cancellation, killed or paused
holders) is the contract's (tests/contract), which runs on sqlite:// too."""

from __future__ import annotations

import itertools
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
from typing import Any

import anyio
import pytest

import asynclock
from asynclock.abc import Kind, LockRequest, Lost, Renewed
from asynclock.backends.sqlite import SQLiteBackend, _sql
from asynclock.backends.sqlite._sql import BOOT_ID, WAITER_TTL, Want
from tests.contract.harness import sqlite_write_locked, stop_process

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[2]


def request(name: str, *, ttl: float = 5.0, **fields: Any) -> LockRequest:
    """A request of ``name``; ``fields``: kind, shared, permits, value."""
    return LockRequest(name, ttl, uuid.uuid4().hex, lambda reason: None, **fields)


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


@pytest.mark.parametrize(
    "fields",
    [{}, {"shared": True}, {"kind": "semaphore", "permits": 2}, {"kind": "election"}],
    ids=["lock", "shared", "semaphore", "election"],
)
async def test_extend_changes_the_ttl_of_one_lease_and_renewals_keep_it(
    store: SQLiteBackend, fields: dict[str, Any]
) -> None:
    grant = await store.acquire(request("x", ttl=1.0, **fields))
    outcome = await store.extend(grant, 30.0)
    assert isinstance(outcome, Renewed) and outcome.ttl == 30.0
    assert isinstance((await store.renew([grant]))[0], Renewed)
    info = await store.inspect("x", grant.space)
    assert info.expires_in is not None and 25 < info.expires_in <= 30
    assert isinstance(await store.extend(grant, 0.5), Renewed)
    info = await store.inspect("x", grant.space)
    assert info.expires_in is not None and info.expires_in <= 0.5
    await anyio.sleep(0.6)
    assert isinstance(await store.extend(grant, 30.0), Lost)
    await store.release(grant)


# -- across processes -------------------------------------------------------------------------

#: Another process that queues for the exclusive lock NAME, then holds it (renewing) until killed.
_WAITER = textwrap.dedent(
    """
    import sys, uuid, anyio
    from asynclock.abc import LockRequest
    from asynclock.backends.sqlite import SQLiteBackend

    async def main(path, name):
        async with SQLiteBackend(path) as backend:
            grant = await backend.acquire(LockRequest(name, 5.0, uuid.uuid4().hex, print))
            print("held", grant.token, flush=True)
            while True:
                await anyio.sleep(1)
                await backend.renew([grant])

    anyio.run(main, sys.argv[1], sys.argv[2])
    """
)

Spawn = Callable[..., subprocess.Popen[str]]


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    started: list[subprocess.Popen[str]] = []

    def start(script: str, *args: str) -> subprocess.Popen[str]:
        command = [sys.executable, "-c", script, *args]
        started.append(subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, text=True))
        return started[-1]

    yield start
    for process in started:
        process.kill()
        process.wait()
        if process.stdout is not None:
            process.stdout.close()


def held_line(process: subprocess.Popen[str]) -> int:
    assert process.stdout is not None
    line = process.stdout.readline().split()
    assert line and line[0] == "held", line
    return int(line[1])


async def stop(process: subprocess.Popen[str], path: Path) -> None:
    """Kill the other process and delete the lock it held (it would only lapse in its ttl)."""
    process.kill()
    await anyio.to_thread.run_sync(process.wait)
    with closing(sqlite3.connect(path)) as db, db:
        db.execute("DELETE FROM asynclock_locks")


async def test_a_writer_waiting_in_another_process_holds_back_readers_here(
    path: Path, store: SQLiteBackend, spawn: Spawn
) -> None:
    reader = await store.acquire(request("x", shared=True))
    writer = spawn(_WAITER, str(path), "x")
    await wait_until_queued(store, "x", 1, "lock")
    assert await store.try_acquire(request("x", shared=True)) is None
    await store.release(reader)
    token = await anyio.to_thread.run_sync(held_line, writer)
    assert reader.token is not None and token > reader.token
    info = await store.inspect("x")
    assert info.held and not info.holders[0].shared
    await stop(writer, path)


async def test_a_stopped_waiter_holds_up_the_queue_for_waiter_ttl_at_most(
    path: Path, store: SQLiteBackend, spawn: Spawn
) -> None:
    """Its row lapses; when it runs again it takes a new place at the back (and gets in)."""
    holder = await store.acquire(request("st"))
    waiter = spawn(_WAITER, str(path), "st")
    await wait_until_queued(store, "st", 1, "lock")
    # Stopped inside a write transaction of its poll, it would keep the file write-locked (and
    # every statement here waiting) until it runs again: stop it while the file is ours.
    await stop_process(waiter.pid, between=sqlite_write_locked(str(path)))
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
    await stop(waiter, path)


#: A process of TASKS tasks taking the lock "rw" ROUNDS times each (in "rw" mode two in three
#: tasks read); it prints each hold as "<r|w> <token> <start> <end>".
_CONTENDER = textwrap.dedent(
    """
    import sys, time, anyio, asynclock

    async def main(url, mode, tasks, rounds):
        async with asynclock.connect(url) as locks:
            async def one(index):
                for _ in range(rounds):
                    shared = mode == "rw" and index % 3 != 0
                    async with locks.lock("rw", ttl=5, timeout=60, shared=shared) as lease:
                        start = time.monotonic()
                        await anyio.sleep(0.005)
                        end = time.monotonic()
                    print("r" if shared else "w", lease.token, repr(start), repr(end), flush=True)

            async with anyio.create_task_group() as tg:
                for index in range(tasks):
                    tg.start_soon(one, index)

    anyio.run(main, sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    """
)


@pytest.mark.parametrize("mode", ["lock", "rw"])
def test_processes_contending_exclude_writers_and_share_reads(
    path: Path, spawn: Spawn, mode: str
) -> None:
    """3 processes of 4 tasks, 5 holds each, on one file; tokens rise with the writes.
    Semaphores and elections across processes are the contract's."""
    started = [spawn(_CONTENDER, f"sqlite://{path}", mode, "4", "5") for _ in range(3)]
    lines = [line.split() for p in started for line in p.communicate(timeout=90)[0].splitlines()]
    assert len(lines) == 3 * 4 * 5 and all(p.returncode == 0 for p in started)
    holds = [(float(start), float(end)) for _, _, start, end in lines]
    tokens = sorted(int(token) for _, token, _, _ in lines)
    assert len(set(tokens)) == len(tokens)
    for kind, _, start, end in lines:
        if kind == "w":
            others = [(s, e) for s, e in holds if (s, e) != (float(start), float(end))]
            assert all(e <= float(start) or s >= float(end) for s, e in others)
    if mode == "rw":
        # CLOCK_MONOTONIC is one clock for all processes on the host, so holds are comparable;
        # sorted by start, some two holds overlap if and only if two neighbours do.
        overlaps = [b[0] < a[1] for a, b in itertools.pairwise(sorted(holds))]
        assert any(overlaps), "readers share"
    else:
        by_start = sorted(lines, key=lambda line: float(line[2]))
        assert [int(line[1]) for line in by_start] == tokens
    assert rows(path) == []


# -- this client's own queue ------------------------------------------------------------------


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


async def test_a_place_in_the_queue_is_the_moment_of_the_request_not_of_its_write(
    path: Path, store: SQLiteBackend
) -> None:
    """The later request reaches the file first (its process got the write lock first) and
    still waits behind the earlier one: placed in the order of their writes, four processes
    queueing 1,000 waiters 2 ms apart were granted up to 365 places out of order."""
    holder = await store.acquire(request("q"))
    made = time.monotonic_ns()
    early, late = (
        Want("lock", "q", owner, 5.0, since=made + n) for owner, n in (("e", 1), ("l", 2))
    )
    with closing(sqlite3.connect(path, isolation_level=None)) as db:
        assert _sql.take(db, late, wait=True).placed
        assert _sql.take(db, early, wait=True).placed
        await store.release(holder)
        assert _sql.take(db, late, wait=True).token is None
        token = _sql.take(db, early, wait=True).token
        assert token is not None and holder.token is not None and token > holder.token
        _sql.release(db, early)
        _sql.dequeue(db, "l")


async def test_waiters_keep_their_places_through_a_stall_longer_than_waiter_ttl(
    path: Path, store: SQLiteBackend, other: SQLiteBackend
) -> None:
    """The file write-locked by another connection past WAITER_TTL (a long transaction, or
    the disk stalled): this client's waiters were not stopped, so they keep their places
    (a loaded run of test_scale put 989 of 1,000 at the back of the line)."""

    def places() -> list[tuple[str, int]]:
        with closing(sqlite3.connect(path)) as db:
            query = "SELECT owner, seq FROM asynclock_queue WHERE name = 'stall' ORDER BY seq"
            return list(db.execute(query))

    holders = [await other.acquire(request(name)) for name in ("stall", "elsewhere")]
    order: list[int] = []

    async def wait(index: int, name: str) -> None:
        grant = await store.acquire(request(name))
        order.append(index)
        await store.release(grant)

    async with anyio.create_task_group() as tg:
        for index in range(3):
            tg.start_soon(wait, index, "stall")
            await wait_until_queued(store, "stall", index + 1, "lock")
        # A later row of another name: places taken again would be numbered after it.
        tg.start_soon(wait, 3, "elsewhere")
        await wait_until_queued(store, "elsewhere", 1, "lock")
        before = places()
        with sqlite_write_locked(str(path)):
            await anyio.sleep(WAITER_TTL + 0.5)
        await anyio.sleep(0.2)  # a poll or two of the first waiters
        assert places() == before
        for holder in holders:
            await other.release(holder)
    assert [index for index in order if index < 3] == [0, 1, 2]


async def test_a_take_on_a_file_locked_past_busy_timeout_fails_within_busy_timeout(
    tmp_path: Path,
) -> None:
    """The docs' promise: a client waits up to ``busy_timeout`` for a file another process
    keeps locked. A take that gave up was rolled back, so nothing is undone after it (the undo
    waited for the lock as long again: twice ``busy_timeout`` in all)."""
    path = tmp_path / "locks.db"
    async with asynclock.connect(f"sqlite://{path}?busy_timeout=0.5") as locks:
        with sqlite_write_locked(str(path)):
            for timeout in (0, 10):
                started = anyio.current_time()
                with pytest.raises(asynclock.BackendUnavailable):
                    await locks.acquire("busy", timeout=timeout)
                assert 0.5 <= anyio.current_time() - started < 0.85
        async with locks.lock("busy", timeout=0):  # and nothing was left behind
            pass


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


# -- the file ---------------------------------------------------------------------------------

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


async def test_tokens_survive_restarts_and_a_row_of_another_boot_is_not_held(path: Path) -> None:
    for expected in (1, 2):
        async with asynclock.connect(f"sqlite://{path}") as locks:
            async with locks.lock("t") as lease:
                assert lease.token == expected
    async with asynclock.connect(f"sqlite://{path}") as locks:
        lease = await locks.acquire("boot", ttl=30)
        assert await locks.try_acquire("boot") is None
        with closing(sqlite3.connect(path)) as db, db:
            db.execute("UPDATE asynclock_locks SET boot_id = 'an-earlier-boot'")
        other = await locks.try_acquire("boot")
        assert other is not None and other.token > lease.token
        await other.release()
        await lease.release()


@pytest.mark.parametrize(
    ("where", "message"),
    [("no/such/dir/locks.db", "does not exist"), ("junk.db", r"cannot open .*DatabaseError")],
)
async def test_a_missing_directory_or_a_file_that_is_no_database_is_a_named_error(
    tmp_path: Path, where: str, message: str
) -> None:
    (tmp_path / "junk.db").write_bytes(b"not a database, " * 512)
    with pytest.raises(asynclock.BackendUnavailable, match=message):
        async with asynclock.connect(f"sqlite://{tmp_path}/{where}"):
            pass
