"""Cleanup that must finish: releases, and deletes after a cancelled acquire.

``anyio.CancelScope(shield=True)`` keeps anyio's own cancellation out, but not a native
``Task.cancel()`` (what ``asyncio.timeout``, ``wait_for``, ``TaskGroup`` and web frameworks on
client disconnect deliver): the ``CancelledError`` is thrown into whatever the cleanup awaits, and
the cleanup is abandoned half-way. :func:`finish` makes such cleanup survive any number of
cancellations, of either kind, within a time bound, and hands the caller's cancellation back
afterwards, untouched (so ``asyncio.timeout`` still turns it into ``TimeoutError``).

The first attempt runs inline, in the caller's task, so the common path costs one cancel scope and
no task. Only when a native cancellation interrupts it does the cleanup run again, from the start,
in a task of its own that nobody else cancels: every cleanup given to :func:`finish` must
therefore be idempotent (delete-if-owner, release-if-still-ours).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Generator
from typing import Any

import anyio
from anyio.abc import TaskGroup

from ._clock import cancel_scope, now

logger = logging.getLogger("asynclock")

Cleanup = Callable[[], Awaitable[object]]


async def finish(
    cleanup: Cleanup,
    *,
    timeout: float,
    what: str,
    unfinished: Callable[[], None] | None = None,
) -> bool:
    """Run ``cleanup`` to its end within ``timeout`` seconds, whatever cancels the caller.

    Returns True if it finished, False if it did not (time ran out; ``unfinished`` is then
    called, for example to hand the work to a background task). A cancellation of the caller
    that arrived meanwhile is raised again once ``cleanup`` has finished or been given up.
    Exceptions of ``cleanup`` itself propagate.
    """
    deadline = now() + timeout
    interrupted: BaseException | None = None
    with cancel_scope(shield=True) as scope:
        try:
            # The first step runs before the scope gets its deadline: a cleanup that ends
            # without suspending (a release with nothing to wait for) then costs no timer,
            # which is as much as the rest of a lock cycle on memory://. One that suspends
            # gets the deadline before its first wait reaches the event loop.
            steps = cleanup().__await__()
            try:
                waiting_on = steps.send(None)
            except StopIteration:
                return True
            scope.deadline = deadline
            await _Resumed(steps, waiting_on)
        except anyio.get_cancelled_exc_class() as exc:
            if scope.cancel_called:
                raise  # our own deadline: the scope swallows it
            interrupted = exc  # a native Task.cancel() went through the shield
        else:
            return True
    if interrupted is None:
        _give_up(what, timeout, unfinished)
        return False
    done = await _again_in_own_task(cleanup, deadline, what)
    if not done:
        _give_up(what, timeout, unfinished)
    raise interrupted


class _Resumed:
    """Awaits the rest of a coroutine whose first step has already run (and yielded
    ``waiting_on`` to the event loop): every later step is passed through unchanged."""

    __slots__ = ("_steps", "_waiting_on")

    def __init__(self, steps: Generator[Any, Any, Any], waiting_on: Any) -> None:
        self._steps = steps
        self._waiting_on = waiting_on

    def __await__(self) -> Generator[Any, Any, Any]:
        steps, waiting_on = self._steps, self._waiting_on
        while True:
            try:
                sent = yield waiting_on
            except BaseException as exc:  # a cancellation, or what the loop throws in
                try:
                    waiting_on = steps.throw(exc)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    waiting_on = steps.send(sent)
                except StopIteration as stop:
                    return stop.value


def _give_up(what: str, timeout: float, unfinished: Callable[[], None] | None) -> None:
    if unfinished is not None:
        unfinished()
    else:
        logger.warning("asynclock: %s did not finish within %g s; given up", what, timeout)


async def _again_in_own_task(cleanup: Cleanup, deadline: float, what: str) -> bool:
    """Run ``cleanup`` once more in a task that no caller cancels, absorbing every cancellation
    that reaches the waiting caller, until it ends or ``deadline`` passes (then it is cancelled).

    Only asyncio can get here: trio has no cancellation that bypasses a shielded scope.
    """
    if not on_asyncio():  # pragma: no cover (defensive)
        return False
    task = asyncio.get_running_loop().create_task(_swallow_errors(cleanup, what))
    try:
        while not task.done():
            left = deadline - now()
            if left <= 0:
                break
            try:
                await asyncio.wait({task}, timeout=left)
            except asyncio.CancelledError:
                continue  # the caller's cancellation is re-raised by finish()
        if task.done():
            return task.result()
        task.cancel()
        # Owned to the end: wait (briefly, still absorbing cancellations) for it to stop.
        for _ in range(3):
            try:
                await asyncio.wait({task}, timeout=0.1)
                break
            except asyncio.CancelledError:
                continue
        return False
    finally:
        if task.done() and not task.cancelled():
            task.result()


async def _swallow_errors(cleanup: Cleanup, what: str) -> bool:
    """Whether ``cleanup`` succeeded; its error is logged, and the caller treats it as
    unfinished (a release is then retried in the background, as one that timed out is)."""
    try:
        await cleanup()
    except Exception as exc:
        logger.warning("asynclock: %s failed: %r", what, exc)
        return False
    return True


def on_asyncio() -> bool:
    """True when the running event loop is asyncio's (and not trio's)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class Deferred:
    """Cleanup that could not finish in time, retried in the background until it does.

    The retries run in a task group someone owns (the client's, or a backend's from ``open()``
    to ``aclose()``), one task each, with capped backoff between attempts, each attempt bounded
    by ``attempt_timeout``. :meth:`aclose` gives what is still pending ``grace`` seconds more,
    then stops it: the server frees what it held when its lease expires.
    """

    def __init__(self, *, attempt_timeout: float, first_pause: float = 0.05, cap: float = 1.0):
        self._attempt_timeout = attempt_timeout
        self._first_pause = first_pause
        self._cap = cap
        self._pending: set[anyio.CancelScope] = set()
        self._group: TaskGroup | None = None

    def bind(self, group: TaskGroup | None) -> None:
        """Retry in ``group`` from now on (None: nothing is retried any more)."""
        self._group = group

    @property
    def pending(self) -> int:
        return len(self._pending)

    def retry(self, cleanup: Cleanup, what: str) -> bool:
        """Retry ``cleanup`` in the background; False if there is no task group to do it in."""
        if self._group is None:
            return False
        scope = anyio.CancelScope()
        self._pending.add(scope)
        self._group.start_soon(self._retry, cleanup, what, scope, name=f"asynclock: {what}")
        return True

    async def _retry(self, cleanup: Cleanup, what: str, scope: anyio.CancelScope) -> None:
        pause = self._first_pause
        try:
            with scope:
                while True:
                    try:
                        with anyio.fail_after(self._attempt_timeout):
                            await cleanup()
                    except Exception as exc:
                        logger.info("asynclock: retrying %s: %r", what, exc)
                        await anyio.sleep(pause * random.uniform(0.5, 1.0))
                        pause = min(self._cap, pause * 2)
                    else:
                        return
        finally:
            self._pending.discard(scope)

    async def aclose(self, grace: float) -> None:
        """Wait up to ``grace`` seconds for pending retries, then stop them. Idempotent."""
        self._group = None
        with anyio.move_on_after(grace):
            while self._pending:  # noqa: ASYNC110 (rare path: cleanup of a hung server)
                await anyio.sleep(0.01)
        for scope in list(self._pending):
            scope.cancel()
