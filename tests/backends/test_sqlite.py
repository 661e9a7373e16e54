"""The embedded backend across real OS processes: exclusion, crashes, pauses, durable tokens."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

import asynclock

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[2]


def spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.backends.sqlite_worker", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )


def read_line(process: subprocess.Popen[str], timeout: float = 20.0) -> str:
    assert process.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if line:
            return line.strip()
        if process.poll() is not None:
            break
    raise AssertionError(f"worker said nothing (exit code {process.poll()})")


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait()
        if process.stdout is not None:
            process.stdout.close()


def test_four_processes_exclude_each_other(
    tmp_path: Path, processes: list[subprocess.Popen[str]]
) -> None:
    db, counter = tmp_path / "locks.db", tmp_path / "counter"
    counter.write_text("0")
    processes.extend(spawn(str(db), "count", str(counter), "25") for _ in range(4))
    holds: list[tuple[int, float, float]] = []
    for process in processes:
        assert process.stdout is not None
        out, _ = process.communicate(timeout=120)
        assert process.returncode == 0
        for line in out.splitlines():
            _, token, start, end = line.split()
            holds.append((int(token), float(start), float(end)))
    assert int(counter.read_text()) == 100
    holds.sort(key=lambda hold: hold[1])
    # CLOCK_MONOTONIC is one clock for all processes on the host, so holds are comparable.
    for earlier, later in itertools.pairwise(holds):
        assert earlier[2] <= later[1], f"holds overlap: {earlier} and {later}"
    tokens = [hold[0] for hold in holds]
    assert tokens == sorted(tokens)
    assert len(set(tokens)) == 100


async def test_a_killed_holder_frees_the_lock_within_its_ttl(
    tmp_path: Path, processes: list[subprocess.Popen[str]]
) -> None:
    db = tmp_path / "locks.db"
    ttl = 1.0
    holder = spawn(str(db), "hold", "job", str(ttl))
    processes.append(holder)
    assert read_line(holder).startswith("held ")
    async with asynclock.connect(f"sqlite://{db}") as locks:
        assert await locks.try_acquire("job", ttl=ttl) is None
        holder.send_signal(signal.SIGKILL)
        killed_at = anyio.current_time()
        lease = await locks.acquire("job", ttl=ttl, timeout=5)
        waited = anyio.current_time() - killed_at
        await lease.release()
    assert waited <= ttl + 0.2


async def test_a_paused_holder_loses_the_lock_and_is_told_when_it_resumes(
    tmp_path: Path, processes: list[subprocess.Popen[str]]
) -> None:
    """The seeds' GC-pause case: the lease expires during the pause, another process takes the
    lock, and the paused holder's body is cancelled as soon as it runs again."""
    db = tmp_path / "locks.db"
    ttl = 1.0
    holder = spawn(str(db), "hold", "job", str(ttl))
    processes.append(holder)
    first_token = int(read_line(holder).split()[1])
    os.kill(holder.pid, signal.SIGSTOP)
    try:
        async with asynclock.connect(f"sqlite://{db}") as locks:
            async with locks.lock("job", ttl=ttl, timeout=5) as lease:
                assert lease.token > first_token
                os.kill(holder.pid, signal.SIGCONT)
                line = await anyio.to_thread.run_sync(read_line, holder)
                assert line.startswith("lost "), line
    finally:
        os.kill(holder.pid, signal.SIGCONT)


async def test_tokens_survive_a_restart_of_every_client(tmp_path: Path) -> None:
    url = f"sqlite://{tmp_path / 'locks.db'}"
    async with asynclock.connect(url) as locks:
        async with locks.lock("t") as lease:
            before = lease.token
    async with asynclock.connect(url) as locks:
        async with locks.lock("t") as lease:
            assert lease.token == before + 1


async def test_a_missing_directory_is_a_named_error(tmp_path: Path) -> None:
    with pytest.raises(asynclock.BackendUnavailable, match="does not exist"):
        async with asynclock.connect(f"sqlite://{tmp_path}/no/such/dir/locks.db"):
            pass


async def test_a_file_that_is_no_database_is_a_named_error(tmp_path: Path) -> None:
    path = tmp_path / "locks.db"
    path.write_bytes(b"not a database, " * 512)
    with pytest.raises(asynclock.BackendUnavailable, match=r"cannot open sqlite://.*DatabaseError"):
        async with asynclock.connect(f"sqlite://{path}"):
            pass


async def test_a_row_from_another_boot_is_not_held(tmp_path: Path) -> None:
    import sqlite3
    from contextlib import closing

    url = f"sqlite://{tmp_path / 'locks.db'}"
    async with asynclock.connect(url) as locks:
        lease = await locks.acquire("boot", ttl=30)
        assert await locks.try_acquire("boot") is None
        with closing(sqlite3.connect(tmp_path / "locks.db")) as db, db:
            db.execute("UPDATE asynclock_locks SET boot_id = 'an-earlier-boot'")
        other = await locks.try_acquire("boot")
        assert other is not None
        assert other.token > lease.token
        await other.release()
        await lease.release()
