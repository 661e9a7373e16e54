"""LeaderTask: a job on one replica at a time, cancelled when its term is lost, campaigning again;
in one process on memory:// (tests/integrations/test_leader_processes.py runs three processes
against a real server)."""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import Awaitable, Callable

import anyio
import pytest

import asynclock
from tests.contract.harness import until
from tests.integrations._memory import memory
from tests.loud import ExpectedLogs
from tests.testing._helpers import cancel_natively

pytestmark = pytest.mark.anyio


@pytest.fixture
def store() -> str:
    return f"memory://leader-{uuid.uuid4().hex[:8]}"


class Runs:
    """What each replica's job did: (replica, token, start, end) of every run that completed."""

    def __init__(self) -> None:
        self.completed: list[tuple[str, int | None, float, float]] = []
        self.cancelled: list[str] = []

    def job(
        self, replica: str, length: float = 0.02
    ) -> Callable[[asynclock.Lease], Awaitable[None]]:
        async def run(term: asynclock.Lease) -> None:
            started = anyio.current_time()
            try:
                await anyio.sleep(length)
            except anyio.get_cancelled_exc_class():
                self.cancelled.append(replica)
                raise
            self.completed.append((replica, term.token, started, anyio.current_time()))

        return run

    def assert_one_at_a_time(self) -> None:
        ordered = sorted(self.completed, key=lambda run: run[2])
        for before, after in itertools.pairwise(ordered):
            if before[0] != after[0]:
                assert before[3] <= after[2], f"{before} overlaps {after}"
        tokens = [run[1] for run in ordered if run[1] is not None]
        assert tokens == sorted(tokens)


async def test_one_replica_runs_the_job_and_another_takes_over_when_it_stops(store: str) -> None:
    runs = Runs()
    async with asynclock.connect(store) as a, asynclock.connect(store) as b:
        first = asynclock.LeaderTask(a, "jobs/refresh", runs.job("a"), value=b"a", every=0.01)
        second = asynclock.LeaderTask(b, "jobs/refresh", runs.job("b"), value=b"b", every=0.01)
        async with first:
            await until(lambda: first.leading)
            async with second:
                await anyio.sleep(0.3)
                assert first.leading and not second.leading
                assert (await a.election("jobs/refresh").leader()).value == b"a"  # type: ignore[union-attr]
                await first.aclose()  # resigns: the other replica leads
                assert not first.leading
                await until(lambda: [run[0] for run in runs.completed].count("b") >= 3)
            await first.aclose()  # idempotent
        assert (first.terms, second.terms) == (1, 1)
        assert await a.election("jobs/refresh").leader() is None  # nothing left behind
    replicas = [run[0] for run in runs.completed]
    assert replicas.count("a") > 5 and replicas.count("b") >= 3
    runs.assert_one_at_a_time()


async def test_a_lost_term_cancels_the_job_and_the_replica_campaigns_again(
    store: str, expected_logs: ExpectedLogs
) -> None:
    expected_logs.expect(r"lease on 'jobs/x' lost: the lock was removed on the server")
    runs = Runs()
    async with asynclock.connect(store) as locks:
        task = asynclock.LeaderTask(locks, "jobs/x", runs.job("a", 10), retry_after=0.05)
        async with task:
            await until(lambda: task.leading)
            first_term = task.term
            memory(locks).expire("jobs/x", notify=True, kind="election")
            await until(lambda: task.terms >= 2 and task.leading)
            assert task.term is not None and first_term is not None
            assert task.term.token > first_term.token
    assert runs.cancelled == ["a", "a"]  # by the loss, then by the close


async def test_a_job_that_fails_is_logged_and_the_replica_campaigns_again(
    store: str, expected_logs: ExpectedLogs
) -> None:
    expected_logs.expect(r"the job of 'jobs/y' failed; resigned, campaigning again")
    calls = 0

    async def flaky(term: asynclock.Lease) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise ValueError("a bug in one run")
        await anyio.sleep_forever()

    async with asynclock.connect(store) as locks:
        task = asynclock.LeaderTask(locks, "jobs/y", flaky, retry_after=0.05)
        await task.start()
        await until(lambda: calls >= 2)
        assert task.leading and task.terms == 2

        # Stopped from another task than the one that started it (a shutdown hook).
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(task.aclose)
        assert not task.leading
        failures = [record.exc_info[1] for record in expected_logs.records if record.exc_info]
        assert [str(failure) for failure in failures] == ["a bug in one run"]


async def test_bad_arguments_are_refused_when_it_is_made(store: str) -> None:
    async def job(term: asynclock.Lease) -> None:
        pass

    async with asynclock.connect(store) as locks:
        for option, value in {"every": 0, "retry_after": -1, "ttl": 0}.items():
            with pytest.raises(asynclock.InvalidArgument, match=option):
                asynclock.LeaderTask(locks, "jobs/z", job, **{option: value})  # type: ignore[arg-type]
        with pytest.raises(asynclock.InvalidArgument, match="job"):
            asynclock.LeaderTask(locks, "jobs/z", "not a job")  # type: ignore[arg-type]
        task = asynclock.LeaderTask(locks, "jobs/z", job)
        await task.aclose()  # never started: nothing to stop
        async with task:
            with pytest.raises(RuntimeError, match="runs already"):
                await task.start()


@pytest.mark.parametrize("cancels", [1, 3])
async def test_stopping_survives_native_cancellation_and_leaves_nothing(
    store: str, cancels: int
) -> None:
    """aclose() cancelled by ``Task.cancel()`` (once, or again and again, as a framework's
    shutdown may) still resigns the term and ends the task: nothing is left running or held."""
    runs = Runs()
    async with asynclock.connect(store) as locks:
        before = asyncio.all_tasks()
        task = asynclock.LeaderTask(locks, "jobs/c", runs.job("a", 10))
        await task.start()
        await until(lambda: task.leading)
        await cancel_natively(asyncio.ensure_future(task.aclose()), cancels)
        await until(lambda: not task.leading and not asyncio.all_tasks() - before)
        # No task of it is left to resign later: the term must be gone now.
        assert await locks.election("jobs/c").leader() is None
    assert runs.cancelled == ["a"]


async def test_a_run_never_starts_on_a_term_whose_deadline_has_passed(
    store: str, expected_logs: ExpectedLogs
) -> None:
    # As after a SIGSTOP of the process: the loop wakes with the pause between two runs and the
    # term's deadline both overdue, and the pause's timer may come first.
    expected_logs.expect(r"lease on 'jobs/x' lost: no successful renewal before the local deadline")
    starts: list[tuple[float, float]] = []

    async def job(term: asynclock.Lease) -> None:
        starts.append((anyio.current_time(), term.deadline))

    async with asynclock.connect(store) as locks:
        task = asynclock.LeaderTask(locks, "jobs/x", job, ttl=0.3, every=0.05, retry_after=0.05)
        async with task:
            await until(lambda: len(starts) >= 2)
            time.sleep(0.5)  # noqa: ASYNC251 (the whole event loop stops, renewals too)
            await until(lambda: task.terms >= 2 and task.leading)
    assert all(started < deadline for started, deadline in starts), starts
