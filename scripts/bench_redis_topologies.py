"""Uncontended lock()+release latency on Redis Sentinel and Redis Cluster, with and without
``wait_replicas``, beside the floor (redis-py SET NX PX + DEL, two round trips) and the peer
(redis-py's own Lock) on the same servers, in one process.

    PYTHONPATH=$PWD python scripts/bench_redis_topologies.py [--iterations 1000] [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable

import anyio
import redis.asyncio
from redis.crc import key_slot

import asynclock
from asynclock.testing._redis_topologies import RedisClusterNodes, RedisSentinelGroup

Step = Callable[[int], Awaitable[None]]


async def interleaved(cases: dict[str, Step], iterations: int) -> dict[str, tuple[float, float]]:
    """p50 and p99 in ms of each case, measured in turns of 50 so that every case sees the
    same load on a shared machine (a case measured after another sees other neighbours)."""
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for step in cases.values():
        for index in range(50):  # warm-up: connections, scripts
            await step(index)
    for turn in range(0, iterations, 50):
        for name, step in cases.items():
            for index in range(turn, min(iterations, turn + 50)):
                started = time.perf_counter()
                await step(index)
                samples[name].append(time.perf_counter() - started)
    result = {}
    for name, values in samples.items():
        values.sort()
        p99 = values[min(len(values) - 1, int(len(values) * 0.99))]
        result[name] = (statistics.median(values) * 1000, p99 * 1000)
    return result


def asynclock_step(locks: asynclock.LockClient) -> Step:
    async def step(index: int) -> None:
        async with locks.lock(f"bench/{index % 16}", ttl=10.0):
            pass

    return step


def floor_step(raw: redis.asyncio.Redis) -> Step:
    async def step(index: int) -> None:
        key = f"{{floor}}:{index % 16}"
        await raw.set(key, "x", nx=True, px=10000)
        await raw.delete(key)

    return step


def peer_step(raw: redis.asyncio.Redis) -> Step:
    async def step(index: int) -> None:
        lock = raw.lock(f"{{floor}}:peer:{index % 16}", timeout=10)
        await lock.acquire()
        await lock.release()

    return step


def table(results: dict[str, tuple[float, float]], floor: str) -> list[str]:
    base = results[floor][0]
    return [
        f"| {name} | {p50:.3f} | {p99:.3f} | {p50 / base:.2f}x |"
        for name, (p50, p99) in results.items()
    ]


def client(url: str, **options: object) -> asynclock.LockClient:
    prefix = f"bench-{uuid.uuid4().hex[:6]}:"
    return asynclock.connect(url, prefix=prefix, durability_warning=False, **options)


async def one_run(iterations: int) -> list[str]:
    lines = []
    with RedisSentinelGroup() as group:
        master = group.master()
        async with (
            redis.asyncio.Redis(host=master.host, port=master.port) as raw,
            client(f"redis://{master.address}/0") as direct,
            client(group.url) as sentinel,
            client(group.url, wait_replicas=1, wait_timeout=0.5) as waiting,
        ):
            cases = {
                "Sentinel: floor, redis-py SET NX PX + DEL": floor_step(raw),
                "Sentinel: peer, redis-py Lock": peer_step(raw),
                "Sentinel: redis:// straight to the master": asynclock_step(direct),
                "Sentinel: redis+sentinel://": asynclock_step(sentinel),
                "Sentinel: redis+sentinel:// wait_replicas=1": asynclock_step(waiting),
            }
            results = await interleaved(cases, iterations)
        lines += table(results, "Sentinel: floor, redis-py SET NX PX + DEL")
    with RedisClusterNodes(3, replicas=1) as cluster:
        # The master that serves the floor's keys ({floor} is their hash tag).
        node = cluster.node_for_slot(key_slot(b"floor"))
        async with (
            redis.asyncio.Redis(host=node.host, port=node.port) as raw,
            client(cluster.url) as plain,
            client(cluster.url, wait_replicas=1, wait_timeout=0.5) as waiting,
        ):
            cases = {
                "Cluster: floor on one master": floor_step(raw),
                "Cluster: peer, redis-py Lock on one master": peer_step(raw),
                "Cluster: redis+cluster://": asynclock_step(plain),
                "Cluster: redis+cluster:// wait_replicas=1": asynclock_step(waiting),
            }
            results = await interleaved(cases, iterations)
        lines += table(results, "Cluster: floor on one master")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iterations", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    for run in range(1, args.runs + 1):
        print(f"\nrun {run}: {args.iterations} uncontended iterations, ms")
        print("| case | p50 | p99 | p50 / floor |\n|---|---|---|---|")
        for line in anyio.run(one_run, args.iterations):
            print(line)


if __name__ == "__main__":
    main()
