"""Timing loops and contention runs: tasks on one event loop, threads, or processes.

Every run is bounded: a timing loop stops at its time limit even if it has not reached its
iteration count, and a contention run cancels (tasks) or abandons (threads, processes) whatever
has not finished a grace period after its end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import (
    AbstractAsyncContextManager,
    AbstractContextManager,
    AsyncExitStack,
    ExitStack,
    asynccontextmanager,
    suppress,
)
from dataclasses import dataclass
from typing import Any

import anyio

from ._stats import MIN_P50_SAMPLES, Hold, analyse_holds
from ._targets import Op

#: A worker's way to hold the lock once: entered with the most seconds it may wait; yields
#: whether it got the lock (False: timed out or refused, try again).
AsyncHold = Callable[[float], AbstractAsyncContextManager[bool]]
SyncHold = Callable[[float], AbstractContextManager[bool]]
#: Opens one worker (its own connection or lock object, as the library wants) for a run.
AsyncWorkerFactory = Callable[[int], AbstractAsyncContextManager[AsyncHold]]
SyncWorkerFactory = Callable[[int], AbstractContextManager[SyncHold]]


@dataclass(frozen=True, slots=True)
class Budget:
    """How long one timing loop may take: iterations after warm-up, capped by seconds, but
    never fewer than the samples a median needs (:data:`MIN_P50_SAMPLES`): on a loaded host
    the cap cut the main job's uncontended timing to 8 samples, and its table showed no p50
    and no ratio to the floor."""

    iterations: int
    warmup: int
    seconds: float


async def time_op(op: Op, budget: Budget) -> list[float]:
    """Durations (seconds, ``perf_counter``) of ``op`` after ``budget.warmup`` calls."""
    limit = time.monotonic() + budget.seconds
    for _ in range(budget.warmup):
        await op()
        if time.monotonic() > limit:
            break
    samples: list[float] = []
    clock = time.perf_counter
    for _ in range(budget.iterations):
        started = clock()
        await op()
        samples.append(clock() - started)
        if time.monotonic() > limit and len(samples) >= MIN_P50_SAMPLES:
            break
    return samples


def time_sync_op(op: Callable[[], object], budget: Budget) -> list[float]:
    """:func:`time_op` for a blocking call (run it in a thread)."""
    limit = time.monotonic() + budget.seconds
    for _ in range(budget.warmup):
        op()
        if time.monotonic() > limit:
            break
    samples: list[float] = []
    clock = time.perf_counter
    for _ in range(budget.iterations):
        started = clock()
        op()
        samples.append(clock() - started)
        if time.monotonic() > limit and len(samples) >= MIN_P50_SAMPLES:
            break
    return samples


@dataclass(frozen=True, slots=True)
class Run:
    """One contention run: how many contenders, how long each hold lasts, for how long."""

    contenders: int
    hold: float
    duration: float
    grace: float


def _result(
    run: Run, holds: list[Hold], started: float, ended: float, **extra: Any
) -> dict[str, Any]:
    return {
        "contenders": run.contenders,
        "hold_ms": run.hold * 1e3,
        **analyse_holds(holds, workers=run.contenders, started=started, ended=ended),
        **extra,
    }


async def contend_tasks(factory: AsyncWorkerFactory, run: Run) -> dict[str, Any]:
    """``run.contenders`` tasks on this event loop take the lock in turn, as fast as they can."""
    holds: list[Hold] = []
    failures = 0
    errors: list[str] = []
    async with AsyncExitStack() as stack:
        workers = [await stack.enter_async_context(factory(i)) for i in range(run.contenders)]
        started = time.monotonic() + 0.05
        ended = started + run.duration

        async def work(index: int, hold: AsyncHold) -> None:
            nonlocal failures
            await anyio.sleep(max(0.0, started - time.monotonic()))
            try:
                while time.monotonic() < ended:
                    async with hold(max(0.05, ended + run.grace - time.monotonic())) as got:
                        if not got:
                            failures += 1
                            continue
                        acquired = time.monotonic()
                        if run.hold:
                            await anyio.sleep(run.hold)
                        released = time.monotonic()
                    holds.append(Hold(index, acquired, released))
            except Exception as exc:
                errors.append(f"{type(exc).__name__}: {exc}")

        with anyio.move_on_after(run.duration + run.grace + 0.05) as scope:
            async with anyio.create_task_group() as group:
                for index, hold in enumerate(workers):
                    group.start_soon(work, index, hold)
    return _result(
        run,
        holds,
        started,
        ended,
        failed_attempts=failures,
        errors=sorted(set(errors)),
        cut_short=scope.cancelled_caught,
    )


def contend_threads(factory: SyncWorkerFactory, run: Run) -> dict[str, Any]:
    """``run.contenders`` threads take the lock in turn with a blocking library."""
    holds: list[Hold] = []
    failures = [0]
    errors: list[str] = []
    guard = threading.Lock()
    with ExitStack() as stack:
        workers = [stack.enter_context(factory(i)) for i in range(run.contenders)]
        started = time.monotonic() + 0.05
        ended = started + run.duration

        def work(index: int, hold: SyncHold) -> None:
            time.sleep(max(0.0, started - time.monotonic()))
            try:
                while time.monotonic() < ended:
                    with hold(max(0.05, ended + run.grace - time.monotonic())) as got:
                        if not got:
                            with guard:
                                failures[0] += 1
                            continue
                        acquired = time.monotonic()
                        if run.hold:
                            time.sleep(run.hold)
                        released = time.monotonic()
                    with guard:
                        holds.append(Hold(index, acquired, released))
            except Exception as exc:
                with guard:
                    errors.append(f"{type(exc).__name__}: {exc}")

        threads = [
            threading.Thread(target=work, args=(i, hold), daemon=True, name=f"bench-{i}")
            for i, hold in enumerate(workers)
        ]
        for thread in threads:
            thread.start()
        limit = ended + run.grace + 1.0
        for thread in threads:
            thread.join(max(0.0, limit - time.monotonic()))
        stuck = sum(thread.is_alive() for thread in threads)
    with guard:
        return _result(
            run,
            list(holds),
            started,
            ended,
            failed_attempts=failures[0],
            errors=sorted(set(errors)),
            cut_short=stuck > 0,
        )


# -- processes ------------------------------------------------------------------------------


@dataclass
class _Child:
    process: subprocess.Popen[str]

    def send(self, message: dict[str, Any]) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()

    def receive(self, deadline: float) -> dict[str, Any]:
        assert self.process.stdout is not None
        result: list[str] = []
        reader = threading.Thread(
            target=lambda: result.append(self.process.stdout.readline()),  # type: ignore[union-attr]
            daemon=True,
        )
        reader.start()
        reader.join(max(0.0, deadline - time.monotonic()))
        if not result or not result[0]:
            raise TimeoutError("a worker process did not answer in time")
        message: dict[str, Any] = json.loads(result[0])
        if "error" in message:
            raise RuntimeError(f"worker process: {message['error']}")
        return message


@dataclass
class Pool:
    """Worker processes (``python -m benchmarks._worker``), each with its own client; its
    methods block (call them in a thread)."""

    children: list[_Child]

    def run(self, run: Run) -> dict[str, Any]:
        """One contention run on every process, holds analysed together."""
        started = time.monotonic() + 0.1
        ended = started + run.duration
        for child in self.children:
            child.send({"started": started, "ended": ended, "hold": run.hold, "grace": run.grace})
        holds: list[Hold] = []
        failures = 0
        limit = ended + run.grace + 5.0
        for index, child in enumerate(self.children):
            reply = child.receive(limit)
            failures += int(reply["failed_attempts"])
            holds.extend(Hold(index, a, r) for a, r in reply["holds"])
        return _result(run, holds, started, ended, failed_attempts=failures)

    def prepare(self, indices: list[list[int]]) -> None:
        """Process ``p`` opens the lock objects (or connections) of waiters ``indices[p]``."""
        for child, mine in zip(self.children, indices, strict=True):
            child.send({"prepare": mine})
        deadline = time.monotonic() + 60.0
        for child in self.children:
            child.receive(deadline)

    def fairness(
        self, starts: list[list[tuple[int, float]]], until: float
    ) -> list[tuple[float, int, float]]:
        """Process ``p`` starts the waiters ``starts[p]`` (``_fairness``); every grant:
        (granted at, index, acquire called at)."""
        for child, mine in zip(self.children, starts, strict=True):
            child.send({"fairness": {"starts": mine, "until": until}})
        grants: list[tuple[float, int, float]] = []
        for child in self.children:
            reply = child.receive(until + 10.0)["grants"]
            grants.extend((float(t), int(i), float(c)) for t, i, c in reply)
        return grants


@asynccontextmanager
async def process_pool(
    config: dict[str, Any], count: int, start_timeout: float
) -> AsyncIterator[Pool]:
    """Start ``count`` worker processes, each with its own client: asynclock's (``config``:
    ``url``, ``options``, ``name``, ``ttl``) or a peer's (``peer``, ``name``); see ``_worker``."""

    def spawn() -> list[_Child]:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [_root(), os.environ.get("PYTHONPATH")])),
        }
        return [
            _Child(
                subprocess.Popen(
                    [sys.executable, "-m", "benchmarks._worker", json.dumps(config)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    text=True,
                    env=env,
                )
            )
            for _ in range(count)
        ]

    children = await anyio.to_thread.run_sync(spawn)
    try:
        deadline = time.monotonic() + start_timeout
        for child in children:
            await anyio.to_thread.run_sync(child.receive, deadline)  # "ready"
        yield Pool(children)
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(_stop_children, children)


def _stop_children(children: list[_Child]) -> None:
    for child in children:
        with suppress(OSError, ValueError):
            child.send({"exit": True})
    deadline = time.monotonic() + 5.0
    for child in children:
        try:
            child.process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.process.kill()
            child.process.wait()


def _root() -> str:
    """The directory that holds the ``benchmarks`` package."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
