"""One class per asynclock backend: how to connect, its floors, how to revoke a lease behind the
client's back, and how to count the requests its server saw.

The floors use the same client library as the backend (redis.asyncio, aetcd, aiozk, asyncpg,
sqlite3 in a worker thread), so a ratio to them is the price of the lock protocol and of
asynclock, not of the driver.
"""

from __future__ import annotations

import asyncio
import http.client
import importlib
import importlib.metadata
import json
import os
import socket
import sqlite3
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any, ClassVar

import anyio
import anyio.lowlevel
import anyio.to_thread

import asynclock

from ._servers import Endpoint, NotAvailable

#: One request of a floor: awaited once per sample.
Op = Callable[[], Awaitable[object]]


def package_version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


class Target(ABC):
    """An asynclock backend under measurement."""

    name: ClassVar[str]
    floor_label: ClassVar[str]
    pair_label: ClassVar[str | None] = None
    #: What :meth:`server_requests` counts, for the report; None when nothing is counted.
    server_requests_label: ClassVar[str | None] = None
    #: The shortest ttl the backend honours, used where a short one helps (loss detection).
    short_ttl: ClassVar[float] = 1.0
    #: A ttl whose renewal interval (ttl / 3) every backend accepts, for the renewal counts.
    renewal_ttl: ClassVar[float] = 3.0
    #: The ttl of latency and contention runs: long, so that no renewal runs meanwhile.
    long_ttl: ClassVar[float] = 30.0
    #: The driver packages whose versions the report lists.
    drivers: ClassVar[tuple[str, ...]] = ()

    def __init__(self, url: str, options: dict[str, Any], endpoint: Endpoint | None) -> None:
        self.url = url
        self.options = options
        self.endpoint = endpoint
        #: The most locks one client is asked to hold (PostgreSQL: a connection per lock).
        self.max_held = 10_000

    @property
    def cross_process(self) -> bool:
        return True

    def connect(self) -> asynclock.LockClient:
        return asynclock.connect(self.url, **self.options)

    @abstractmethod
    def floor(self) -> AbstractAsyncContextManager[Op]:
        """A raw round trip with the backend's own client library."""

    def pair(self) -> AbstractAsyncContextManager[Op] | None:
        """The least a lock must do with the same library (take + give back), if measured."""
        return None

    @abstractmethod
    async def revoke(self, locks: asynclock.LockClient, name: str) -> None:
        """Make the server drop the lease on ``name`` behind the holder's back."""

    async def server_requests(self) -> int | None:
        """A counter of requests the server has handled, or None when there is none."""
        return None

    async def versions(self) -> dict[str, str]:
        return {driver: package_version(driver) for driver in self.drivers}


class MemoryTarget(Target):
    name = "memory"
    floor_label = "event-loop checkpoint"
    #: The core's overhead is measured against the lock everyone has at hand in-process.
    pair_label = "anyio.Lock acquire + release"

    @property
    def cross_process(self) -> bool:
        return False

    @asynccontextmanager
    async def floor(self) -> AsyncIterator[Op]:
        yield anyio.lowlevel.checkpoint

    @asynccontextmanager
    async def pair(self) -> AsyncIterator[Op]:
        lock = anyio.Lock()

        async def op() -> object:
            async with lock:
                return None

        yield op

    async def revoke(self, locks: asynclock.LockClient, name: str) -> None:
        backend: Any = locks._backend
        backend.expire(name, notify=True)


class SQLiteTarget(Target):
    name = "sqlite"
    floor_label = "SELECT 1 in a thread"
    pair_label = "2 write txns in a thread"

    def __init__(self, url: str, options: dict[str, Any], endpoint: Endpoint | None) -> None:
        super().__init__(url, options, endpoint)
        self.path = url[len("sqlite://") :].split("?", 1)[0]

    def _open(self) -> sqlite3.Connection:
        connection = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        connection.execute("PRAGMA journal_mode=WAL")
        connection.execute("PRAGMA synchronous=full")
        return connection

    @asynccontextmanager
    async def floor(self) -> AsyncIterator[Op]:
        connection = await anyio.to_thread.run_sync(self._open)
        try:

            async def op() -> object:
                return await anyio.to_thread.run_sync(
                    lambda: connection.execute("SELECT 1").fetchone()
                )

            yield op
        finally:
            connection.close()

    @asynccontextmanager
    async def pair(self) -> AsyncIterator[Op]:
        connection = await anyio.to_thread.run_sync(self._open)
        connection.execute("CREATE TABLE IF NOT EXISTS bench_floor (name TEXT PRIMARY KEY)")
        try:

            async def op() -> object:
                # Two autocommitted writes, each in its own hop to the thread, as a take and a
                # release are.
                await anyio.to_thread.run_sync(
                    lambda: connection.execute("INSERT INTO bench_floor VALUES ('floor')")
                )
                return await anyio.to_thread.run_sync(
                    lambda: connection.execute("DELETE FROM bench_floor WHERE name = 'floor'")
                )

            yield op
        finally:
            connection.close()

    async def revoke(self, locks: asynclock.LockClient, name: str) -> None:
        def delete() -> None:
            connection = sqlite3.connect(self.path, isolation_level=None)
            try:
                connection.execute("DELETE FROM asynclock_locks WHERE name = ?", (name,))
            finally:
                connection.close()

        await anyio.to_thread.run_sync(delete)

    async def versions(self) -> dict[str, str]:
        return {"sqlite": sqlite3.sqlite_version}


# -- redis and redlock ----------------------------------------------------------------------


async def _redis_command_calls(host: str, port: int) -> int:
    import redis.asyncio

    async with redis.asyncio.Redis(host=host, port=port) as raw:
        stats: dict[str, Any] = await raw.info("commandstats")
    return sum(
        int(value["calls"])
        for key, value in stats.items()
        # INFO itself (this probe) and the probe's connection handshake are not the lock's.
        if key not in ("cmdstat_info", "cmdstat_hello", "cmdstat_client|setinfo")
    )


async def _redis_version(host: str, port: int) -> str:
    import redis.asyncio

    async with redis.asyncio.Redis(host=host, port=port) as raw:
        info: dict[str, Any] = await raw.info("server")
    return str(info.get("redis_version", "?"))


class RedisTarget(Target):
    name = "redis"
    floor_label = "PING"
    pair_label = "SET NX PX + DEL"
    server_requests_label = "commands (INFO commandstats, Lua's redis.call() included)"
    drivers = ("redis", "hiredis")

    def _addresses(self) -> tuple[tuple[str, int], ...]:
        assert self.endpoint is not None
        return self.endpoint.addresses

    @asynccontextmanager
    async def floor(self) -> AsyncIterator[Op]:
        import redis.asyncio

        clients = [redis.asyncio.Redis(host=h, port=p) for h, p in self._addresses()]
        try:
            if len(clients) == 1:
                yield clients[0].ping
            else:

                async def op() -> object:
                    return await asyncio.gather(*(client.ping() for client in clients))

                yield op
        finally:
            for client in clients:
                await client.aclose()

    @asynccontextmanager
    async def pair(self) -> AsyncIterator[Op]:
        import redis.asyncio

        clients = [redis.asyncio.Redis(host=h, port=p) for h, p in self._addresses()]
        key = f"bench-floor:{uuid.uuid4().hex}"
        try:

            async def op() -> object:
                await asyncio.gather(
                    *(client.set(key, b"1", nx=True, px=30_000) for client in clients)
                )
                return await asyncio.gather(*(client.delete(key) for client in clients))

            yield op
        finally:
            for client in clients:
                await client.aclose()

    async def revoke(self, locks: asynclock.LockClient, name: str) -> None:
        import redis.asyncio

        backend: Any = locks._backend
        key = backend.lock_key(name)
        addresses = self._addresses()
        # Redlock: a majority of masters forget it, so no majority holds it for us any more.
        for host, port in addresses[: len(addresses) // 2 + 1]:
            async with redis.asyncio.Redis(host=host, port=port) as raw:
                await raw.delete(key)

    async def server_requests(self) -> int | None:
        return sum([await _redis_command_calls(h, p) for h, p in self._addresses()])

    async def versions(self) -> dict[str, str]:
        host, port = self._addresses()[0]
        return {**await super().versions(), "redis-server": await _redis_version(host, port)}


class RedlockTarget(RedisTarget):
    name = "redlock"
    floor_label = "PING x3 (concurrent)"
    pair_label = "SET NX PX + DEL on 3"


# -- etcd -----------------------------------------------------------------------------------


def _http_get(host: str, port: int, path: str) -> str:
    connection = http.client.HTTPConnection(host, port, timeout=5)
    try:
        connection.request("GET", path)
        return connection.getresponse().read().decode("utf-8", "replace")
    finally:
        connection.close()


class EtcdTarget(Target):
    name = "etcd"
    floor_label = "get"
    pair_label = "put + delete"
    server_requests_label = "gRPC messages received (/metrics)"
    short_ttl = 2.0
    renewal_ttl = 3.0
    drivers = ("aetcd", "grpcio", "protobuf")

    @asynccontextmanager
    async def _client(self) -> AsyncIterator[Any]:
        import aetcd

        assert self.endpoint is not None
        client = aetcd.Client(host=self.endpoint.host, port=self.endpoint.port)
        await client.connect()
        try:
            yield client
        finally:
            await client.close()

    @asynccontextmanager
    async def floor(self) -> AsyncIterator[Op]:
        async with self._client() as client:
            key = f"bench-floor/{uuid.uuid4().hex}".encode()
            yield lambda: client.get(key)

    @asynccontextmanager
    async def pair(self) -> AsyncIterator[Op]:
        async with self._client() as client:
            key = f"bench-floor/{uuid.uuid4().hex}".encode()

            async def op() -> object:
                await client.put(key, b"1")
                return await client.delete(key)

            yield op

    async def revoke(self, locks: asynclock.LockClient, name: str) -> None:
        from urllib.parse import quote

        # Delete the holder's key (the lowest create revision under the name), as an operator
        # would (the contract suite's fixture does the same).
        base = f"{self.options['prefix']}{quote(name, safe='')}/".encode()
        async with self._client() as client:
            found = await client.get_prefix(
                base, sort_order="ascend", sort_target="create", keys_only=True
            )
            if not found:
                raise NotAvailable(f"nobody holds {name!r} on the server")
            await client.delete(found[0].key)

    async def server_requests(self) -> int | None:
        assert self.endpoint is not None
        text = await anyio.to_thread.run_sync(
            _http_get, self.endpoint.host, self.endpoint.port, "/metrics"
        )
        total = 0.0
        for line in text.splitlines():
            if line.startswith("grpc_server_msg_received_total{"):
                total += float(line.rsplit(" ", 1)[1])
        return int(total)

    async def versions(self) -> dict[str, str]:
        assert self.endpoint is not None
        text = await anyio.to_thread.run_sync(
            _http_get, self.endpoint.host, self.endpoint.port, "/version"
        )
        server = str(json.loads(text).get("etcdserver", "?"))
        return {**await super().versions(), "etcd": server}


# -- zookeeper ------------------------------------------------------------------------------


def _four_letter_word(host: str, port: int, word: str) -> str:
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(word.encode())
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks).decode("utf-8", "replace")


class ZooKeeperTarget(Target):
    name = "zookeeper"
    floor_label = "exists"
    pair_label = "create + delete"
    server_requests_label = "packets received (mntr)"
    short_ttl = 2.0
    # The test server's tickTime of 500 ms allows sessions (the lease) of 1-10 s only.
    long_ttl = 10.0
    drivers = ("aiozk",)

    def __init__(self, url: str, options: dict[str, Any], endpoint: Endpoint | None) -> None:
        super().__init__(url, options, endpoint)
        path = url.split("://", 1)[1].partition("/")[2].split("?", 1)[0].strip("/")
        self.chroot = f"/{path}" if path else "/asynclock"  # the backend's default

    @asynccontextmanager
    async def _client(self) -> AsyncIterator[Any]:
        import aiozk

        assert self.endpoint is not None
        client = aiozk.ZKClient(
            self.endpoint.hosts, chroot=self.endpoint.extra.get("chroot"), session_timeout=10
        )
        with anyio.fail_after(10):
            await client.start()
        try:
            yield client
        finally:
            with anyio.move_on_after(5, shield=True):
                await client.close()

    @asynccontextmanager
    async def floor(self) -> AsyncIterator[Op]:
        async with self._client() as client:
            yield lambda: client.exists("/")

    @asynccontextmanager
    async def pair(self) -> AsyncIterator[Op]:
        async with self._client() as client:
            path = f"/bench-floor-{uuid.uuid4().hex}"

            async def op() -> object:
                await client.create(path, data=b"", ephemeral=True)
                return await client.delete(path, force=True)

            yield op

    async def revoke(self, locks: asynclock.LockClient, name: str) -> None:
        from asynclock.backends.zookeeper import encode_name

        # Delete the holder's znode (the lowest sequence number), as an operator would.
        parent = f"{self.chroot}/{encode_name(name)}"
        async with self._client() as client:
            children = await client.get_children(parent)
            if not children:
                raise NotAvailable(f"nobody holds {name!r} on the server")
            holder = min(children, key=lambda child: int(child.rpartition("-")[2]))
            await client.delete(f"{parent}/{holder}", force=True)

    async def server_requests(self) -> int | None:
        assert self.endpoint is not None
        host, port = self.endpoint.addresses[0]
        text = await anyio.to_thread.run_sync(_four_letter_word, host, port, "mntr")
        for line in text.splitlines():
            key, _, value = line.partition("\t")
            if key == "zk_packets_received":
                # Minus this probe's own packet.
                return int(value) - 1
        return None

    async def versions(self) -> dict[str, str]:
        assert self.endpoint is not None
        host, port = self.endpoint.addresses[0]
        text = await anyio.to_thread.run_sync(_four_letter_word, host, port, "srvr")
        version = "?"
        for line in text.splitlines():
            if line.startswith("Zookeeper version:"):
                version = line.split(":", 1)[1].strip().split(",")[0]
        return {**await super().versions(), "zookeeper": version}


# -- postgres -------------------------------------------------------------------------------

_HOLDERS_OF_KEY = """
SELECT pid FROM pg_locks
WHERE locktype = 'advisory' AND objsubid = 1 AND granted AND classid = $1 AND objid = $2
"""


class PostgresTarget(Target):
    name = "postgres"
    floor_label = "SELECT 1"
    pair_label = "pg_advisory_lock + unlock"
    # Not counted: pg_stat_database is flushed by each session up to 10 s late, which makes a
    # delta over a few seconds meaningless, and pg_stat_statements is not loaded by default.
    drivers = ("asyncpg",)

    def __init__(self, url: str, options: dict[str, Any], endpoint: Endpoint | None) -> None:
        super().__init__(url, options, endpoint)
        assert endpoint is not None
        self.dsn: str = endpoint.extra["dsn"]
        # Held locks share one connection per ttl, and waiters beyond max_waiting per client
        # wait in the queue table without one: no cap below the base class's.

    @asynccontextmanager
    async def _connection(self) -> AsyncIterator[Any]:
        import asyncpg

        connection = await asyncpg.connect(self.dsn)
        try:
            yield connection
        finally:
            await connection.close()

    @asynccontextmanager
    async def floor(self) -> AsyncIterator[Op]:
        async with self._connection() as connection:
            yield lambda: connection.fetchval("SELECT 1")

    @asynccontextmanager
    async def pair(self) -> AsyncIterator[Op]:
        async with self._connection() as connection:
            key = int.from_bytes(os.urandom(8), "big", signed=True)

            async def op() -> object:
                await connection.fetchval("SELECT pg_advisory_lock($1)", key)
                return await connection.fetchval("SELECT pg_advisory_unlock($1)", key)

            yield op

    async def revoke(self, locks: asynclock.LockClient, name: str) -> None:
        from asynclock.backends.postgres import lock_key

        key = lock_key(name, str(self.options.get("schema", "public"))) & 0xFFFFFFFFFFFFFFFF
        async with self._connection() as admin:
            pids = [
                row[0] for row in await admin.fetch(_HOLDERS_OF_KEY, key >> 32, key & 0xFFFFFFFF)
            ]
            for pid in pids:
                await admin.execute("SELECT pg_terminate_backend($1)", pid)
        if not pids:
            raise NotAvailable(f"nobody holds {name!r} on the server")

    async def versions(self) -> dict[str, str]:
        async with self._connection() as connection:
            server = await connection.fetchval("SHOW server_version")
        return {**await super().versions(), "postgresql": str(server)}


TARGETS: dict[str, type[Target]] = {
    cls.name: cls
    for cls in (
        MemoryTarget,
        SQLiteTarget,
        RedisTarget,
        RedlockTarget,
        EtcdTarget,
        ZooKeeperTarget,
        PostgresTarget,
    )
}


def make_target(name: str, endpoint: Endpoint | None, workdir: Path, tag: str) -> Target:
    """The target for backend ``name``; raises :class:`NotAvailable` when its module (or its
    driver) does not import."""
    from asynclock._registry import backend_class

    scheme = "postgresql" if name == "postgres" else name
    try:
        backend_class(scheme)
    except asynclock.MissingDependency as exc:
        raise NotAvailable(str(exc)) from exc
    except ImportError as exc:
        raise NotAvailable(f"asynclock.backends.{name} does not import: {exc}") from exc
    except Exception as exc:  # a backend being written right now may fail in any way
        raise NotAvailable(
            f"asynclock.backends.{name} failed to import: {type(exc).__name__}: {exc}"
        ) from exc
    options: dict[str, Any] = {}
    if name == "memory":
        url = f"memory://bench-{tag}"
    elif name == "sqlite":
        url = endpoint.url if endpoint is not None else f"sqlite://{workdir / 'locks.db'}"
    else:
        if endpoint is None:
            raise NotAvailable(f"no {name} server")
        url = endpoint.url
        if name == "etcd":
            options = {"prefix": f"/asynclock-bench/{tag}/"}
        if name == "zookeeper" and endpoint.started:
            url = f"{endpoint.url}/asynclock-bench-{tag}"
        if name in ("redis", "redlock"):
            options = {"prefix": f"bench-{tag}:"}
            if name == "redis":
                # The throwaway servers run without persistence on purpose.
                options["durability_warning"] = False
    return TARGETS[name](url, options, endpoint)


def load_module(name: str) -> Any:
    """Import a module that may have no type information (the peers)."""
    return importlib.import_module(name)
