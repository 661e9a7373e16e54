"""Clusters start together, name their leader, and keep serving when the leader dies."""

from __future__ import annotations

import aetcd
import aetcd.exceptions
import anyio
import pytest

from asynclock.testing import EtcdCluster, EtcdMember, ZooKeeperEnsemble, ZooKeeperMember

from ._helpers import process_gone, zookeeper_client


async def etcd_put_until_it_works(member: EtcdMember, key: bytes, value: bytes) -> None:
    # gRPC deadlines instead of anyio.fail_after around each call: see test_servers.py.
    async with aetcd.Client(host=member.host, port=member.port, timeout=0.5) as client:
        with anyio.fail_after(20):
            while True:
                try:
                    await client.put(key, value)
                except aetcd.exceptions.ClientError:
                    await anyio.sleep(0.1)
                else:
                    return


async def etcd_get(member: EtcdMember, key: bytes) -> bytes | None:
    async with aetcd.Client(host=member.host, port=member.port, timeout=5) as client:
        got = await client.get(key)
    return None if got is None else bytes(got.value)


@pytest.mark.anyio
async def test_etcd_cluster_survives_the_loss_of_its_leader_a_pause_and_a_restart() -> None:
    with EtcdCluster(size=3) as cluster:
        members = cluster.members
        assert cluster.url == "etcd://" + ",".join(f"127.0.0.1:{m.port}" for m in members)
        assert all(m.is_running for m in members)
        assert len({m.port for m in members}) == 3
        await etcd_put_until_it_works(members[0], b"before", b"1")

        assert cluster.leader() in members
        # Not asserting that the same member is still leader below: under load an election
        # can move leadership at any moment, and kill_leader() asks again.
        killed = cluster.kill_leader()
        assert killed in members and not killed.is_running

        survivor = next(m for m in members if m is not killed)
        await etcd_put_until_it_works(survivor, b"after", b"2")
        assert cluster.leader() is not killed

        # The old leader comes back on its port as a follower and catches up.
        killed.restart()
        assert killed.is_running
        assert await etcd_get(killed, b"after") == b"2"
        assert await etcd_get(killed, b"before") == b"1"

        # A paused member is routed around: two of three still form a quorum.
        paused = next(m for m in members if m is not cluster.leader())
        paused.pause()
        assert paused.is_paused
        await etcd_put_until_it_works(next(m for m in members if m is not paused), b"k2", b"v2")
        paused.resume()
        cluster.restart()  # and a restart keeps the data
        assert all(m.is_running for m in cluster.members)
        assert await etcd_get(paused, b"k2") == b"v2"
        data_dirs = [m.data_dir for m in cluster.members]
    assert not any(d.exists() for d in data_dirs)


@pytest.mark.anyio
async def test_zookeeper_ensemble_survives_the_loss_of_its_leader_and_member_types() -> None:
    with ZooKeeperEnsemble(size=3) as ensemble:
        members = ensemble.members
        assert ensemble.url == "zookeeper://" + ",".join(f"127.0.0.1:{m.port}" for m in members)
        assert sorted(m.mode() or "" for m in members) == ["follower", "follower", "leader"]

        leader = ensemble.leader()
        assert leader.mode() == "leader"
        pid = leader.pid
        assert pid is not None
        killed = ensemble.kill_leader()
        # ZooKeeper does not move leadership while the leader is healthy.
        assert killed is leader
        assert process_gone(pid)

        new_leader = ensemble.leader()
        assert new_leader is not killed and new_leader.mode() == "leader"

        survivors = [m for m in members if m is not killed]
        async with zookeeper_client(",".join(m.address for m in survivors), 20) as client:
            await client.create("/after-leader-loss", data=b"1")
        killed.restart()
        assert killed.mode() == "follower"
        async with zookeeper_client(killed.address, 20) as client:
            assert await client.get_data("/after-leader-loss") == b"1"
    # Member and leader types; a one-member ensemble.
    with ZooKeeperEnsemble(size=1) as ensemble:
        (only,) = ensemble.members
        assert isinstance(only, ZooKeeperMember)
        # A one-member ensemble is its own leader; ZooKeeper calls that "standalone".
        assert only.mode() == "standalone"
        assert ensemble.leader() is only
    with pytest.raises(ValueError, match="at least one member"):
        EtcdCluster(size=0)
