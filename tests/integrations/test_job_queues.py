"""arq, saq and taskiq with their real workers (2 processes each) on the session's Redis: 500 jobs
over 10 accounts, deferring busy jobs at once and waiting for the lock. The jobs
(jobqueue_workers.py) record their start and end in Redis while they hold their lock."""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import os
import random
import signal
import sys
import uuid
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, cast

import anyio
import pytest
import redis.asyncio

import asynclock
from asynclock.testing import RedisServer
from tests.contract.harness import until

from ._servers import Process, start_process, stop_processes
from .jobqueue_common import PAUSED_JOB, PAUSED_KEY, READY_KEY, call, records_key, runs_key

pytestmark = pytest.mark.anyio

JOBS = 500
ACCOUNTS = [f"acct{number}" for number in range(10)]
#: Redis databases of their own: one per queue, one for the locks (each run has its own prefix).
QUEUE_DBS = {"arq": 8, "saq": 9, "taskiq": 10}
LOCK_DB = 11
#: How long one batch of 500 jobs may take before the test gives up.
BATCH_TIMEOUT = 40.0
#: How long the "waiting" batch keeps a lock holder stopped: past its ttl (1 s).
PAUSE = 1.5


def job_list(seed: int) -> list[tuple[str, int]]:
    jobs = [(ACCOUNTS[number % len(ACCOUNTS)], number) for number in range(JOBS)]
    random.Random(seed).shuffle(jobs)
    return jobs


class JobQueue:
    """What the three queues share; each also has ``open()``,
    ``submit(mode, account, job_id)`` (a handle), ``outcome(handle)`` (why the job did not
    succeed, ``None`` if it did, and how often it was deferred) and ``aclose()``."""

    name: str
    #: The worker's command, after ``python -m``.
    command: tuple[str, ...]

    def __init__(self, port: int) -> None:
        self.port = port
        self.db = QUEUE_DBS[self.name]
        self.url = f"redis://127.0.0.1:{port}/{self.db}"

    async def settled(self) -> None:
        """Wait until the started workers have done what they do once at start-up."""


class Arq(JobQueue):
    name = "arq"
    command = ("arq", "tests.integrations.jobqueue_workers.ArqSettings")

    async def open(self) -> None:
        from arq import create_pool
        from arq.connections import RedisSettings

        self.pool = await create_pool(
            RedisSettings(host="127.0.0.1", port=self.port, database=self.db)
        )

    async def submit(self, mode: str, account: str, job_id: int) -> Any:
        handle = await self.pool.enqueue_job(mode, account, job_id)
        assert handle is not None
        return handle

    async def outcome(self, handle: Any) -> tuple[str | None, int]:
        # result_info() unpickles the stored result: an asynclock error must survive that.
        info = await handle.result_info()
        if info is None or not info.success:
            return f"{handle.job_id}: {info and info.result!r}", 0
        return None, info.job_try - 1  # each deferral was one of arq's tries

    async def aclose(self) -> None:
        await self.pool.aclose()


class Saq(JobQueue):
    name = "saq"
    command = ("saq", "tests.integrations.jobqueue_workers.saq_settings")

    async def open(self) -> None:
        from saq import Queue

        self.queue = Queue.from_url(self.url, name="jobqueue")
        await self.queue.connect()

    async def settled(self) -> None:
        # A starting saq worker sweeps the active list (then not again for 60 s). A job another
        # worker has taken but not yet marked active looks stuck to it and is run again: saq's
        # own race. Its sweep key says the first sweep is done.
        from saq.queue.redis import RedisQueue

        queue = cast(RedisQueue, self.queue)
        with anyio.fail_after(10):
            while not await queue.redis.exists(queue.namespace("sweep")):  # noqa: ASYNC110 - polls Redis
                await anyio.sleep(0.02)

    async def submit(self, mode: str, account: str, job_id: int) -> Any:
        handle = await self.queue.enqueue(mode, account=account, job_id=job_id, timeout=30)
        assert handle is not None
        return handle

    async def outcome(self, handle: Any) -> tuple[str | None, int]:
        from saq.job import Status

        job = await self.queue.job(handle.key)
        if job is None or job.status is not Status.COMPLETE:
            return f"{handle.key}: {job and job.status} {job and job.error}", 0
        return None, int(job.meta.get("asynclock", {}).get("deferrals", 0))

    async def aclose(self) -> None:
        await self.queue.disconnect()


class Taskiq(JobQueue):
    name = "taskiq"
    # One taskiq worker command with its own process manager and 2 worker processes.
    command = (
        "taskiq", "worker", "tests.integrations.jobqueue_workers:broker",
        "--workers", "2", "--max-async-tasks", "5", "--shutdown-timeout", "10",
    )  # fmt: skip

    async def open(self) -> None:
        from .jobqueue_common import RedisListBroker, RedisResultBackend

        self.results: RedisResultBackend[str] = RedisResultBackend(self.url)
        self.broker = RedisListBroker(self.url, queue_name="jobqueue").with_result_backend(
            self.results
        )
        await self.broker.startup()

    async def submit(self, mode: str, account: str, job_id: int) -> Any:
        from taskiq.kicker import AsyncKicker

        kicker: AsyncKicker[Any, Any] = AsyncKicker(f"jobqueue.{mode}", self.broker, {})
        return await kicker.kiq(account, job_id)

    async def outcome(self, handle: Any) -> tuple[str | None, int]:
        if not await self.results.is_result_ready(handle.task_id):
            return f"{handle.task_id}: no result", 0
        result = await self.results.get_result(handle.task_id)
        if result.is_err:
            return f"{handle.task_id}: {result.error!r}", 0
        return None, int(result.labels.get("X-Taskiq-requeue", 0))

    async def aclose(self) -> None:
        await self.broker.shutdown()


Queue = Arq | Saq | Taskiq
QUEUES: dict[str, type[Queue]] = {"arq": Arq, "saq": Saq, "taskiq": Taskiq}


async def outcomes(queue: Queue, handles: list[Any]) -> tuple[list[str], int]:
    """Why each job that did not succeed failed, and how often the jobs were deferred."""
    found = [await queue.outcome(handle) for handle in handles]
    return [error for error, _ in found if error is not None], sum(n for _, n in found)


def tail(log: Path, size: int = 0) -> str:
    return log.read_text()[-size:]


def overlaps(records: list[dict[str, Any]]) -> list[str]:
    by_account: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        by_account[record["account"]].append(record)
    found = []
    for account, runs in by_account.items():
        runs.sort(key=lambda run: run["start"])
        for before, after in itertools.pairwise(runs):
            if after["start"] < before["end"]:
                found.append(f"{account}: job {before['job']} and job {after['job']}")
    found += [
        f"{r['account']}: job {r['job']} saw {r['active']} active"
        for r in records
        if r["active"] != 1
    ]
    return found


@asynccontextmanager
async def lock_server(
    redis_server: RedisServer, label: str
) -> AsyncIterator[tuple[str, str, redis.asyncio.Redis]]:
    """A lock URL with a prefix of its own, the prefix, and a client of its database; afterwards,
    no key of it may be left but the fencing counters (which stay by design), cleaned up then."""
    prefix = f"jq-{label}-{uuid.uuid4().hex[:6]}:"
    url = (
        f"redis://127.0.0.1:{redis_server.port}/{LOCK_DB}?prefix={prefix}&durability_warning=false"
    )
    async with redis.asyncio.Redis(host="127.0.0.1", port=redis_server.port, db=LOCK_DB) as lock_db:
        try:
            yield url, prefix, lock_db
            keys = [key.decode() async for key in lock_db.scan_iter(match=f"{prefix}*")]
            assert [key for key in keys if not key.startswith(f"{prefix}token:")] == []
        finally:
            keys = [key async for key in lock_db.scan_iter(match=f"{prefix}*")]
            if keys:
                await lock_db.delete(*keys)


async def wait_for(
    count: Callable[[], Awaitable[int]], want: int, processes: list[Any], log: Path, limit: float
) -> None:
    """Wait until ``count()`` reaches ``want`` (at most ``limit`` seconds); fail at once, with
    the workers' log, if a worker process exits meanwhile."""
    with anyio.move_on_after(limit):
        while await count() < want:
            exited = [process.returncode for process in processes if process.poll() is not None]
            assert not exited, f"worker exited ({exited}):\n{tail(log, 3000)}"
            await anyio.sleep(0.05)


async def resume_paused(records_db: redis.asyncio.Redis) -> None:
    """Wait until the worker that stopped itself holding a lock is stopped, keep it stopped past
    its lease's ttl, and resume it."""
    await until(lambda: records_db.exists(PAUSED_KEY), BATCH_TIMEOUT)
    pid = int(await records_db.get(PAUSED_KEY))
    stat = Path(f"/proc/{pid}/stat")
    await until(lambda: stat.read_text().rpartition(")")[2].split()[0] == "T")
    await anyio.sleep(PAUSE)
    os.kill(pid, signal.SIGCONT)


async def run_batch(
    queue: Queue,
    mode: str,
    seed: int,
    records_db: redis.asyncio.Redis,
    workers: list[Any],
    log: Path,
) -> None:
    jobs = job_list(seed)
    handles = [await queue.submit(mode, *job) for job in jobs]
    if mode == "waiting":
        await resume_paused(records_db)
    await wait_for(
        lambda: call(records_db, "HLEN", records_key(mode)), JOBS, workers, log, BATCH_TIMEOUT
    )
    records = [json.loads(item) for item in await call(records_db, "HVALS", records_key(mode))]
    assert {record["job"] for record in records} == {job_id for _, job_id in jobs}, (
        f"{mode}: {JOBS - len(records)} jobs never ran\n{tail(log, 3000)}"
    )
    runs = {
        int(job): int(n) for job, n in (await call(records_db, "HGETALL", runs_key(mode))).items()
    }
    if mode == "deferring":
        assert [job for job, n in runs.items() if n > 1] == [], f"ran more than once\n{tail(log)}"
        assert overlaps(records) == []
    else:
        # The stopped holder's lease was lost: its job ran again (its fenced write is once).
        assert runs[PAUSED_JOB] >= 2, runs[PAUSED_JOB]
    assert len({record["pid"] for record in records}) == 2, mode  # both processes worked
    # The queue writes a job's outcome just after the job's record.
    failed, deferrals = await outcomes(queue, handles)
    with anyio.move_on_after(10):
        while failed:
            await anyio.sleep(0.1)
            failed, deferrals = await outcomes(queue, handles)
    assert failed == [], mode
    if mode == "deferring":
        assert deferrals > 0  # busy locks did defer jobs
    reruns = sum(runs.values()) - JOBS
    print(f"{queue.name} {mode}: {len(records)} jobs, {deferrals} deferrals, {reruns} reruns")


@pytest.mark.parametrize("queue_name", list(QUEUES))
async def test_500_jobs_over_10_accounts_on_2_worker_processes_one_stopped_past_its_ttl(
    queue_name: str, redis_server: RedisServer, tmp_path: Path
) -> None:
    queue = QUEUES[queue_name](redis_server.port)
    log = tmp_path / f"{queue_name}-workers.log"
    async with (
        lock_server(redis_server, queue_name) as (lock_url, _, _),
        redis.asyncio.Redis(host="127.0.0.1", port=redis_server.port, db=queue.db) as records_db,
    ):
        env = dict(os.environ)
        env.update(
            JOBQUEUE_PORT=str(redis_server.port), JOBQUEUE_DB=str(queue.db), JOBQUEUE_LOCKS=lock_url
        )
        await records_db.flushdb()
        await queue.open()
        processes: list[Process] = []
        try:
            # taskiq's command starts 2 worker processes itself; arq and saq: 2 commands.
            count = 1 if queue_name == "taskiq" else 2
            processes.extend(
                start_process([sys.executable, "-m", *queue.command], env, log)
                for _ in range(count)
            )
            ready = functools.partial(call, records_db, "SCARD", READY_KEY)
            await wait_for(ready, 2, processes, log, 20)
            assert await ready() == 2, f"workers did not start:\n{tail(log, 3000)}"
            await queue.settled()
            for seed, mode in enumerate(["deferring", "waiting"]):
                await run_batch(queue, mode, seed, records_db, processes, log)
        finally:
            await stop_processes(processes, grace=15)
            await queue.aclose()
            await records_db.flushdb()
        # The workers shut down gracefully: no error, and (lock_server checks) no lock left.
        assert "Traceback" not in tail(log), tail(log, 3000)


# -- the lifecycle helpers, with each queue's own worker in this process ---------------------------
# These tests allow their lease-loss warning instead of expecting it: in two whole
# runs (this directory with tests/contract, -n 2) it never came although the job failed with
# LeaseLost, and in every run of this file alone it did. Unexplained so far.


class Losing:
    """A job body that loses the lease of ``life/{n}`` on its first ``times`` runs, then returns
    how many runs it took."""

    def __init__(self, lock_db: redis.asyncio.Redis, prefix: str) -> None:
        self.lock_db = lock_db
        self.prefix = prefix
        self.runs: Counter[int] = Counter()

    async def __call__(self, n: int, times: int) -> str:
        self.runs[n] += 1
        if self.runs[n] > times:
            return f"run {self.runs[n]}"
        await self.lock_db.delete(f"{self.prefix}lock:{{life/{n}}}")  # as if it had expired
        await asyncio.sleep(5)
        return "not reached"


def assert_closed(worker_locks: Any, before: set[asyncio.Task[Any]]) -> None:
    with pytest.raises(RuntimeError, match="not open"):
        worker_locks.client  # noqa: B018
    assert [task for task in asyncio.all_tasks() - before if not task.done()] == []


# arq's Worker.close() calls redis-py's deprecated close().
@pytest.mark.filterwarnings("ignore:Call to deprecated close:DeprecationWarning")
@pytest.mark.allow_log(r"lease on 'life/([13])' lost: the hold of 'life/\1' is gone")
async def test_arq_worker_opens_the_client_at_startup_and_closes_it_at_shutdown_and_reruns_lost_jobs(
    redis_server: RedisServer,
) -> None:
    from arq import Worker, create_pool
    from arq.connections import RedisSettings

    from asynclock.integrations.arq import WorkerLocks, locked

    settings = RedisSettings(host="127.0.0.1", port=redis_server.port, database=QUEUE_DBS["arq"])
    hooks_ran_in: dict[str, asyncio.Task[Any] | None] = {}
    async with lock_server(redis_server, "arq-life") as (lock_url, prefix, lock_db):
        worker_locks = WorkerLocks(lock_url)

        async def on_startup(ctx: dict[str, Any]) -> None:
            hooks_ran_in["startup"] = asyncio.current_task()
            await worker_locks.on_startup(ctx)

        async def on_shutdown(ctx: dict[str, Any]) -> None:
            hooks_ran_in["shutdown"] = asyncio.current_task()
            await worker_locks.on_shutdown(ctx)

        losing = Losing(lock_db, prefix)

        @locked("life/{n}", ttl=1, defer=0.05, max_tries=2)
        async def lose(ctx: dict[str, Any], n: int, times: int) -> str:
            return await losing(n, times)

        @locked("life/{n}")
        async def keep(ctx: dict[str, Any], n: int) -> int:
            return n * 2

        before = asyncio.all_tasks()
        pool = await create_pool(settings)
        try:
            # arq names a job after its function's __qualname__, which @locked keeps.
            lost_job = await pool.enqueue_job(lose.__qualname__, 1, 99)
            rerun_job = await pool.enqueue_job(lose.__qualname__, 3, 1)
            kept_job = await pool.enqueue_job(keep.__qualname__, 2)
            assert lost_job is not None and rerun_job is not None and kept_job is not None
            worker = Worker(
                functions=[lose, keep],  # type: ignore[list-item]
                redis_settings=settings,
                on_startup=on_startup,
                on_shutdown=on_shutdown,
                burst=True,
                handle_signals=False,
                poll_delay=0.01,
                max_tries=2,
            )
            # As arq's Worker.run() does: main() in a task of its own, close() in another.
            with anyio.fail_after(20):
                await asyncio.create_task(worker.main())
                await worker.close()
            assert await kept_job.result(timeout=1) == 4
            # A lost lease is one of arq's tries: run again, and on the last try a failure.
            assert await rerun_job.result(timeout=1) == "run 2"
            assert losing.runs == {1: 2, 3: 2}
            # The failed job's result is read back (unpickled) as asynclock's own error.
            info = await lost_job.result_info()
            assert info is not None and not info.success
            assert isinstance(info.result, asynclock.LeaseLost)
            assert info.result.name == "life/1"
            with pytest.raises(asynclock.LeaseLost):
                await lost_job.result(timeout=1)  # arq raises the job's own error
        finally:
            await pool.aclose()
        assert hooks_ran_in["startup"] is not hooks_ran_in["shutdown"]
        assert_closed(worker_locks, before)


@pytest.mark.allow_log(r"lease on 'life/([46])' lost: the hold of 'life/\1' is gone")
async def test_saq_worker_opens_the_client_at_startup_and_closes_it_at_shutdown_and_reruns_lost_jobs(
    redis_server: RedisServer,
) -> None:
    from saq import Queue, Worker
    from saq.job import TERMINAL_STATUSES, Status

    from asynclock.integrations.saq import WorkerLocks, locked

    async with lock_server(redis_server, "saq-life") as (lock_url, prefix, lock_db):
        worker_locks = WorkerLocks(lock_url)

        @locked("life/{n}")
        async def keep(ctx: Any, *, n: int) -> int:
            assert ctx["asynclock"] is worker_locks.client
            return n * 2

        losing = Losing(lock_db, prefix)

        @locked("life/{n}", ttl=1, defer=0.05, lost_retries=1)
        async def lose(ctx: Any, *, n: int, times: int) -> str:
            return await losing(n, times)

        before = asyncio.all_tasks()
        queue = Queue.from_url(f"redis://127.0.0.1:{redis_server.port}/{QUEUE_DBS['saq']}")
        await queue.connect()
        try:
            worker = Worker(
                queue,
                functions=[keep, lose],
                startup=worker_locks.startup,
                shutdown=worker_locks.shutdown,
                concurrency=2,
            )
            # As in Saq.settled above: a worker's start-up sweep aborts a job taken but not yet
            # marked active; sweeping the empty queue first holds it off for `lock` seconds.
            await queue.sweep(lock=120)
            job = await queue.enqueue(keep.__qualname__, n=3)
            lost = await queue.enqueue(lose.__qualname__, n=4, times=99)  # retries=1: no retry
            rerun = await queue.enqueue(lose.__qualname__, n=6, times=1)
            assert job is not None and lost is not None and rerun is not None
            jobs = (job, lost, rerun)
            running = asyncio.create_task(worker.start())
            with anyio.fail_after(20):
                # Polled: refresh(until_complete=...) misses a job that completes between its
                # read and its subscription to the job's updates, then waits out its timeout.
                while any(each.status not in TERMINAL_STATUSES for each in jobs):
                    await anyio.sleep(0.02)
                    for each in jobs:
                        await each.refresh()
                assert (job.status, job.result) == (Status.COMPLETE, 6), job.error
                # Run again once each without using up the job's retries, then a failure.
                assert (rerun.status, rerun.result) == (Status.COMPLETE, "run 2"), rerun.error
                assert losing.runs == {4: 2, 6: 2}
                counts = {"deferrals": 0, "lost": 1}
                assert lost.meta["asynclock"] == rerun.meta["asynclock"] == counts
                assert lost.status is Status.FAILED
                assert "asynclock.LeaseLost: lease on lock 'life/4' was lost" in (lost.error or "")
                await worker.stop()  # from this task: start-up ran in the worker's
                await running
        finally:
            await queue.disconnect()
        assert_closed(worker_locks, before)


@pytest.mark.allow_log(r"lease on 'life/([57])' lost: the hold of 'life/\1' is gone")
async def test_taskiq_worker_events_open_and_close_the_client_and_rerun_lost_tasks(
    redis_server: RedisServer,
) -> None:
    from taskiq import InMemoryBroker

    from asynclock.integrations.taskiq import WorkerLocks, locked

    async with lock_server(redis_server, "taskiq-life") as (lock_url, prefix, lock_db):
        broker = InMemoryBroker()
        worker_locks = WorkerLocks(lock_url).install(broker)

        @broker.task
        @locked("life/{n}")
        async def keep(n: int) -> int:
            return n * 2

        losing = Losing(lock_db, prefix)

        @broker.task
        @locked("life/{n}", ttl=1, defer=0.05, lost_retries=1)
        async def lose(n: int, times: int) -> str:
            return await losing(n, times)

        before = asyncio.all_tasks()
        # WORKER_STARTUP and WORKER_SHUTDOWN in different tasks.
        await asyncio.create_task(broker.startup())
        assert broker.state.asynclock is worker_locks.client
        sent = await keep.kiq(4)
        result = await sent.wait_result(timeout=10)
        assert not result.is_err
        rerun = await (await lose.kiq(7, 1)).wait_result(timeout=10)
        assert not rerun.is_err and cast(Any, rerun.return_value) == "run 2"
        assert rerun.labels["asynclock-lost"] == "1"
        lost = await (await lose.kiq(5, 99)).wait_result(timeout=10)
        assert lost.is_err
        assert isinstance(lost.error, asynclock.LeaseLost)
        assert losing.runs == {7: 2, 5: 2}
        await broker.shutdown()
        assert "asynclock" not in broker.state
        assert_closed(worker_locks, before)
