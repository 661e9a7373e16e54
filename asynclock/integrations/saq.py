"""saq jobs that hold a lock: ``@locked("invoices/{invoice_id}")``, and a client per worker.

.. code-block:: python

    worker_locks = WorkerLocks("redis://127.0.0.1:6379/1")

    @locked("invoices/{invoice_id}", ttl=30, timeout=0, defer=2.0)
    async def charge(ctx: saq.types.Context, *, invoice_id: int) -> str: ...

    settings = {
        "queue": saq.Queue.from_url("redis://127.0.0.1:6379/0"),
        "functions": [charge],
        "startup": worker_locks.startup,
        "shutdown": worker_locks.shutdown,
    }

saq has no "run me again later" answer for a job, only its retry of a failed one. So when the
lock is busy the job gives itself one more retry (``job.retries += 1``: a deferral never uses up
a retry of the job's own), sets this retry's delay, and fails with the
:class:`asynclock.AcquireTimeout`; saq then schedules it again (``Job.retry``). A job whose lease
is lost while it runs is cancelled and run again the same way, up to ``lost_retries`` times; after
that the :class:`asynclock.LeaseLost` is an ordinary failure, retried if the job has retries left. The job's own
``retry_delay`` and ``retry_backoff`` are kept in ``job.meta["asynclock"]`` and put back when it
runs again, so its real failures are retried as configured. saq's worker checks for due jobs once a
second (``timers["schedule"]``), so a deferral lasts at least until the next check; ``defer=0``
puts the job straight back at the end of the queue.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Concatenate, TypeVar, cast

from .._decorator import ClientSource
from . import requires
from ._jobs import CONTEXT_KEY, JobLock, P, R, RunAgain, WorkerClient

with requires("saq"):
    from saq.job import Job

__all__ = ("QuietDeferrals", "WorkerLocks", "locked")

C = TypeVar("C")  # saq's context: saq.types.Context or the application's own TypedDict

#: Where a deferred job keeps its own retry settings while a deferral's are in force.
META_KEY = CONTEXT_KEY


def locked(
    template: str,
    *,
    client: ClientSource | None = None,
    ttl: float = 30.0,
    timeout: float | None = 0,
    defer: float = 1.0,
    jitter: float = 0.5,
    lost_retries: int = 3,
) -> Callable[
    [Callable[Concatenate[C, P], Awaitable[R]]], Callable[Concatenate[C, P], Awaitable[R]]
]:
    """Hold the lock named by ``template`` (formatted with the job's arguments) while the job runs.

    ``client`` defaults to the one :class:`WorkerLocks` put in the worker's context.
    ``timeout=0`` defers at once when the lock is held; a number waits up to that long first;
    ``None`` waits as long as it takes (bounded by the job's saq ``timeout``, 10 s by default).
    A deferral reschedules the job ``defer`` seconds later, spread by ``jitter`` (0.5: between
    0.5x and 1.5x), without using up one of its ``retries``.

    A lease lost while the job runs cancels it (its effects may be partial: fence them with the
    lease's token) and reschedules it like a deferral, up to ``lost_retries`` times per job
    without using up its ``retries``; after that it fails with :class:`asynclock.LeaseLost`,
    which saq retries if the job has retries left. A job whose lease is found lost only after it
    returned keeps its result and is not run again.
    """
    lock = JobLock(
        template,
        client=client,
        ttl=ttl,
        timeout=timeout,
        defer=defer,
        jitter=jitter,
        queue="saq",
        lost_retries=lost_retries,
    )

    def decorate(
        func: Callable[Concatenate[C, P], Awaitable[R]],
    ) -> Callable[Concatenate[C, P], Awaitable[R]]:
        signature = lock.signature_of(func, skip=1)

        @functools.wraps(func)
        async def job(ctx: C, /, *args: P.args, **kwargs: P.kwargs) -> R:
            context = cast(Mapping[str, Any], ctx)
            current = context.get("job")
            if isinstance(current, Job):
                _restore_retry_settings(current)
            # Without a saq Job (the function called directly) there is nothing to reschedule.
            in_queue = isinstance(current, Job)
            try:
                return await lock.run(
                    func,
                    signature,
                    (ctx, *args),
                    kwargs,
                    found=context.get(CONTEXT_KEY),
                    where="saq's context",
                    wait=not in_queue,
                    rerun_lost=in_queue and _counts(current)["lost"] < lock.lost_retries,
                )
            except RunAgain as again:
                assert isinstance(current, Job)
                _defer(current, again.delay, "lost" if again.lost else "deferrals")
                error = again.error
                error.add_note(f"asynclock: saq runs the job again in {again.delay:.2g} s")
                error.asynclock_deferred = True  # type: ignore[union-attr]  # for QuietDeferrals
                raise error from None

        return job

    return decorate


def _counts(job: object) -> dict[str, int]:
    """How often the job was deferred for a busy lock and run again for a lost lease."""
    saved = job.meta.get(META_KEY) if isinstance(job, Job) else None
    saved = saved if isinstance(saved, dict) else {}
    return {key: int(saved.get(key, 0)) for key in ("deferrals", "lost")}


def _defer(job: Job, delay: float, why: str) -> None:
    """Make saq's retry of this failure a deferral: one more retry, this delay, no backoff."""
    counts = _counts(job)
    counts[why] += 1
    job.meta[META_KEY] = {
        "retry_delay": job.retry_delay,
        "retry_backoff": job.retry_backoff,
        **counts,
    }
    job.retries += 1
    job.retry_delay = delay
    job.retry_backoff = False


def _restore_retry_settings(job: Job) -> None:
    saved = job.meta.get(META_KEY)
    if isinstance(saved, dict) and "retry_delay" in saved:
        job.retry_delay = float(saved["retry_delay"])
        job.retry_backoff = saved["retry_backoff"]
        # The counts stay: they bound the reruns of lost leases, and show how often it waited.
        job.meta[META_KEY] = _counts(job)


class QuietDeferrals(logging.Filter):
    """A logging filter for saq's logger that drops its "Error processing job" records for
    deferrals and for runs again after a lost lease (saq logs every failure it retries with a
    traceback, and these are failures to saq; asynclock has logged the lost lease itself):
    ``logging.getLogger("saq").addFilter(QuietDeferrals())``. Other errors pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not getattr(error, "asynclock_deferred", False)


class WorkerLocks(WorkerClient):
    """One lock client per saq worker: ``startup`` opens it into the worker's context
    (``ctx["asynclock"]``, which every job's context copies), ``shutdown`` closes it.

    Use the two methods as the worker's ``startup`` / ``shutdown``, or call them from your own.
    ``url`` and ``options`` are those of :func:`asynclock.connect`, checked at once.
    """

    async def startup(self, ctx: Any) -> None:
        cast(dict[str, Any], ctx)[CONTEXT_KEY] = await self.open()

    async def shutdown(self, ctx: Any) -> None:
        cast(dict[str, Any], ctx).pop(CONTEXT_KEY, None)
        await self.close()
