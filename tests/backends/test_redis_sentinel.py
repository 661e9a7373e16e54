"""redis+sentinel:// against a real Sentinel group: URL forms, discovery, failovers, WAIT.

(The contract, fault and boundary suites run against it too: tests/contract/backend_sentinel.py.)
The failover tests share one group of their own (the session's serves the contract suite), and
each leaves it as it found it: a master, a replica in sync, three sentinels that see both.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

import asynclock
from asynclock.backends._kit import HostPort
from asynclock.backends.redis import _scripts as lua
from asynclock.backends.redis.sentinel import RedisSentinelBackend
from asynclock.testing import free_port
from asynclock.testing._redis_topologies import SERVICE, RedisSentinelGroup
from tests.contract.backend_redis import connect as redis_client
from tests.contract.backend_redis import kill_connections, replicated
from tests.contract.harness import until

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def group() -> Iterator[RedisSentinelGroup]:
    with RedisSentinelGroup() as own:
        yield own


def connect(group: RedisSentinelGroup | str, prefix: str, **options: Any) -> asynclock.LockClient:
    return redis_client(group, prefix, **{"op_timeout": 0.5, **options})


def test_url_names_the_sentinels_the_service_and_the_db() -> None:
    backend = RedisSentinelBackend.from_url(
        "redis+sentinel://user:secret@10.0.0.1,10.0.0.2:26380,[::1]:26381/my%20master/3",
        {"sentinel_password": "s3", "wait_replicas": "1", "wait_timeout": "0.2"},
    )
    sentinels = [str(sentinel) for sentinel in backend.sentinels]
    assert sentinels == ["10.0.0.1:26379", "10.0.0.2:26380", "[::1]:26381"]
    settings = backend.settings
    assert (backend.locator.service, settings.db, settings.password) == ("my master", 3, "secret")
    assert (backend.replica_wait.replicas, backend.replica_wait.timeout_ms) == (1, 200)
    assert "secret" not in backend.describe() and "s3" not in backend.describe()
    assert backend.describe().startswith("redis+sentinel://user@10.0.0.1:26379,")
    # No db: 0.
    assert RedisSentinelBackend.from_url("redis+sentinel://h/svc", {}).settings.db == 0
    # (Bad ones: test_redis.py.)


async def test_discovery_refuses_an_unknown_service_and_passes_over_dead_sentinels_and_replicas(
    group: RedisSentinelGroup, prefix: str, name: str
) -> None:
    """A replica taken for the master is as after a failover this client has not heard of yet:
    a new connection to the address it knows finds a replica (ROLE), and the call goes on to
    the master the sentinels name."""
    unknown = group.url.replace(f"/{SERVICE}/", "/no-such-master/")
    with pytest.raises(asynclock.BackendUnavailable, match="monitors no master named"):
        async with connect(unknown, prefix):
            pass
    dead = f"127.0.0.1:{free_port()}"
    client_name = f"stale-{uuid.uuid4().hex[:6]}"
    url = group.url.replace("//", f"//{dead},", 1)
    async with connect(url, prefix, client_name=client_name) as locks:
        async with locks.lock(name, ttl=2) as lease:
            assert lease.token > 0
        backend = locks._backend
        assert isinstance(backend, RedisSentinelBackend)
        # The sentinel that answered is asked first from now on.
        assert str(backend.locator.sentinels[0]) != dead
        assert backend.extra_info()["master"] == group.master().address
        replica = group.replicas()[0]
        backend.locator._master = HostPort(replica.host, replica.port)
        await kill_connections(group.master(), client_name)  # the next call connects anew
        async with locks.lock(name, ttl=2.0) as lease:
            assert lease.token > 0
        assert backend.extra_info()["master"] == group.master().address


# The unreplicated lock: told by the restart watcher, a renewal or the local deadline,
# whichever comes first.
@pytest.mark.expect_log(r"lease on '.*/u' lost: ")
async def test_replicated_holds_survive_the_masters_death_and_an_unreplicated_lock_is_lost(
    group: RedisSentinelGroup, prefix: str, name: str
) -> None:
    """Holds of every kind that reached the replica renew on the new master, exclude the others,
    and the next holds' tokens are higher. The documented caveat: a lock not replicated before
    the master failed is free on the new master; its holder is told, and the new holder's token
    is higher."""
    async with connect(group, prefix) as locks, connect(group, prefix) as other:
        # A ttl well above the failover's ~2 s: renewals fail until it is over.
        leases = [
            await locks.acquire(name, ttl=5.0),
            await locks.acquire(f"{name}/r", ttl=5.0, shared=True),
            await locks.semaphore(name, permits=1).acquire(ttl=5.0),
        ]
        campaign = locks.election(name).campaign(b"old-master-era", ttl=5.0)
        leases.append(await campaign.__aenter__())
        unreplicated = await locks.acquire(f"{name}/u", ttl=5.0)
        try:
            for each in (name, f"{name}/u"):
                await replicated(group.replicas()[0], lua.lock_key(prefix, each))
            for each, kind in ((f"{name}/r", "lock"), (name, "semaphore"), (name, "election")):
                await replicated(group.replicas()[0], lua.holds_key(prefix, each, kind))
            # Stand-in for "not replicated yet": the replica forgets the key as the master dies.
            old = group.fail_over_losing(lua.lock_key(prefix, f"{name}/u"))
            try:
                new = await anyio.to_thread.run_sync(group.wait_for_failover, old)
                assert new is not old
                with anyio.fail_after(5):
                    second = await other.acquire(f"{name}/u", ttl=2.0)
                    reason = await unreplicated.wait_lost()
                assert second.token > unreplicated.token
                assert unreplicated.lost and reason == unreplicated.lost_reason
                await second.release()
                assert await other.try_acquire(name, ttl=1.0) is None
                assert await other.try_acquire(f"{name}/r", ttl=1.0) is None  # the reader holds
                assert await other.semaphore(name, permits=1).try_acquire(ttl=1.0) is None
                leader = await other.election(name).leader()
                assert leader is not None and leader.value == b"old-master-era"
                await anyio.sleep(2.0)  # renewed on the new master meanwhile
                assert all(lease.held for lease in leases), [each.lost_reason for each in leases]
            finally:
                await anyio.to_thread.run_sync(group.restore, old)
        finally:
            await campaign.__aexit__(None, None, None)
        for lease in [*leases[:3], unreplicated]:
            await lease.release()
        async with other.lock(name, ttl=1.0) as writer:
            assert writer.token > leases[0].token
        async with other.lock(f"{name}/r", ttl=1.0) as writer:
            assert writer.token > leases[1].token
        async with other.semaphore(name, permits=1).lock(ttl=1.0) as permit:
            assert permit.token > leases[2].token


async def test_a_demoted_master_is_left_for_the_new_one(
    group: RedisSentinelGroup, prefix: str, name: str
) -> None:
    """SENTINEL FAILOVER demotes the master a moment after promoting the replica, our
    connections to it open: the lease is held or told lost (the split brain caveat), and then
    every call goes to the new master."""
    async with connect(group, prefix) as locks, connect(group, prefix) as other:
        lease = await locks.acquire(name, ttl=2.0)
        await replicated(group.replicas()[0], lua.lock_key(prefix, name))
        old, new = await anyio.to_thread.run_sync(group.fail_over)
        # Held (renewed on the new master) or told lost; never held by two without a word.
        await anyio.sleep(1.0)
        taken = await other.try_acquire(name, ttl=2.0)
        if lease.held:
            assert taken is None
            assert new.call("GET", lua.lock_key(prefix, name)) is not None
            await lease.release()
        else:
            assert taken is not None and taken.token > lease.token
            await taken.release()
        async with locks.lock(name, ttl=1.0) as again:
            assert again.token > lease.token
        assert locks._backend.extra_info()["master"] == new.address
        await anyio.to_thread.run_sync(group.restore, old)


async def test_a_frozen_master_is_left_for_the_new_one(
    group: RedisSentinelGroup, prefix: str, name: str
) -> None:
    """A frozen master's calls and handshakes time out, which sends the client to the
    sentinels; the replicated lease renews on the promoted replica."""
    async with connect(group, prefix) as locks, connect(group, prefix) as other:
        # A ttl that outlasts a failover on a loaded host (5 s did not, in a CI run); what is
        # checked is a renewal on the promoted replica after it, not how soon one comes.
        lease = await locks.acquire(name, ttl=12.0)
        await replicated(group.replicas()[0], lua.lock_key(prefix, name))
        old = group.pause_master()
        try:
            new = await anyio.to_thread.run_sync(group.wait_for_failover, old)
            promoted_at = anyio.current_time()
            # A renewal sent after the promotion moves the deadline to its send time + 10.88 s
            # (ttl less 1 % drift and the 1 s margin); the last one before the freeze cannot
            # reach past promoted_at + 10.4 unless the failover took under 0.5 s.
            await until(lambda: lease.deadline >= promoted_at + 10.4, timeout=10)
            assert lease.held, lease.lost_reason
            assert await other.try_acquire(name, ttl=1.0) is None
            assert locks._backend.extra_info()["master"] == new.address
        finally:
            await anyio.to_thread.run_sync(group.restore, old)
        await lease.release()


async def test_wait_replicas_takes_once_the_replica_has_the_lock_and_undoes_a_take_it_lacks(
    group: RedisSentinelGroup, prefix: str, name: str
) -> None:
    replica = group.replicas()[0]
    async with connect(group, prefix, wait_replicas=1, wait_timeout=0.1) as locks:
        async with locks.lock(name, ttl=2.0):
            # No polling: WAIT returned only once the replica had it.
            assert replica.call("EXISTS", lua.lock_key(prefix, name)) == 1
        replica.pause()
        try:
            with pytest.raises(asynclock.BackendUnavailable, match="wait_replicas"):
                await locks.try_acquire(name, ttl=2.0)
        finally:
            replica.resume()
        # The take was undone on the master: the lock is free for the next one.
        assert group.master().call("EXISTS", lua.lock_key(prefix, name)) == 0
        async with locks.lock(name, ttl=2.0):
            pass
