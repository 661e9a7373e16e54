"""The etcd backend's shared holds, semaphores, elections, extend() and change feed, through its
Backend methods, against real etcd (the contract suite runs them through the client)."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
from aetcd import rpc

from asynclock import InvalidArgument
from asynclock.abc import Kind, LockInfo, LockRequest, Lost, Renewed
from asynclock.backends.etcd import EtcdBackend, EtcdGrant
from asynclock.testing import EtcdServer
from tests.contract.backend_etcd import raw, wait_until

pytestmark = pytest.mark.anyio


@asynccontextmanager
async def backend(url: str, prefix: str) -> AsyncIterator[EtcdBackend]:
    async with EtcdBackend.from_url(url, {"prefix": prefix}) as opened:
        yield opened


def request(name: str, *, ttl: float = 5.0, **fields: Any) -> LockRequest:
    """A request as the core makes it (a fresh owner secret each time)."""
    return LockRequest(name, ttl, secrets.token_hex(16), on_lost=lambda reason: None, **fields)


async def keys_under(server: EtcdServer, prefix: str) -> list[Any]:
    async with raw(server.address) as direct:
        return await direct.keys(prefix.encode())


async def started(tg: Any, etcd: EtcdBackend, req: LockRequest, into: list[EtcdGrant]) -> None:
    """Start an acquire in ``tg`` and return once its key is on the server."""

    async def run() -> None:
        into.append(await etcd.acquire(req))

    before = len(etcd._keys.local)
    tg.start_soon(run)

    async def placed() -> bool:
        return len(etcd._keys.local) > before and not etcd._keys.unsettled

    await wait_until(placed, timeout=5)


async def granted_one(granted: list[EtcdGrant]) -> None:
    async def some() -> bool:
        return bool(granted)

    await wait_until(some, timeout=5)


# -- shared holds ------------------------------------------------------------------------------


async def test_a_reader_of_one_client_does_not_keep_its_other_readers_out(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    async with backend(etcd_server.url, etcd_prefix) as etcd:
        first = await etcd.acquire(request("r", shared=True))
        # known_busy() must not count our own reader against another reader.
        second = await etcd.try_acquire(request("r", shared=True))
        assert second is not None
        assert await etcd.try_acquire(request("r")) is None
        for grant in (first, second):
            await etcd.release(grant)
        writer = await etcd.try_acquire(request("r"))
        assert writer is not None
        await etcd.release(writer)


# -- semaphores --------------------------------------------------------------------------------


async def test_semaphore_inspect_and_a_permits_mismatch_that_leaves_no_key(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    async with backend(etcd_server.url, etcd_prefix) as etcd:
        assert (await etcd.inspect("s", "semaphore")).permits is None
        held = [await etcd.acquire(request("s", kind="semaphore", permits=2)) for _ in range(2)]
        assert await etcd.try_acquire(request("s", kind="semaphore", permits=2)) is None
        for call in (etcd.try_acquire, etcd.acquire):
            with pytest.raises(InvalidArgument, match=r"has 2 permits.*asked for 3"):
                await call(request("s", kind="semaphore", permits=3))
        assert len(await keys_under(etcd_server, etcd_prefix)) == 2
        info = await etcd.inspect("s", "semaphore")
        assert info.permits == 2 and info.kind == "semaphore" and info.waiters == 0
        assert [h.token for h in info.holders] == [g.token for g in held]
        for grant in held:
            await etcd.release(grant)


async def test_permits_are_granted_in_queue_order_even_to_a_waiter_that_stalls(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    """A key marked waiting (its waiter stalled between seeing its turn and marking its key
    granted) holds up the keys behind it, and a try, until it goes with its lease."""
    base = f"{etcd_prefix}!semaphore/s/".encode()
    async with backend(etcd_server.url, etcd_prefix) as etcd, raw(etcd_server.address) as direct:
        stalled = await direct.leases.LeaseGrant(rpc.LeaseGrantRequest(TTL=30))
        await direct.kv.Put(
            rpc.PutRequest(key=base + b"%016x-stalled" % stalled.ID, value=b"2;w", lease=stalled.ID)
        )
        info = await etcd.inspect("s", "semaphore")
        assert not info.held and info.waiters == 1 and info.permits == 2
        assert await etcd.try_acquire(request("s", kind="semaphore", permits=2)) is None
        granted: list[EtcdGrant] = []
        async with anyio.create_task_group() as tg:
            await started(tg, etcd, request("s", kind="semaphore", permits=2), granted)
            await anyio.sleep(0.3)
            assert not granted  # a permit is free, but the older key is not granted yet
            await direct.leases.LeaseRevoke(rpc.LeaseRevokeRequest(ID=stalled.ID))
            await granted_one(granted)
        (key,) = await direct.keys(base)
        assert key.value == b"2;" and key.create_revision == granted[0].token
        await etcd.release(granted[0])


# -- elections ---------------------------------------------------------------------------------


async def test_an_election_shows_its_leader_and_pushes_each_change(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    async with backend(etcd_server.url, etcd_prefix) as etcd:
        idle = await etcd.inspect("e", "election")
        assert not idle.held and idle.kind == "election"
        first = await etcd.acquire(request("e", kind="election", value=b"one"))
        info = await etcd.inspect("e", "election")
        assert info.value == b"one" and info.token == first.token
        assert info.holders[0].value == b"one"
        # A lock "e" is unrelated.
        lock = await etcd.try_acquire(request("e"))
        assert lock is not None
        await etcd.release(lock)
        # Nothing changes: waits out the timeout.
        started_at = anyio.current_time()
        await etcd.wait_for_change("e", "election", info, 0.3)
        assert anyio.current_time() - started_at >= 0.29
        granted: list[EtcdGrant] = []
        async with anyio.create_task_group() as tg:
            await started(tg, etcd, request("e", kind="election", value=b"two"), granted)
            # A candidate queueing is no change of leader.
            await etcd.wait_for_change("e", "election", info, 0.3)
            assert (await etcd.inspect("e", "election")).value == b"one"

            async def resign() -> None:
                await anyio.sleep(0.1)
                await etcd.release(first)

            tg.start_soon(resign)
            with anyio.fail_after(3):
                await etcd.wait_for_change("e", "election", info, 10)
        now = await etcd.inspect("e", "election")
        assert now.value == b"two" and now.token == granted[0].token
        assert now.token is not None and info.token is not None and now.token > info.token
        # A change already made before the call: returns at once.
        await etcd.release(granted[0])
        with anyio.fail_after(1):
            await etcd.wait_for_change("e", "election", now, 10)
        assert not await keys_under(etcd_server, etcd_prefix)


# -- extend ------------------------------------------------------------------------------------


async def lease_ttl(server: EtcdServer, lease_id: int) -> int:
    async with raw(server.address) as direct:
        reply = await direct.leases.LeaseTimeToLive(rpc.LeaseTimeToLiveRequest(ID=lease_id))
        return int(reply.grantedTTL)


@pytest.mark.parametrize("kind", ["lock", "semaphore", "election"])
async def test_extend_moves_the_key_to_a_lease_of_the_new_ttl_keeping_its_token(
    etcd_server: EtcdServer, etcd_prefix: str, kind: Kind
) -> None:
    async with backend(etcd_server.url, etcd_prefix) as etcd:
        grant = await etcd.acquire(request("x", ttl=3, kind=kind, value=b"v"))
        token, before = grant.token, grant.lease_id
        outcome = await etcd.extend(grant, 20)
        assert isinstance(outcome, Renewed) and outcome.ttl == 20
        assert grant.lease_id != before and grant.ttl == 20 and grant.token == token
        (key,) = await keys_under(etcd_server, etcd_prefix)
        assert key.lease == grant.lease_id and key.create_revision == token
        assert await lease_ttl(etcd_server, grant.lease_id) == 20
        expires_in = (await etcd.inspect("x", kind)).expires_in
        assert expires_in is not None and 10 < expires_in <= 20
        if kind == "election":
            assert (await etcd.inspect("x", "election")).value == b"v"
        (renewed,) = await etcd.renew([grant])
        assert isinstance(renewed, Renewed) and renewed.ttl == 20
        # Shorter again, and the same ttl only renews.
        assert isinstance(await etcd.extend(grant, 2), Renewed) and grant.ttl == 2
        assert isinstance(await etcd.extend(grant, 2), Renewed)
        async with raw(etcd_server.address) as direct:
            await direct.kv.DeleteRange(rpc.DeleteRangeRequest(key=grant.key))
        assert isinstance(await etcd.extend(grant, 10), Lost)
        await etcd.release(grant)


async def test_an_extended_lock_outlives_its_first_ttl(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    async with backend(etcd_server.url, etcd_prefix) as etcd:
        grant = await etcd.acquire(request("x", ttl=2))
        assert isinstance(await etcd.extend(grant, 6), Renewed)
        await anyio.sleep(3.5)  # no renewal meanwhile
        (key,) = await keys_under(etcd_server, etcd_prefix)
        assert key.create_revision == grant.token
        await etcd.release(grant)


async def test_wait_for_change_leaves_no_watch(etcd_server: EtcdServer, etcd_prefix: str) -> None:
    async with backend(etcd_server.url, etcd_prefix) as etcd:
        seen = LockInfo("w", held=False)
        for _ in range(3):
            with anyio.move_on_after(0.05):
                await etcd.wait_for_change("w", "election", seen, 10)
        await anyio.sleep(0.05)
        assert etcd._hub.watches == 0
