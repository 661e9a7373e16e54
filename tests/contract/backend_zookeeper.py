"""ZooKeeper for the contract suite (``zookeeper_backend``), and the helpers and fixtures of
the ZooKeeper tests in tests/backends/: a plain aiozk client beside the backend under test, the
queue's znodes, the server's watches, a session expired from outside."""

from __future__ import annotations

import contextlib
import struct
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import Any

import anyio
import pytest
from aiozk import ZKClient, exc, protocol

import asynclock
from asynclock.backends.zookeeper import ZooKeeperBackend, ZooKeeperGrant, encode_name
from asynclock.testing import FaultProxy, ZooKeeperServer
from tests.contract.harness import BackendUnderTest, WaiterCount, until


@asynccontextmanager
async def admin_client(address: str) -> AsyncIterator[ZKClient]:
    """A plain aiozk client, independent of the backend under test."""
    client = ZKClient(address, session_timeout=10)
    try:
        # Closed if its start fails as well: aiozk's repair loop would run on otherwise.
        with anyio.fail_after(10):
            await client.start()
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
        """Delete the znode of the current holder of ``name`` (the lowest sequence number)."""
        # The backend watches its own node, so the holder's body can be cancelled while this
        # delete is still closing its connection; the operator's delete itself always completes
        # (the body sees the cancellation at its next await).
        parent = f"{chroot}/{encode_name(name)}"
        with anyio.CancelScope(shield=True):
            async with admin_client(address) as client:
                children = await client.get_children(parent)
                assert children, f"nobody holds {name!r}"
                holder = min(children, key=lambda child: int(child.rpartition("-")[2]))
                await client.delete(f"{parent}/{holder}", force=True)

    async def leftovers() -> list[str]:
        async with admin_client(address) as client:
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
    @asynccontextmanager
    async def counter() -> AsyncIterator[WaiterCount]:
        async with admin_client(address) as client:

            async def waiting(name: str) -> int:
                # The lock's children are its holder's node and the waiters' (one round trip).
                request = protocol.ExistsRequest(path=f"{chroot}/{encode_name(name)}", watch=False)
                reply = await client.send(request)
                return max(0, int(reply.stat.num_children) - 1)

            yield waiting

    return BackendUnderTest(
        "zookeeper",
        f"{zookeeper_server.url}{chroot}",
        1.0,
        revoke,
        leftovers,
        options={"session_timeout": 5.0, "op_timeout": 3.0},
        counter=counter,
        servers=[zookeeper_server],
        url_via=lambda addresses: f"zookeeper://{addresses[0]}{chroot}",
        url_for_hosts=lambda hosts: f"zookeeper://{hosts}{chroot}",
        many_hosts=True,
    )


# -- for tests/backends/test_zookeeper*.py ------------------------------------------------------


@pytest.fixture
def zk_chroot() -> str:
    """A chroot of the test's own on the shared server."""
    return f"/test-{uuid.uuid4().hex[:10]}"


@dataclass
class Zk:
    """A test's own chroot on the shared server, and a plain aiozk client beside the backend."""

    server: ZooKeeperServer
    admin: ZKClient
    chroot: str

    def connect(self, **options: Any) -> asynclock.LockClient:
        return asynclock.connect(f"{self.server.url}{self.chroot}", **options)

    @asynccontextmanager
    async def backend(self, **options: Any) -> AsyncIterator[ZooKeeperBackend]:
        async with self.connect(**options) as locks:
            yield backend_of(locks)

    @asynccontextmanager
    async def proxied(
        self, **options: Any
    ) -> AsyncIterator[tuple[FaultProxy, asynclock.LockClient]]:
        """A client that reaches the server through a fault proxy."""
        async with FaultProxy(self.server.host, self.server.port) as proxy:
            url = f"zookeeper://{proxy.address}{self.chroot}"
            async with asynclock.connect(url, **options) as locks:
                yield proxy, locks

    async def children(self, parent: str) -> list[str]:
        """The children of the chroot's ``parent`` in queue order (their sequence numbers)."""
        try:
            found: list[str] = await self.admin.get_children(f"{self.chroot}/{parent}")
        except exc.NoNode:
            return []
        return sorted(found, key=lambda child: int(child.rpartition("-")[2]))

    async def wait_for_children(self, parent: str, count: int) -> list[str]:
        """The children of ``parent`` once there are ``count`` (or more)."""
        await until(lambda: self.has_children(parent, count, at_least=True), 10)
        return await self.children(parent)

    async def has_children(self, parent: str, count: int, *, at_least: bool = False) -> bool:
        found = len(await self.children(parent))
        return found >= count if at_least else found == count

    async def tree(self) -> list[str]:
        return await znodes_under(self.admin, self.chroot)


@pytest.fixture
async def zk(zookeeper_server: ZooKeeperServer, zk_chroot: str) -> AsyncIterator[Zk]:
    """A :class:`Zk` on the shared server; deletes the test's chroot afterwards."""
    async with admin_client(zookeeper_server.address) as client:
        yield Zk(zookeeper_server, client, zk_chroot)
        await delete_tree(client, zk_chroot)


def grant_of(lease: asynclock.Lease) -> ZooKeeperGrant:
    grant = lease.grant
    assert isinstance(grant, ZooKeeperGrant)
    return grant


def backend_of(locks: asynclock.LockClient) -> ZooKeeperBackend:
    backend = locks._backend
    assert isinstance(backend, ZooKeeperBackend)
    return backend


def watched_paths(server: ZooKeeperServer) -> dict[str, list[str]]:
    """The server's data watches: path -> session ids (four-letter word ``wchp``)."""
    watched: dict[str, list[str]] = {}
    path = ""
    for line in server.four_letter_word("wchp", timeout=5).splitlines():
        if line.startswith("/"):
            path = line.strip()
            watched[path] = []
        elif line.strip():
            watched[path].append(line.strip())
    return watched


def assert_session_state_clean(locks: asynclock.LockClient) -> None:
    for info in backend_of(locks).extra_info()["sessions"].values():
        assert info["held"] == info["waiting_calls"] == info["orphans"] == 0, info
        assert info["watches"] == info["listeners"] == 0, info
        assert info["state"] == "connected", info


async def expire_session(server: ZooKeeperServer, grant: ZooKeeperGrant) -> None:
    """Take over the grant's session from a second connection and close it (server-side)."""
    session = grant.session
    assert session is not None
    connect = protocol.ConnectRequest(
        protocol_version=0,
        last_seen_zxid=0,
        timeout=round(session.timeout * 1000),
        session_id=session.session_id,
        password=session._id.password,
        read_only=False,
    ).serialize()
    close = protocol.CloseRequest().serialize(1)
    with anyio.fail_after(5):
        async with await anyio.connect_tcp(server.host, server.port) as stream:
            await stream.send(struct.pack("!i", len(connect)) + connect)
            received = b""
            while len(received) < 4 or len(received) < 4 + int.from_bytes(received[:4], "big"):
                received += await stream.receive()
            reply = protocol.ConnectResponse.deserialize(received[4:])
            assert reply.session_id == session.session_id
            await stream.send(struct.pack("!i", len(close)) + close)
            with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError):
                while True:  # the close reply, then the server hangs up
                    await stream.receive()
