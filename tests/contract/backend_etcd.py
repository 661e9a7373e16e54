from __future__ import annotations

import http.client
import json
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import quote

import grpc
import pytest
from aetcd import rpc

from asynclock.testing import EtcdServer
from tests.contract.harness import BackendUnderTest


def _end(prefix: bytes) -> bytes:
    return prefix[:-1] + bytes([prefix[-1] + 1])


def lease_ids(server: EtcdServer) -> set[int]:
    """The leases on ``server`` now, through etcd's JSON gateway (no event loop needed)."""
    connection = http.client.HTTPConnection(server.host, server.port, timeout=5)
    try:
        connection.request("POST", "/v3/lease/leases", body=b"{}")
        reply = json.loads(connection.getresponse().read())
    finally:
        connection.close()
    return {int(item["ID"]) for item in reply.get("leases", [])}


@asynccontextmanager
async def stubs(server: EtcdServer) -> AsyncIterator[tuple[Any, Any]]:
    channel = grpc.aio.insecure_channel(server.address)
    try:
        yield rpc.KVStub(channel), rpc.LeaseStub(channel)
    finally:
        await channel.close()


@pytest.fixture
def etcd_backend(etcd_server: EtcdServer) -> BackendUnderTest:
    # Each test gets its own key prefix on the shared server, and counts only the leases
    # granted while it ran.
    prefix = f"/asynclock-contract/{uuid.uuid4().hex[:12]}/"
    before = lease_ids(etcd_server)

    async def revoke(name: str) -> None:
        # Delete the holder's key (the lowest create revision under the name), as an operator
        # would; revoking the lease itself is tested in tests/backends/test_etcd.py.
        base = f"{prefix}{quote(name, safe='')}/".encode()
        async with stubs(etcd_server) as (kv, _):
            reply = await kv.Range(
                rpc.RangeRequest(
                    key=base,
                    range_end=_end(base),
                    sort_target=rpc.RangeRequest.CREATE,
                    sort_order=rpc.RangeRequest.ASCEND,
                    limit=1,
                    keys_only=True,
                )
            )
            assert reply.kvs, f"nobody holds {name!r}"
            await kv.DeleteRange(rpc.DeleteRangeRequest(key=reply.kvs[0].key))

    async def leftovers() -> list[str]:
        # Everything under the test's prefix: locks (and their shared holds), and the
        # semaphores' and elections' keys, which live under "<prefix>!semaphore/" and
        # "<prefix>!election/".
        base = prefix.encode()
        async with stubs(etcd_server) as (kv, leases):
            reply = await kv.Range(rpc.RangeRequest(key=base, range_end=_end(base), keys_only=True))
            listed = (await leases.LeaseLeases(rpc.LeaseLeasesRequest())).leases
        found = [f"key {bytes(item.key).decode()}" for item in reply.kvs]
        found += [f"lease {item.ID:016x}" for item in listed if item.ID not in before]
        return sorted(found)

    return BackendUnderTest(
        "etcd",
        etcd_server.url,
        2.0,
        revoke,
        leftovers,
        options={"prefix": prefix},
        servers=[etcd_server],
        url_via=lambda addresses: f"etcd://{addresses[0]}",
        url_for_hosts=lambda hosts: f"etcd://{hosts}",
        many_hosts=True,
    )
