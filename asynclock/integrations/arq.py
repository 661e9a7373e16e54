"""arq jobs that hold a lock: ``@locked("invoices/{invoice_id}")``, and a client per worker.

.. code-block:: python

    worker_locks = WorkerLocks("redis://127.0.0.1:6379/1")

    @locked("invoices/{invoice_id}", ttl=30, timeout=0, defer=2.0)
    async def charge(ctx: dict[str, Any], invoice_id: int) -> str: ...

    class WorkerSettings:
        functions = [charge]
        on_startup = worker_locks.on_startup
        on_shutdown = worker_locks.on_shutdown

When the lock is busy the job raises ``arq.Retry(defer=...)``, so arq runs it again later; it is
never dropped. A job whose lease is lost while it runs is cancelled and run again the same way.
Each deferral and each run again is one of arq's tries (``ctx["job_try"]``), so on the job's last
try (``max_tries``, arq's default 5) the job waits for the lock instead of deferring once more
(arq would fail it with "max retries exceeded" otherwise), and a lease lost on that try fails it.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any, Concatenate

from .._decorator import ClientSource
from .._errors import InvalidArgument
from . import requires
from ._jobs import CONTEXT_KEY, JobLock, P, R, RunAgain, WorkerClient

with requires("arq"):
    from arq import Retry

__all__ = ("WorkerLocks", "locked")


Ctx = dict[str, Any]

#: arq's own default for ``max_tries`` (``Worker(max_tries=5)``).
ARQ_MAX_TRIES = 5


def locked(
    template: str,
    *,
    client: ClientSource | None = None,
    ttl: float = 30.0,
    timeout: float | None = 0,
    defer: float = 1.0,
    jitter: float = 0.5,
    max_tries: int = ARQ_MAX_TRIES,
) -> Callable[
    [Callable[Concatenate[Ctx, P], Awaitable[R]]], Callable[Concatenate[Ctx, P], Awaitable[R]]
]:
    """Hold the lock named by ``template`` (formatted with the job's arguments) while the job runs.

    ``client`` defaults to the one :class:`WorkerLocks` put in ``ctx``. ``timeout=0`` defers at
    once when the lock is held; a number waits up to that long first; ``None`` waits as long as
    it takes (bounded by arq's ``job_timeout``). A deferral raises ``arq.Retry`` with ``defer``
    seconds, spread by ``jitter`` (0.5: between 0.5x and 1.5x) so that deferred jobs of one key
    do not all come back at once.

    ``max_tries`` must be the job's arq ``max_tries`` (the worker's setting, or
    ``arq.func(..., max_tries=)``): on that try the job waits for the lock instead of deferring.
    A smaller number here only makes jobs wait sooner; a larger one lets arq fail deferred jobs.

    A lease lost while the job runs cancels it (its effects may be partial: fence them with the
    lease's token) and arq runs it again after ``defer`` seconds, as one of its tries; on the last
    try it fails with :class:`asynclock.LeaseLost`. A job whose lease is found lost only after it
    returned keeps its result and is not run again.
    """
    lock = JobLock(
        template, client=client, ttl=ttl, timeout=timeout, defer=defer, jitter=jitter, queue="arq"
    )
    if isinstance(max_tries, bool) or not isinstance(max_tries, int) or max_tries < 1:
        raise InvalidArgument(f"max_tries must be an int >= 1 (arq's own), got {max_tries!r}")

    def decorate(
        func: Callable[Concatenate[Ctx, P], Awaitable[R]],
    ) -> Callable[Concatenate[Ctx, P], Awaitable[R]]:
        signature = lock.signature_of(func, skip=1)

        @functools.wraps(func)
        async def job(ctx: Ctx, /, *args: P.args, **kwargs: P.kwargs) -> R:
            # arq counts each Retry as a try: the last one may not defer, or arq fails the job.
            last_try = int(ctx.get("job_try") or 1) >= max_tries
            try:
                return await lock.run(
                    func,
                    signature,
                    (ctx, *args),
                    kwargs,
                    found=ctx.get(CONTEXT_KEY),
                    where="arq's ctx",
                    wait=last_try,
                    rerun_lost=not last_try,
                )
            except RunAgain as again:
                raise Retry(defer=again.delay) from again.error

        return job

    return decorate


class WorkerLocks(WorkerClient):
    """One lock client per arq worker: ``on_startup`` opens it into ``ctx["asynclock"]``,
    ``on_shutdown`` closes it (arq runs the two in different tasks).

    Use the two methods as the worker's hooks, or call them from your own. ``url`` and
    ``options`` are those of :func:`asynclock.connect`, checked at once.
    """

    async def on_startup(self, ctx: Ctx) -> None:
        ctx[CONTEXT_KEY] = await self.open()

    async def on_shutdown(self, ctx: Ctx) -> None:
        ctx.pop(CONTEXT_KEY, None)
        await self.close()
