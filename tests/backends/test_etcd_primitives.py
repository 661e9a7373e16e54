"""The etcd backend's semaphores, elections, extend() and change feed, through its Backend
methods, against real etcd (the contract suite runs them through the client)."""

from __future__ import annotations

import secrets
from typing import Any

import anyio
import pytest
from aetcd import rpc

from asynclock import InvalidArgument
from asynclock.abc import Kind, LockRequest, Lost, Renewed
from asynclock.backends.etcd import EtcdBackend, EtcdGrant
from tests.contract.backend_etcd import Etcd, wait_until

pytestmark = pytest.mark.anyio


def backend(etcd: Etcd) -> EtcdBackend:
    return EtcdBackend.from_url(etcd.server.url, {"prefix": etcd.prefix})


def request(name: str, *, ttl: float = 5.0, **fields: Any) -> LockRequest:
    """A request as the core makes it (a fresh owner secret each time)."""
    return LockRequest(name, ttl, secrets.token_hex(16), on_lost=lambda reason: None, **fields)


async def test_a_try_for_a_reader_is_not_refused_for_the_clients_own_reader(etcd: Etcd) -> None:
    async with backend(etcd) as store:
        first = await store.acquire(request("r", shared=True))
        # known_busy() must not count our own reader against another reader.
        second = await store.try_acquire(request("r", shared=True))
        assert second is not None
        assert await store.try_acquire(request("r")) is None
        for grant in (first, second):
            await store.release(grant)


# -- semaphores --------------------------------------------------------------------------------


async def test_semaphore_inspect_and_a_permits_mismatch_that_leaves_no_key(etcd: Etcd) -> None:
    async with backend(etcd) as store, etcd.raw() as direct:
        assert (await store.inspect("s", "semaphore")).permits is None
        held = [await store.acquire(request("s", kind="semaphore", permits=2)) for _ in range(2)]
        assert await store.try_acquire(request("s", kind="semaphore", permits=2)) is None
        for call in (store.try_acquire, store.acquire):
            with pytest.raises(InvalidArgument, match=r"has 2 permits.*asked for 3"):
                await call(request("s", kind="semaphore", permits=3))
        assert await direct.count(etcd.prefix.encode()) == 2
        info = await store.inspect("s", "semaphore")
        assert info.permits == 2 and info.kind == "semaphore" and info.waiters == 0
        assert [h.token for h in info.holders] == [g.token for g in held]
        for grant in held:
            await store.release(grant)


async def test_permits_are_granted_in_queue_order_even_to_a_waiter_that_stalls(etcd: Etcd) -> None:
    """A key marked waiting (its waiter stalled between seeing its turn and marking its key
    granted) holds up the keys behind it, and a try, until it goes with its lease."""
    base = f"{etcd.prefix}!semaphore/s/".encode()
    async with backend(etcd) as store, etcd.raw() as direct:
        stalled = await direct.leases.LeaseGrant(rpc.LeaseGrantRequest(TTL=30))
        await direct.kv.Put(
            rpc.PutRequest(key=base + b"%016x-stalled" % stalled.ID, value=b"2;w", lease=stalled.ID)
        )
        info = await store.inspect("s", "semaphore")
        assert not info.held and info.waiters == 1 and info.permits == 2
        assert await store.try_acquire(request("s", kind="semaphore", permits=2)) is None
        granted: list[EtcdGrant] = []

        async def take() -> None:
            granted.append(await store.acquire(request("s", kind="semaphore", permits=2)))

        async with anyio.create_task_group() as tg:
            tg.start_soon(take)
            await direct.until_count(base, 2)
            await anyio.sleep(0.3)
            assert not granted  # a permit is free, but the older key is not granted yet
            await direct.leases.LeaseRevoke(rpc.LeaseRevokeRequest(ID=stalled.ID))
            await wait_until(lambda: bool(granted), 5)
        (key,) = await direct.keys(base)
        assert key.value == b"2;" and key.create_revision == granted[0].token
        await store.release(granted[0])


# -- extend ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["lock", "semaphore", "election"])
async def test_extend_moves_the_key_to_a_lease_of_the_new_ttl_keeping_its_token(
    etcd: Etcd, kind: Kind
) -> None:
    async with backend(etcd) as store, etcd.raw() as direct:
        grant = await store.acquire(request("x", ttl=3, kind=kind, value=b"v"))
        token, before = grant.token, grant.lease_id
        outcome = await store.extend(grant, 20)
        assert isinstance(outcome, Renewed) and outcome.ttl == 20
        assert grant.lease_id != before and grant.ttl == 20 and grant.token == token
        (key,) = await direct.keys(etcd.prefix.encode())
        assert key.lease == grant.lease_id and key.create_revision == token
        lease = await direct.leases.LeaseTimeToLive(rpc.LeaseTimeToLiveRequest(ID=grant.lease_id))
        assert lease.grantedTTL == 20
        expires_in = (await store.inspect("x", kind)).expires_in
        assert expires_in is not None and 10 < expires_in <= 20
        if kind == "election":
            assert (await store.inspect("x", "election")).value == b"v"
        (renewed,) = await store.renew([grant])
        assert isinstance(renewed, Renewed) and renewed.ttl == 20
        # Shorter again, and the same ttl only renews.
        assert isinstance(await store.extend(grant, 2), Renewed) and grant.ttl == 2
        assert isinstance(await store.extend(grant, 2), Renewed)
        await direct.kv.DeleteRange(rpc.DeleteRangeRequest(key=grant.key))
        assert isinstance(await store.extend(grant, 10), Lost)
        await store.release(grant)


async def test_wait_for_change_waits_out_its_timeout_and_leaves_no_watch(etcd: Etcd) -> None:
    async with backend(etcd) as store:
        seen = await store.inspect("w", "election")
        started_at = anyio.current_time()
        await store.wait_for_change("w", "election", seen, 0.3)  # nothing changes
        assert anyio.current_time() - started_at >= 0.29
        for _ in range(3):
            with anyio.move_on_after(0.05):
                await store.wait_for_change("w", "election", seen, 10)
        await anyio.sleep(0.05)
        assert store._hub.watches == 0
