"""The core (deadlines, renewal, cancellation, contextvars) on the in-memory backend's fault hooks."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest

import asynclock
from asynclock import _registry
from asynclock._clock import now
from asynclock.abc import Grant
from asynclock.backends.memory import MemoryBackend
from tests.integrations._memory import memory, memory_locks
from tests.loud import ExpectedLogs
from tests.testing._helpers import cancel_natively

pytestmark = pytest.mark.anyio

#: The warnings a lost lease logs: at its loss, and when its body had already completed.
LOST = r"lease on '{}' lost: {}"
DEADLINE = "no successful renewal before the local deadline"
REMOVED = "the lock was removed on the server"
INJECTED = "injected: the server says the lock is gone"
AFTER_COMPLETION = r"lease on '{}' was lost after its body had run to completion"
RELEASE_DEFERRED = r"releasing 'a' on memory://core-\w+ did not complete in 0\.2 s; retrying"


@pytest.fixture
async def locks() -> AsyncIterator[asynclock.LockClient]:
    async with memory_locks() as client:
        yield client


async def test_clients_and_locks_need_async_with_start_once_and_let_errors_through() -> None:
    with pytest.raises(RuntimeError, match=r"async with asynclock\.connect"):
        await asynclock.connect("memory://unentered").acquire("a")
    with pytest.raises(TypeError, match="async with"), asynclock.connect("memory://x"):
        pass
    locks = await asynclock.connect(f"memory://core-{uuid.uuid4().hex[:8]}").start()
    try:
        with pytest.raises(RuntimeError, match="once"):
            await locks.start()
        with pytest.raises(RuntimeError, match="once"):
            await locks.__aenter__()
    finally:
        await locks.aclose()
    with pytest.raises(RuntimeError, match="once"):
        await locks.start()
    # Exceptions from the body and the client block propagate unwrapped.
    with pytest.raises(KeyError):
        async with asynclock.connect("memory://unwrapped"):
            raise KeyError("x")
    async with asynclock.connect("memory://unwrapped") as locks:
        with pytest.raises(KeyError):
            async with locks.lock("a", ttl=30.0):
                raise KeyError("x")
        assert await locks.try_acquire("a") is not None  # released on the way out
        with pytest.raises(TypeError, match="async with"):
            await locks.lock("a")
        with pytest.raises(TypeError, match="async with"), locks.lock("a"):
            pass
    with pytest.raises(asynclock.AcquireTimeout):
        async with asynclock.connect("memory://unwrapped") as locks:
            await locks.acquire("a")
            async with locks.lock("a", timeout=0):
                pass


@pytest.mark.parametrize("cancels", [1, 3])
async def test_start_cancelled_natively_while_opening_leaves_nothing_running(cancels: int) -> None:
    locks = asynclock.connect(f"memory://core-{uuid.uuid4().hex[:8]}")
    memory(locks).faults.paused = True  # open() waits, as on a server that does not answer
    before = set(asyncio.all_tasks())
    task = asyncio.ensure_future(locks.start())
    await asyncio.sleep(0.05)
    await cancel_natively(task, cancels)
    assert locks._host.state == "closed"
    assert set(asyncio.all_tasks()) == before


def test_a_started_client_left_open_is_closed_when_the_loop_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = f"memory://core-{uuid.uuid4().hex[:8]}"
    seen: list[MemoryBackend] = []
    # Left open on purpose: asyncio.run cancels the client's own tasks, which close it. Those
    # tasks are named here instead of failing the test (tests/loud.py's check of the loop).
    left_running: list[str] = []

    def cancel_all_tasks(loop: asyncio.AbstractEventLoop) -> None:  # as asyncio.run does
        tasks = asyncio.all_tasks(loop)
        left_running.extend(task.get_name() for task in tasks)
        for task in tasks:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))

    monkeypatch.setattr(asyncio.runners, "_cancel_all_tasks", cancel_all_tasks)

    async def main() -> None:
        locks = await asynclock.connect(url).start()
        seen.append(memory(locks))
        await locks.acquire("left", ttl=5)

    asyncio.run(main())
    assert seen[0]._store.get("left").holder is None  # released on the way out, not stranded
    assert f"asynclock client of {url}" in left_running


@pytest.mark.expect_log(LOST.format("a", DEADLINE))
@pytest.mark.expect_log(LOST.format("short", DEADLINE))
async def test_a_hung_renewal_cancels_each_body_at_its_own_deadline_before_the_server_expiry() -> (
    None
):
    # A margin of 0.3 s: the time between a local deadline and the server's expiry, which is
    # what a loaded machine may delay the cancellation by. With the default (ttl / 10), the
    # 0.4 s lease below had 44 ms, and a 2-core machine starting JVMs beside the test ran past
    # it (cancelled 48 ms after the deadline).
    margin = 0.3
    async with asynclock.connect(f"memory://hung-{uuid.uuid4().hex[:8]}", margin=margin) as locks:
        memory(locks).faults.renew = "hang"
        ttl = 1.0
        with pytest.raises(asynclock.LeaseLost, match="local deadline"):
            async with locks.lock("a", ttl=ttl) as lease:
                acquired_at = lease.grant.valid_from
                await anyio.sleep(10)
        cancelled_at = anyio.current_time()
        # The server (memory store) expires the lock at valid_from + ttl; we gave up before.
        assert cancelled_at < acquired_at + ttl
        # ... and not long before: the deadline is ttl * (1 - drift) - margin.
        assert cancelled_at >= acquired_at + ttl * 0.99 - margin - 0.01
        # A lease taken while a renewal hangs is cancelled at its own deadline.
        # The renewal loop is stuck in a renewal of "long" (bounded by long's deadline only),
        # so it cannot end "short" in time; the client's deadline task, asleep until long's
        # deadline (1.78 s after long's acquire, past short's expiry at 1.35 s), must be woken
        # for short's earlier one (1.04 s).
        async with locks.lock("long", ttl=2.1) as long_lease:
            await anyio.sleep_until(long_lease.next_renewal + 0.05)  # its renewal hangs now
            with pytest.raises(asynclock.LeaseLost, match="local deadline"):
                async with locks.lock("short", ttl=0.6) as short_lease:
                    await anyio.sleep(10)
            cancelled_at = anyio.current_time()
            assert cancelled_at < short_lease.grant.valid_from + 0.6  # before the expiry
            assert cancelled_at >= short_lease.grant.valid_from + 0.6 * 0.99 - margin - 0.01
            assert not long_lease.lost


async def test_a_renewal_unanswered_past_its_retry_spacing_suspends_the_client_and_not_before(
    locks: asynclock.LockClient,
) -> None:
    # ttl 2.4 s: renewed 0.8 s after the acquire, suspected 0.2 s into a renewal (a quarter of
    # the interval). The watcher sleeps through each renewal's window, so it is checked over
    # several renewals: answered in time twice, then late once.
    changes = locks.state_changes()
    faults = memory(locks).faults
    async with locks.lock("a", ttl=2.4) as lease:
        for _ in range(2):
            renewed_at = lease.next_renewal
            await anyio.sleep_until(renewed_at - 0.05)
            faults.paused = True  # the renewal waits about 0.05 s for an answer
            await anyio.sleep(0.1)
            faults.paused = False
            with anyio.fail_after(1):
                while lease.next_renewal == renewed_at:  # noqa: ASYNC110 - no event to wait on
                    await anyio.sleep(0.01)
        assert locks.state is asynclock.ConnectionState.CONNECTED
        renewed_at = lease.next_renewal
        await anyio.sleep_until(renewed_at - 0.05)
        faults.paused = True
        with anyio.fail_after(1):
            change = await anext(changes)
        suspended_at = anyio.current_time()
        assert change.state is asynclock.ConnectionState.SUSPENDED
        assert renewed_at + 0.2 <= suspended_at < lease.deadline
        faults.paused = False
        with anyio.fail_after(1):
            assert (await anext(changes)).state is asynclock.ConnectionState.RECONNECTED
    assert not lease.lost


@pytest.mark.expect_log(LOST.format("a", DEADLINE))
@pytest.mark.expect_log(LOST.format("a", INJECTED))
@pytest.mark.expect_log(LOST.format("a", REMOVED))
async def test_failing_renewals_do_not_move_the_deadline_and_a_proven_loss_cancels_at_once(
    locks: asynclock.LockClient,
) -> None:
    memory(locks).faults.renew = "fail"
    async with locks.lock("a", ttl=1.0, on_lost="flag") as lease:
        first_deadline = lease.deadline
        await anyio.sleep(0.6)
        assert lease.deadline == first_deadline
        assert locks.renew_calls >= 2  # it retried after the first failure
        reason = await lease.wait_lost()
    assert "deadline" in reason
    # A loss the server proves cancels at once: pushed, or found on the first renewal (at ttl / 3,
    # far before the 3 s deadline).
    for how, reason, within in [("push", REMOVED, 0.1), ("renewal", INJECTED, 1.5)]:
        with pytest.raises(asynclock.LeaseLost, match=reason):
            async with locks.lock("a", ttl=3.0):
                started = anyio.current_time()
                if how == "push":
                    memory(locks).expire("a", notify=True)
                else:
                    memory(locks).faults.renew = "lost"
                await anyio.sleep(10)
        assert anyio.current_time() - started < within


@pytest.mark.expect_log(LOST.format("[abc]", REMOVED))
@pytest.mark.expect_log(AFTER_COMPLETION.format("[ac]"))
@pytest.mark.expect_log(LOST.format("a", REMOVED))
async def test_a_loss_is_reported_not_raised_when_swallowed_or_unchecked_and_yields_to_outer(
    locks: asynclock.LockClient,
) -> None:
    # Loss signalled without a later checkpoint: the body's result stands.
    async with locks.lock("c", ttl=30.0) as lease:
        memory(locks).expire("c", notify=True)
    assert (lease.lost, lease.lost_reason) == (True, REMOVED)
    async with locks.lock("a", ttl=30.0) as lease:
        memory(locks).expire("a", notify=True)
        try:
            await anyio.sleep(10)
        except anyio.get_cancelled_exc_class():
            pass  # a careless body: it was told to stop, and returned
    assert lease.lost
    await anyio.lowlevel.checkpoint()  # no cancellation left pending for the caller
    # ... while a body that swallows it and goes on to await is cancelled again, and raises.
    with pytest.raises(asynclock.LeaseLost):
        async with locks.lock("b", ttl=30.0):
            memory(locks).expire("b", notify=True)
            with contextlib.suppress(anyio.get_cancelled_exc_class()):
                await anyio.sleep(10)
            await anyio.sleep(10)
    # Outer cancellation wins over a simultaneous loss.
    with anyio.CancelScope() as outer:
        async with locks.lock("a", ttl=30.0):
            memory(locks).expire("a", notify=True)
            outer.cancel()
            await anyio.sleep(10)
    assert outer.cancelled_caught


@pytest.mark.expect_log(LOST.format("a", DEADLINE))
@pytest.mark.expect_log(AFTER_COMPLETION.format("a"))
@pytest.mark.expect_log(LOST.format("job/3", DEADLINE))
@pytest.mark.expect_log(AFTER_COMPLETION.format("job/3"))
async def test_a_body_or_locked_call_that_finished_before_its_loss_was_known_keeps_its_result(
    locks: asynclock.LockClient,
) -> None:
    # As if this process were paused past the ttl at the body's last step: the deadline passes
    # with no checkpoint, so the body returns before anything could tell it.
    async with locks.lock("a", ttl=0.3) as lease:
        time.sleep(0.35)  # noqa: ASYNC251 - blocking the loop is the point: a pause
    assert lease.lost and "local deadline" in (lease.lost_reason or "")
    assert await locks.try_acquire("a") is not None

    @asynclock.locked("job/{n}", client=locks, ttl=0.3)
    async def job(n: int) -> int:
        time.sleep(0.35)  # noqa: ASYNC251 - a pause at the call's last step
        return n * 2

    assert await job(3) == 6


async def test_acquire_tracks_the_token_and_remaining_renewals_are_batched_and_need_room(
    locks: asynclock.LockClient,
) -> None:
    lease = await locks.acquire("tracked", ttl=10.0)
    assert asynclock.current_token() == lease.token
    assert asynclock.current_lease("tracked") is lease
    assert 8.0 < lease.remaining <= 10.0
    with pytest.raises(asynclock.NotHeld, match="'tracked'"):
        asynclock.current_token("other")
    # The server's expiry is never before the local deadline.
    holder = memory(locks)._store.get("tracked").holder
    assert holder is not None and lease.deadline < holder.expires_at
    await lease.release()
    assert lease.remaining == 0.0
    with pytest.raises(asynclock.NotHeld, match="no lock is held"):
        asynclock.current_token()
    # Renewals of many leases are batched.
    leases = [await locks.acquire(f"batch/{index}", ttl=0.9) for index in range(100)]
    await anyio.sleep(0.95)
    assert all(not lease.lost for lease in leases)
    # 100 leases renewed ~3 times each: a handful of round trips, not 300.
    assert 2 <= locks.renew_calls <= 8
    for lease in leases:
        await lease.release()
    # A margin that leaves no room to renew is refused.
    async with asynclock.connect("memory://m", margin=5.0) as locks:
        with pytest.raises(asynclock.InvalidArgument, match="margin"):
            await locks.acquire("a", ttl=6.0)


async def test_backend_open_errors_are_named_and_a_backend_may_own_a_task_group() -> None:
    client = asynclock.connect("memory://unreachable")
    memory(client).faults.unreachable = True
    with pytest.raises(asynclock.BackendUnavailable, match="unreachable"):
        async with client:
            pass

    client = asynclock.connect("memory://hang", connect_timeout=0.2)
    memory(client).faults.paused = True  # open() waits, as on a server that does not answer
    with pytest.raises(asynclock.BackendTimeout, match=r"did not answer within 0\.2 s"):
        async with client:
            pass
    # A backend may own a task group from open() to aclose().
    client = asynclock.LockClient(
        _BackendWithTasks("tasks"), drift=0.01, margin=None, connect_timeout=5, release_timeout=5
    )
    async with client as locks, locks.lock("a"):
        pass


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("", {}, "must not be empty"),
        ("x" * 10_000, {}, "10000 bytes long"),
        ("a\x00b", {}, "control character"),
        ("a\nb", {}, "control character"),
        ("\ud800", {}, "not valid Unicode"),
        (42, {}, "must be a str"),
        ("a", {"ttl": 0}, "> 0"),
        ("a", {"ttl": -1}, "> 0"),
        ("a", {"ttl": float("nan")}, "finite"),
        ("a", {"ttl": float("inf")}, "finite"),
        ("a", {"ttl": "1"}, "number"),
        ("a", {"timeout": -1}, ">= 0"),
        ("a", {"timeout": float("nan")}, "finite"),
        ("a", {"on_lost": "ignore"}, "on_lost"),
    ],
)
async def test_bad_names_and_options_are_refused_with_the_reason(
    locks: asynclock.LockClient, name: object, options: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message) as info:
        await locks.acquire(name, **options)  # type: ignore[arg-type]
    assert isinstance(info.value, asynclock.InvalidArgument)


REDLOCK = "redlock://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3"


@pytest.mark.parametrize(
    ("url", "option", "default", "in_url", "given"),
    [
        ("postgresql://app@db.internal/orders", "connect_timeout", 5.0, 2.0, 7.0),
        ("redlock://h1,h2,h3/0", "drift", 0.01, 0.03, 0.05),
    ],
)
def test_a_keyword_of_connect_that_is_a_backend_option_too_sets_both_when_given(
    url: str, option: str, default: float, in_url: float, given: float
) -> None:
    """connect()'s own keyword (PostgreSQL's connect_timeout, Redlock's drift), when given, sets
    the backend's option of the same name (keywords win over the URL, as for every option); not
    given, the URL's value or the backend's default holds."""

    def backend_option(url: str, **options: Any) -> float:
        value = getattr(asynclock.connect(url, **options)._backend, option)
        assert isinstance(value, float)
        return value

    assert backend_option(url) == default
    assert backend_option(f"{url}?{option}={in_url:g}") == in_url
    assert backend_option(f"{url}?{option}={in_url:g}", **{option: given}) == given


@pytest.mark.parametrize(
    ("url", "options", "error", "message"),
    [
        ("", {}, asynclock.InvalidURL, "not a lock URL"),
        ("127.0.0.1:6379", {}, asynclock.InvalidURL, "not a lock URL"),
        ("mysql://127.0.0.1", {}, asynclock.InvalidURL, "unknown lock backend 'mysql'"),
        ("memory://x?a=1&a=2", {}, asynclock.InvalidURL, "given twice"),
        ("sqlite://", {}, asynclock.InvalidURL, "needs a database file"),
        ("sqlite:///tmp/x.db?synchronous=maybe", {}, asynclock.InvalidURL, "synchronous"),
        ("memory://x?bogus=1", {}, asynclock.InvalidArgument, "bogus"),
        ("memory://x", {"require": ["quorum"]}, asynclock.UnsupportedFeature, "quorum"),
        ("memory://x", {"require": ["magic"]}, asynclock.InvalidArgument, "unknown capabilities"),
        (REDLOCK, {"require": ["semaphores"]}, asynclock.UnsupportedFeature, "semaphores"),
    ],
)
def test_bad_urls_options_and_requirements_are_refused_with_the_reason(
    url: str, options: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        asynclock.connect(url, **options)


def test_missing_driver_names_the_extra_public_names_match_all_and_owners_are_unique(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A backend module whose driver is not installed, registered under a scheme of its own.
    (tmp_path / "asynclock_fake_backend.py").write_text("import not_installed_driver\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(
        _registry._BACKENDS,
        "fake",
        _registry._Entry(
            "asynclock_fake_backend", "FakeBackend", "fake", ("not_installed_driver",)
        ),
    )
    with pytest.raises(asynclock.MissingDependency, match=r"pip install 'asynclock\[fake\]'"):
        asynclock.connect("fake://127.0.0.1")
    # The public names match __all__.
    # "@py_..." names: pytest's assertion rewriting of the installed plugin's package.
    public = {name for name in dir(asynclock) if not name.startswith(("_", "@"))}
    modules = {"abc", "backends", "extras", "fencing", "integrations", "otel"}
    assert isinstance(asynclock.__all__, tuple)
    assert public - modules - {"testing"} == set(asynclock.__all__)
    for name in asynclock.__all__:
        assert getattr(asynclock, name).__module__ in ("asynclock", "asynclock.abc")
    # Owner secrets are unique, and a forked child draws its own.
    from asynclock._lease import new_owner

    drawn = {new_owner() for _ in range(1000)}
    assert len(drawn) == 1000
    assert all(len(secret) == 32 and int(secret, 16) >= 0 for secret in drawn)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its first secret must not be the parent's next one
        os.write(write_end, new_owner().encode())
        os._exit(0)
    os.waitpid(pid, 0)
    child = os.read(read_end, 64).decode()
    os.close(read_end)
    os.close(write_end)
    assert child != new_owner()


def test_clients_can_be_made_without_an_event_loop() -> None:
    # The other network backends' clients are made outside a loop by test_trio's refusal test.
    for url in ("memory://x", "sqlite:///tmp/x.db", "zookeeper://127.0.0.1:1/chroot"):
        assert asynclock.connect(url).capabilities is not None
    # The primitives are capabilities too.
    asynclock.connect("memory://x", require=["shared_locks", "semaphores", "elections"])


class _BackendWithTasks(MemoryBackend):
    async def open(self) -> None:
        self._group = anyio.create_task_group()
        await self._group.__aenter__()
        self._group.start_soon(anyio.sleep_forever)

    async def aclose(self) -> None:
        self._group.cancel_scope.cancel()
        await self._group.__aexit__(None, None, None)


@pytest.mark.expect_log(RELEASE_DEFERRED)
async def test_an_unanswered_release_goes_on_in_the_background_until_the_client_closes() -> None:
    namespace = f"memory://core-{uuid.uuid4().hex[:8]}"
    async with (
        asynclock.connect(namespace, release_timeout=0.2) as locks,
        asynclock.connect(namespace) as other,
    ):
        lease = await locks.acquire("a", ttl=5.0)
        memory(locks).faults.paused = True
        started = anyio.current_time()
        await lease.release()
        assert anyio.current_time() - started < 0.5  # returns after release_timeout
        assert await other.try_acquire("a", ttl=5.0) is None  # not released yet
        memory(locks).faults.paused = False
        await (await other.acquire("a", ttl=5.0, timeout=2)).release()
    started = anyio.current_time()
    async with asynclock.connect(namespace, release_timeout=0.2) as locks:
        lease = await locks.acquire("a", ttl=5.0)
        memory(locks).faults.paused = True
        await lease.release()
    # One release_timeout inline, one more for the background retry at close, then it stops.
    assert anyio.current_time() - started < 1.5


@pytest.mark.expect_log(r"observer .*Broken.* failed on acquired; it is unsubscribed")
async def test_an_observer_that_raises_is_dropped_not_allowed_to_break_a_lock(
    locks: asynclock.LockClient, expected_logs: ExpectedLogs
) -> None:
    from asynclock._events import Observer

    class Broken(Observer):
        def acquired(self, *args: object) -> None:
            raise ValueError("observer bug")

    locks._events.subscribe(Broken())
    async with locks.lock("a", ttl=1.0):
        pass
    (logged,) = expected_logs.records
    assert logged.exc_info is not None and "observer bug" in str(logged.exc_info[1])
    assert not locks._events.active  # unsubscribed


async def test_a_task_that_waits_for_a_lock_it_holds_is_refused_at_once(
    locks: asynclock.LockClient,
) -> None:
    """Without deadlock detection it waited for ever: the server sees a holder and a waiter.
    (No fail_after here: a deadline bounds the wait, which is then allowed.)"""
    async with locks.lock("a"):
        with pytest.raises(asynclock.DeadlockDetected, match="waits for 'a'"):
            async with locks.lock("a"):
                pytest.fail("held twice")
        with pytest.raises(asynclock.DeadlockDetected):
            await locks.acquire("a")
        assert await locks.try_acquire("a") is None  # a try does not wait
        # Bounded waits are the caller's: they end as any wait for a busy lock.
        with pytest.raises(asynclock.AcquireTimeout):
            await locks.acquire("a", timeout=0.05)
        with anyio.move_on_after(0.05) as scope:
            await locks.acquire("a")
        assert scope.cancelled_caught
    async with locks.lock("r", shared=True):
        async with locks.lock("r", shared=True):  # two read holds do not exclude each other
            pass
        with pytest.raises(asynclock.DeadlockDetected):
            await locks.acquire("r")
    # Another task, even one started in the body, may wait for it: it gets it after the body.
    got: list[int] = []
    async with anyio.create_task_group() as tg:
        async with locks.lock("c") as lease:

            async def child() -> None:
                async with locks.lock("c", timeout=5) as later:
                    got.append(later.token)

            tg.start_soon(child)
            await anyio.sleep(0.05)
            assert not got
    assert got and got[0] > lease.token


@pytest.mark.expect_log(r"lease on 'p' lost: .*\(ttl 2 s, handed over with 0\.02 s of it left\)")
async def test_a_lease_lost_after_a_short_hand_over_names_the_ttl_asked_for() -> None:
    """A lock handed over with 0.02 s left of a waiter's place said "(ttl 0.02 s)" when lost,
    for a ttl of 2 s (#28 item 6)."""

    async def release(lease: asynclock.Lease) -> None:
        return None

    grant = Grant("p", "owner", 1, now(), 0.02)
    lease = asynclock.Lease(
        grant, on_lost="flag", drift=0.0, margin=0.0, fencing=True, releaser=release, asked_ttl=2
    )
    await anyio.sleep(0.05)
    assert lease.lost
    assert "(ttl 2 s, handed over with 0.02 s of it left)" in (lease.lost_reason or "")


def test_a_client_used_from_another_event_loop_says_so_at_once() -> None:
    """A session-loop client in a function-loop test: it was a BackendUnavailable ("attached to
    a different loop"), a 503 behind @locked, hiding a programming error (#28 item 2)."""
    with asyncio.Runner() as own, asyncio.Runner() as other:
        locks = own.run(asynclock.connect(f"memory://loops-{uuid.uuid4().hex[:8]}").start())
        try:
            with pytest.raises(asynclock.WrongEventLoop, match="one client per event loop"):
                other.run(locks.acquire("a", ttl=5))
            own.run(locks.acquire("a", ttl=5))  # its own loop still works
        finally:
            own.run(locks.aclose())


def test_capabilities_every_names_only_what_a_store_lacks() -> None:
    every = asynclock.Capabilities.every(quorum=False)
    assert not every.quorum and every.fencing and every.ttl_change and every.elections
    for wrong in ({"quorom": False}, {"quorum": True}):
        with pytest.raises(TypeError, match="flags set to False"):
            asynclock.Capabilities.every(**wrong)
