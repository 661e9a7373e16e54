"""taskiq tasks that hold a lock: ``@locked("invoices/{invoice_id}")``, and a client per worker.

.. code-block:: python

    broker = ListQueueBroker("redis://127.0.0.1:6379/0")
    worker_locks = WorkerLocks("redis://127.0.0.1:6379/1").install(broker)

    @broker.task
    @locked("invoices/{invoice_id}", ttl=30, timeout=0, defer=0.5)
    async def charge(invoice_id: int) -> str: ...

Put ``@locked`` *below* ``@broker.task``. When the lock is busy the task waits ``defer`` seconds
(with jitter) without holding the lock, then sends itself to the back of the queue with
:meth:`taskiq.Context.requeue` (same task id, so ``wait_result()`` gets the result of the run
that finally holds the lock; the label ``X-Taskiq-requeue`` counts the deferrals) and stores no
result for this run. It is never dropped and uses up no retry of taskiq's retry middlewares
(they ignore the ``NoResultError`` a requeue raises). A task whose lease is lost while it runs is
cancelled and requeued the same way, up to ``lost_retries`` times (counted in the label
``asynclock-lost``); after that its :class:`asynclock.LeaseLost` is an ordinary failure. The wait happens in the worker because
taskiq's Redis brokers have no delayed delivery; it takes one of the worker's
``--max-async-tasks`` slots meanwhile, so keep ``defer`` short.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable

import anyio

from .._decorator import ClientSource
from . import requires, with_keyword
from ._jobs import CONTEXT_KEY, JobLock, P, R, RunAgain, WorkerClient

with requires("taskiq"):
    from taskiq import AsyncBroker, Context, TaskiqDepends, TaskiqEvents, TaskiqState

__all__ = ("WorkerLocks", "locked")


#: The keyword argument through which taskiq's dependency injection hands the wrapper its
#: Context (the task's own signature stays as it is for callers and for taskiq's validation).
_CONTEXT_PARAMETER = "_asynclock_context"

#: The message label that counts how often a task was requeued for a lost lease.
LOST_LABEL = "asynclock-lost"


def locked(
    template: str,
    *,
    client: ClientSource | None = None,
    ttl: float = 30.0,
    timeout: float | None = 0,
    defer: float = 0.1,
    jitter: float = 0.5,
    lost_retries: int = 3,
) -> Callable[[Callable[P, Awaitable[R]]], Callable[P, Awaitable[R]]]:
    """Hold the lock named by ``template`` (formatted with the task's arguments) while it runs.

    ``client`` defaults to the one :class:`WorkerLocks` put in ``broker.state``. ``timeout=0``
    defers at once when the lock is held; a number waits up to that long first; ``None`` as long
    as it takes. A deferral waits ``defer`` seconds spread by ``jitter``, then requeues the task.

    A lease lost while the task runs cancels it (its effects may be partial: fence them) and
    requeues it like a deferral, up to ``lost_retries`` times; then it fails with
    :class:`asynclock.LeaseLost`. A task whose lease is found lost only after it returned keeps
    its result and is not run again.
    """
    lock = JobLock(
        template,
        client=client,
        ttl=ttl,
        timeout=timeout,
        defer=defer,
        jitter=jitter,
        queue="taskiq",
        lost_retries=lost_retries,
    )

    def decorate(func: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
        signature = lock.signature_of(func)
        if _CONTEXT_PARAMETER in signature.parameters:
            raise TypeError(f"{func!r} already has a parameter named {_CONTEXT_PARAMETER}")

        @functools.wraps(func)
        async def task(*args: P.args, **kwargs: P.kwargs) -> R:
            context = kwargs.pop(_CONTEXT_PARAMETER, None)
            if not isinstance(context, Context):
                # Called directly, not by a worker: nothing to requeue, so wait for the lock.
                context = None
            lost = int(context.message.labels.get(LOST_LABEL, 0)) if context is not None else 0
            try:
                return await lock.run(
                    func,
                    signature,
                    args,
                    kwargs,
                    found=context.state.get(CONTEXT_KEY) if context is not None else None,
                    where="broker.state",
                    wait=context is None,
                    rerun_lost=context is not None and lost < lock.lost_retries,
                )
            except RunAgain as again:
                assert context is not None
                if again.lost:
                    context.message.labels[LOST_LABEL] = str(lost + 1)
                await anyio.sleep(again.delay)  # the lock is not held meanwhile
                await context.requeue()  # raises NoResultError: no result for this run
                raise AssertionError("taskiq's Context.requeue() returned") from again.error

        # The wrapper asks taskiq for its Context with a keyword-only parameter of its own; the
        # task's parameters are otherwise the function's, for taskiq's argument parsing.
        task.__signature__ = with_keyword(  # type: ignore[attr-defined]
            signature, _CONTEXT_PARAMETER, default=TaskiqDepends(Context)
        )
        return task

    return decorate


class WorkerLocks(WorkerClient):
    """One lock client per taskiq worker process, kept in ``broker.state.asynclock``:
    :meth:`install` opens it on ``WORKER_STARTUP`` and closes it on ``WORKER_SHUTDOWN``.

    ``url`` and ``options`` are those of :func:`asynclock.connect`, checked at once.
    """

    def install(self, broker: AsyncBroker) -> WorkerLocks:
        """Register the start-up and shutdown handlers on ``broker``; returns ``self``."""
        broker.add_event_handler(TaskiqEvents.WORKER_STARTUP, self.startup)
        broker.add_event_handler(TaskiqEvents.WORKER_SHUTDOWN, self.shutdown)
        return self

    async def startup(self, state: TaskiqState) -> None:
        state[CONTEXT_KEY] = await self.open()

    async def shutdown(self, state: TaskiqState) -> None:
        state.pop(CONTEXT_KEY, None)
        await self.close()
