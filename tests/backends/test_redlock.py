"""The redlock:// backend against three real redis-server masters, with faults on a minority and
on a majority."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import anyio
import pytest
import redis.asyncio

import asynclock
from asynclock.abc import Lost, Renewed
from asynclock.backends import _redis_scripts as lua
from asynclock.backends.redlock import RedlockBackend, RedlockGrant
from asynclock.testing import FaultProxy, RedisServer, free_port

pytestmark = pytest.mark.anyio


@pytest.fixture
def prefix() -> str:
    return f"test-{uuid.uuid4().hex[:10]}:"


@pytest.fixture
def name() -> str:
    return f"redlock-test/{uuid.uuid4().hex[:8]}"


@pytest.fixture
def own_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


def url_of(addresses: Sequence[str]) -> str:
    return "redlock://" + ",".join(addresses) + "/0"


def connect(addresses: Sequence[str], prefix: str, **options: Any) -> asynclock.LockClient:
    return asynclock.connect(url_of(addresses), prefix=prefix, **options)


@asynccontextmanager
async def proxies(servers: Sequence[RedisServer]) -> AsyncIterator[list[FaultProxy]]:
    async with AsyncExitStack() as stack:
        yield [
            await stack.enter_async_context(FaultProxy(server.host, server.port))
            for server in servers
        ]


async def holders(servers: Sequence[RedisServer], key: str) -> list[bytes | str | None]:
    """The value of ``key`` on each master (None where it is absent)."""
    values: list[bytes | str | None] = []
    for server in servers:
        async with redis.asyncio.Redis(host=server.host, port=server.port) as raw:
            values.append(await raw.get(key))
    return values


# -- URLs, options, capabilities --------------------------------------------------------------


def test_url_lists_masters_with_shared_db_credentials_and_options() -> None:
    backend = RedlockBackend.from_url(
        "redlock://bob:pw@10.0.0.1:7000,10.0.0.2,[::1]:7002/2",
        {"drift": "0.02", "max_retry_delay": 0.05, "prefix": "app:", "tls": "true"},
    )
    assert [(a.host, a.port) for a in backend.addresses] == [
        ("10.0.0.1", 7000),
        ("10.0.0.2", 6379),
        ("::1", 7002),
    ]
    assert backend.quorum == 2
    settings = backend.settings
    assert (settings.db, settings.username, settings.password, settings.tls) == (
        2,
        "bob",
        "pw",
        True,
    )
    assert (backend.drift, backend.max_retry_delay, settings.prefix) == (0.02, 0.05, "app:")
    assert backend.describe() == "redlock://bob@10.0.0.1:7000,10.0.0.2:6379,[::1]:7002/2"
    assert RedlockBackend.from_url("redlock://a:1,b:2,c:3,d:4,e:5", {}).quorum == 3


@pytest.mark.parametrize(
    ("url", "options", "error", "message"),
    [
        ("redlock:///0", {}, asynclock.InvalidURL, "names no masters"),
        ("redlock://a:1,b:2,a:1/0", {}, asynclock.InvalidURL, "twice"),
        ("redlock://a:1,b:0,c:3/0", {}, asynclock.InvalidURL, "port"),
        ("redlock://a,b,c/x", {}, asynclock.InvalidURL, "database number"),
        ("redlock://a,b,c/0", {"drift": "0.7"}, asynclock.InvalidArgument, "drift"),
        ("redlock://a,b,c/0", {"retries": "3"}, asynclock.InvalidArgument, "retries"),
        ("redlock://a,b,c/0", {"ssl_certfile": "/c"}, asynclock.InvalidArgument, "tls=true"),
    ],
)
def test_bad_urls_and_options_are_refused(
    url: str, options: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        asynclock.connect(url, **options)


def test_requiring_fencing_is_refused_before_connecting() -> None:
    # Nothing listens on these ports: the refusal must come before any I/O.
    url = url_of([f"127.0.0.1:{free_port()}" for _ in range(3)])
    with pytest.raises(asynclock.UnsupportedFeature, match="fencing"):
        asynclock.connect(url, require=["fencing"])
    capabilities = RedlockBackend.capabilities
    assert not capabilities.fencing and capabilities.quorum and not capabilities.fifo


async def test_no_fencing_token_lease_token_and_current_token_raise(
    redis_servers: list[RedisServer], prefix: str, name: str
) -> None:
    async with connect([s.address for s in redis_servers], prefix) as locks:
        async with locks.lock(name, ttl=2) as lease:
            assert lease.grant.token is None
            with pytest.raises(asynclock.UnsupportedFeature, match="Redlock"):
                _ = lease.token
            with pytest.raises(asynclock.UnsupportedFeature):
                asynclock.current_token()
            with pytest.raises(asynclock.UnsupportedFeature):
                asynclock.current_token(name)


async def test_unreachable_masters_give_backend_unavailable_quickly(prefix: str) -> None:
    url = url_of([f"127.0.0.1:{free_port()}" for _ in range(3)])
    started = time.monotonic()
    with pytest.raises(asynclock.BackendUnavailable, match="majority") as info:
        async with asynclock.connect(url, prefix=prefix):
            pytest.fail("connected to masters that do not exist")
    assert time.monotonic() - started < 1.0
    assert "3 of 3 masters did not answer" in str(info.value)


# -- the algorithm ----------------------------------------------------------------------------


async def test_validity_starts_before_the_first_request_and_leaves_out_the_drift(
    redis_servers: list[RedisServer], prefix: str, name: str
) -> None:
    async with proxies(redis_servers) as fronts:
        for front in fronts:
            front.delay(20)  # every round trip takes 40 ms or more
        async with connect([f.address for f in fronts], prefix) as locks:
            before = anyio.current_time()
            lease = await locks.acquire(name, ttl=2)
            after = anyio.current_time()
            grant = lease.grant
            assert isinstance(grant, RedlockGrant)
            # Taken before the requests went out, not when the replies came back.
            assert before <= grant.valid_from < after - 0.035
            assert grant.ttl == pytest.approx(2 - (2 * 0.01 + 0.002))
            assert grant.ttl_ms == 2000
            key = lua.lock_key(prefix, name)
            assert await holders(redis_servers, key) == [lease.grant.owner.encode()] * 3
            await lease.release()
            assert await holders(redis_servers, key) == [None] * 3


async def test_healthy_rounds_keep_their_connections(
    redis_servers: list[RedisServer], prefix: str, name: str
) -> None:
    """A round decided by two masters waits a moment for the third instead of cancelling it
    (which would cost that master's connection, and a reconnect on every round)."""

    async def connections_received() -> int:
        total = 0
        for server in redis_servers:
            async with redis.asyncio.Redis(host=server.host, port=server.port) as raw:
                total += int((await raw.info("stats"))["total_connections_received"])
        return total

    async with connect([s.address for s in redis_servers], prefix) as locks:
        lease = await locks.acquire(name, ttl=5)
        await lease.release()
        before = await connections_received()
        for _ in range(50):
            lease = await locks.acquire(name, ttl=5)
            await lease.release()
        # 3 are the counting clients above; a reconnect per round would be 100 more.
        assert await connections_received() - before <= 3 + 10


async def test_a_failed_partial_acquire_releases_on_every_master(
    redis_servers: list[RedisServer], prefix: str, name: str
) -> None:
    key = lua.lock_key(prefix, name)
    # Someone else holds the lock on two masters; the third one is free.
    for server in redis_servers[:2]:
        async with redis.asyncio.Redis(host=server.host, port=server.port) as raw:
            await raw.set(key, "other", px=10_000)
    async with connect([s.address for s in redis_servers], prefix) as locks:
        assert await locks.try_acquire(name, ttl=5) is None
        assert await holders(redis_servers, key) == [b"other", b"other", None]
        with pytest.raises(asynclock.AcquireTimeout):
            await locks.acquire(name, ttl=5, timeout=0.3)
        assert await holders(redis_servers, key) == [b"other", b"other", None]


async def test_cancelling_a_round_in_flight_releases_on_every_master(
    redis_servers: list[RedisServer], prefix: str, name: str
) -> None:
    key = lua.lock_key(prefix, name)
    async with proxies(redis_servers) as fronts:
        async with connect([f.address for f in fronts], prefix) as locks:
            for front in fronts:
                front.delay(30)  # the takes reach the masters; the replies come back late
            with anyio.move_on_after(0.045):
                await locks.acquire(name, ttl=5)
                pytest.fail("the round was not cancelled")
            for front in fronts:
                front.pass_through()
            await anyio.sleep(0.1)
            assert await holders(redis_servers, key) == [None] * 3


async def test_a_minority_revoked_is_tolerated_and_a_majority_revoked_is_loss(
    redis_servers: list[RedisServer], prefix: str, name: str
) -> None:
    key = lua.lock_key(prefix, name)
    async with connect([s.address for s in redis_servers], prefix) as locks:
        lease = await locks.acquire(name, ttl=1)
        backend = locks._backend
        async with redis.asyncio.Redis(
            host=redis_servers[0].host, port=redis_servers[0].port
        ) as raw:
            await raw.delete(key)
        (outcome,) = await backend.renew([lease.grant])
        assert isinstance(outcome, Renewed)
        async with redis.asyncio.Redis(
            host=redis_servers[1].host, port=redis_servers[1].port
        ) as raw:
            await raw.delete(key)
        (outcome,) = await backend.renew([lease.grant])
        assert isinstance(outcome, Lost)
        assert "2 of 3 masters" in outcome.reason
        await lease.release()


async def test_a_stale_owner_can_neither_renew_nor_release(
    redis_servers: list[RedisServer], prefix: str, name: str
) -> None:
    key = lua.lock_key(prefix, name)
    addresses = [s.address for s in redis_servers]
    async with connect(addresses, prefix) as first, connect(addresses, prefix) as second:
        stale = await first.acquire(name, ttl=5)
        for server in redis_servers:
            async with redis.asyncio.Redis(host=server.host, port=server.port) as raw:
                await raw.delete(key)  # its keys expired, say
        current = await second.acquire(name, ttl=5)
        (outcome,) = await first._backend.renew([stale.grant])
        assert isinstance(outcome, Lost)
        await first._backend.release(stale.grant)
        assert await holders(redis_servers, key) == [current.grant.owner.encode()] * 3
        await current.release()


# -- faults on a minority: locking goes on ----------------------------------------------------


async def test_a_partitioned_minority_master_does_not_stop_locking(
    redis_servers: list[RedisServer], prefix: str, name: str
) -> None:
    async with FaultProxy(redis_servers[0].host, redis_servers[0].port) as front:
        addresses = [front.address, redis_servers[1].address, redis_servers[2].address]
        async with connect(addresses, prefix) as locks, connect(addresses, prefix) as other:
            front.blackhole()
            started = anyio.current_time()
            quick = await locks.acquire(f"{name}/quick", ttl=3)
            # The round was decided by the two masters that answer; it did not wait for the
            # third one's per-request bound (ttl / 10 = 0.3 s).
            assert anyio.current_time() - started < 0.2
            await quick.release()
            async with locks.lock(name, ttl=1) as lease:
                await anyio.sleep(2.0)  # renewed on the majority, past twice the ttl
                assert not lease.lost
                assert await other.try_acquire(name, ttl=1) is None
            again = await other.try_acquire(name, ttl=1)
            assert again is not None
            await again.release()


async def test_a_paused_minority_master_does_not_stop_renewal(
    own_server: RedisServer, redis_servers: list[RedisServer], prefix: str, name: str
) -> None:
    addresses = [own_server.address, redis_servers[1].address, redis_servers[2].address]
    async with connect(addresses, prefix) as locks:
        async with locks.lock(name, ttl=1) as lease:
            own_server.pause()
            try:
                await anyio.sleep(2.0)
                assert not lease.lost
            finally:
                own_server.resume()


async def test_a_dead_minority_master_does_not_stop_locking(
    own_server: RedisServer, redis_servers: list[RedisServer], prefix: str, name: str
) -> None:
    addresses = [own_server.address, redis_servers[1].address, redis_servers[2].address]
    async with connect(addresses, prefix) as locks, connect(addresses, prefix) as other:
        async with locks.lock(name, ttl=1) as lease:
            own_server.kill()  # connections refused from now on
            await anyio.sleep(1.5)
            assert not lease.lost
            assert await other.try_acquire(name, ttl=1) is None
        # Released on the two live masters: free again.
        again = await other.try_acquire(name, ttl=1)
        assert again is not None
        await again.release()


# -- faults on a majority: no grant, and loss mid-hold ----------------------------------------


async def test_a_majority_unreachable_refuses_to_grant(
    redis_servers: list[RedisServer], prefix: str, name: str
) -> None:
    async with proxies(redis_servers[:2]) as fronts:
        addresses = [fronts[0].address, fronts[1].address, redis_servers[2].address]
        async with connect(addresses, prefix, op_timeout=0.3) as locks:
            for front in fronts:
                front.blackhole()
            # One attempt cannot tell whether the lock is free: an error, not "held".
            with pytest.raises(asynclock.BackendUnavailable, match="only 1 of 3 masters"):
                await locks.try_acquire(name, ttl=1)
            started = anyio.current_time()
            with pytest.raises(asynclock.AcquireTimeout):
                await locks.acquire(name, ttl=1, timeout=0.5)
            # It kept retrying until the caller's timeout, then gave up.
            assert 0.45 < anyio.current_time() - started < 1.5
            for front in fronts:
                front.pass_through()


async def test_a_majority_lost_mid_hold_cancels_the_body_before_another_client_takes_it(
    redis_servers: list[RedisServer], prefix: str, name: str
) -> None:
    events: dict[str, float] = {}
    held = anyio.Event()

    async def holder(locks: asynclock.LockClient) -> None:
        with pytest.raises(asynclock.LeaseLost):
            async with locks.lock(name, ttl=1):
                held.set()
                try:
                    await anyio.sleep(30)
                finally:
                    events["cancelled"] = anyio.current_time()

    async with proxies(redis_servers[:2]) as fronts:
        behind = [fronts[0].address, fronts[1].address, redis_servers[2].address]
        direct = [server.address for server in redis_servers]
        async with (
            connect(behind, prefix, op_timeout=0.3, release_timeout=0.3) as first,
            connect(direct, prefix) as second,
        ):
            async with anyio.create_task_group() as tg:
                tg.start_soon(holder, first)
                await held.wait()
                for front in fronts:
                    front.blackhole()
                current = await second.acquire(name, ttl=1, timeout=10)
                events["taken"] = anyio.current_time()
            # The other client got a majority only once the first one's keys expired; the
            # first body had been cancelled before that.
            assert events["cancelled"] < events["taken"]
            await current.release()
            for front in fronts:
                front.pass_through()
