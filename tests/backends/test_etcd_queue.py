"""The etcd queue's hand-over: one watch stream per client, one watch per lock name for the
waiters behind the client's own keys, and a release that hands the lock to the waiter behind
in its own transaction. Real servers; counts read from etcd's /metrics."""

from __future__ import annotations

import anyio
import pytest
from aetcd import rpc

import asynclock
from asynclock.testing import EtcdServer, FaultProxy
from tests.contract.backend_etcd import Etcd, metrics

pytestmark = pytest.mark.anyio


def watchers(server: EtcdServer) -> tuple[float, float]:
    """(watch streams, watchers) open on the server."""
    return (
        metrics(server, "etcd_debugging_mvcc_watch_stream_total"),
        metrics(server, "etcd_debugging_mvcc_watcher_total"),
    )


async def until_watchers(etcd: Etcd, streams: float | None, watching: float, within: float) -> None:
    """Until the server counts ``streams`` (None: any) and ``watching``; it counts a stream
    closed or a watch cancelled a moment after the client did it."""
    with anyio.fail_after(within):
        while True:
            now_streams, now_watching = watchers(etcd.server)
            if now_watching == watching and streams in (None, now_streams):
                return
            await anyio.sleep(0.005)


def calls(server: EtcdServer, method: str) -> float:
    return metrics(server, "grpc_server_handled_total", f'grpc_method="{method}"')


async def test_waiters_of_one_client_share_one_stream_and_one_watch_and_leave_none(
    etcd: Etcd,
) -> None:
    # No stream open: an earlier test's stream, still counted, would hide the one opened here.
    await until_watchers(etcd, 0, 0, within=5)
    order: list[int] = []
    async with etcd.connect() as locks, etcd.raw() as direct:
        holder = await locks.acquire("a", ttl=10)
        base = etcd.base("a")

        async def waiter(index: int) -> None:
            async with locks.lock("a", ttl=10):
                order.append(index)

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                for index in range(50):
                    tg.start_soon(waiter, index)
                    await direct.until_count(base, index + 2)
                await anyio.sleep(0.2)  # every waiter has armed its wait
                streams, watching = watchers(etcd.server)
                # Each waiter is behind a key of this client: one stream, one watch on the name.
                assert streams == 1
                assert watching == 1
                await holder.release()
        assert order == list(range(50))
        # The name's watch outlives its last waiter by a second, then it is cancelled.
        await until_watchers(etcd, None, 0, within=5)
    await until_watchers(etcd, 0, 0, within=3)


async def test_a_hand_over_within_one_client_is_the_release_transaction_alone(etcd: Etcd) -> None:
    async with etcd.connect() as locks, etcd.raw() as direct:
        holder = await locks.acquire("a", ttl=10)
        base = etcd.base("a")
        got = anyio.Event()
        done = anyio.Event()
        tokens: list[int] = []

        async def waiter() -> None:
            async with locks.lock("a", ttl=10) as lease:
                tokens.append(lease.token)
                got.set()
                await done.wait()

        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await direct.until_count(base, 2)
            await anyio.sleep(0.2)
            # Trying a lock this client holds and queues for needs no request at all.
            txns, ranges = calls(etcd.server, "Txn"), calls(etcd.server, "Range")
            assert await locks.try_acquire("a", ttl=10) is None
            assert (calls(etcd.server, "Txn"), calls(etcd.server, "Range")) == (txns, ranges)
            await holder.release()
            with anyio.fail_after(5):
                await got.wait()
            # The release's transaction proved the waiter's key the lowest: no read of its own.
            assert calls(etcd.server, "Txn") - txns == 1
            assert calls(etcd.server, "Range") == ranges
            assert tokens[0] > holder.token
            (left,) = await direct.keys(base)
            assert int(left.create_revision) == tokens[0]
            done.set()


async def test_an_operator_deleting_the_key_before_a_waiter_of_the_same_client_wakes_it(
    etcd: Etcd,
) -> None:
    async with etcd.connect() as locks, etcd.raw() as direct:
        holder = await locks.acquire("a", ttl=10)
        base = etcd.base("a")
        async with anyio.create_task_group() as tg:
            acquired: list[asynclock.Lease] = []
            woken = anyio.Event()

            async def waiter() -> None:
                acquired.append(await locks.acquire("a", ttl=10))
                woken.set()

            tg.start_soon(waiter)
            await direct.until_count(base, 2)
            await anyio.sleep(0.2)
            first, second = await direct.keys(base)
            # The waiter's own key deleted: it queues again, at the back (a new key).
            await direct.kv.DeleteRange(rpc.DeleteRangeRequest(key=second.key))
            await direct.until_count(base, 2, 3)
            (_, again) = await direct.keys(base)
            assert again.create_revision > second.create_revision
            assert not acquired
            # The holder's key deleted behind its back: the waiter is woken by the watch.
            await direct.kv.DeleteRange(rpc.DeleteRangeRequest(key=first.key))
            with anyio.fail_after(1.0):
                await woken.wait()
        assert acquired[0].token == again.create_revision
        await acquired[0].release()
        await holder.release()  # lost already; releasing is still allowed


async def test_a_waiter_whose_answer_is_on_its_way_finds_the_lock_handed_over(etcd: Etcd) -> None:
    async with FaultProxy(etcd.server.host, etcd.server.port) as proxy:
        async with etcd.connect(f"etcd://{proxy.address}") as locks:
            holder = await locks.acquire("a", ttl=10)
            # 120 ms round trips: the release goes out while the waiter's request is on its
            # way (and reaches etcd after it, on the same connection).
            proxy.delay(60)
            txns, ranges = calls(etcd.server, "Txn"), calls(etcd.server, "Range")
            acquired: list[asynclock.Lease] = []

            async def waiter() -> None:
                acquired.append(await locks.acquire("a", ttl=10))

            async with anyio.create_task_group() as tg:
                tg.start_soon(waiter)
                await anyio.sleep(0.02)
                await holder.release()
            # The queueing request and the release, nothing else: the release's transaction
            # read that the waiter's key was the lowest left, and the waiter's answer found
            # the lock handed over.
            assert calls(etcd.server, "Txn") - txns == 2
            assert calls(etcd.server, "Range") == ranges
            assert acquired[0].token > holder.token
            proxy.pass_through()
            await acquired[0].release()
