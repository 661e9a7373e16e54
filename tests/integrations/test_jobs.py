"""``asynclock.locked`` on job functions: a plain asyncio worker pool and an arq-style job."""

from __future__ import annotations

import asyncio
import functools
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest

import asynclock

from ._servers import memory

pytestmark = pytest.mark.anyio


@dataclass
class Ledger:
    """What the workers did: who ran at once, and how each job ended."""

    active: Counter[str] = field(default_factory=Counter)
    overlaps: list[str] = field(default_factory=list)
    most_at_once: int = 0
    succeeded: list[int] = field(default_factory=list)
    failed: dict[int, str] = field(default_factory=dict)


async def run_pool(
    jobs: list[tuple[str, int]], process: Any, ledger: Ledger, *, workers: int = 4
) -> None:
    """A worker pool as an application writes it: an asyncio.Queue and N worker tasks."""
    queue: asyncio.Queue[tuple[str, int]] = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)

    async def worker() -> None:
        while True:
            try:
                key, job_id = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            try:
                await process(key, job_id)
            except Exception as exc:  # a job failure is recorded, never fatal to the worker
                ledger.failed[job_id] = type(exc).__name__
            else:
                ledger.succeeded.append(job_id)
            finally:
                queue.task_done()

    async with anyio.create_task_group() as task_group:
        for _ in range(workers):
            task_group.start_soon(worker)


async def test_worker_pool_never_overlaps_jobs_with_the_same_key(
    locks: asynclock.LockClient,
) -> None:
    ledger = Ledger()

    @asynclock.locked("account-{key}", client=locks, timeout=10)
    async def process(key: str, job_id: int) -> None:
        ledger.active[key] += 1
        if ledger.active[key] > 1:
            ledger.overlaps.append(key)
        ledger.most_at_once = max(ledger.most_at_once, sum(ledger.active.values()))
        await anyio.sleep(0.01)
        ledger.active[key] -= 1

    jobs = [(key, number) for number, key in enumerate(["a", "b", "a", "c", "a", "b"] * 3)]
    await run_pool(jobs, process, ledger, workers=4)
    assert ledger.overlaps == []
    assert sorted(ledger.succeeded) == list(range(len(jobs)))
    assert ledger.failed == {}
    assert ledger.most_at_once > 1  # different keys did run in parallel


async def test_a_job_whose_lease_is_lost_fails_instead_of_succeeding(
    locks: asynclock.LockClient,
) -> None:
    ledger = Ledger()
    doomed_started = anyio.Event()
    finished_body: list[int] = []

    @asynclock.locked("account-{key}", client=locks, timeout=10)
    async def process(key: str, job_id: int) -> None:
        if job_id == 1:
            doomed_started.set()
            await anyio.sleep(5)  # cancelled when the lease is lost
        else:
            await anyio.sleep(0.01)
        finished_body.append(job_id)

    async with anyio.create_task_group() as task_group:
        task_group.start_soon(run_pool, [("x", 1), ("x", 2), ("y", 3)], process, ledger)
        await doomed_started.wait()
        memory(locks).expire("account-x", notify=True)
    assert ledger.failed == {1: "LeaseLost"}
    assert sorted(ledger.succeeded) == [2, 3]  # job 2 (same key) then got the lock and ran
    assert 1 not in finished_body


# -- arq's calling convention: ``await job(ctx, *args)``, registered by ``__name__`` ---------------

_clients: dict[str, asynclock.LockClient] = {}


@asynclock.locked("invoice-{invoice_id}", client=lambda: _clients["locks"], timeout=0)
async def charge_invoice(ctx: dict[str, Any], invoice_id: int) -> str:
    ctx["charged"].append(invoice_id)
    await ctx["gate"].wait()
    return f"charged {invoice_id} with token {asynclock.current_token()}"


async def test_arq_style_job_function(locks: asynclock.LockClient) -> None:
    _clients["locks"] = locks
    ctx: dict[str, Any] = {"job_try": 1, "charged": [], "gate": anyio.Event()}
    assert charge_invoice.__name__ == "charge_invoice"  # arq names the job after the function
    results: dict[str, object] = {}

    async def run(label: str, *args: Any, **kwargs: Any) -> None:
        try:
            results[label] = await charge_invoice(ctx, *args, **kwargs)
        except asynclock.AcquireTimeout as exc:  # arq would record the failure and retry
            results[label] = exc

    try:
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(run, "first", 10)
            await anyio.wait_all_tasks_blocked()
            # The same invoice, passed by keyword: the lock name is the same.
            task_group.start_soon(functools.partial(run, "duplicate", invoice_id=10))
            task_group.start_soon(run, "other", 11)
            await anyio.wait_all_tasks_blocked()
            ctx["gate"].set()
    finally:
        _clients.clear()
    assert isinstance(results["duplicate"], asynclock.AcquireTimeout)
    assert results["duplicate"].name == "invoice-10"
    assert str(results["first"]).startswith("charged 10 with token")
    assert str(results["other"]).startswith("charged 11 with token")
    assert sorted(ctx["charged"]) == [10, 11]
