"""The Redis family in the contract suite, and the helpers and fixtures that the Redis,
Sentinel, Cluster and Redlock test files share (this module is a plugin: see tests/conftest.py).
"""

from __future__ import annotations

import shlex
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis.asyncio

import asynclock
from asynclock.abc import Kind
from asynclock.backends import _redis_scripts as lua
from asynclock.backends.redis import RedisBackend
from asynclock.testing import RedisServer, free_port
from tests.contract.harness import BackendUnderTest


async def redis_leftovers(server: RedisServer, prefix: str, client_name: str) -> list[str]:
    """Keys under ``prefix`` (fencing counters excepted, of every kind: locks, semaphores and
    elections alike, they are meant to stay) and connections named ``client_name`` still open
    on ``server``. So a semaphore's or an election's holds, queue and permits count here."""
    token_prefixes = tuple(f"{prefix}{space}{lua.TOKEN_TAG}" for space in lua.KIND_SPACE.values())
    async with redis.asyncio.Redis(host=server.host, port=server.port) as raw:
        keys = [
            key.decode()
            async for key in raw.scan_iter(match=f"{prefix}*", count=1000)
            if not key.decode().startswith(token_prefixes)
        ]
        # A client that just closed its sockets may still be listed for a moment.
        with anyio.move_on_after(2):
            while True:
                clients = [
                    f"connection {entry['addr']} named {entry['name']}"
                    for entry in await raw.client_list()
                    if entry.get("name") == client_name
                ]
                if not clients:
                    break
                await anyio.sleep(0.02)
    return sorted(keys) + clients


@pytest.fixture
def redis_backend(redis_server: RedisServer) -> BackendUnderTest:
    tag = uuid.uuid4().hex[:10]
    prefix = f"contract-{tag}:"
    client_name = f"asynclock-contract-{tag}"

    async def revoke(name: str) -> None:
        async with redis.asyncio.Redis(host=redis_server.host, port=redis_server.port) as raw:
            assert await raw.delete(lua.lock_key(prefix, name)) == 1

    async def leftovers() -> list[str]:
        return await redis_leftovers(redis_server, prefix, client_name)

    return BackendUnderTest(
        "redis",
        redis_server.url,
        1.0,
        revoke,
        leftovers,
        # The test servers run without persistence (--appendonly no), which is what the
        # durability warning is about; tests/backends/test_redis.py checks that it appears.
        options={"prefix": prefix, "client_name": client_name, "durability_warning": False},
        servers=[redis_server],
        url_via=lambda addresses: f"redis://{addresses[0]}/0",
        url_for_hosts=lambda hosts: f"redis://{hosts}/0",
        persistent=False,
        long_waits={"waiter_ttl": 60},
    )


# -- shared by tests/backends/test_redis*.py and test_redlock.py -------------------------------


@pytest.fixture
def own_redis_server() -> Iterator[RedisServer]:
    """A server of the test's own, for faults and settings that would disturb the shared one."""
    with RedisServer() as server:
        yield server


@pytest.fixture
async def raw_redis(redis_server: RedisServer) -> AsyncIterator[redis.asyncio.Redis]:
    """A plain redis-py client of the shared server, to look at what the scripts left."""
    async with redis.asyncio.Redis(host=redis_server.host, port=redis_server.port) as client:
        yield client


def connect(server: RedisServer | str, prefix: str, **options: Any) -> asynclock.LockClient:
    """A redis:// client (the test servers have no append-only file: no durability warning)."""
    url = server if isinstance(server, str) else server.url
    options.setdefault("durability_warning", False)
    return asynclock.connect(url, prefix=prefix, **options)


@asynccontextmanager
async def acl_user(
    raw: redis.asyncio.Redis, server: RedisServer, **rules: Any
) -> AsyncIterator[str]:
    """A user of ``server`` with the password ``pw`` and redis-py's ``acl_setuser`` ``rules``
    (by default every key, channel and command), for the block: its URL."""
    user = f"user-{uuid.uuid4().hex[:6]}"
    rules = {"keys": ["*"], "channels": ["*"], "commands": ["+@all"], **rules}
    await raw.acl_setuser(user, enabled=True, passwords=["+pw"], **rules)
    try:
        yield f"redis://{user}:pw@{server.address}/0"
    finally:
        await raw.acl_deluser(user)


async def connections_named(raw: redis.asyncio.Redis | RedisServer, client_name: str) -> int:
    """How many connections named ``client_name`` the server has now (``CLIENT LIST``)."""
    if isinstance(raw, RedisServer):
        async with redis.asyncio.Redis(host=raw.host, port=raw.port) as client:
            return await connections_named(client, client_name)
    return sum(1 for entry in await raw.client_list() if entry.get("name") == client_name)


def lane_of(locks: asynclock.LockClient) -> lua.Lane:
    backend = locks._backend
    assert isinstance(backend, RedisBackend)
    assert backend._lane is not None
    return backend._lane


async def wait_for_queue(
    raw: redis.asyncio.Redis,
    prefix: str,
    name: str,
    length: int,
    kind: Kind = "lock",
    within: float = 10,
) -> list[str]:
    """Until ``length`` wait in the queue of ``name`` of ``kind``: their owner ids, first in
    line first."""
    key = lua.queue_key(prefix, name, kind)
    with anyio.fail_after(within):
        # The queue lives on the server: polling it is the only way to look.
        while await raw.zcard(key) != length:  # noqa: ASYNC110
            await anyio.sleep(0.005)
    return [member.decode().split(" ")[4] for member in await raw.zrange(key, 0, -1)]


async def kill_connections(server: RedisServer | redis.asyncio.Redis, client_name: str) -> int:
    """``CLIENT KILL`` every connection named ``client_name``; how many there were."""
    if isinstance(server, RedisServer):
        async with redis.asyncio.Redis(host=server.host, port=server.port) as raw:
            return await kill_connections(raw, client_name)
    killed = 0
    for entry in await server.client_list():
        if entry.get("name") == client_name:
            killed += int(await server.client_kill_filter(_id=entry["id"]))
    return killed


@pytest.fixture
def tls_ports(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[list[int], Path]]:
    """redis-servers that speak only TLS, with a certificate from a throwaway CA: their ports
    and the CA's file. Three, or as many as an indirect parametrisation of ``tls_ports`` says."""

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=tmp_path, check=True, capture_output=True)

    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
            "-subj", "/CN=asynclock test CA")  # fmt: skip
    openssl("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
    (tmp_path / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", "server.pem", "-days", "1", "-extfile", "san.ext")  # fmt: skip
    ports = [free_port() for _ in range(getattr(request, "param", 3))]
    common = shlex.split(
        "--port 0 --bind 127.0.0.1 --tls-cert-file server.pem --tls-key-file server.key"
        " --tls-ca-cert-file ca.pem --tls-auth-clients no --save '' --appendonly no --dir ."
        " --unixsocket ''"
    )
    processes = [
        subprocess.Popen(
            ["redis-server", *common, *f"--tls-port {port} --logfile {port}.log".split()],
            cwd=tmp_path,
            stdin=subprocess.DEVNULL,
        )
        for port in ports
    ]
    try:
        deadline = time.monotonic() + 10
        for port, process in zip(ports, processes, strict=True):
            log = tmp_path / f"{port}.log"
            while "Ready to accept connections" not in (log.read_text() if log.exists() else ""):
                assert process.poll() is None, log.read_text() if log.exists() else ""
                assert time.monotonic() < deadline, "a TLS redis-server did not start"
                time.sleep(0.01)
        yield ports, tmp_path / "ca.pem"
    finally:
        for process in processes:
            process.kill()
            process.wait()
