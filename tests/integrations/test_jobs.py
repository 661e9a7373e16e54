"""The job-queue decorators (arq, saq, taskiq) called as their workers call them. Their real
workers are in test_job_queues.py; a plain worker pool is examples/worker_pool.py."""

from __future__ import annotations

import time
from typing import Any, cast

import anyio
import pytest

import asynclock

pytestmark = pytest.mark.anyio


async def hold_elsewhere(locks: asynclock.LockClient, name: str) -> asynclock.Lease:
    lease = await locks.try_acquire(name)
    assert lease is not None
    return lease


async def test_arq_defers_a_busy_job_with_retry_and_jitter_but_waits_on_the_last_try(
    locks: asynclock.LockClient,
) -> None:
    from arq import Retry

    from asynclock.integrations import arq

    ran: list[int] = []

    @arq.locked("invoice-{invoice_id}", defer=2.0, jitter=0.5)
    async def charge(ctx: dict[str, Any], invoice_id: int) -> int:
        ran.append(invoice_id)
        return invoice_id

    holder = await hold_elsewhere(locks, "invoice-7")
    delays = []
    for _ in range(20):
        with pytest.raises(Retry) as caught:
            await charge({"job_try": 1, "asynclock": locks}, 7)
        assert isinstance(caught.value.__cause__, asynclock.AcquireTimeout)
        assert caught.value.defer_score is not None
        delays.append(caught.value.defer_score / 1000)
    assert ran == []
    assert all(1.0 <= delay <= 3.0 for delay in delays), delays
    assert len(set(delays)) > 1  # jittered
    await holder.release()
    assert await charge({"job_try": 2, "asynclock": locks}, 7) == 7

    # A timeout from the job's own lock is its error, not a deferral.
    @arq.locked("outer-{n}")
    async def job(ctx: dict[str, Any], n: int) -> None:
        async with locks.lock("inner", timeout=0):
            pass

    holder = await hold_elsewhere(locks, "inner")
    with pytest.raises(asynclock.AcquireTimeout) as inner:
        await job({"job_try": 1, "asynclock": locks}, 1)
    assert inner.value.name == "inner"
    await holder.release()

    # arq waits for the lock on the last try instead of failing.
    @arq.locked("invoice-{invoice_id}", max_tries=3)
    async def charge_last(ctx: dict[str, Any], invoice_id: int) -> str:
        return f"charged {invoice_id}"

    holder = await hold_elsewhere(locks, "invoice-8")
    last: list[str] = []

    async def last_try() -> None:
        last.append(await charge_last({"job_try": 3, "asynclock": locks}, 8))

    async with anyio.create_task_group() as task_group:
        task_group.start_soon(last_try)
        await anyio.sleep(0.05)
        assert last == []  # waiting, not deferred (arq would fail a 4th try)
        await holder.release()
    assert last == ["charged 8"]


@pytest.mark.expect_log(r"lease on 'slow-1' (was )?lost")
async def test_a_job_that_returned_before_its_lease_loss_was_known_keeps_its_result(
    locks: asynclock.LockClient,
) -> None:
    # A job that fails with LeaseLost: test_job_queues' lifecycle tests, on each queue's worker.
    from asynclock.integrations import arq

    @arq.locked("slow-{n}", ttl=0.3)
    async def paused(ctx: dict[str, Any], n: int) -> str:
        time.sleep(0.35)  # noqa: ASYNC251 - a paused process: the deadline passes unseen
        return "done"

    # Returned, not raised (LeaseLost would make arq record a failure; Retry would redo it).
    assert await paused({"job_try": 1, "asynclock": locks}, 1) == "done"


async def test_saq_defers_with_one_more_retry_and_restores_the_jobs_own_settings(
    locks: asynclock.LockClient,
) -> None:
    from saq.job import Job

    from asynclock.integrations import saq

    @saq.locked("invoice-{invoice_id}", defer=2.0, jitter=0.25)
    async def charge(ctx: dict[str, Any], *, invoice_id: int) -> int:
        return invoice_id

    job = Job("charge", kwargs={"invoice_id": 3}, retries=2, retry_delay=7.0, retry_backoff=30.0)
    job.attempts = 1  # as saq's worker counts it before calling the function
    holder = await hold_elsewhere(locks, "invoice-3")
    with pytest.raises(asynclock.AcquireTimeout):
        await charge({"job": job, "asynclock": locks}, invoice_id=3)
    # saq now retries it (retries > attempts) after this deferral's delay, without backoff.
    assert (job.retries, job.retryable) == (3, True)
    assert 1.5 <= job.next_retry_delay() <= 2.5
    assert job.meta["asynclock"]["deferrals"] == 1
    await holder.release()
    job.attempts = 2
    assert await charge({"job": job, "asynclock": locks}, invoice_id=3) == 3
    # The job's own retry settings are back for its real failures; one retry is still its own.
    assert (job.retry_delay, job.retry_backoff) == (7.0, 30.0)
    assert job.retries - job.meta["asynclock"]["deferrals"] == 2


async def test_taskiq_requeues_a_busy_task_until_it_gets_the_lock(
    locks: asynclock.LockClient,
) -> None:
    from taskiq import InMemoryBroker

    from asynclock.integrations import taskiq

    broker = InMemoryBroker()
    runs: list[int] = []

    @broker.task
    @taskiq.locked("invoice-{invoice_id}", client=locks, defer=0.01)
    async def charge(invoice_id: int) -> int:
        runs.append(invoice_id)
        return invoice_id * 10

    # Every send of the task, the first and each requeue, goes through the broker's kick.
    kicks = 0
    kick = broker.kick

    async def counting_kick(message: Any) -> None:
        nonlocal kicks
        kicks += 1
        await kick(message)

    broker.kick = counting_kick  # type: ignore[method-assign]
    await broker.startup()
    try:
        holder = await hold_elsewhere(locks, "invoice-5")
        sent = await charge.kiq(5)
        with anyio.fail_after(5):
            while kicks < 3:  # noqa: ASYNC110 (the worker's requeues count them)
                await anyio.sleep(0.01)
        assert runs == []
        await holder.release()
        result = await sent.wait_result(timeout=5)
        await broker.wait_all()
    finally:
        await broker.shutdown()
    assert not result.is_err
    assert cast(object, result.return_value) == 50
    assert runs == [5]  # run once, after several deferrals
    assert int(result.labels["X-Taskiq-requeue"]) > 1


async def test_decorator_mistakes_fail_at_import_and_a_missing_client_says_where_to_open_one(
    locks: asynclock.LockClient,
) -> None:
    from taskiq import InMemoryBroker

    from asynclock.integrations import arq, taskiq

    with pytest.raises(asynclock.InvalidArgument, match=r"invoice_no.*not a parameter"):

        @arq.locked("invoice-{invoice_no}")
        async def charge(ctx: dict[str, Any], invoice_id: int) -> None: ...

    broker = InMemoryBroker()

    async def task(invoice_id: int) -> None: ...

    with pytest.raises(asynclock.InvalidArgument, match=r"below @broker\.task"):
        taskiq.locked("invoice-{invoice_id}")(broker.task(task))
    with pytest.raises(asynclock.InvalidArgument, match="jitter"):
        arq.locked("x", jitter=2)
    with pytest.raises(asynclock.InvalidArgument, match="lost_retries is how often"):
        taskiq.locked("x", lost_retries=-1)

    @arq.locked("x-{n}")
    async def job(ctx: dict[str, Any], n: int) -> None: ...

    with pytest.raises(RuntimeError, match="WorkerLocks"):  # no client in ctx
        await job({"job_try": 1}, 1)
