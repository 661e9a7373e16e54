"""asynclock._shield.finish: cleanup that survives native and anyio cancellation, bounded."""

from __future__ import annotations

import asyncio

import anyio
import anyio.lowlevel
import pytest

from asynclock._shield import finish
from tests.testing._helpers import cancel_natively

pytestmark = pytest.mark.anyio


class Cleanup:
    """An idempotent cleanup that takes ``seconds`` and records each start and each end."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.started = 0
        self.finished = 0

    async def __call__(self) -> None:
        self.started += 1
        await asyncio.sleep(self.seconds)
        self.finished += 1


class ScopedCleanup(Cleanup):
    """A cleanup whose first step enters a cancel scope of its own and waits inside it (as a
    backend's release bounded by ``anyio.fail_after`` does): finish's shield must enclose it."""

    async def __call__(self) -> None:
        self.started += 1
        with anyio.CancelScope():
            await anyio.sleep(self.seconds)
        self.finished += 1


KINDS = [Cleanup, ScopedCleanup]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cancels", [1, 2, 3, 10])
async def test_native_cancels_do_not_stop_the_cleanup_and_are_raised_after_it(
    cancels: int, kind: type[Cleanup]
) -> None:
    cleanup = kind(0.05)
    finished_at: list[float] = []

    async def run() -> None:
        await finish(cleanup, timeout=5, what="test cleanup")
        finished_at.append(anyio.current_time())

    task = asyncio.create_task(run())
    await cancel_natively(task, cancels, pause=0.01)
    assert cleanup.finished >= 1  # re-run from the start after the first interruption
    assert finished_at == []  # the caller's cancellation was raised, not swallowed


async def test_asyncio_timeout_still_becomes_timeout_error() -> None:
    cleanup = Cleanup(0.05)
    started = anyio.current_time()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.01):
            await finish(cleanup, timeout=5, what="test cleanup")
    assert cleanup.finished == 1
    assert anyio.current_time() - started >= 0.05


@pytest.mark.parametrize("kind", KINDS)
async def test_anyio_cancellation_waits_for_the_cleanup_inline(kind: type[Cleanup]) -> None:
    cleanup = kind(0.05)
    with anyio.move_on_after(0.01) as scope:
        await finish(cleanup, timeout=5, what="test cleanup")
        await anyio.sleep(1)
    assert scope.cancelled_caught
    assert (cleanup.started, cleanup.finished) == (1, 1)  # no second run was needed


@pytest.mark.expect_log(r"scoped and slow did not finish within 0\.1 s; given up")
async def test_a_cleanup_past_its_timeout_is_given_up_reported_and_its_retry_task_stopped() -> None:
    unfinished: list[bool] = []

    def gave_up() -> None:
        unfinished.append(True)

    started = anyio.current_time()
    assert not await finish(Cleanup(10), timeout=0.1, what="slow", unfinished=gave_up)
    assert unfinished == [True]
    assert anyio.current_time() - started < 1
    # Without an ``unfinished`` callback it is logged; a scope of the cleanup's own is bounded too.
    assert await finish(ScopedCleanup(10), timeout=0.1, what="scoped and slow") is False
    # Given up after a native cancel, the retry task is stopped too.
    tasks_before = asyncio.all_tasks()
    task = asyncio.create_task(finish(Cleanup(10), timeout=0.2, what="slow", unfinished=gave_up))
    await cancel_natively(task, 1, pause=0.01)
    assert unfinished == [True, True]
    await asyncio.sleep(0)
    assert [t for t in asyncio.all_tasks() - tasks_before if not t.done()] == []


async def test_errors_of_the_cleanup_propagate() -> None:
    async def broken() -> None:
        raise OSError("connection refused")

    with pytest.raises(OSError, match="refused"):
        await finish(broken, timeout=1, what="broken")


@pytest.mark.expect_log(r"asynclock: release failed: OSError\('a failover is under way'\)")
@pytest.mark.parametrize("cancels", [1, 3])
async def test_a_rerun_that_fails_after_a_native_cancel_is_unfinished_not_done(
    cancels: int,
) -> None:
    """Interrupted by Task.cancel(), the cleanup runs again in its own task; if that run
    fails, the work is not done: ``unfinished`` hands it on (a release is retried in the
    background), where it was reported done and the lock stayed held until its ttl."""
    runs: list[str] = []

    async def failing() -> None:
        runs.append("run")
        await asyncio.sleep(0.05)
        raise OSError("a failover is under way")

    unfinished: list[bool] = []
    task = asyncio.create_task(
        finish(failing, timeout=5, what="release", unfinished=lambda: unfinished.append(True))
    )
    await cancel_natively(task, cancels, pause=0.01)
    assert runs == ["run", "run"]
    assert unfinished == [True]


async def test_a_cleanup_that_never_suspends_finishes_inline_and_keeps_a_pending_cancel() -> None:
    calls: list[str] = []

    async def local_release() -> None:  # like the in-process backend's release
        calls.append("released")

    with anyio.CancelScope() as outer:
        outer.cancel()
        assert await finish(local_release, timeout=1, what="local") is True
        assert calls == ["released"]
        await anyio.lowlevel.checkpoint()  # the caller's cancellation is still delivered
        pytest.fail("the cancellation was swallowed")
    assert outer.cancelled_caught
