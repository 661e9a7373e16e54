"""FaultProxy: every mode does what it says, measured against an echo server (and redis's QUIT)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
import pytest
from anyio.abc import SocketStream

from asynclock.testing import FaultProxy, ProxyMode, RedisServer, free_port
from tests.contract.harness import until

pytestmark = pytest.mark.anyio

# How long a request must go unanswered to count as "no reply".
NO_REPLY = 0.3


@dataclass
class Echo:  # a TCP echo server that records what reached it
    port: int = 0
    received: bytearray = field(default_factory=bytearray)
    accepted: int = 0


@asynccontextmanager
async def echo_server() -> AsyncIterator[Echo]:
    echo = Echo()

    async def handle(stream: SocketStream) -> None:
        echo.accepted += 1
        async with stream:
            try:
                async for chunk in stream:
                    echo.received += chunk
                    await stream.send(chunk)
            except (anyio.BrokenResourceError, OSError):
                pass  # the proxy reset us: that is the point of some tests

    async with (
        await anyio.create_tcp_listener(local_host="127.0.0.1") as listener,
        anyio.create_task_group() as tasks,
    ):
        echo.port = listener.extra(anyio.abc.SocketAttribute.local_port)
        tasks.start_soon(listener.serve, handle)
        yield echo
        tasks.cancel_scope.cancel()


async def round_trip(stream: SocketStream, payload: bytes = b"ping") -> float:
    start = anyio.current_time()
    await stream.send(payload)
    got = b""
    while len(got) < len(payload):
        got += await stream.receive()
    assert got == payload
    return anyio.current_time() - start


def mode_of(proxy: FaultProxy) -> ProxyMode:
    # Read through a function so that mypy does not narrow proxy.mode across mode changes.
    return proxy.mode


async def test_pass_through_relays_and_counts_connections_and_reset_sends_rst() -> None:
    async with echo_server() as echo, FaultProxy("127.0.0.1", echo.port) as proxy:
        assert (proxy.host, proxy.address) == ("127.0.0.1", f"127.0.0.1:{proxy.port}")
        assert (proxy.mode, proxy.connections) == ("pass_through", 0)
        async with await anyio.connect_tcp(proxy.host, proxy.port) as stream:
            await round_trip(stream, b"hello")
            assert proxy.connections == 1
            async with await anyio.connect_tcp(proxy.host, proxy.port) as second:
                await round_trip(second)
                assert proxy.connections == 2
        await until(lambda: proxy.connections == 0)
        assert bytes(echo.received) == b"helloping"
        # reset sends RST and keeps accepting.
        async with await anyio.connect_tcp(proxy.host, proxy.port) as stream:
            await round_trip(stream)
            proxy.reset()
            await until(lambda: proxy.connections == 0)
            # RST, not FIN: the client's next read fails instead of returning end-of-stream.
            with pytest.raises(anyio.BrokenResourceError) as caught:
                await stream.receive()
            assert isinstance(caught.value.__cause__, ConnectionResetError)
        assert proxy.mode == "pass_through"
        async with await anyio.connect_tcp(proxy.host, proxy.port) as stream:
            await round_trip(stream)


async def test_delay_adds_latency_both_ways_and_cut_heals_to_the_previous_mode() -> None:
    async with echo_server() as echo, FaultProxy("127.0.0.1", echo.port) as proxy:
        async with await anyio.connect_tcp(proxy.host, proxy.port) as stream:
            baseline = min([await round_trip(stream) for _ in range(5)])
            proxy.delay(50)
            assert proxy.mode == "delay"
            delayed = min([await round_trip(stream) for _ in range(3)])
            # 50 ms on the way there and 50 ms on the way back.
            assert delayed - baseline >= 0.099
            assert delayed < 0.5
            # A latency, not a bandwidth limit: ten back-to-back chunks overlap, they take one
            # delay each way (0.1 s), not ten (1 s).
            start = anyio.current_time()
            for i in range(10):
                await stream.send(b"%d;" % i)
            got = b""
            while got.count(b";") < 10:
                got += await stream.receive()
            assert 0.099 <= anyio.current_time() - start < 0.5
            proxy.pass_through()
            assert min([await round_trip(stream) for _ in range(3)]) < 0.05
    # cut heals after the given time, to the previous mode unless changed meanwhile.
    async with echo_server() as echo, FaultProxy("127.0.0.1", echo.port) as proxy:
        async with await anyio.connect_tcp(proxy.host, proxy.port) as stream:
            await round_trip(stream)
            proxy.cut(1)
            assert proxy.mode == "blackhole"
            with anyio.fail_after(3):
                took = await round_trip(stream)
            assert 0.95 <= took < 2.0
            assert mode_of(proxy) == "pass_through"
        proxy.delay(10)
        proxy.cut(0.1)
        await until(lambda: mode_of(proxy) == "delay", timeout=2)

        proxy.cut(0.1)
        proxy.drop_replies()  # a newer decision wins over the cut's timer
        await anyio.sleep(0.3)
        assert mode_of(proxy) == "drop_replies"


async def test_blackhole_holds_traffic_and_drop_replies_loses_only_replies() -> None:
    async with echo_server() as echo, FaultProxy("127.0.0.1", echo.port) as proxy:
        async with await anyio.connect_tcp(proxy.host, proxy.port) as stream:
            await round_trip(stream, b"a")
            proxy.blackhole()
            await stream.send(b"b")
            with pytest.raises(TimeoutError), anyio.fail_after(NO_REPLY):
                await stream.receive()
            assert bytes(echo.received) == b"a"
            assert proxy.connections == 1

            # A new connection is accepted but does not reach the server during the partition.
            async with await anyio.connect_tcp(proxy.host, proxy.port) as late:
                await anyio.sleep(0.1)
                assert proxy.connections == 2
                assert echo.accepted == 1

                # Healing delivers what was sent during the partition, as TCP would.
                proxy.pass_through()
                with anyio.fail_after(2):
                    assert await stream.receive() == b"b"
                    await round_trip(late)
                assert echo.accepted == 2
    # drop_replies delivers requests and loses the replies.
    async with echo_server() as echo, FaultProxy("127.0.0.1", echo.port) as proxy:
        async with await anyio.connect_tcp(proxy.host, proxy.port) as stream:
            proxy.drop_replies()
            await stream.send(b"lost-reply")
            await until(lambda: bytes(echo.received) == b"lost-reply")
            with pytest.raises(TimeoutError), anyio.fail_after(NO_REPLY):
                await stream.receive()
            proxy.pass_through()
            await round_trip(stream, b"next")


async def test_a_servers_close_is_relayed_as_end_of_stream(redis_server: RedisServer) -> None:
    # What faults do to a real client is the backends' tests' (test_redis.py, test_etcd.py,
    # test_zookeeper.py, test_postgres.py, test_faults.py run their clients through the proxy).
    async with FaultProxy(redis_server.host, redis_server.port) as proxy:
        async with await anyio.connect_tcp(proxy.host, proxy.port) as stream:
            await stream.send(b"QUIT\r\n")
            with anyio.fail_after(5):
                assert await stream.receive() == b"+OK\r\n"
                with pytest.raises(anyio.EndOfStream):
                    await stream.receive()
        await until(lambda: proxy.connections == 0)


async def test_aclose_closes_everything_once_and_an_unreachable_target_resets() -> None:
    async with echo_server() as echo:
        proxy = FaultProxy("127.0.0.1", echo.port)
        with pytest.raises(RuntimeError, match="not started"):
            _ = proxy.port
        async with proxy:
            port = proxy.port
            async with await anyio.connect_tcp(proxy.host, port) as stream:
                await round_trip(stream)
                proxy.blackhole()
                await proxy.aclose()
                assert proxy.connections == 0
                with pytest.raises((anyio.EndOfStream, anyio.BrokenResourceError)):
                    await stream.receive()
            await proxy.aclose()
            with pytest.raises(RuntimeError, match="not running"):
                proxy.cut(1)
        await proxy.aclose()
        with pytest.raises(OSError):
            await anyio.connect_tcp("127.0.0.1", port)
        with pytest.raises(RuntimeError, match="only once"):
            await proxy.__aenter__()
        # An exception in the body propagates, and the proxy is closed all the same.
        failing = FaultProxy("127.0.0.1", echo.port)
        with pytest.raises(ValueError, match=">= 0"):
            failing.delay(-1)
        with pytest.raises(LookupError):
            async with failing:
                port = failing.port
                raise LookupError
        with pytest.raises(OSError):
            await anyio.connect_tcp("127.0.0.1", port)
    # An unreachable target resets the client.
    async with FaultProxy("127.0.0.1", free_port()) as proxy:
        async with await anyio.connect_tcp(proxy.host, proxy.port) as stream:
            with pytest.raises(anyio.BrokenResourceError), anyio.fail_after(5):
                await stream.receive()
        await until(lambda: proxy.connections == 0)
