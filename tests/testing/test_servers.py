"""Each server starts, serves a real client, survives pause/resume, kill/restart, and cleans up."""

from __future__ import annotations

import os
import pwd
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aetcd
import aetcd.exceptions
import anyio
import asyncpg
import pytest
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from asynclock.testing import (
    EtcdServer,
    PostgresServer,
    RedisServer,
    Server,
    ServerNotInstalled,
    ServerStartError,
    ZooKeeperServer,
    find_binary,
)
from asynclock.testing._process import SingleServer

from ._helpers import process_gone, wait_for, zookeeper_client

# Long enough to be sure a frozen server will not answer, short enough for a fast suite.
PAUSED_WAIT = 0.4


@dataclass
class Store:
    put: Callable[[str, bytes], Awaitable[object]]
    get: Callable[[str], Awaitable[bytes | None]]
    frozen: type[BaseException] = TimeoutError  # what a call to a paused server raises


@asynccontextmanager
async def store(server: Server) -> AsyncIterator[Store]:
    if isinstance(server, RedisServer):
        # No retries: a frozen server must show as one timeout, not as four.
        async with Redis(host=server.host, port=server.port, retry=Retry(NoBackoff(), 0)) as redis:
            yield Store(redis.set, redis.get)
    elif isinstance(server, EtcdServer):
        # gRPC's own deadline, not anyio.fail_after: a cancelled unary gRPC call raises a fresh
        # CancelledError that anyio cannot tell from an outer cancellation (grpc/grpc#43502).
        async with aetcd.Client(host=server.host, port=server.port, timeout=1) as etcd:

            async def etcd_get(key: str) -> bytes | None:
                got = await etcd.get(key.encode())
                return None if got is None else bytes(got.value)

            yield Store(
                lambda key, value: etcd.put(key.encode(), value),
                etcd_get,
                aetcd.exceptions.ConnectionTimeoutError,
            )
    elif isinstance(server, ZooKeeperServer):
        async with zookeeper_client(server.address, 10) as zookeeper:
            yield Store(
                lambda key, value: zookeeper.create(f"/{key}", data=value),
                lambda key: zookeeper.get_data(f"/{key}"),
            )
    else:
        connection = await asyncpg.connect(server.url)
        put = "CREATE TABLE IF NOT EXISTS kv (k text PRIMARY KEY, v bytea); INSERT INTO kv "
        try:
            yield Store(
                lambda key, value: connection.execute(
                    put + f"VALUES ('{key}', '\\x{value.hex()}')"
                ),
                lambda key: connection.fetchval("SELECT v FROM kv WHERE k = $1", key),
            )
        finally:
            connection.terminate()  # also when a paused server left a query unanswered


def assert_cleaned_up(pid: int, data_dir: Path) -> None:
    assert wait_for(lambda: process_gone(pid))
    assert not data_dir.exists()


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("make", "url"),
    [
        # Without its append-only file: what a restart after a kill keeps is then certain.
        (lambda: RedisServer(appendonly=False), "redis://{}/0"),
        (EtcdServer, "etcd://{}"),
        (lambda: ZooKeeperServer(tick_time_ms=500), "zookeeper://{}"),
        (PostgresServer, "postgresql://postgres@{}/postgres"),
    ],
    ids=["redis", "etcd", "zookeeper", "postgres"],
)
async def test_a_server_serves_pauses_resumes_and_restarts(
    make: Callable[[], SingleServer], url: str
) -> None:
    server = make()
    with server:
        assert (server.host, server.address) == ("127.0.0.1", f"127.0.0.1:{server.port}")
        assert server.url == url.format(server.address)
        assert server.is_running and not server.is_paused and server.data_dir.is_dir()
        port, data_dir, pid = server.port, server.data_dir, server.pid
        assert pid is not None
        if isinstance(server, PostgresServer) and os.geteuid() == 0:
            # Run as postgres by setpriv, which exec'd the server: the pid we signal is its own.
            assert os.stat(f"/proc/{pid}").st_uid == pwd.getpwnam("postgres").pw_uid
        async with store(server) as client:
            await client.put("k", b"v")
            # A postmaster's backends are its children: pausing the process group freezes them.
            server.pause()
            assert server.is_paused
            with (
                pytest.raises(client.frozen),
                anyio.fail_after(PAUSED_WAIT if client.frozen is TimeoutError else 5),
            ):
                await client.get("k")
            server.resume()
        async with store(server) as client:
            with anyio.fail_after(5):
                assert await client.get("k") == b"v"

        server.kill()
        assert not server.is_running and process_gone(pid)
        server.restart()
        assert (server.port, server.data_dir) == (port, data_dir)
        assert server.pid != pid
        async with store(server) as client:
            with anyio.fail_after(5):
                # No persistence: a restarted redis starts empty, as a real one without AOF would.
                kept = await client.get("k")
                assert kept == (None if isinstance(server, RedisServer) else b"v")
    assert_cleaned_up(server.pid or pid, data_dir)
    server.stop()
    with pytest.raises(RuntimeError, match="stopped"):
        server.restart()


async def assert_clock(server: RedisServer, offset: float) -> None:
    """The server's TIME is this machine's clock moved by ``offset`` seconds."""
    async with Redis(host=server.host, port=server.port) as client:
        seconds, _ = await client.time()
    assert abs(seconds - (time.time() + offset)) < 2


@pytest.mark.anyio
async def test_redis_fake_clock_jumps_at_run_time_and_start_offsets_have_units() -> None:
    with RedisServer(faketime="+0") as server:
        assert server.faketime
        await assert_clock(server, 0)
        server.jump_clock(3600)
        await assert_clock(server, 3600)
        server.jump_clock(-7200)
        await assert_clock(server, -3600)
        assert server.clock_offset == pytest.approx(3600 - 7200)
        # DEBUG works for local clients, so a test can also stall the server on demand.
        async with Redis(host=server.host, port=server.port) as client:
            start = time.monotonic()
            await client.execute_command("DEBUG", "SLEEP", "0.2")  # type: ignore[no-untyped-call]
            assert time.monotonic() - start >= 0.19
        server.restart()
        await assert_clock(server, -3600)
    # Start offsets have units, a jump may come before the start, and arguments are checked.
    with pytest.raises(ValueError, match="relative offset"):
        RedisServer(faketime="@2020-01-01 00:00:00")
    server = RedisServer()
    with pytest.raises(RuntimeError, match="faketime"):
        server.jump_clock(1)
    with pytest.raises(RuntimeError, match="not running"):
        server.pause()
    server.stop()
    server = RedisServer(faketime="-1.5h")
    assert server.clock_offset == -5400
    server.jump_clock(60)
    with server:
        assert server.clock_offset == -5340
        await assert_clock(server, -5340)


class _Crashing(SingleServer):
    kind = "crashing"

    def __init__(self, script: str, **kwargs: Any) -> None:
        self._script = script
        super().__init__(**kwargs)

    @property
    def url(self) -> str:
        return f"crashing://{self.address}"

    def _command(self) -> list[str]:
        return ["/bin/sh", "-c", self._script]

    def _probe(self, timeout: float) -> bool:
        return False


def test_a_start_error_or_timeout_carries_the_log_and_a_stop_is_bounded() -> None:
    server = _Crashing("echo 'fatal: boom-marker' >&2; exit 3")
    with pytest.raises(ServerStartError, match="status 3") as caught:
        server.start()
    assert "boom-marker" in str(caught.value)
    assert server._resources.directory is None
    assert not server.is_running
    server = _Crashing("echo still-starting; exec sleep 60", start_timeout=0.3)
    start = time.monotonic()
    with pytest.raises(ServerStartError, match=r"did not serve within 0\.3 s") as caught:
        server.start()
    assert time.monotonic() - start < 5
    assert "still-starting" in str(caught.value)
    assert not server.is_running
    # A stop is bounded when the server ignores the shutdown signal.
    server = _Crashing("trap '' TERM; echo up; while :; do sleep 0.05; done")
    server.stop_timeout = 0.3
    server._begin_start()  # it never becomes ready; launch only
    pid = server.pid
    assert pid is not None
    # Signalled before the shell ran "trap", it would just die.
    assert wait_for(lambda: b"up" in server._output_path.read_bytes())
    start = time.monotonic()
    server.stop()
    assert 0.25 < time.monotonic() - start < 5
    assert wait_for(lambda: process_gone(pid))


def test_find_binary_and_servers_left_running_are_killed_at_interpreter_exit(
    tmp_path: Path,
) -> None:
    with pytest.raises(ServerNotInstalled, match="apt-get install some-package") as caught:
        find_binary("asynclock-no-such-binary", "some-package")
    assert caught.value.apt_package == "some-package"
    assert find_binary("sh", "dash").endswith("/sh")
    # Like /usr/lib/postgresql/<major>/bin, which Debian keeps out of PATH.
    for version in ("9.6", "15", "13"):
        program = tmp_path / version / "bin" / "asynclock-fake-initdb"
        program.parent.mkdir(parents=True)
        program.write_text("#!/bin/sh\n")
        program.chmod(0o755)
    found = find_binary("asynclock-fake-initdb", "postgresql", extra_dirs=[f"{tmp_path}/*/bin"])
    assert found == str(tmp_path / "15" / "bin" / "asynclock-fake-initdb")
    # Servers left running are killed at interpreter exit.
    script = (
        "from asynclock.testing import RedisServer, PostgresServer\n"
        "r = RedisServer().start(); p = PostgresServer().start()\n"
        "print(r.pid, r.data_dir, p.pid, p.data_dir, flush=True)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    redis_pid, redis_dir, postgres_pid, postgres_dir = done.stdout.split()
    assert_cleaned_up(int(redis_pid), Path(redis_dir))
    assert_cleaned_up(int(postgres_pid), Path(postgres_dir))


def test_server_context_stop_taken_port_and_a_paused_server_reported_by_wait_ready() -> None:
    server = RedisServer()
    assert (server.is_running, server.pid) == (False, None)
    with pytest.raises(RuntimeError, match="never started"):
        _ = server.data_dir
    # /dev/shm when it is writable (faster fsync for etcd and ZooKeeper), else the temp dir.
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    with server as entered:
        assert entered is server
        assert str(server.data_dir).startswith(f"{base}/asynclock-redis-")
        pid = server.pid
        assert pid is not None
        data_dir = server.data_dir
        assert server.start() is server  # already running: nothing happens
        assert server.pid == pid
    server.stop()
    server.stop()
    assert_cleaned_up(pid, data_dir)
    assert "stopped" in repr(server)
    # A first start moves to another port when its port is taken.
    server = RedisServer()
    taken = server.port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        with server:
            assert server.port != taken
            assert server.is_running
    # A paused server is reported by wait_ready, and still stops.
    with RedisServer() as server:
        pid = server.pid
        assert pid is not None
        server.pause()
        with pytest.raises(ServerStartError, match="did not serve"):
            server.wait_ready(0.2)
        assert server.is_running  # reported, not killed
        server.resume()
        server.wait_ready(5)
        server.pause()
        start = time.monotonic()
    assert time.monotonic() - start < 5
    assert wait_for(lambda: process_gone(pid))
