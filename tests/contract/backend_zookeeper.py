from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress

import anyio
import pytest
from aiozk import ZKClient, exc

from asynclock.backends.zookeeper import encode_name
from asynclock.testing import ZooKeeperServer
from tests.contract.harness import BackendUnderTest


@asynccontextmanager
async def zk_admin(address: str) -> AsyncIterator[ZKClient]:
    """A plain aiozk client, independent of the backend under test."""
    client = ZKClient(address, session_timeout=10)
    with anyio.fail_after(10):
        await client.start()
    try:
        yield client
    finally:
        with anyio.CancelScope(shield=True), anyio.move_on_after(10):
            await client.close()


async def znodes_under(client: ZKClient, path: str) -> list[str]:
    """Every znode below ``path`` (not ``path`` itself), depth first."""
    try:
        children = await client.get_children(path)
    except exc.NoNode:
        return []
    found: list[str] = []
    for child in sorted(children):
        found.append(f"{path}/{child}")
        found += await znodes_under(client, f"{path}/{child}")
    return found


async def delete_tree(client: ZKClient, path: str) -> None:
    for node in [*reversed(await znodes_under(client, path)), path]:
        with suppress(exc.NoNode):
            await client.delete(node, force=True)


async def revoke_lock(address: str, chroot: str, name: str) -> None:
    """Delete the znode of the current holder of ``name`` (the lowest sequence number)."""
    parent = f"{chroot}/{encode_name(name)}"
    async with zk_admin(address) as client:
        children = await client.get_children(parent)
        assert children, f"nobody holds {name!r}"
        holder = min(children, key=lambda child: int(child.rpartition("-")[2]))
        await client.delete(f"{parent}/{holder}", force=True)


def alive_connections(server: ZooKeeperServer) -> int:
    for line in server.four_letter_word("mntr").splitlines():
        key, _, value = line.partition("\t")
        if key == "zk_num_alive_connections":
            return int(value)
    raise AssertionError("mntr gave no zk_num_alive_connections")


@pytest.fixture
def zookeeper_backend(zookeeper_server: ZooKeeperServer) -> BackendUnderTest:
    chroot = f"/contract-{uuid.uuid4().hex[:10]}"
    address = zookeeper_server.address
    baseline = alive_connections(zookeeper_server)

    async def revoke(name: str) -> None:
        # The backend watches its own node, so the holder's body can be cancelled while this
        # delete is still closing its connection; the operator's delete itself always completes
        # (the body sees the cancellation at its next await).
        with anyio.CancelScope(shield=True):
            await revoke_lock(address, chroot, name)

    async def leftovers() -> list[str]:
        async with zk_admin(address) as client:
            # Every kind lives under the chroot: locks' parents, semaphores' (%semaphore-<name>)
            # and elections' (%election-<name>), with their nodes.
            left = await znodes_under(client, chroot)
            # Runs once, at the end of the test: leave the server as we found it.
            await delete_tree(client, chroot)
        # Every session of a closed client is closed on the server too.
        for _ in range(100):
            if alive_connections(zookeeper_server) <= baseline:
                break
            await anyio.sleep(0.02)
        extra = alive_connections(zookeeper_server) - baseline
        return left + ([f"{extra} connection(s) still open"] if extra > 0 else [])

    # The test server's tickTime is 500 ms, its maxSessionTimeout 60 s: sessions of 1-60 s, which covers the suite's
    # ttl * 1 ... ttl * 10. The session opened at connect serves the ttl * 5 locks.
    return BackendUnderTest(
        "zookeeper",
        f"{zookeeper_server.url}{chroot}",
        1.0,
        revoke,
        leftovers,
        options={"session_timeout": 5.0, "op_timeout": 3.0},
        servers=[zookeeper_server],
        url_via=lambda addresses: f"zookeeper://{addresses[0]}{chroot}",
        url_for_hosts=lambda hosts: f"zookeeper://{hosts}{chroot}",
        many_hosts=True,
    )
