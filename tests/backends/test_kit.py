"""The backend kit's parts on their own (the backends' tests cover them against real servers)."""

from __future__ import annotations

import asyncio

import anyio
import pytest

import asynclock
from asynclock.backends._kit import (
    Backoff,
    CallOrder,
    HostPort,
    IdlePool,
    MayHaveApplied,
    RetryPolicy,
    TaskHost,
    parse_host,
    parse_hosts,
    split_userinfo,
    translate,
)

pytestmark = pytest.mark.anyio

URL = "demo://h/x"
EXAMPLE = "demo://127.0.0.1:1234"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1", HostPort("127.0.0.1", 1234)),
        ("127.0.0.1:99", HostPort("127.0.0.1", 99)),
        ("db.internal", HostPort("db.internal", 1234)),
        ("[::1]", HostPort("::1", 1234)),
        ("[::1]:7", HostPort("::1", 7)),
        (" host-a:65535 ", HostPort("host-a", 65535)),
        ("", "empty host"),
        ("::1", "brackets"),
        ("[::1", "unbalanced"),
        ("[::1]x", "unexpected"),
        ("[nothost]:1", "not an IPv6"),
        (":99", "names no host"),
        ("h:0", "1 to 65535"),
        ("h:65536", "1 to 65535"),
        ("h:x", "1 to 65535"),
        ("h:", "1 to 65535"),
        ("a b", "not a host"),
    ],
)
def test_hosts_are_read_with_their_default_port_or_refused_naming_the_problem(
    text: str, expected: HostPort | str
) -> None:
    if isinstance(expected, HostPort):
        assert parse_host(text, default_port=1234, url=URL, example=EXAMPLE) == expected
        return
    with pytest.raises(asynclock.InvalidURL, match=expected) as info:
        parse_host(text, default_port=1234, url=URL, example=EXAMPLE)
    assert EXAMPLE in str(info.value)


def test_host_lists_one_family_and_no_password_in_messages() -> None:
    hosts = parse_hosts("a:1,b,[::1]:3", default_port=9, url=URL, example=EXAMPLE)
    assert [str(host) for host in hosts] == ["a:1", "b:9", "[::1]:3"]
    with pytest.raises(asynclock.InvalidURL, match="mixes IPv4 and IPv6"):
        parse_hosts("127.0.0.1,[::1]", default_port=9, url=URL, example=EXAMPLE, one_family=True)
    with pytest.raises(asynclock.InvalidURL, match="empty host"):
        parse_hosts("a,,b", default_port=9, url=URL, example=EXAMPLE)
    with pytest.raises(asynclock.InvalidURL) as info:
        parse_host("h:x", default_port=1, url="demo://user:secret@h:x/0", example=EXAMPLE)
    assert "secret" not in str(info.value)
    assert split_userinfo("user:pw@h:1,g") == ("user:pw", "h:1,g")
    assert split_userinfo("h:1") == (None, "h:1")


async def test_backoff_grows_to_its_cap_with_jitter_resets_and_gives_up_after_its_window() -> None:
    backoff = RetryPolicy(first=0.1, cap=0.4, jitter=0.5).backoff()
    delays = [backoff.next_delay() for _ in range(5)]
    assert 0.05 <= delays[0] <= 0.1
    assert all(0.2 <= delay <= 0.4 for delay in delays[2:])
    backoff.reset()
    assert backoff.next_delay() <= 0.1
    backoff = Backoff(RetryPolicy(first=0.01, cap=0.01), window=0.05)
    error = OSError("down")
    with pytest.raises(OSError, match="down"):
        for _ in range(100):
            await backoff.pause(error)


class Connection:
    def __init__(self, number: int) -> None:
        self.number = number
        self.alive = True
        self.aborted = False


async def test_pool_reuses_only_connections_whose_last_request_completed() -> None:
    made: list[Connection] = []

    async def connect() -> Connection:
        made.append(Connection(len(made)))
        return made[-1]

    async def close(connection: Connection) -> None:
        connection.alive = False

    def abort(connection: Connection) -> None:
        connection.aborted = True

    pool = IdlePool(connect=connect, alive=lambda c: c.alive, abort=abort, close=close, keep=2)
    async with pool.connection() as first:
        pass
    async with pool.connection() as again:
        assert again is first  # completed: reused
    with anyio.move_on_after(0.01):
        async with pool.connection() as interrupted:
            await anyio.sleep(1)  # cancelled with a request "in flight"
    assert interrupted is first and interrupted.aborted
    async with pool.connection() as fresh:
        assert fresh is not first
    fresh.alive = False  # died while idle (the server's idle timeout)
    async with pool.connection() as replaced:
        assert replaced is not fresh and fresh.aborted
    await pool.aclose()
    assert pool.idle == 0 and not replaced.alive


def test_translate_takes_a_table_or_a_function() -> None:
    with pytest.raises(asynclock.BackendUnavailable, match="doing x: ConnectionResetError") as info:
        with translate({OSError: asynclock.BackendUnavailable}, "doing x"):
            raise ConnectionResetError("reset")
    assert isinstance(info.value.__cause__, ConnectionResetError)

    def classify(exc: Exception, context: str) -> asynclock.LockError | None:
        if isinstance(exc, TimeoutError):
            return MayHaveApplied(f"{context}: no answer")
        return None

    with pytest.raises(asynclock.BackendTimeout, match="no answer"):
        with translate(classify, "taking"):
            raise TimeoutError
    with pytest.raises(KeyError):  # not a driver error: passes through
        with translate(classify, "taking"):
            raise KeyError("x")


async def test_task_host_owns_its_tasks_and_abandons_late_work() -> None:
    host = TaskHost(cleanup_timeout=0.1)
    stopped = anyio.Event()

    async def forever() -> None:
        try:
            await anyio.sleep_forever()
        finally:
            stopped.set()

    await host.open()
    host.start_soon(forever, name="forever")

    async def slow() -> int:
        await anyio.sleep(1)
        return 1

    async def quick() -> int:
        return 7

    assert await TaskHost.within(0.05, slow, "slow work") is None
    assert await TaskHost.within(1, quick, "quick work") == 7
    await host.aclose()
    await host.aclose()  # idempotent
    assert stopped.is_set()
    with pytest.raises(asynclock.BackendUnavailable, match="the backend is closed"):
        host.start_soon(forever, name="late")


@pytest.mark.parametrize("cancels", [1, 2])
async def test_call_order_lets_turns_out_in_the_order_asked_and_survives_native_cancels(
    cancels: int,
) -> None:
    """One turn per key, in the order asked; a waiter or the holder cancelled natively (once or
    twice) gives its turn up, the others keep their order, and nothing is left behind."""
    order = CallOrder()
    entered: list[int] = []
    release = asyncio.Event()

    async def take(index: int) -> None:
        async with order.turn("name"):
            entered.append(index)
            if index == 0:
                await release.wait()  # the holder, until told or cancelled

    tasks = [asyncio.ensure_future(take(index)) for index in range(6)]
    await asyncio.sleep(0)  # every task asked, in index order; 0 holds the turn
    assert entered == [0]
    for victim in (tasks[2], tasks[0]):  # a waiter, then the holder
        for _ in range(cancels):
            victim.cancel()
        await asyncio.sleep(0)
    await asyncio.gather(*tasks, return_exceptions=True)
    assert entered == [0, 1, 3, 4, 5]
    assert tasks[0].cancelled() and tasks[2].cancelled()
    # Nobody holds or waits: the key's turn is forgotten.
    assert not order._turns
    async with order.turn("name"):  # and a new one is free at once
        pass
    assert not order._turns


async def test_call_order_passes_a_turn_on_when_its_taker_is_cancelled_as_it_gets_it() -> None:
    """A waiter handed the turn and cancelled before it ran passes it on; a waiter that
    anyio's timeout cancels leaves no ticket behind."""
    order = CallOrder()
    entered: list[int] = []

    async def take(index: int) -> None:
        async with order.turn("name"):
            entered.append(index)

    holder = await order.take("name")
    tasks = [asyncio.ensure_future(take(index)) for index in (1, 2)]
    await asyncio.sleep(0)  # both wait, 1 first
    holder.give()  # 1 is handed the turn...
    tasks[0].cancel()  # ...and cancelled before it ran
    await asyncio.gather(*tasks, return_exceptions=True)
    assert entered == [2]
    assert tasks[0].cancelled()
    assert not order._turns

    holder = await order.take("name")
    with anyio.move_on_after(0.01):
        await order.take("name")
    holder.give()
    holder.give()  # idempotent
    assert not order._turns
