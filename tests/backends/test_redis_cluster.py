"""redis+cluster:// against a real 3-master Redis Cluster: URL forms, routing, MOVED, renewals
batched per master, WAIT.

(The contract, fault and boundary suites run against it too: tests/contract/backend_cluster.py.)
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any, cast

import anyio
import pytest
from redis.crc import key_slot

import asynclock
from asynclock.backends.redis import _scripts as lua
from asynclock.backends.redis.backend import RedisGrant
from asynclock.backends.redis.cluster import RedisClusterBackend
from asynclock.testing._redis_topologies import RedisClusterNodes
from tests.contract.backend_redis import connect as redis_client
from tests.contract.backend_redis import replicated

pytestmark = pytest.mark.anyio


def connect(cluster: RedisClusterNodes, prefix: str, **options: Any) -> asynclock.LockClient:
    return redis_client(cluster, prefix, **{"op_timeout": 1.0, **options})


def names_on_every_master(cluster: RedisClusterNodes, prefix: str, per_master: int) -> list[str]:
    """Lock names whose slots are served by each master in turn, ``per_master`` each."""
    wanted: Counter[str] = Counter()
    names: list[str] = []
    index = 0
    while len(names) < per_master * 3:
        name = f"spread/{index}"
        index += 1
        owner = cluster.node_for_slot(key_slot(lua.lock_key(prefix, name).encode())).address
        if wanted[owner] < per_master:
            wanted[owner] += 1
            names.append(name)
    return names


def test_url_names_the_nodes() -> None:
    backend = RedisClusterBackend.from_url(
        "redis+cluster://u:pw@10.0.0.1:7000,10.0.0.2,[::1]:7002", {"wait_replicas": 1}
    )
    assert [str(seed) for seed in backend.seeds] == ["10.0.0.1:7000", "10.0.0.2:6379", "[::1]:7002"]
    assert backend.describe() == "redis+cluster://u@10.0.0.1:7000,10.0.0.2:6379,[::1]:7002"
    assert backend.replica_wait.replicas == 1
    assert RedisClusterBackend.from_url("rediss+cluster://h:1/0", {}).settings.tls
    # (Bad ones: test_redis.py.)


async def test_locks_live_on_the_master_of_their_slot_and_renewals_are_one_call_per_master(
    redis_cluster_nodes: RedisClusterNodes, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = redis_cluster_nodes
    names = names_on_every_master(cluster, prefix, 5)
    async with connect(cluster, prefix) as locks:
        leases = [await locks.acquire(name, ttl=5.0) for name in names]
        for lease in leases:
            keys = [lua.lock_key(prefix, lease.name), lua.token_key(prefix, lease.name)]
            assert len({key_slot(key.encode()) for key in keys}) == 1
            node = cluster.node_for_slot(key_slot(keys[0].encode()))
            assert node.call("GET", keys[0]) is not None
            assert int(node.call("GET", keys[1])) == lease.token
        grants = [cast(RedisGrant, lease.grant) for lease in leases]
        backend = locks._backend
        lane = locks._backend.cluster  # type: ignore[attr-defined]
        assert len(lane.masters) == 3
        calls: Counter[str] = Counter()
        for address in lane.masters:
            node_lane = lane._lane(address)
            original = node_lane.script

            async def counted(
                *args: Any, _original: Any = original, _at: str = str(address)
            ) -> Any:
                calls[_at] += 1
                return await _original(*args)

            monkeypatch.setattr(node_lane, "script", counted)
        outcomes = await backend.renew(grants)
        assert all(type(outcome).__name__ == "Renewed" for outcome in outcomes), outcomes
        assert sorted(calls.values()) == [1, 1, 1]
        # One revoked behind our back: the others still renew, that one is lost.
        victim = leases[4]
        key = lua.lock_key(prefix, victim.name)
        cluster.node_for_slot(key_slot(key.encode())).call("DEL", key)
        outcomes = await backend.renew(grants)
        kinds = [type(outcome).__name__ for outcome in outcomes]
        assert kinds == ["Lost" if lease is victim else "Renewed" for lease in leases]
        for lease in leases:
            if lease is not victim:
                await lease.release()


async def test_a_stale_slot_map_is_corrected_by_moved(
    redis_cluster_nodes: RedisClusterNodes, prefix: str, name: str
) -> None:
    cluster = redis_cluster_nodes
    async with connect(cluster, prefix) as locks:
        lane = locks._backend.cluster  # type: ignore[attr-defined]
        key = lua.lock_key(prefix, name)
        right = cluster.node_for_slot(key_slot(key.encode())).address
        wrong = next(m for m in lane.masters if str(m) != right)
        # As after a resharding this client has not heard of: every slot "on" the wrong node.
        lane._slots = [wrong] * len(lane._slots)
        lookups = lane.lookups
        async with locks.lock(name, ttl=2.0) as lease:
            assert lease.token > 0
        assert str(lane.node_of(key)) == right
        # The MOVED reply named the node: no new look-up was needed for that.
        assert lane.lookups == lookups


async def test_wait_replicas_refuses_takes_on_a_cluster_without_replicas(
    redis_cluster_nodes: RedisClusterNodes, prefix: str, name: str
) -> None:
    async with connect(redis_cluster_nodes, prefix, wait_replicas=1, wait_timeout=0.05) as locks:
        with pytest.raises(asynclock.BackendUnavailable, match="wait_replicas"):
            await locks.try_acquire(name, ttl=2.0)
        # Undone on the master: nothing left behind.
        key = lua.lock_key(prefix, name)
        assert redis_cluster_nodes.node_for_slot(key_slot(key.encode())).call("EXISTS", key) == 0


async def test_a_masters_failover_is_followed(prefix: str, name: str) -> None:
    """A master dies and its replica takes its slots over: the client finds it through the slot
    map, and a lock that reached the replica is still held, renewed there."""
    with RedisClusterNodes(3, replicas=1) as cluster:
        # A name on the first node of the URL, which also carries both clients' wake channels:
        # they move to another node with the failover.
        first = cluster.nodes[0]
        assert first.role() == "master"
        name = next(
            f"{name}/{i}"
            for i in range(10_000)
            if cluster.node_for_slot(key_slot(lua.lock_key(prefix, f"{name}/{i}").encode()))
            is first
        )
        async with connect(cluster, prefix) as locks, connect(cluster, prefix) as other:
            lease = await locks.acquire(name, ttl=5.0)
            key = lua.lock_key(prefix, name)
            slot = key_slot(key.encode())
            old = cluster.node_for_slot(slot)
            (replica,) = cluster.replicas_of(old)
            await replicated(replica, key)  # before the crash
            old.kill()
            new = await anyio.to_thread.run_sync(cluster.wait_for_failover, slot, old)
            assert new is not old
            assert new.call("GET", key) is not None
            assert await other.try_acquire(name, ttl=1.0) is None
            await anyio.sleep(2.0)  # renewals reach the new master meanwhile
            assert lease.held, lease.lost_reason
            with anyio.fail_after(2):
                waiting = asyncio.ensure_future(other.acquire(name, ttl=1.0))
                await anyio.sleep(0.2)
                await lease.release()
                # Handed over by the release: the wake reaches the other client's channel, now
                # on a surviving node.
                second = await waiting
            assert second.token > lease.token
            await second.release()


# (A cycle of processes broken once on redis://: tests/test_deadlock.py.)
@pytest.mark.parametrize("store", ["redis_server", "redis_cluster_nodes"])
async def test_deadlock_records_are_published_scanned_and_withdrawn(
    store: str, request: pytest.FixtureRequest, prefix: str
) -> None:
    async with redis_client(request.getfixturevalue(store), prefix) as locks:
        registry = locks._backend.waiter_registry()
        assert registry is not None
        await registry.publish("a", "record-a", 2.0)
        await registry.publish("b", "record-b", 2.0)
        assert sorted(await registry.scan()) == ["record-a", "record-b"]
        await registry.withdraw("a")
        await registry.withdraw("b")
        assert await registry.scan() == []


async def test_an_election_change_is_pushed_across_nodes(
    redis_cluster_nodes: RedisClusterNodes, prefix: str, name: str
) -> None:
    """(Every key of a name and kind is in one slot: test_redis_waiting.py; shared holds and
    semaphores on a cluster: the contract.) The scripts' PUBLISH of an election's change reaches
    a watcher subscribed on whichever node its wake channel is."""
    async with (
        connect(redis_cluster_nodes, prefix) as locks,
        connect(redis_cluster_nodes, prefix) as watcher,
    ):
        backend = watcher._backend
        seen = await backend.inspect(name, "election")

        async def campaign() -> None:
            await anyio.sleep(0.2)
            async with locks.election(name).campaign(b"leader", ttl=5, timeout=5):
                await anyio.sleep(0.2)

        async with anyio.create_task_group() as tg:
            tg.start_soon(campaign)
            started = anyio.current_time()
            await backend.wait_for_change(name, "election", seen, 5)
            assert anyio.current_time() - started < 1.0
