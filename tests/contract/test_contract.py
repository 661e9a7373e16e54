"""The contract every backend passes, run against each real backend (see tests/conftest.py).

A test that takes ``kind`` runs for locks, semaphores of one permit and elections alike
(tests/contract/kinds.py)."""

from __future__ import annotations

import asyncio
import random
from contextlib import suppress

import anyio
import pytest

import asynclock
from asynclock.abc import Kind
from tests.contract.harness import (
    BackendUnderTest,
    cancel_while_waiting,
    hold_until_cancelled,
    wait_until_free,
    warm_up_for_wait_until_free,
)
from tests.contract.kinds import Holds, holds

pytestmark = pytest.mark.anyio

#: The warning a lease lost on the server logs.
LOST = r"lease on '.*' lost"


async def test_mutual_exclusion_under_50_contending_tasks(
    backend: BackendUnderTest, name: str, kind: Kind
) -> None:
    """A read-sleep-write counter shared by 50 tasks on 5 clients never loses an update."""
    counter = 0
    inside = 0
    most_inside = 0

    async def worker(hold: Holds) -> None:
        nonlocal counter, inside, most_inside
        async with hold.lock(name, ttl=10 * backend.ttl):
            inside += 1
            most_inside = max(most_inside, inside)
            seen = counter
            await anyio.sleep(random.uniform(0, 0.002))
            counter = seen + 1
            inside -= 1

    clients = [backend.connect() for _ in range(5)]
    async with clients[0], clients[1], clients[2], clients[3], clients[4]:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for index in range(50):
                    tg.start_soon(worker, holds(clients[index % 5], kind))
    assert counter == 50
    assert most_inside == 1


async def test_try_acquire_returns_none_while_held_and_a_lease_when_free(
    backend: BackendUnderTest, name: str, kind: Kind
) -> None:
    async with backend.connect() as first, backend.connect() as second:
        lease = await holds(first, kind).try_acquire(name, ttl=backend.ttl * 5)
        assert lease is not None
        assert await holds(second, kind).try_acquire(name, ttl=backend.ttl * 5) is None
        await lease.release()
        again = await holds(second, kind).try_acquire(name, ttl=backend.ttl * 5)
        assert again is not None
        await again.release()


async def test_timeout_raises_acquire_timeout_after_the_timeout(
    backend: BackendUnderTest, name: str, kind: Kind
) -> None:
    async with backend.connect() as first, backend.connect() as second:
        async with holds(first, kind).lock(name, ttl=backend.ttl * 5):
            started = anyio.current_time()
            with pytest.raises(asynclock.AcquireTimeout) as info:
                async with holds(second, kind).lock(name, ttl=backend.ttl * 5, timeout=0.3):
                    pytest.fail("entered a lock that another client holds")
            waited = anyio.current_time() - started
            assert isinstance(info.value, TimeoutError)
            assert 0.25 <= waited < 2.0
            with pytest.raises(asynclock.AcquireTimeout):
                async with holds(second, kind).lock(name, ttl=backend.ttl * 5, timeout=0):
                    pass


async def test_a_timeout_bounds_the_wait_not_the_first_attempt(
    backend: BackendUnderTest, name: str, kind: Kind
) -> None:
    """However short the timeout, the lock is tried once: ``timeout=1e-9`` takes a free lock as
    ``timeout=0`` does, and gives up on a held one without a place left behind in its queue."""
    ttl = backend.ttl * 5
    async with backend.connect() as first, backend.connect() as second:
        async with holds(first, kind).lock(name, ttl=ttl, timeout=1e-9):
            with pytest.raises(asynclock.AcquireTimeout):
                async with holds(second, kind).lock(name, ttl=ttl, timeout=1e-9):
                    pytest.fail("entered a lock that another client holds")
        async with holds(second, kind).lock(name, ttl=ttl, timeout=1e-9):
            pass


async def test_waiter_gets_the_lock_when_it_is_released(
    backend: BackendUnderTest, name: str, kind: Kind
) -> None:
    order: list[str] = []
    async with backend.connect() as first, backend.connect() as second:
        holder = await holds(first, kind).acquire(name, ttl=backend.ttl * 5)

        async def wait_for_it() -> None:
            async with holds(second, kind).lock(name, ttl=backend.ttl * 5, timeout=10):
                order.append("waiter")

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait_for_it)
            await anyio.sleep(0.2)
            order.append("release")
            await holder.release()
    assert order == ["release", "waiter"]


async def test_tokens_strictly_increase_across_clients(
    backend: BackendUnderTest, name: str, kind: Kind
) -> None:
    tokens: list[int] = []
    async with backend.connect() as first, backend.connect() as second:
        if not first.capabilities.fencing:
            # No sound token (Redlock): asking for one is an error, never a made-up number.
            async with holds(first, kind).lock(name, ttl=backend.ttl * 5) as lease:
                with pytest.raises(asynclock.UnsupportedFeature, match="efficiency"):
                    _ = lease.token
                with pytest.raises(asynclock.UnsupportedFeature):
                    asynclock.current_token()
            return
        for index in range(10):
            locks = first if index % 2 else second
            async with holds(locks, kind).lock(name, ttl=backend.ttl * 5) as lease:
                tokens.append(lease.token)
                assert asynclock.current_token() == lease.token
    assert tokens == sorted(tokens)
    assert len(set(tokens)) == len(tokens)


# The revoke ends the stale lease: a backend told at once (PostgreSQL, ZooKeeper) warns that
# it is lost before its late release; the others learn it only from that release.
@pytest.mark.allow_log(LOST)
async def test_release_is_idempotent_and_never_frees_another_holders_lock(
    backend: BackendUnderTest, name: str
) -> None:
    async with backend.connect() as first, backend.connect() as second:
        lease = await first.acquire(name, ttl=backend.ttl * 5)
        await lease.release()
        await lease.release()
        assert lease.released
        # A stale lease (revoked on the server, then taken by someone else) releasing late must
        # leave the new holder's lock alone.
        stale = await first.acquire(name, ttl=backend.ttl * 5)
        await backend.revoke(name)
        current = await second.acquire(name, ttl=backend.ttl * 5, timeout=10)
        await stale.release()
        assert await first.try_acquire(name, ttl=backend.ttl * 5) is None
        await current.release()


@pytest.mark.expect_log(LOST)
async def test_lease_lost_on_the_server_cancels_the_body_and_raises_lease_lost(
    backend: BackendUnderTest, name: str
) -> None:
    ttl = backend.ttl * 3
    reached_end = False
    async with backend.connect() as locks:
        with pytest.raises(asynclock.LeaseLost) as info:
            async with locks.lock(name, ttl=ttl) as lease:
                deadline = lease.deadline
                # A backend with push notification cancels the body inside revoke's own awaits:
                # shield it, so that the time of the revoke is recorded.
                with anyio.CancelScope(shield=True):
                    await backend.revoke(name)
                revoked_at = anyio.current_time()
                await anyio.sleep(ttl * 10)
                reached_end = True
        cancelled_at = anyio.current_time()
    assert not reached_end
    assert info.value.name == name
    assert lease.lost and lease.lost_reason == info.value.reason
    # Detected by the renewal (or a push), not by waiting out the local deadline.
    assert cancelled_at < deadline
    assert cancelled_at - revoked_at < ttl


@pytest.mark.expect_log(LOST)
async def test_on_lost_flag_keeps_the_body_running_and_wait_lost_returns(
    backend: BackendUnderTest, name: str
) -> None:
    ttl = backend.ttl * 3
    async with backend.connect() as locks:
        async with locks.lock(name, ttl=ttl, on_lost="flag") as lease:
            assert not lease.lost
            await backend.revoke(name)
            with anyio.fail_after(ttl * 2):
                reason = await lease.wait_lost()
            assert lease.lost
            assert reason == lease.lost_reason
            await anyio.sleep(0.01)  # still running: not cancelled
        assert lease.released


async def test_a_callers_cancellation_passes_through_untouched(
    backend: BackendUnderTest, name: str, kind: Kind
) -> None:
    async with backend.connect() as locks:
        # Cancelled inside the body, whatever the take cost: a deadline of 0.2 s could fall in
        # a slow take (beside a CPU hog, PgBouncer's election), whose undo may finish a moment
        # after the caller left (test_cancelling_acquire_at_any_point_leaves_nothing_behind).
        with anyio.CancelScope() as scope:
            async with holds(locks, kind).lock(name, ttl=backend.ttl * 5):
                scope.cancel()
                await anyio.sleep(10)
        assert scope.cancelled_caught
        # And the lock was released on the way out.
        lease = await holds(locks, kind).try_acquire(name, ttl=backend.ttl * 5)
        assert lease is not None
        await lease.release()


async def test_cancelling_acquire_at_any_point_leaves_nothing_behind(
    backend: BackendUnderTest, name: str, kind: Kind
) -> None:
    """Cancel a free-lock acquire and a waiting acquire at delays spread over a round trip."""
    async with backend.connect() as locks, backend.connect() as other:
        started = anyio.current_time()
        lease = await holds(locks, kind).acquire(name, ttl=backend.ttl * 5)
        round_trip = max(anyio.current_time() - started, 0.001)
        await lease.release()
        await warm_up_for_wait_until_free(backend, other, kind)
        for step in range(12):
            delay = round_trip * step / 8
            with anyio.move_on_after(delay):
                async with holds(locks, kind).lock(name, ttl=backend.ttl * 5):
                    await anyio.sleep(10)
            # Free at once, or within the 100 ms of test_faults (d): a take on PostgreSQL,
            # cancelled while its statement runs, returns before the unlock that undoes it.
            await wait_until_free(backend, other, name, within=0.1, kind=kind)
            probe = await holds(other, kind).acquire(name, ttl=backend.ttl * 5, timeout=5)
            # Now cancel a waiter queued behind the probe.
            with anyio.move_on_after(delay + 0.01):
                async with holds(locks, kind).lock(name, ttl=backend.ttl * 5):
                    pytest.fail("entered a held lock")
            await probe.release()
            # Likewise for the cancelled waiter (a CI run found it still held at once on
            # PostgreSQL: a semaphore waiter's take, cancelled mid-statement).
            await wait_until_free(backend, other, name, within=0.1, kind=kind)


async def test_a_waiter_cancelled_natively_or_by_anyio_leaves_nothing_behind(
    backend: BackendUnderTest, name: str, kind: Kind
) -> None:
    """A waiter's task cancelled once, twice and five times in a row (as a web framework's
    disconnect and a timeout may both do), then by anyio: nothing is left queued."""
    ttl = backend.ttl * 5
    async with backend.connect() as locks, backend.connect() as other:
        holder = await holds(other, kind).acquire(name, ttl=ttl)
        for cancels in (1, 2, 5):
            await cancel_while_waiting(holds(locks, kind).lock(name, ttl=ttl), cancels)
        with anyio.move_on_after(0.05):
            await hold_until_cancelled(holds(locks, kind).lock(name, ttl=ttl))
        await holder.release()
        # The cancelled waiters are gone: the next one gets in at once.
        again = await holds(locks, kind).acquire(name, ttl=ttl, timeout=5)
        await again.release()


async def test_cancelling_release_still_releases(
    backend: BackendUnderTest, name: str, kind: Kind
) -> None:
    async with backend.connect() as locks, backend.connect() as other:
        for step in range(6):
            lease = await holds(locks, kind).acquire(name, ttl=backend.ttl * 5)
            with anyio.CancelScope() as scope:
                scope.cancel()
                await lease.release()
            del step
            probe = await holds(other, kind).try_acquire(name, ttl=backend.ttl * 5)
            assert probe is not None
            await probe.release()


async def test_nested_locks_and_current_token_in_child_tasks(
    backend: BackendUnderTest, name: str
) -> None:
    seen: dict[str, asynclock.Lease] = {}

    async def child() -> None:
        seen["innermost"] = asynclock.current_lease()
        seen["outer"] = asynclock.current_lease(f"{name}/outer")

    async with backend.connect() as locks:
        fencing = locks.capabilities.fencing
        async with locks.lock(f"{name}/outer", ttl=backend.ttl * 5) as outer:
            async with locks.lock(f"{name}/inner", ttl=backend.ttl * 5) as inner:
                assert asynclock.current_lease() is inner
                assert asynclock.current_lease(f"{name}/outer") is outer
                if fencing:
                    assert asynclock.current_token() == inner.token
                    assert asynclock.current_token(f"{name}/outer") == outer.token
                async with anyio.create_task_group() as tg:
                    tg.start_soon(child)
            assert asynclock.current_lease() is outer
            with pytest.raises(asynclock.NotHeld):
                asynclock.current_lease(f"{name}/inner")
        with pytest.raises(asynclock.NotHeld):
            asynclock.current_token()
    assert seen == {"innermost": inner, "outer": outer}


async def test_leases_are_renewed_past_their_ttl(
    backend: BackendUnderTest, name: str, kind: Kind
) -> None:
    async with backend.connect() as locks, backend.connect() as other:
        async with holds(locks, kind).lock(name, ttl=backend.ttl) as lease:
            await anyio.sleep(backend.ttl * 2.5)
            assert not lease.lost
            assert lease.remaining > 0
            assert await holds(other, kind).try_acquire(name, ttl=backend.ttl) is None


async def test_unusual_names_work(backend: BackendUnderTest, name: str) -> None:
    names = [
        f"{name}/a/b",
        f"{name}/ünïcødé ☃",
        f"{name}/" + "x" * 400,
        f"{name}/../.",
        f"{name}%2F",
    ]
    async with backend.connect() as locks, backend.connect() as other:
        leases = [await locks.acquire(each, ttl=backend.ttl * 5) for each in names]
        for each in names:
            assert await other.try_acquire(each, ttl=backend.ttl * 5) is None
        # Distinct names are distinct locks, even when an encoding could confuse them.
        assert await other.try_acquire(f"{name}/a", ttl=backend.ttl * 5) is not None
        for lease in leases:
            await lease.release()
    assert len({lease.name for lease in leases}) == len(names)


async def test_closing_the_client_releases_what_it_holds(
    backend: BackendUnderTest, name: str, kind: Kind
) -> None:
    async with backend.connect() as other:
        async with backend.connect() as locks:
            await holds(locks, kind).acquire(name, ttl=backend.ttl * 5)
            await holds(locks, kind).acquire(f"{name}/2", ttl=backend.ttl * 5)
        lease = await holds(other, kind).try_acquire(name, ttl=backend.ttl * 5)
        assert lease is not None
        await lease.release()


async def test_a_client_started_in_one_task_is_closed_from_another(
    backend: BackendUnderTest, name: str
) -> None:
    # As arq, saq and taskiq do: open in a start-up hook, close in a shutdown hook, each hook
    # in a task of its own, the jobs in others again.
    locks = backend.connect()
    before = _tasks()
    async with anyio.create_task_group() as startup:
        startup.start_soon(locks.start)
    lease = await locks.acquire(name, ttl=backend.ttl)
    await anyio.sleep(backend.ttl * 1.2)
    assert lease.held  # renewed by the client's own task, which outlived the start-up task
    async with anyio.create_task_group() as shutdown:
        shutdown.start_soon(locks.aclose)
        shutdown.start_soon(locks.aclose)  # idempotent, also when called at the same time
    assert lease.released
    await locks.aclose()
    assert _tasks() == before  # the client's own task is joined, not left running
    async with backend.connect() as other:
        again = await other.try_acquire(name, ttl=backend.ttl)
        assert again is not None
        await again.release()


@pytest.mark.parametrize("native_cancels", [0, 1, 2])
async def test_closing_the_client_ends_its_waiters_at_once_with_a_named_error(
    backend: BackendUnderTest, name: str, native_cancels: int
) -> None:
    """Waiters of a client that closes (three asked together, a fourth later) end as it
    closes, each with BackendUnavailable, not on a timeout of their own; nothing is left. A
    fifth, cancelled natively (once, twice) as the close begins, ends cancelled or the same."""
    async with backend.connect() as other:
        holder = await other.acquire(name, ttl=backend.ttl * 5)
        before = _tasks()
        locks = backend.connect()
        await locks.start()
        errors: list[BaseException] = []

        async def wait() -> None:
            try:
                await locks.acquire(name, ttl=backend.ttl * 5, timeout=60)
            except Exception as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(wait)
            await anyio.sleep(0.05)
            tg.start_soon(wait)
            native = asyncio.create_task(locks.acquire(name, ttl=backend.ttl * 5, timeout=60))
            await anyio.sleep(0.05)
            closed = anyio.current_time()
            closing = asyncio.create_task(locks.aclose())
            for _ in range(native_cancels):
                await asyncio.sleep(0)
                native.cancel()
            await closing
        ended = anyio.current_time() - closed
        await asyncio.wait([native])
        outcome = "cancelled" if native.cancelled() else type(native.exception()).__name__
        allowed = ("cancelled", "BackendUnavailable") if native_cancels else ("BackendUnavailable",)
        assert outcome in allowed, outcome
        await holder.release()
        assert len(errors) == 4 and all(type(e) is asynclock.BackendUnavailable for e in errors), (
            errors
        )
        assert all("closed" in str(e) for e in errors), errors
        # Well inside the backends' op timeouts (5 s): a PostgreSQL waiter whose turn came as
        # its client closed waited that long for a lane that never ran, then said "timeout".
        assert ended < 3.0, f"the waiters ended {ended:.2f} s after the close began"
        assert _tasks() == before
        # Nothing of theirs is left on the server: the lock goes to the next one at once.
        async with backend.connect() as third:
            lease = await third.try_acquire(name, ttl=backend.ttl)
            assert lease is not None
            await lease.release()


@pytest.mark.parametrize("cancels", [1, 2])
async def test_start_cancelled_natively_while_it_opens_leaves_nothing(
    backend: BackendUnderTest, name: str, cancels: int
) -> None:
    """``start()`` cancelled with ``Task.cancel()`` (once, twice) at moments spread over the
    opening (connects, the server's checks) and just after it: no task runs on and nothing is
    left on the server. (A start() cancelled as the backend finished opening left the backend
    open, with its connections; a connect cancelled half-way left asyncpg's socket open; Redis's
    wake channel connection was left open when its reader's task was cancelled before it ran.)"""
    async with backend.connect():
        pass  # what a first client makes on the server (a schema, a chroot) is there
    before = _tasks()
    for delay in (0.0, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05):
        locks = backend.connect()
        task = asyncio.create_task(locks.start())
        await asyncio.sleep(delay)
        for _ in range(cancels):
            task.cancel()
            await asyncio.sleep(0)
        with suppress(asyncio.CancelledError):
            await task
        await locks.aclose()
    assert _tasks() == before
    assert await backend.leftovers() == []
    async with backend.connect() as locks:
        lease = await locks.try_acquire(name, ttl=backend.ttl)
        assert lease is not None
        await lease.release()


def _tasks() -> set[str]:
    return {task.get_name() for task in asyncio.all_tasks()}


async def test_inspect_shows_the_holder_its_token_and_the_waiters(
    backend: BackendUnderTest, name: str
) -> None:
    async with backend.connect() as locks, backend.connect() as other:
        assert not (await locks.inspect(name)).held
        async with locks.lock(name, ttl=backend.ttl * 5) as lease:
            info = await other.inspect(name)
            assert info.held
            assert info.owner in (None, lease.owner)
            if locks.capabilities.fencing:
                assert info.token in (None, lease.token)
            else:  # Redlock: the holder a majority of masters names, and no token
                assert info.token is None
            assert info.expires_in is None or 0 < info.expires_in <= lease.ttl + 1

            async def wait() -> None:
                async with other.lock(name, ttl=backend.ttl * 5, timeout=10):
                    pass

            async with anyio.create_task_group() as tg:
                tg.start_soon(wait)
                if info.waiters is not None:  # stores where waiters leave a trace
                    with anyio.fail_after(5):
                        while (await locks.inspect(name)).waiters != 1:  # noqa: ASYNC110
                            await anyio.sleep(0.02)
                await lease.release()
        assert not (await locks.inspect(name)).held
