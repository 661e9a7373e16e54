"""etcd for the contract suite (``etcd_backend``), and the helpers and fixtures of the etcd
tests in tests/backends/: direct gRPC access beside the backend under test, /metrics."""

from __future__ import annotations

import http.client
import json
import uuid
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import anyio
import grpc
import pytest
from aetcd import rpc

import asynclock
from asynclock.testing import EtcdServer
from tests.contract.harness import BackendUnderTest, WaiterCount


def end(prefix: bytes) -> bytes:
    """The range end that covers every key starting with ``prefix``."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


def key_prefix(prefix: str, name: str) -> bytes:
    """Where the queue of the lock ``name`` lives under the client's ``prefix``."""
    return f"{prefix}{quote(name, safe='')}/".encode()


@dataclass
class Raw:
    """Direct gRPC access to etcd, beside the backend under test."""

    kv: Any
    leases: Any

    async def keys(self, prefix: bytes) -> list[Any]:
        """The keys under ``prefix``, oldest first (the queue's order)."""
        reply = await self.kv.Range(
            rpc.RangeRequest(
                key=prefix,
                range_end=end(prefix),
                sort_target=rpc.RangeRequest.CREATE,
                sort_order=rpc.RangeRequest.ASCEND,
            )
        )
        return list(reply.kvs)

    async def count(self, prefix: bytes) -> int:
        return len(await self.keys(prefix))

    async def until_count(self, prefix: bytes, expected: int, timeout: float = 10.0) -> None:
        """Until ``expected`` keys are under ``prefix`` (the queue lives on the server)."""
        with anyio.fail_after(timeout):
            while await self.count(prefix) != expected:  # noqa: ASYNC110
                await anyio.sleep(0.005)


@asynccontextmanager
async def raw(address: str) -> AsyncIterator[Raw]:
    channel = grpc.aio.insecure_channel(address)
    try:
        yield Raw(rpc.KVStub(channel), rpc.LeaseStub(channel))
    finally:
        await channel.close()


def lease_ids(server: EtcdServer) -> set[int]:
    """The leases on ``server`` now, through etcd's JSON gateway (no event loop needed)."""
    connection = http.client.HTTPConnection(server.host, server.port, timeout=5)
    try:
        connection.request("POST", "/v3/lease/leases", body=b"{}")
        reply = json.loads(connection.getresponse().read())
    finally:
        connection.close()
    return {int(item["ID"]) for item in reply.get("leases", [])}


def metrics(server: EtcdServer, name: str, labels: str = "") -> float:
    """The sum of the series of one metric of etcd's Prometheus endpoint (those whose labels
    contain ``labels``)."""
    connection = http.client.HTTPConnection(server.host, server.port, timeout=5)
    try:
        connection.request("GET", "/metrics")
        text = connection.getresponse().read().decode()
    finally:
        connection.close()
    total = 0.0
    for line in text.splitlines():
        series, _, value = line.rpartition(" ")
        if (series == name or series.startswith(name + "{")) and labels in series:
            total += float(value)
    return total


@dataclass
class Etcd:
    """The shared server and a key prefix of the test's own on it."""

    server: EtcdServer
    prefix: str

    def connect(self, url: str | None = None, **options: Any) -> asynclock.LockClient:
        return asynclock.connect(url or self.server.url, prefix=self.prefix, **options)

    def raw(self) -> AbstractAsyncContextManager[Raw]:
        return raw(self.server.address)

    def base(self, name: str) -> bytes:
        """Where the queue of the lock ``name`` lives."""
        return key_prefix(self.prefix, name)


@pytest.fixture
def etcd(etcd_server: EtcdServer) -> Etcd:
    return Etcd(etcd_server, f"/asynclock-test/{uuid.uuid4().hex[:12]}/")


@pytest.fixture
def etcd_backend(etcd_server: EtcdServer) -> BackendUnderTest:
    # Each test gets its own key prefix on the shared server, and counts only the leases
    # granted while it ran.
    prefix = f"/asynclock-contract/{uuid.uuid4().hex[:12]}/"
    before = lease_ids(etcd_server)

    async def revoke(name: str) -> None:
        # Delete the holder's key (the lowest create revision under the name), as an operator
        # would; revoking the lease itself is tested in tests/backends/test_etcd.py.
        async with raw(etcd_server.address) as direct:
            keys = await direct.keys(key_prefix(prefix, name))
            assert keys, f"nobody holds {name!r}"
            await direct.kv.DeleteRange(rpc.DeleteRangeRequest(key=keys[0].key))

    async def leftovers() -> list[str]:
        # Everything under the test's prefix: locks (and their shared holds), and the
        # semaphores' and elections' keys, which live under "<prefix>!semaphore/" and
        # "<prefix>!election/".
        async with raw(etcd_server.address) as direct:
            found = [
                f"key {bytes(item.key).decode()}" for item in await direct.keys(prefix.encode())
            ]
        found += [f"lease {id_:016x}" for id_ in lease_ids(etcd_server) if id_ not in before]
        return sorted(found)

    @asynccontextmanager
    async def counter() -> AsyncIterator[WaiterCount]:
        async with raw(etcd_server.address) as direct:

            async def waiting(name: str) -> int:
                # The queue's keys are its holder's and the waiters' (a count, not a listing).
                base = key_prefix(prefix, name)
                request = rpc.RangeRequest(key=base, range_end=end(base), count_only=True)
                return max(0, int((await direct.kv.Range(request)).count) - 1)

            yield waiting

    return BackendUnderTest(
        "etcd",
        etcd_server.url,
        2.0,
        revoke,
        leftovers,
        options={"prefix": prefix},
        counter=counter,
        servers=[etcd_server],
        url_via=lambda addresses: f"etcd://{addresses[0]}",
        url_for_hosts=lambda hosts: f"etcd://{hosts}",
        many_hosts=True,
    )
