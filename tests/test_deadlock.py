"""Deadlock detection: cycles across tasks and processes are found and broken exactly once."""

from __future__ import annotations

import random
import uuid
from pathlib import Path

import anyio
import pytest

import asynclock
from asynclock._deadlock import find_cycle, victim
from asynclock.testing import RedisServer
from asynclock.testing._forked import PIPE, ForkedPython

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[1]
INTERVAL = 0.1


def memory_url() -> str:
    return f"memory://deadlock-{uuid.uuid4().hex[:8]}"


def test_find_cycle_follows_waits_to_holders() -> None:
    a = asynclock.Waiter("a", ("A",), "B", 1.0)
    b = asynclock.Waiter("b", ("B",), "C", 2.0)
    c = asynclock.Waiter("c", ("C",), "A", 3.0)
    bystander = asynclock.Waiter("d", (), "A", 4.0)
    assert find_cycle("a", [a, b, c, bystander]) == [a, b, c]
    assert find_cycle("d", [a, b, c, bystander]) is None  # waits on the cycle, not in it
    assert victim([a, b, c]) == "c"
    assert find_cycle("a", [a, b]) is None


@pytest.mark.parametrize("size", [2, 3, 5])
async def test_a_cycle_of_tasks_is_broken_once(size: int) -> None:
    outcomes: list[str] = []
    errors: list[tuple[int, asynclock.DeadlockDetected]] = []
    async with asynclock.connect(
        memory_url(), deadlock_detection=True, deadlock_interval=INTERVAL
    ) as locks:
        holding = anyio.Event()
        held = 0

        async def member(index: int) -> None:
            nonlocal held
            async with locks.lock(f"r{index}", ttl=30):
                held += 1
                if held == size:
                    holding.set()
                await holding.wait()
                try:
                    async with locks.lock(f"r{(index + 1) % size}", ttl=30, timeout=20):
                        outcomes.append("done")
                except asynclock.DeadlockDetected as exc:
                    outcomes.append("deadlock")
                    errors.append((index, exc))

        started = anyio.current_time()
        async with anyio.create_task_group() as tg:
            for index in range(size):
                tg.start_soon(member, index, name=f"member{index}")
        elapsed = anyio.current_time() - started
    assert sorted(outcomes) == ["deadlock"] + ["done"] * (size - 1)
    index, error = errors[0]
    assert len(error.cycle) == size
    assert f"waits for 'r{(index + 1) % size}'" in str(error)
    # First record after one interval, found by the victim at its next look.
    assert elapsed < 4 * INTERVAL + 1.0


@pytest.fixture(params=["sqlite", "redis"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite://{tmp_path}/locks.db"
    server: RedisServer = request.getfixturevalue("redis_server")
    return f"{server.url}?prefix=deadlock-{uuid.uuid4().hex[:8]}:&durability_warning=false"


def test_a_forked_process_tags_its_actor_ids_as_its_own(tmp_path: Path) -> None:
    """Processes forked after asynclock was imported (gunicorn --preload, the suite's fork
    server) do not keep the parent's process tag: with a reused pid, they would repeat the
    actor ids of a process that is gone."""
    (tmp_path / "print_tag.py").write_text(
        "from asynclock import _deadlock\nprint(_deadlock._PROCESS)\n"
    )
    tags = []
    for _ in range(2):
        worker = ForkedPython("print_tag", cwd=tmp_path, stdout=PIPE)
        out, _ = worker.communicate(timeout=30)
        worker.close()
        assert worker.returncode == 0
        tags.append(out.strip())
    assert len(tags[0]) == 6 and tags[0] != tags[1], tags


@pytest.mark.parametrize("size", [2, 3, 5])
def test_a_cycle_of_processes_is_broken_once(tmp_path: Path, size: int, url: str) -> None:
    ready = tmp_path / "ready"
    ready.mkdir()
    workers = [
        ForkedPython(
            "tests.deadlock_worker", [url, str(index), str(size), str(ready)], cwd=ROOT, stdout=PIPE
        )
        for index in range(size)
    ]
    outputs = []
    try:
        for worker in workers:
            out, _ = worker.communicate(timeout=60)
            assert worker.returncode == 0
            outputs.append(out.strip())
    finally:
        for worker in workers:
            worker.close()
    deadlocked = [out for out in outputs if out.startswith("deadlock")]
    assert len(deadlocked) == 1, outputs
    assert outputs.count("done") == size - 1
    seconds, message = deadlocked[0].split(" ", 2)[1:]
    # The bound stated in the docs: about three intervals (0.2 s here), plus process start-up.
    assert float(seconds) < 3 * 0.2 + 0.5
    for index in range(size):
        assert f"worker{index}/" in message


@pytest.mark.parametrize("backend", ["memory", "sqlite"])
async def test_no_false_positive_without_a_cycle(tmp_path: Path, backend: str) -> None:
    """1,000 acquisitions of pairs of 20 locks, always in canonical order: never a deadlock."""
    url = memory_url() if backend == "memory" else f"sqlite://{tmp_path}/locks.db"
    names = [f"n{index:02d}" for index in range(20)]
    count = 0

    async def worker(locks: asynclock.LockClient, seed: int) -> None:
        nonlocal count
        rng = random.Random(seed)
        for _ in range(100):
            first, second = sorted(rng.sample(names, 2))
            async with locks.lock(first, ttl=30), locks.lock(second, ttl=30):
                count += 1
                await anyio.sleep(rng.uniform(0, 0.004))

    async with (
        asynclock.connect(url, deadlock_detection=True, deadlock_interval=0.02) as one,
        asynclock.connect(url, deadlock_detection=True, deadlock_interval=0.02) as two,
    ):
        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for seed in range(10):
                    tg.start_soon(worker, one if seed % 2 else two, seed)
    assert count == 1000


async def test_detection_needs_a_backend_with_a_registry_and_a_sane_label() -> None:
    with pytest.raises(asynclock.InvalidArgument, match="label"):
        asynclock.connect(memory_url(), deadlock_detection=True, label="a/b")
    with pytest.raises(asynclock.InvalidArgument, match="deadlock_interval"):
        asynclock.connect(memory_url(), deadlock_detection=True, deadlock_interval=0)
