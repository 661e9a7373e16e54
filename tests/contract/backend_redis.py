"""The Redis family in the contract suite, and the helpers and fixtures that the Redis,
Sentinel, Cluster and Redlock test files share (this module is a plugin: see tests/conftest.py).
"""

from __future__ import annotations

import functools
import subprocess
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import ExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis.asyncio

import asynclock
from asynclock.abc import Kind
from asynclock.backends.redis import RedisBackend
from asynclock.backends.redis import _scripts as lua
from asynclock.backends.redis._wire import Lane
from asynclock.testing import RedisServer, free_port
from asynclock.testing._redis_topologies import (
    RedisClusterNodes,
    RedisNode,
    RedisSentinelGroup,
    command,
)
from asynclock.testing._redis_topologies import _wait as wait
from tests.contract.harness import BackendUnderTest, until


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


async def leftovers_on(servers: Sequence[RedisServer], prefix: str, client_name: str) -> list[str]:
    """:func:`redis_leftovers` on each of ``servers``."""
    found: list[str] = []
    for server in servers:
        found += [
            f"{server.address}: {item}"
            for item in await redis_leftovers(server, prefix, client_name)
        ]
    return found


@pytest.fixture
def redis_backend(redis_server: RedisServer) -> BackendUnderTest:
    return single_redis("redis", redis_server)


def single_redis(name: str, redis_server: RedisServer) -> BackendUnderTest:
    """The contract backend ``name``: a single server of the Redis protocol (``redis_server``,
    which may run Valkey)."""
    # The test servers keep an append-only file, as the docs recommend: no durability warning
    # to turn off (tests/backends/test_redis.py checks that one appears without it).
    return redis_family(
        name,
        redis_server.url,
        lambda key: [redis_server],
        lambda: [redis_server],
        servers=[redis_server],
        url_via=lambda addresses: f"redis://{addresses[0]}/0",
        url_for_hosts=lambda hosts: f"redis://{hosts}/0",
    )


def redis_family(
    name: str,
    url: str,
    holding: Callable[[str], Sequence[RedisServer]],
    every: Callable[[], Sequence[RedisServer]],
    options: dict[str, Any] | None = None,
    **fields: Any,
) -> BackendUnderTest:
    """A contract backend of the Redis family under a prefix of its own: ``revoke`` deletes the
    lock's key on the servers ``holding(key)``, ``leftovers`` looks on the servers ``every()``."""
    tag = uuid.uuid4().hex[:10]
    prefix, client_name = f"contract-{tag}:", f"asynclock-contract-{tag}"

    async def revoke(lock: str) -> None:
        key = lua.lock_key(prefix, lock)
        for server in holding(key):
            async with redis.asyncio.Redis(host=server.host, port=server.port) as raw:
                assert await raw.delete(key) == 1

    async def leftovers() -> list[str]:
        return await leftovers_on(every(), prefix, client_name)

    fields.setdefault("long_waits", {"waiter_ttl": 60})
    options = {"prefix": prefix, "client_name": client_name, **(options or {})}
    return BackendUnderTest(name, url, 1.0, revoke, leftovers, options=options, **fields)


# -- shared by tests/backends/test_redis*.py and test_redlock.py -------------------------------


@pytest.fixture
def prefix() -> str:
    """A key prefix of the test's own, so tests never see each other's keys."""
    return f"test-{uuid.uuid4().hex[:10]}:"


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


def connect(
    server: RedisServer | RedisSentinelGroup | RedisClusterNodes | str, prefix: str, **options: Any
) -> asynclock.LockClient:
    """A client of the Redis family (the test servers have no append-only file: no durability
    warning)."""
    url = server if isinstance(server, str) else server.url
    options.setdefault("durability_warning", False)
    return asynclock.connect(url, prefix=prefix, **options)


def backend_of(locks: asynclock.LockClient) -> RedisBackend:
    backend = locks._backend
    assert isinstance(backend, RedisBackend)
    return backend


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


async def connections_named(server: RedisServer, client_name: str) -> int:
    """How many connections named ``client_name`` the server has now (``CLIENT LIST``)."""
    async with redis.asyncio.Redis(host=server.host, port=server.port) as raw:
        return sum(1 for entry in await raw.client_list() if entry.get("name") == client_name)


def lane_of(locks: asynclock.LockClient) -> Lane:
    lane = backend_of(locks)._lane
    assert lane is not None
    return lane


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


async def replicated(replica: RedisNode, key: str) -> None:
    """Until ``replica`` has ``key`` (replication is asynchronous; KEYS, as a cluster's
    replica redirects GET)."""
    await until(lambda: bool(replica.call("KEYS", key)))


async def kill_connections(server: RedisServer, client_name: str) -> int:
    """``CLIENT KILL`` every connection named ``client_name``; how many there were."""
    async with redis.asyncio.Redis(host=server.host, port=server.port) as raw:
        entries = [entry for entry in await raw.client_list() if entry.get("name") == client_name]
        return sum([int(await raw.client_kill_filter(_id=entry["id"])) for entry in entries])


class RedisServerWith(RedisServer):
    """A test server with more ``redis-server`` arguments (a later one overrides an earlier)."""

    def __init__(self, *arguments: str) -> None:
        self.arguments = arguments
        super().__init__()

    def _command(self) -> list[str]:
        return [*super()._command(), *self.arguments]


def serves(server: RedisServer) -> bool:
    """A Redis Cluster's node says the cluster serves every slot."""
    return "cluster_state:ok" in command(server.host, server.port, "CLUSTER", "INFO")


@pytest.fixture
def tls_ports(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[list[int], Path]]:
    """redis-servers that also speak TLS, with a self-signed certificate for 127.0.0.1: their
    TLS ports and the certificate, which is its own CA. Three, or as many as an indirect
    parametrisation of ``tls_ports`` says; ``"cluster"``: one that is a whole Redis Cluster
    (every slot), its cluster bus on TLS too; ``"client-auth"``: one that asks clients for a
    certificate (the same one will do)."""
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", "server.key", "-out", "server.pem", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        cwd=tmp_path, check=True, capture_output=True,
    )  # fmt: skip
    param = getattr(request, "param", 3)
    ports = [free_port() for _ in range(param if isinstance(param, int) else 1)]
    # "client-auth": the server asks for a client certificate signed by its CA (itself).
    asks = "yes" if param == "client-auth" else "no"
    tls = ["--tls-auth-clients", asks, "--tls-ca-cert-file", str(tmp_path / "server.pem")]
    tls += ["--tls-cert-file", str(tmp_path / "server.pem")]
    tls += ["--tls-key-file", str(tmp_path / "server.key")]
    if param == "cluster":
        tls += ["--tls-cluster", "yes", "--cluster-enabled", "yes"]
        tls += ["--cluster-port", str(free_port()), "--cluster-config-file", "nodes.conf"]
    with ExitStack() as stack:
        for port in ports:
            server = stack.enter_context(RedisServerWith("--tls-port", str(port), *tls))
            if param == "cluster":
                command(server.host, server.port, "CLUSTER", "ADDSLOTSRANGE", "0", "16383")
                wait("the cluster serves every slot", functools.partial(serves, server), 10.0)
        yield ports, tmp_path / "server.pem"
