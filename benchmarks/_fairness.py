"""Fairness across clients: waiters started in a known order, granted in which order?

W waiters start D ms apart (waiter ``i`` at ``t0 + i * D``), spread round-robin over P
processes (one client each; waiter ``i`` in process ``i % P``) or all in one client, while a
holder on a client of its own keeps the lock; once the last waiter has had time to queue the
holder releases, and each waiter, on its grant, records (``time.monotonic()``, its index) and
releases at once. The grant order against the start order gives each waiter's displacement
(``|grant rank - start rank|``); the largest and the mean are reported, with the longest run of
grants in a row to one process. A waiter also records when it called acquire: on a loaded
machine a process can be descheduled for longer than D, so that the calls reach the lock in
another order than the schedule's; the displacement against the order of the calls, and how
late the calls were, tell that apart from the lock's own order.
"""

from __future__ import annotations

import gc
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread

from ._contend import AsyncHold, AsyncWorkerFactory

#: Opens one client and yields the worker factory of a lock name on it.
Opener = Callable[[str], AbstractAsyncContextManager[AsyncWorkerFactory]]
#: Runs the waiters of each process (``starts[p]``) on the pool, returns every grant.
PoolFairness = Callable[[list[list[tuple[int, float]]], float], list["Grant"]]
#: One grant: when acquire returned, the waiter's start index, when it called acquire.
Grant = tuple[float, int, float]


@dataclass(frozen=True, slots=True)
class Fairness:
    """One fairness setting: ``waiters`` started ``spacing`` seconds apart over ``processes``."""

    waiters: int
    spacing: float
    processes: int
    ttl: float = 30.0

    def seconds(self) -> float:
        """About how long one run takes once its clients are up (queueing, settling, draining
        at a few ms a grant)."""
        return self.waiters * (self.spacing + 0.005) + 1.0

    def record(self) -> dict[str, Any]:
        return {
            "waiters": self.waiters,
            "spacing_ms": self.spacing * 1e3,
            "processes": self.processes,
            "ttl_s": self.ttl,
        }


async def run_waiters(
    holds: list[AsyncHold], starts: list[tuple[int, float]], until: float
) -> list[Grant]:
    """Start waiter ``index`` with ``holds[k]`` at monotonic time ``at`` (``starts[k]``); each
    takes the lock (giving up at ``until``), records its grant and releases at once."""
    grants: list[Grant] = []

    async def one(hold: AsyncHold, index: int, at: float) -> None:
        await anyio.sleep(max(0.0, at - time.monotonic()))
        called = time.monotonic()
        async with hold(max(0.05, until - time.monotonic())) as got:
            if got:
                grants.append((time.monotonic(), index, called))

    with anyio.move_on_after(max(0.0, until - time.monotonic()) + 5.0):
        async with anyio.create_task_group() as group:
            for hold, (index, at) in zip(holds, starts, strict=True):
                group.start_soon(one, hold, index, at)
    return grants


def freeze_heap() -> None:
    """Keep what is set up out of the garbage collector's scans (``gc.freeze``), in every
    worker process (asynclock's and every peer's alike) and for a run in one client. Worker
    processes that do the same work collect their oldest generation at the same moment: in a
    fairness run over 4 processes, 4 collections of 42-90 ms within 30 ms of each other, 1.7 s
    in (the waiters of 3 processes called acquire up to 87 ms late, and were granted up to 25
    places out of order). Frozen, a collection scans only what the run made since."""
    gc.collect()
    gc.freeze()


def _displacement(ordered: list[int], rank: dict[int, int]) -> list[int]:
    return [abs(position - rank[index]) for position, index in enumerate(ordered)]


def analyse(grants: list[Grant], setting: Fairness, processes: int, t0: float) -> dict[str, Any]:
    """Displacement of the grant order against the start order (and against the order in
    which the waiters called acquire); runs of one process; how late the calls were."""
    by_grant = sorted(grants)
    ordered = [index for _, index, _ in by_grant]
    rank = {index: position for position, index in enumerate(sorted(ordered))}
    displacement = _displacement(ordered, rank)
    calls = sorted((called, index) for _, index, called in by_grant)
    by_call = {index: position for position, (_, index) in enumerate(calls)}
    displacement_called = _displacement(ordered, by_call)
    lags = sorted(called - (t0 + index * setting.spacing) for _, index, called in by_grant)
    longest = run = 0
    previous = -1
    for index in ordered:
        process = index % processes
        run = run + 1 if process == previous else 1
        previous = process
        longest = max(longest, run)
    count = len(ordered)
    return {
        **setting.record(),
        "processes": processes,
        "granted": count,
        "not_granted": setting.waiters - count,
        "max_displacement": max(displacement, default=0),
        "mean_displacement": sum(displacement) / count if count else 0.0,
        "in_start_order": sum(d == 0 for d in displacement),
        "longest_run_one_process": longest if processes > 1 else None,
        "max_displacement_vs_calls": max(displacement_called, default=0),
        "mean_displacement_vs_calls": sum(displacement_called) / count if count else 0.0,
        "call_lag_p99_ms": lags[min(count - 1, int(count * 0.99))] * 1e3 if count else None,
        "call_lag_max_ms": lags[-1] * 1e3 if count else None,
    }


def schedule(setting: Fairness, processes: int, t0: float) -> list[list[tuple[int, float]]]:
    """The waiters' start times, round-robin over ``processes``."""
    starts: list[list[tuple[int, float]]] = [[] for _ in range(processes)]
    for index in range(setting.waiters):
        starts[index % processes].append((index, t0 + index * setting.spacing))
    return starts


#: Seconds from the last waiter's start to the holder's release: time to queue.
SETTLE = 0.3


def _until(setting: Fairness, t0: float) -> float:
    """When waiters give up: the release, then a generous 50 ms a grant, at least 10 s."""
    release = t0 + setting.waiters * setting.spacing + SETTLE
    return release + max(10.0, setting.waiters * 0.05)


@asynccontextmanager
async def _holding(opener: Opener, name: str) -> AsyncIterator[None]:
    """The holder, on a client of its own: holds ``name`` while the body runs."""
    async with opener(name) as factory, factory(-1) as hold, hold(30.0) as got:
        if not got:
            raise RuntimeError("the holder did not get the free lock")
        yield


async def in_one_client(opener: Opener, name: str, setting: Fairness) -> dict[str, Any]:
    """All ``setting.waiters`` in one client (tasks of one process), behind a holder."""
    async with opener(name) as factory, AsyncExitStack() as stack:
        holds = [await stack.enter_async_context(factory(i)) for i in range(setting.waiters)]
        # As the worker processes do: this process's heap holds every library and result so
        # far, and one collection of it made a run's calls 30-90 ms late together.
        freeze_heap()
        try:
            return await _timeline(opener, name, setting, 1, holds=holds)
        finally:
            gc.unfreeze()


async def over_processes(
    opener: Opener,
    name: str,
    setting: Fairness,
    prepare: Callable[[list[list[int]]], None],
    pool: PoolFairness,
) -> dict[str, Any]:
    """The waiters over ``setting.processes`` worker processes (``pool``), behind a holder;
    ``prepare`` first opens each waiter's lock object or connection in its process."""
    indices = [[i for i, _ in mine] for mine in schedule(setting, setting.processes, 0.0)]
    await anyio.to_thread.run_sync(prepare, indices)
    return await _timeline(opener, name, setting, setting.processes, pool=pool)


async def _timeline(
    opener: Opener,
    name: str,
    setting: Fairness,
    processes: int,
    *,
    holds: list[AsyncHold] | None = None,
    pool: PoolFairness | None = None,
) -> dict[str, Any]:
    grants: list[Grant] = []
    holding, release = anyio.Event(), anyio.Event()
    released: list[float] = []

    async def holder() -> None:
        async with _holding(opener, name):
            holding.set()
            await release.wait()
            released.append(time.monotonic())
        # Leaving the block released the lock: the waiters are granted in turn.

    async def waiters(starts: list[list[tuple[int, float]]], until: float) -> None:
        if holds is not None:
            grants.extend(await run_waiters(holds, starts[0], until))
        else:
            assert pool is not None
            grants.extend(await anyio.to_thread.run_sync(pool, starts, until))

    t0 = 0.0
    async with anyio.create_task_group() as group:
        group.start_soon(holder)
        await holding.wait()
        t0 = time.monotonic() + 0.2
        group.start_soon(waiters, schedule(setting, processes, t0), _until(setting, t0))
        await anyio.sleep(
            max(0.0, t0 + setting.waiters * setting.spacing + SETTLE - time.monotonic())
        )
        release.set()
    record = analyse(grants, setting, processes, t0)
    if grants and released:
        record["drain_s"] = max(grant[0] for grant in grants) - released[0]
    return record
