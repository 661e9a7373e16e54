"""The peer libraries, measured on the same servers in the same run (``--peers``).

Each peer is used the way its documentation shows, with its defaults (poll intervals, retry
counts), except that a lease-like expiry is set where the default is none. The blocking
libraries (pottery, python-redis-lock, kazoo) run in plain threads, one per contender, with the
clock read in those threads: that measures the library, not a hop from an event loop.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import (
    AbstractAsyncContextManager,
    AbstractContextManager,
    asynccontextmanager,
    contextmanager,
)
from typing import Any, ClassVar

import anyio

from ._contend import AsyncHold, AsyncWorkerFactory, SyncHold, SyncWorkerFactory
from ._servers import Endpoint, NotAvailable
from ._targets import load_module, package_version

#: The expiry given to peers whose default is "never expires" (redis-py) or that need one.
PEER_TTL = 30


class Peer(ABC):
    name: ClassVar[str]
    #: The server kind it runs on, and the asynclock backend it is compared with.
    server: ClassVar[str]
    compare_with: ClassVar[str]
    distribution: ClassVar[str]
    modules: ClassVar[tuple[str, ...]]
    sync: ClassVar[bool] = False
    note: ClassVar[str] = ""
    #: Whether the recipe queues its waiters (so that its grant order can be compared with
    #: the start order: the fairness runs, ``_fairness``).
    queues: ClassVar[bool] = False
    #: The most waiters a fairness run gives it (asyncpg: a connection per waiter).
    max_waiters: ClassVar[int | None] = None
    #: Issue #29's peer of its backend: the two are also measured in alternated rounds
    #: (``_alternate``).
    alternated: ClassVar[bool] = False

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint

    def check(self) -> None:
        """Raise :class:`NotAvailable` when the library does not import."""
        for module in self.modules:
            try:
                load_module(module)
            except Exception as exc:
                raise NotAvailable(
                    f"{self.distribution} does not import: {type(exc).__name__}: {exc} "
                    f"(pip install {self.distribution})"
                ) from exc

    def version(self) -> str:
        return package_version(self.distribution)

    def config(self) -> dict[str, Any]:
        """What a worker process needs to make the same peer (:func:`peer_from_config`)."""
        endpoint = self.endpoint
        return {
            "class": type(self).__name__,
            "endpoint": {
                "kind": endpoint.kind,
                "url": endpoint.url,
                "addresses": [list(address) for address in endpoint.addresses],
                "started": endpoint.started,
                # The server objects the run keeps there stay in this process.
                "extra": {
                    key: value
                    for key, value in endpoint.extra.items()
                    if value is None or isinstance(value, (str, int, float, bool))
                },
            },
        }


class AsyncPeer(Peer):
    @abstractmethod
    def session(self) -> AbstractAsyncContextManager[Callable[[str], AsyncWorkerFactory]]:
        """Open the shared client(s); yield a function from a lock name to worker factories."""


class SyncPeer(Peer):
    sync = True

    @abstractmethod
    def session(self) -> AbstractContextManager[Callable[[str], SyncWorkerFactory]]:
        """:meth:`AsyncPeer.session` for a blocking library."""


def _key(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big", signed=True)


# -- redis ----------------------------------------------------------------------------------


class RedisPyLock(AsyncPeer):
    name = "redis-py Lock"
    server = "redis"
    compare_with = "redis"
    distribution = "redis"
    modules = ("redis.asyncio.lock",)
    note = f"redis.asyncio.lock.Lock, polls every 0.1 s (default); timeout={PEER_TTL} s"

    @asynccontextmanager
    async def session(self) -> AsyncIterator[Callable[[str], AsyncWorkerFactory]]:
        import redis.asyncio

        client = redis.asyncio.Redis(host=self.endpoint.host, port=self.endpoint.port)
        try:

            def factory(name: str) -> AsyncWorkerFactory:
                @asynccontextmanager
                async def worker(index: int) -> AsyncIterator[AsyncHold]:
                    # One Lock object per task: its token lives in a threading.local.
                    lock = client.lock(name, timeout=PEER_TTL)

                    @asynccontextmanager
                    async def hold(timeout: float) -> AsyncIterator[bool]:
                        got = await lock.acquire(blocking_timeout=timeout)
                        try:
                            yield bool(got)
                        finally:
                            if got:
                                await lock.release()

                    yield hold

                return worker

            yield factory
        finally:
            await client.aclose()


class PythonRedisLock(SyncPeer):
    name = "python-redis-lock"
    server = "redis"
    compare_with = "redis"
    alternated = True
    distribution = "python-redis-lock"
    modules = ("redis_lock",)
    note = f"sync, in threads; BLPOP wake-up on release; expire={PEER_TTL} s, no auto-renewal"

    @contextmanager
    def session(self) -> Iterator[Callable[[str], SyncWorkerFactory]]:
        import redis

        redis_lock = load_module("redis_lock")
        client = redis.Redis(host=self.endpoint.host, port=self.endpoint.port)
        try:

            def factory(name: str) -> SyncWorkerFactory:
                @contextmanager
                def worker(index: int) -> Iterator[SyncHold]:
                    lock = redis_lock.Lock(client, name, expire=PEER_TTL)

                    @contextmanager
                    def hold(timeout: float) -> Iterator[bool]:
                        # Whole seconds only; 0 would mean "wait for the expiry".
                        got = bool(lock.acquire(blocking=True, timeout=max(1, int(timeout))))
                        try:
                            yield got
                        finally:
                            if got:
                                lock.release()

                    yield hold

                return worker

            yield factory
        finally:
            client.close()


class PotteryRedlock(SyncPeer):
    name = "pottery Redlock"
    server = "redlock"
    compare_with = "redlock"
    distribution = "pottery"
    modules = ("pottery",)
    note = "sync, in threads; 3 masters; retries after a random 0-0.2 s"

    @contextmanager
    def session(self) -> Iterator[Callable[[str], SyncWorkerFactory]]:
        import redis

        pottery = load_module("pottery")
        masters = [redis.Redis(host=h, port=p) for h, p in self.endpoint.addresses]
        try:

            def factory(name: str) -> SyncWorkerFactory:
                @contextmanager
                def worker(index: int) -> Iterator[SyncHold]:
                    lock = pottery.Redlock(
                        key=name, masters=set(masters), auto_release_time=float(PEER_TTL)
                    )

                    @contextmanager
                    def hold(timeout: float) -> Iterator[bool]:
                        got = bool(lock.acquire(blocking=True, timeout=timeout))
                        try:
                            yield got
                        finally:
                            if got:
                                lock.release()

                    yield hold

                return worker

            yield factory
        finally:
            for master in masters:
                master.close()


class AioRedlock(AsyncPeer):
    name = "aioredlock"
    server = "redlock"
    compare_with = "redlock"
    distribution = "aioredlock"
    modules = ("aioredlock",)
    note = "3 masters; gives up after 3 tries 0.1-0.3 s apart (counted as failed attempts)"

    @asynccontextmanager
    async def session(self) -> AsyncIterator[Callable[[str], AsyncWorkerFactory]]:
        aioredlock = load_module("aioredlock")
        manager = aioredlock.Aioredlock(
            [{"host": host, "port": port} for host, port in self.endpoint.addresses]
        )
        try:

            def factory(name: str) -> AsyncWorkerFactory:
                @asynccontextmanager
                async def worker(index: int) -> AsyncIterator[AsyncHold]:
                    @asynccontextmanager
                    async def hold(timeout: float) -> AsyncIterator[bool]:
                        try:
                            lock = await manager.lock(name, lock_timeout=PEER_TTL)
                        except aioredlock.LockError:
                            yield False
                            return
                        try:
                            yield True
                        finally:
                            await manager.unlock(lock)

                    yield hold

                return worker

            yield factory
        finally:
            with anyio.move_on_after(5, shield=True):
                await manager.destroy()


# -- etcd -----------------------------------------------------------------------------------


class AetcdLock(AsyncPeer):
    name = "aetcd Lock"
    server = "etcd"
    compare_with = "etcd"
    alternated = True
    distribution = "aetcd"
    modules = ("aetcd",)
    note = f"a new lease per attempt (never revoked), watch on DELETE; ttl={PEER_TTL} s"

    queues = True

    @asynccontextmanager
    async def session(self) -> AsyncIterator[Callable[[str], AsyncWorkerFactory]]:
        aetcd = load_module("aetcd")
        client = aetcd.Client(host=self.endpoint.host, port=self.endpoint.port)
        await client.connect()
        try:

            def factory(name: str) -> AsyncWorkerFactory:
                @asynccontextmanager
                async def worker(index: int) -> AsyncIterator[AsyncHold]:
                    lock = client.lock(f"bench-peer/{name}".encode(), ttl=PEER_TTL)

                    @asynccontextmanager
                    async def hold(timeout: float) -> AsyncIterator[bool]:
                        got = bool(await lock.acquire(timeout=timeout))
                        try:
                            yield got
                        finally:
                            if got:
                                await lock.release()

                    yield hold

                return worker

            yield factory
        finally:
            await client.close()


# -- zookeeper ------------------------------------------------------------------------------


def _znode(name: str) -> str:
    return "/bench-peer/" + name.replace("/", "-")


class AiozkLock(AsyncPeer):
    name = "aiozk Lock"
    server = "zookeeper"
    compare_with = "zookeeper"
    alternated = True
    distribution = "aiozk"
    modules = ("aiozk",)
    note = "recipe Lock, one object per task, watches the predecessor"

    queues = True

    @asynccontextmanager
    async def session(self) -> AsyncIterator[Callable[[str], AsyncWorkerFactory]]:
        aiozk = load_module("aiozk")
        client = aiozk.ZKClient(self.endpoint.hosts, session_timeout=10)
        with anyio.fail_after(10):
            await client.start()
        try:

            def factory(name: str) -> AsyncWorkerFactory:
                @asynccontextmanager
                async def worker(index: int) -> AsyncIterator[AsyncHold]:
                    lock = client.recipes.Lock(_znode(name))

                    @asynccontextmanager
                    async def hold(timeout: float) -> AsyncIterator[bool]:
                        try:
                            await lock.acquire(timeout=timeout)
                        except aiozk.exc.TimeoutError:
                            yield False
                            return
                        try:
                            yield True
                        finally:
                            await lock.release()

                    yield hold

                return worker

            yield factory
        finally:
            with anyio.move_on_after(5, shield=True):
                await client.close()


class KazooLock(SyncPeer):
    name = "kazoo Lock"
    server = "zookeeper"
    compare_with = "zookeeper"
    distribution = "kazoo"
    modules = ("kazoo.client",)
    note = "sync, in threads; recipe Lock, watches the predecessor"

    @contextmanager
    def session(self) -> Iterator[Callable[[str], SyncWorkerFactory]]:
        kazoo_client = load_module("kazoo.client")
        kazoo_exceptions = load_module("kazoo.exceptions")
        client = kazoo_client.KazooClient(hosts=self.endpoint.hosts, timeout=10)
        client.start(timeout=10)
        try:

            def factory(name: str) -> SyncWorkerFactory:
                @contextmanager
                def worker(index: int) -> Iterator[SyncHold]:
                    lock = client.Lock(_znode(name) + "-kazoo", identifier=f"worker-{index}")

                    @contextmanager
                    def hold(timeout: float) -> Iterator[bool]:
                        try:
                            got = bool(lock.acquire(blocking=True, timeout=timeout))
                        except kazoo_exceptions.LockTimeout:
                            got = False
                        try:
                            yield got
                        finally:
                            if got:
                                lock.release()

                    yield hold

                return worker

            yield factory
        finally:
            client.stop()
            client.close()


# -- postgres -------------------------------------------------------------------------------


class AsyncpgAdvisory(AsyncPeer):
    name = "asyncpg advisory pair"
    server = "postgres"
    compare_with = "postgres"
    alternated = True
    distribution = "asyncpg"
    modules = ("asyncpg",)
    note = (
        "bare pg_advisory_lock / pg_advisory_unlock on a connection per task (no lease, no token)"
    )

    queues = True
    #: The test server allows 300 connections; the holder and other clients need some.
    max_waiters = 200

    @asynccontextmanager
    async def session(self) -> AsyncIterator[Callable[[str], AsyncWorkerFactory]]:
        asyncpg = load_module("asyncpg")
        dsn: str = self.endpoint.extra["dsn"]

        def factory(name: str) -> AsyncWorkerFactory:
            key = _key(name)

            @asynccontextmanager
            async def worker(index: int) -> AsyncIterator[AsyncHold]:
                connection = await asyncpg.connect(dsn)
                try:

                    @asynccontextmanager
                    async def hold(timeout: float) -> AsyncIterator[bool]:
                        got = False
                        with anyio.move_on_after(timeout):
                            await connection.fetchval("SELECT pg_advisory_lock($1)", key)
                            got = True
                        try:
                            yield got
                        finally:
                            if got:
                                await connection.fetchval("SELECT pg_advisory_unlock($1)", key)

                    yield hold
                finally:
                    await connection.close()

            return worker

        yield factory


PEERS: tuple[type[Peer], ...] = (
    RedisPyLock,
    PythonRedisLock,
    PotteryRedlock,
    AioRedlock,
    AetcdLock,
    AiozkLock,
    KazooLock,
    AsyncpgAdvisory,
)


def peer_from_config(config: dict[str, Any]) -> Peer:
    """The peer :meth:`Peer.config` describes, in a worker process."""
    classes = {peer.__name__: peer for peer in PEERS}
    spec = config["endpoint"]
    endpoint = Endpoint(
        spec["kind"],
        spec["url"],
        tuple((host, int(port)) for host, port in spec["addresses"]),
        bool(spec["started"]),
        dict(spec["extra"]),
    )
    return classes[config["class"]](endpoint)


def peer_info(peer: Peer) -> dict[str, Any]:
    return {
        "server": peer.server,
        "compare_with": peer.compare_with,
        "sync": peer.sync,
        "queues": peer.queues,
        "note": peer.note,
        "version": peer.version(),
    }
