"""The measurements: one asynclock backend at a time, then the peers on the same servers.

Each phase is bounded by its own time limit and by the share of the run's budget that its backend
or peer was given (``_plan``); a phase that fails, runs out of time or does not fit in the share
is recorded as such (``{"error": ...}`` or ``{"skipped": ...}``) and the run goes on, so that a
backend still being written cannot take the whole run down.
"""

from __future__ import annotations

import gc
import logging
import random
import sys
import time
import tracemalloc
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import anyio
import anyio.to_thread

import asynclock
from asynclock._registry import redact

from . import _alternate, _cross
from ._contend import (
    Budget,
    Run,
    contend_tasks,
    contend_threads,
    time_op,
    time_sync_op,
)
from ._cross import CLIENT_TTL
from ._fairness import Fairness
from ._peers import AsyncPeer, Peer, SyncPeer, peer_info
from ._stats import summarize
from ._targets import Target
from ._worker import asynclock_factory

#: The issue's fairness setting: 1,000 waiters 2 ms apart over 4 processes.
FULL_FAIRNESS = Fairness(1000, 0.002, 4)
#: The most waiting tasks the memory measurement starts.
MAX_WAITERS = 200
#: The longest the renewal measurement spends taking its locks (10,000 of them in a full run).
ACQUIRE_MANY_SECONDS = 45.0


@dataclass(frozen=True, slots=True)
class Settings:
    mode: str
    floor: Budget
    latency: Budget
    contenders: tuple[int, ...]
    holds: tuple[float, ...]
    duration: float
    grace: float
    process_contenders: tuple[int, ...]
    process_duration: float
    renewal_counts: tuple[int, ...]
    renewal_intervals: int
    loss_repeats: int
    memory_count: int
    peer_latency: Budget
    peer_contenders: int
    peer_duration: float
    #: ``time.monotonic()`` after which no new phase starts.
    deadline: float
    #: Contenders with a client each, in one process (issue #29).
    client_counts: tuple[int, ...] = (2, 8)
    #: Waiters, their spacing and processes of the fairness runs (``_fairness``).
    fairness: Fairness = FULL_FAIRNESS
    processes: str = "all"
    progress: Callable[[str], None] = field(default=lambda line: print(line, file=sys.stderr))
    #: The run's whole budget, seconds (``deadline`` is a share's end while one is measured).
    budget: float = 0.0

    @classmethod
    def make(
        cls,
        *,
        mode: str,
        budget: float,
        processes: str,
        quiet: bool = False,
    ) -> Settings:
        """``mode`` is "full", "quick" or "smoke" (the shortest run that exercises every
        phase, for the test suite: its numbers mean nothing)."""
        progress: Callable[[str], None] = (
            (lambda line: None)
            if quiet
            else (lambda line: print(line, file=sys.stderr, flush=True))
        )
        deadline = time.monotonic() + budget
        fair = {
            "smoke": Fairness(6, 0.002, 2),
            "quick": Fairness(40, 0.002, 2),
        }.get(mode, FULL_FAIRNESS)
        if mode == "smoke":
            return cls(
                mode="smoke",
                floor=Budget(20, 2, 2.0),
                latency=Budget(20, 2, 2.0),
                contenders=(2,),
                holds=(0.0,),
                duration=0.1,
                grace=1.0,
                process_contenders=(2,),
                process_duration=0.2,
                client_counts=(2,),
                fairness=fair,
                renewal_counts=(2,),
                renewal_intervals=1,
                loss_repeats=1,
                memory_count=10,
                peer_latency=Budget(10, 1, 2.0),
                peer_contenders=2,
                peer_duration=0.1,
                deadline=deadline,
                processes=processes,
                progress=progress,
                budget=budget,
            )
        if mode == "quick":
            return cls(
                mode="quick",
                floor=Budget(200, 20, 5.0),
                latency=Budget(200, 20, 5.0),
                contenders=(2, 8, 32),
                holds=(0.0, 0.001),
                duration=0.4,
                grace=1.0,
                process_contenders=(2, 8),
                process_duration=0.4,
                fairness=fair,
                renewal_counts=(1, 100),
                renewal_intervals=1,
                loss_repeats=3,
                memory_count=100,
                peer_latency=Budget(100, 10, 5.0),
                peer_contenders=8,
                peer_duration=0.5,
                deadline=deadline,
                processes=processes,
                progress=progress,
                budget=budget,
            )
        return cls(
            mode="full",
            floor=Budget(2000, 200, 6.0),
            latency=Budget(2000, 200, 8.0),
            contenders=(2, 8, 32),
            holds=(0.0, 0.001),
            duration=1.0,
            grace=2.0,
            process_contenders=(2, 8),
            process_duration=1.0,
            fairness=fair,
            renewal_counts=(1, 100, 10_000),
            renewal_intervals=2,
            loss_repeats=8,
            memory_count=500,
            peer_latency=Budget(1000, 100, 6.0),
            peer_contenders=8,
            peer_duration=1.0,
            deadline=deadline,
            processes=processes,
            progress=progress,
            budget=budget,
        )

    def settings_record(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "budget_s": self.budget,
            "floor_iterations": self.floor.iterations,
            "latency_iterations": self.latency.iterations,
            "warmup": self.latency.warmup,
            "contenders": list(self.contenders),
            "holds_ms": [hold * 1e3 for hold in self.holds],
            "contention_seconds": self.duration,
            "process_contenders": list(self.process_contenders),
            "client_counts": list(self.client_counts),
            "client_ttl_s": CLIENT_TTL,
            "fairness": self.fairness.record(),
            "processes": self.processes,
            "renewal_counts": list(self.renewal_counts),
            "renewal_intervals": self.renewal_intervals,
            "loss_repeats": self.loss_repeats,
            "memory_count": self.memory_count,
            "peer_iterations": self.peer_latency.iterations,
            "peer_contenders": self.peer_contenders,
        }


#: Why a phase did not run: the backend's (or peer's) share of the budget, see ``_plan``.
SHARE_SPENT = "its share of the run's time budget was spent"


def left(settings: Settings) -> float:
    """Seconds left of the share being measured (``settings.deadline`` is the share's end)."""
    return settings.deadline - time.monotonic()


def fits(settings: Settings, seconds: float) -> bool:
    """Whether something expected to take ``seconds`` ends within the share."""
    return left(settings) >= seconds


def cut(budget: Budget, seconds: float) -> Budget:
    """``budget`` with its time cap lowered to ``seconds`` (the iteration count stays the
    most): a short share gets fewer iterations, never none."""
    return Budget(budget.iterations, budget.warmup, min(budget.seconds, seconds))


async def phase(
    settings: Settings,
    label: str,
    limit: float,
    body: Callable[[], Awaitable[Any]],
    *,
    essential: bool = False,
    needs: float = 0.0,
) -> Any:
    """Run one measurement within ``limit`` seconds; failures become a record, not a crash.

    An ``essential`` phase (one the summary table shows) always runs, cut to its share by its
    caller; any other starts only if ``needs`` seconds are left of the share."""
    if not essential and not fits(settings, needs):
        settings.progress(f"  {label}: skipped ({SHARE_SPENT})")
        return {"skipped": SHARE_SPENT}
    started = time.monotonic()
    try:
        with anyio.fail_after(limit):
            result = await body()
    except TimeoutError:
        settings.progress(f"  {label}: timed out after {limit:g} s")
        return {"error": f"timed out after {limit:g} s"}
    except Exception as exc:
        settings.progress(f"  {label}: {describe_error(exc)}")
        return {"error": describe_error(exc)}
    settings.progress(f"  {label}: {_brief(result)} ({time.monotonic() - started:.1f} s)")
    return result


def describe_error(exc: BaseException) -> str:
    """One line: the exception, or for a group the first leaf and how many there were."""
    if isinstance(exc, BaseExceptionGroup):
        leaves: list[BaseException] = []
        stack: list[BaseException] = [exc]
        while stack:
            current = stack.pop()
            if isinstance(current, BaseExceptionGroup):
                stack.extend(reversed(current.exceptions))
            else:
                leaves.append(current)
        kinds = sorted({type(leaf).__name__ for leaf in leaves})
        first = leaves[0] if leaves else exc
        return (
            f"{len(leaves)} errors ({', '.join(kinds)}), the first: {type(first).__name__}: {first}"
        )
    return f"{type(exc).__name__}: {exc}"


class LogCounter(logging.Handler):
    """Counts asynclock's log records instead of printing each (a lost lease logs a warning,
    and the renewal phase can lose thousands at once): the report lists the commonest."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.counts: dict[tuple[str, str], int] = {}
        self.examples: dict[tuple[str, str], str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        key = (record.levelname, str(record.msg))
        self.counts[key] = self.counts.get(key, 0) + 1
        if key not in self.examples:
            try:
                self.examples[key] = record.getMessage()[:300]
            except Exception:
                self.examples[key] = str(record.msg)[:300]

    def take(self) -> list[str]:
        """The commonest messages since the last call, and forget them."""
        ranked = sorted(self.counts.items(), key=lambda item: -item[1])[:5]
        lines = [
            f"{count} x {level}: {self.examples[(level, msg)]}" for (level, msg), count in ranked
        ]
        self.counts.clear()
        self.examples.clear()
        return lines


def _brief(result: Any) -> str:
    if isinstance(result, dict) and "p50_ms" in result:
        return f"p50 {result['p50_ms']:.3g} ms, p99 {result['p99_ms']:.3g} ms, n={result['n']}"
    if isinstance(result, list):
        return f"{len(result)} runs"
    return "done"


def _name(tag: str, what: str) -> str:
    return f"bench/{tag}/{what}/{uuid.uuid4().hex[:8]}"


# -- one backend ----------------------------------------------------------------------------


#: The contention run the summary table shows (contenders, hold): it runs first.
TABLE_RUN = (8, 0.0)


async def measure_target(target: Target, settings: Settings, tag: str) -> dict[str, Any]:
    """Every phase for one backend within its share (``settings.deadline``, see ``_plan``):
    the summary table's phases first, cut to fit, then the others while the share lasts."""
    say = settings.progress
    began = time.monotonic()
    share = max(0.0, left(settings))
    say(f"{target.name}: {redact(target.url)} (share of the budget: {share:.1f} s)")
    result: dict[str, Any] = {"status": "measured", "url": redact(target.url)}
    try:
        with anyio.fail_after(30):
            result["versions"] = await target.versions()
            async with target.connect() as locks:
                capabilities = locks.capabilities
                result["capabilities"] = {
                    key: getattr(capabilities, key)
                    for key in ("fencing", "fifo", "loss_detection", "quorum", "cross_process")
                }
                result["backend_info"] = {
                    key: value
                    for key, value in dict(locks._backend.extra_info()).items()
                    if isinstance(value, (str, int, float, bool))
                }
    except Exception as exc:
        say(f"  cannot connect: {type(exc).__name__}: {exc}")
        return {
            "status": "not available",
            "reason": f"connecting failed: {type(exc).__name__}: {exc}",
            "url": redact(target.url),
        }
    result["share_s"] = share
    result["connect_s"] = time.monotonic() - began
    # The timing loops' caps shrink with the share (their iteration counts are the most).
    floor_budget = cut(settings.floor, max(0.3, share * 0.04))
    latency_budget = cut(settings.latency, max(0.5, share * 0.08))

    async def floor() -> dict[str, Any]:
        async with target.floor() as op:
            return {"label": target.floor_label, **summarize(await time_op(op, floor_budget))}

    result["floor"] = await phase(
        settings, "floor", floor_budget.seconds + 30, floor, essential=True
    )
    pair_context = target.pair()
    if pair_context is not None:

        async def pair() -> dict[str, Any]:
            assert pair_context is not None
            async with pair_context as op:
                return {"label": target.pair_label, **summarize(await time_op(op, floor_budget))}

        # Cheap, and what the targets compare with.
        result["pair"] = await phase(
            settings, "pair floor", floor_budget.seconds + 30, pair, essential=True
        )

    async def uncontended() -> dict[str, Any]:
        async with target.connect() as locks:
            name = _name(tag, "uncontended")

            async def op() -> None:
                async with locks.lock(name, ttl=target.long_ttl):
                    pass

            return summarize(await time_op(op, latency_budget))

    result["uncontended"] = await phase(
        settings, "uncontended", latency_budget.seconds + 30, uncontended, essential=True
    )
    runs = _task_runs(settings, share)
    limit = sum(run.duration + run.grace + 5 for run in runs) + 30
    result["contention_tasks"] = await phase(
        settings,
        "contention (tasks)",
        limit,
        lambda: _tasks(target, settings, tag, runs),
        essential=True,
    )
    await _cross_phases(target, settings, tag, share, result, first=True)
    result["loss_to_cancel"] = await phase(
        settings,
        "lease loss -> body cancelled",
        settings.loss_repeats * (target.short_ttl * 3 + 5) + 20,
        lambda: _loss(target, settings, tag),
        essential=True,
    )
    await _cross_phases(target, settings, tag, share, result, first=False)
    result["memory"] = await phase(
        settings,
        "memory",
        120 if settings.mode == "full" else 60,
        lambda: _memory(target, settings, tag),
        needs=1.0,
    )
    result["renewal"] = await phase(
        settings,
        "renewal",
        200 if settings.mode == "full" else 60,
        lambda: _renewal(target, settings, tag),
        needs=_renewal_seconds(target, settings, settings.renewal_counts[0]),
    )
    result["spent_s"] = time.monotonic() - began
    say(f"{target.name}: done in {result['spent_s']:.1f} s (share {share:.1f} s)")
    return result


def _task_runs(settings: Settings, share: float) -> list[Run]:
    """The contention runs, the table's first and cut to fit a short share."""
    runs = [
        Run(count, hold, settings.duration, settings.grace)
        for count in settings.contenders
        for hold in settings.holds
    ]
    first = next((run for run in runs if (run.contenders, run.hold) == TABLE_RUN), runs[0])
    rest = [run for run in runs if run is not first]
    return [replace(first, duration=min(first.duration, max(0.2, share * 0.08))), *rest]


async def _tasks(
    target: Target, settings: Settings, tag: str, runs: list[Run]
) -> list[dict[str, Any]]:
    """The first run always, the others while the share lasts; in the report's order."""
    records = []
    async with target.connect() as locks:
        for index, run in enumerate(runs):
            if index and not fits(settings, run.duration + 0.3):
                break
            name = _name(tag, "tasks")
            records.append(
                await contend_tasks(asynclock_factory(locks, name, target.long_ttl), run)
            )
            settings.progress(_contention_line("tasks", records[-1]))
    return sorted(records, key=lambda record: (record["contenders"], record["hold_ms"]))


def _wants_processes(unit: Target | Peer, settings: Settings) -> bool:
    if isinstance(unit, Peer):
        return settings.processes == "all"
    return settings.processes == "all" or (
        settings.processes == "embedded" and unit.name == "sqlite"
    )


async def _cross_phases(
    unit: Target | Peer,
    settings: Settings,
    tag: str,
    share: float,
    result: dict[str, Any],
    *,
    first: bool,
) -> None:
    """Contention across clients (``_cross``). ``first``: the runs of clients in one process
    (the first, the table's, always); then processes and fairness while the share lasts."""

    def name_of(what: str) -> str:
        return _name(tag, what)

    def fits_share(seconds: float) -> bool:
        return fits(settings, seconds)

    if first:
        runs = _cross.client_runs(settings, share)
        result["contention_clients"] = await phase(
            settings,
            "contention (clients, one process)",
            sum(run.duration + run.grace + 10 for run in runs) + 30,
            lambda: _cross.in_process(unit, settings, name_of, runs, fits_share),
            essential=True,
        )
        return
    cross_process = unit.cross_process if isinstance(unit, Target) else True
    if _wants_processes(unit, settings) and cross_process:
        seconds = _cross.process_seconds(settings.process_contenders[0], settings.process_duration)
        result["contention_processes"] = await phase(
            settings,
            "contention (processes, one client each)",
            len(settings.process_contenders) * (60 + settings.process_duration + 10),
            lambda: _cross.processes(unit, settings, name_of, fits_share),
            needs=seconds,
        )
    elif _wants_processes(unit, settings):
        result["contention_processes"] = {"skipped": "the backend excludes within one process only"}
    queues = unit.queues if isinstance(unit, Peer) else unit.cross_process
    if queues and not (isinstance(unit, Peer) and unit.sync):
        setting = _cross.fairness_settings(settings, unit)
        result["fairness"] = await phase(
            settings,
            "fairness",
            2 * (setting.seconds() + setting.waiters * 0.05 + 30) + 60,
            lambda: _cross.fairness(unit, settings, name_of, fits_share),
            needs=setting.seconds() + 1.5,
        )


def _contention_line(mode: str, record: dict[str, Any]) -> str:
    handoff = record["handoff"]
    p99 = f"{handoff['p99_ms']:.3g}" if handoff.get("n") else "-"
    return (
        f"    {mode} x{record['contenders']} hold {record['hold_ms']:g} ms: "
        f"{record['per_second']:.0f}/s, handoff p99 {p99} ms, "
        f"retaken {record['retaken_share']:.0%}, fewest {record['min_per_worker']}"
    )


async def _acquire_many(
    locks: asynclock.LockClient, names: list[str], ttl: float, *, within: float = 60.0
) -> list[asynclock.Lease]:
    """Take every lock in ``names`` (32 at a time); stops after ``within`` seconds."""
    leases: list[asynclock.Lease] = []
    limiter = anyio.CapacityLimiter(32)

    async def one(name: str) -> None:
        async with limiter:
            leases.append(await locks.acquire(name, ttl=ttl, timeout=30))

    with anyio.move_on_after(within):
        async with anyio.create_task_group() as group:
            for name in names:
                group.start_soon(one, name)
    return leases


async def _release_many(leases: list[asynclock.Lease]) -> None:
    limiter = anyio.CapacityLimiter(32)

    async def one(lease: asynclock.Lease) -> None:
        async with limiter:
            await lease.release()

    async with anyio.create_task_group() as group:
        for lease in leases:
            group.start_soon(one, lease)


def _renewal_seconds(target: Target, settings: Settings, wanted: int) -> float:
    """About what measuring ``wanted`` held locks takes: taking them (a thousand or so a
    second), waiting for a renewal, then the window."""
    interval = target.renewal_ttl * (3 if wanted > 1000 else 1) / 3
    intervals = 1 if wanted > 1000 else settings.renewal_intervals
    return min(wanted, target.max_held) / 1000 + interval * (intervals + 1.5)


async def _renewal(target: Target, settings: Settings, tag: str) -> list[dict[str, Any]]:
    """Round trips per renewal interval (ttl / 3) with 1, 100, 10,000 locks held by one client."""
    records: list[dict[str, Any]] = []
    async with target.connect() as locks:
        for index, wanted in enumerate(settings.renewal_counts):
            if index and not fits(settings, _renewal_seconds(target, settings, wanted)):
                break
            # Taking 10,000 locks takes seconds: a longer lease, so that none expires meanwhile.
            ttl = target.renewal_ttl * (3 if wanted > 1000 else 1)
            interval = ttl / 3
            count = min(wanted, target.max_held)
            record: dict[str, Any] = {"locks": count, "interval_s": interval}
            if count < wanted:
                record["capped_from"] = wanted
                record["capped_why"] = f"{target.name} holds at most {target.max_held} locks here"
            started = time.monotonic()
            leases = await _acquire_many(
                locks,
                [_name(tag, f"renew{count}-{i}") for i in range(count)],
                ttl,
                within=ACQUIRE_MANY_SECONDS,
            )
            record["acquire_seconds"] = time.monotonic() - started
            if len(leases) < count:
                record["capped_from"] = wanted
                record["capped_why"] = f"only {len(leases)} taken in {ACQUIRE_MANY_SECONDS} s"
                record["locks"] = count = len(leases)
            try:
                # Start the window right after a renewal, so that it holds whole intervals.
                before = locks.renew_calls
                with anyio.move_on_after(interval * 2 + 5):
                    # A counter, not an event: poll it.
                    while locks.renew_calls == before:  # noqa: ASYNC110
                        await anyio.sleep(0.005)
                calls0 = locks.renew_calls
                server0 = await target.server_requests()
                time0 = time.monotonic()
                # One (long) interval for 10,000 locks, to stay inside the run's time budget.
                intervals = 1 if wanted > 1000 else settings.renewal_intervals
                await anyio.sleep(interval * (intervals + 0.5))
                calls1 = locks.renew_calls
                server1 = await target.server_requests()
                record["window_s"] = time.monotonic() - time0
                record["renew_calls_per_interval"] = (calls1 - calls0) / intervals
                if server0 is not None and server1 is not None:
                    record["server_requests_per_interval"] = (server1 - server0) / intervals
                    record["server_requests_label"] = target.server_requests_label
                record["lost"] = sum(lease.lost for lease in leases)
            finally:
                await _release_many(leases)
            records.append(record)
            settings.progress(
                f"    {count} locks: {record.get('renew_calls_per_interval')} renew calls, "
                f"{record.get('server_requests_per_interval')} server requests per interval"
            )
    return records


async def _loss(target: Target, settings: Settings, tag: str) -> dict[str, Any]:
    """From the server dropping the lease to the body's cancellation (``LeaseLost`` raised)."""
    ttl = target.short_ttl
    samples: list[float] = []
    outcomes: dict[str, int] = {}
    async with target.connect() as locks:
        await _lose(target, settings, tag, locks, samples, outcomes)
    return {**summarize(samples), "ttl_s": ttl, "outcomes": outcomes}


async def _lose(
    target: Target,
    settings: Settings,
    tag: str,
    locks: asynclock.LockClient,
    samples: list[float],
    outcomes: dict[str, int],
) -> None:
    for index in range(settings.loss_repeats):
        # The first always (the summary shows it); one try takes up to about 2/3 of the ttl.
        if index and not fits(settings, target.short_ttl * 2 / 3):
            break
        outcome, seconds = await _lose_once(target, locks, _name(tag, "loss"))
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        if seconds is not None:
            samples.append(seconds)


async def _lose_once(
    target: Target, locks: asynclock.LockClient, name: str
) -> tuple[str, float | None]:
    """Hold ``name``, revoke it on the server, and time the body's cancellation."""
    ttl = target.short_ttl
    holding = anyio.Event()
    lost_at: list[float] = []
    outcome = ["not cancelled"]

    async def body() -> None:
        try:
            async with locks.lock(name, ttl=ttl):
                holding.set()
                await anyio.sleep(ttl * 3)
        except asynclock.LeaseLost as exc:
            lost_at.append(time.monotonic())
            # Cancelled by the local deadline rather than by the detected loss.
            outcome[0] = "deadline" if "deadline" in str(exc) else "LeaseLost"

    async with anyio.create_task_group() as group:
        group.start_soon(body)
        await holding.wait()
        # Anywhere within a renewal interval: detection by renewal depends on it.
        await anyio.sleep(random.uniform(0.02, ttl / 3))
        revoked_at = time.monotonic()
        await target.revoke(locks, name)
    return outcome[0], (lost_at[0] - revoked_at if lost_at else None)


async def _memory(target: Target, settings: Settings, tag: str) -> dict[str, Any]:
    """Python heap (tracemalloc) per held lock and per waiter, net of a bare parked task."""
    count = min(settings.memory_count, target.max_held)
    # A waiter may hold a connection (a blocking pop, a waiting advisory lock): a few hundred
    # stay well inside the default limit of 1024 open files.
    waiters = min(settings.memory_count, MAX_WAITERS, max(10, target.max_held // 2))

    def traced() -> int:
        gc.collect()
        return tracemalloc.get_traced_memory()[0]

    tracemalloc.start()
    try:
        async with target.connect() as locks:
            async with locks.lock(_name(tag, "warm"), ttl=target.long_ttl):
                pass
            # What a parked task costs by itself, to subtract from the waiters.
            release = anyio.Event()
            async with anyio.create_task_group() as group:
                before = traced()
                for _ in range(waiters):
                    group.start_soon(release.wait)
                await anyio.sleep(0.05)
                bare_task = (traced() - before) / waiters
                release.set()

            before = traced()
            leases = await _acquire_many(
                locks, [_name(tag, f"mem-{i}") for i in range(count)], target.long_ttl
            )
            per_lock = (traced() - before) / count
            await _release_many(leases)
            del leases

            name = _name(tag, "mem-wait")
            holder = await locks.acquire(name, ttl=target.long_ttl, timeout=30)
            async with anyio.create_task_group() as group:
                before = traced()

                async def wait() -> None:
                    async with locks.lock(name, ttl=target.long_ttl, timeout=60):
                        pass

                for _ in range(waiters):
                    group.start_soon(wait)
                # Let every waiter reach its wait (a few polls for the polling backends).
                await anyio.sleep(0.5)
                per_waiter = (traced() - before) / waiters - bare_task
                # Cancelled waits clean up after themselves; faster than 200 turns in a row.
                group.cancel_scope.cancel()
            await holder.release()
    finally:
        tracemalloc.stop()
    return {
        "held_locks": count,
        "waiters": waiters,
        "bytes_per_held_lock": per_lock,
        "bytes_per_waiter": per_waiter,
        "bytes_per_bare_task": bare_task,
    }


# -- peers ----------------------------------------------------------------------------------


async def measure_peer(peer: Peer, settings: Settings, tag: str) -> dict[str, Any]:
    """A peer within its share (``settings.deadline``): uncontended latency and the table's
    contention run always (cut to fit), the run with a hold while the share lasts."""
    say = settings.progress
    share = max(0.0, left(settings))
    say(
        f"peer {peer.name} ({'sync, threads' if peer.sync else 'async'}; "
        f"share of the budget: {share:.1f} s)"
    )
    result: dict[str, Any] = {"status": "measured", **peer_info(peer), "share_s": share}
    latency = cut(settings.peer_latency, max(0.3, share * 0.15))
    runs = [
        Run(settings.peer_contenders, hold, settings.peer_duration, settings.grace)
        for hold in settings.holds
    ]
    runs[0] = replace(runs[0], duration=min(runs[0].duration, max(0.2, share * 0.15)))
    if settings.mode != "smoke" and settings.peer_contenders != 2:
        # Issue #18 compares 2-task throughput too (etcd against aetcd).
        runs.append(Run(2, 0.0, settings.peer_duration, settings.grace))
    limit = latency.seconds + sum(r.duration + r.grace + 10 for r in runs) + 60
    if isinstance(peer, AsyncPeer):
        result.update(
            await phase(
                settings,
                "peer",
                limit,
                lambda: _async_peer(peer, settings, tag, latency, runs),
                essential=True,
            )
        )
    elif isinstance(peer, SyncPeer):
        result.update(
            await phase(
                settings,
                "peer",
                limit,
                lambda: anyio.to_thread.run_sync(_sync_peer, peer, settings, tag, latency, runs),
                essential=True,
            )
        )
    if "error" in result or "skipped" in result:
        result["status"] = "failed" if "error" in result else "skipped"
        return result
    await _cross_phases(peer, settings, tag, share, result, first=True)
    await _cross_phases(peer, settings, tag, share, result, first=False)
    return result


async def measure_alternated(
    target: Target,
    peer: Peer,
    ours: dict[str, Any],
    theirs: dict[str, Any],
    settings: Settings,
    tag: str,
) -> dict[str, Any]:
    """asynclock and ``peer`` in alternated rounds (``_alternate``), within the share given
    by ``settings.deadline``: the first round always, once both were measured."""
    if ours.get("status") != "measured" or theirs.get("status") != "measured":
        return {"skipped": "asynclock or the peer was not measured"}
    duration = settings.duration
    first = _alternate.round_seconds(duration)
    settings.progress(
        f"alternated rounds, {target.name} / {peer.name} (share {max(0.0, left(settings)):.1f} s)"
    )
    result: dict[str, Any] = await phase(
        settings,
        "alternated rounds",
        _alternate.ROUNDS * (first + 10 * len(_alternate.CLIENTS)) + 60,
        lambda: _alternate.alternated(
            target,
            peer,
            duration=duration,
            grace=settings.grace,
            name_of=lambda what: _name(tag, what),
            fits=lambda seconds: fits(settings, seconds),
        ),
        essential=True,
    )
    for count, row in result.get("clients", {}).items():
        ratios = ", ".join("-" if value is None else f"{value:.2f}" for value in row["ratios"])
        median = "-" if row["median"] is None else f"{row['median']:.2f}x"
        settings.progress(f"    alternated x{count}: {ratios}; median {median}")
    return result


async def _async_peer(
    peer: AsyncPeer, settings: Settings, tag: str, latency: Budget, runs: list[Run]
) -> dict[str, Any]:
    async with peer.session() as factory:
        async with factory(_name(tag, "peer"))(0) as hold:

            async def op() -> None:
                async with hold(30.0) as got:
                    if not got:
                        raise RuntimeError("an uncontended acquire failed")

            uncontended = summarize(await time_op(op, latency))
        contention = []
        for index, run in enumerate(runs):
            if index and not fits(settings, run.duration + 0.3):
                break
            contention.append(await contend_tasks(factory(_name(tag, "peer-tasks")), run))
            settings.progress(_contention_line("tasks", contention[-1]))
    return {"uncontended": uncontended, "contention_tasks": contention}


def _sync_peer(
    peer: SyncPeer, settings: Settings, tag: str, latency: Budget, runs: list[Run]
) -> dict[str, Any]:
    with peer.session() as factory:
        with factory(_name(tag, "peer"))(0) as hold:

            def op() -> None:
                with hold(30.0) as got:
                    if not got:
                        raise RuntimeError("an uncontended acquire failed")

            uncontended = summarize(time_sync_op(op, latency))
        contention = []
        for index, run in enumerate(runs):
            if index and not fits(settings, run.duration + 0.3):
                break
            contention.append(contend_threads(factory(_name(tag, "peer-threads")), run))
            settings.progress(_contention_line("threads", contention[-1]))
    return {"uncontended": uncontended, "contention_tasks": contention}
