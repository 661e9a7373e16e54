"""Contention across clients (issue #29): what deployments do, beside the in-client runs.

* **Clients in one process**: N contenders on one event loop, each with its own client
  (asynclock: its own ``asynclock.connect(url)``; a peer: its own client or connection, opened
  the way the peer's documentation shows), all on one lock name, 0 ms hold.
* **Processes**: N worker processes (``_worker``), one client each, same lock, same hold.
* **Fairness** (``_fairness``): waiters started in a known order over P processes, or in one
  client, queued behind a holder; grant order against start order.

asynclock runs with its defaults (renewal and fencing on) and :data:`CLIENT_TTL`, the ttl of
the issue's measurement; the peers keep their own settings (``_peers``).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import replace
from typing import Any

import anyio
import anyio.to_thread

from ._contend import (
    AsyncWorkerFactory,
    Run,
    SyncHold,
    SyncWorkerFactory,
    contend_tasks,
    contend_threads,
    process_pool,
)
from ._fairness import Fairness, Opener, in_one_client, over_processes
from ._peers import AsyncPeer, Peer, SyncPeer
from ._targets import Target
from ._worker import asynclock_factory

#: asynclock's ttl in the runs across clients (renewal every 3 s, as by default ttl / 3).
CLIENT_TTL = 9.0
#: The 8-clients-in-one-process run the summary table shows.
TABLE_CLIENTS = 8


def target_opener(target: Target, ttl: float) -> Opener:
    """Each call opens a new asynclock client of ``target``."""

    @asynccontextmanager
    async def opener(name: str) -> AsyncIterator[AsyncWorkerFactory]:
        async with target.connect() as locks:
            yield asynclock_factory(locks, name, ttl)

    return opener


def peer_opener(peer: AsyncPeer) -> Opener:
    """Each call opens a new client of the peer library (its ``session``)."""

    @asynccontextmanager
    async def opener(name: str) -> AsyncIterator[AsyncWorkerFactory]:
        async with peer.session() as make:
            yield make(name)

    return opener


def own_clients(opener: Opener, name: str) -> AsyncWorkerFactory:
    """Workers on one event loop, each with a client of its own."""

    @asynccontextmanager
    async def worker(index: int) -> AsyncIterator[Any]:
        async with opener(name) as factory, factory(index) as hold:
            yield hold

    return worker


def own_sync_clients(peer: SyncPeer, name: str) -> SyncWorkerFactory:
    """Threads, each with a client of its own, for a blocking peer."""

    @contextmanager
    def worker(index: int) -> Iterator[SyncHold]:
        with peer.session() as make, make(name)(index) as hold:
            yield hold

    return worker


def client_runs(settings: Any, share: float) -> list[Run]:
    """The runs with clients in one process: the table's first, cut to fit a short share."""
    counts = sorted(settings.client_counts, key=lambda n: n != TABLE_CLIENTS)
    runs = [Run(n, 0.0, settings.duration, settings.grace) for n in counts]
    runs[0] = replace(runs[0], duration=min(runs[0].duration, max(0.2, share * 0.06)))
    return runs


async def in_process(
    unit: Target | Peer, settings: Any, name_of: Any, runs: list[Run], fits: Any
) -> list[dict[str, Any]]:
    """``runs`` with each contender its own client, on this event loop (threads for a
    blocking peer); the first always, the others while ``fits(seconds)``."""
    records: list[dict[str, Any]] = []
    for index, run in enumerate(runs):
        # Connecting N clients takes time too (ZooKeeper, etcd: tens of ms each).
        if index and not fits(run.duration + 0.1 * run.contenders + 0.3):
            break
        record = await one_in_process(unit, run, name_of("clients"))
        records.append({**record, "clients": "own, one process"})
        settings.progress(_line("clients", records[-1]))
    return sorted(records, key=lambda record: record["contenders"])


async def one_in_process(unit: Target | Peer, run: Run, name: str) -> dict[str, Any]:
    """One ``run`` on lock ``name`` with each contender its own client of ``unit``, on this
    event loop (threads for a blocking peer)."""
    if isinstance(unit, SyncPeer):
        return await anyio.to_thread.run_sync(contend_threads, own_sync_clients(unit, name), run)
    opener = (
        target_opener(unit, CLIENT_TTL) if isinstance(unit, Target) else peer_opener(unit)  # type: ignore[arg-type]
    )
    return await contend_tasks(own_clients(opener, name), run)


def worker_config(unit: Target | Peer, name: str) -> dict[str, Any]:
    if isinstance(unit, Target):
        return {"url": unit.url, "options": unit.options, "name": name, "ttl": CLIENT_TTL}
    return {"peer": unit.config(), "name": name}


def process_seconds(count: int, duration: float) -> float:
    """About what one count of processes takes: starting them (a second or so on 2 cores
    for 8), then one run."""
    return 0.8 + 0.15 * count + duration + 0.3


async def processes(
    unit: Target | Peer, settings: Any, name_of: Any, fits: Any
) -> list[dict[str, Any]]:
    """N worker processes, one client each, 0 ms hold; the first count always."""
    records: list[dict[str, Any]] = []
    for index, count in enumerate(settings.process_contenders):
        if index and not fits(process_seconds(count, settings.process_duration)):
            break
        name = name_of("processes")
        async with process_pool(worker_config(unit, name), count, start_timeout=60) as pool:
            run = Run(count, 0.0, settings.process_duration, settings.grace)
            record = await anyio.to_thread.run_sync(pool.run, run)
        records.append({**record, "clients": "own, one process each"})
        settings.progress(_line("processes", records[-1]))
    return records


def fairness_settings(settings: Any, unit: Target | Peer) -> Fairness:
    setting: Fairness = settings.fairness
    cap = getattr(unit, "max_waiters", None)
    if cap is not None and setting.waiters > cap:
        return replace(setting, waiters=cap)
    return setting


async def fairness(unit: Target | Peer, settings: Any, name_of: Any, fits: Any) -> dict[str, Any]:
    """The fairness runs: over processes (one client each), then in one client."""
    setting = fairness_settings(settings, unit)
    opener = (
        target_opener(unit, setting.ttl) if isinstance(unit, Target) else peer_opener(unit)  # type: ignore[arg-type]
    )
    result: dict[str, Any] = {}
    if setting.waiters < settings.fairness.waiters:
        result["capped_from"] = settings.fairness.waiters
        result["capped_why"] = f"{setting.waiters} connections at most on the test server"
    name = name_of("fair-processes")
    config = worker_config(unit, name)
    if isinstance(unit, Target):
        config["ttl"] = setting.ttl
    started = time.monotonic()
    async with process_pool(config, setting.processes, start_timeout=60) as pool:
        result["processes"] = await over_processes(
            opener, name, setting, pool.prepare, pool.fairness
        )
    settings.progress(_fair_line("processes", result["processes"], time.monotonic() - started))
    if fits(setting.seconds() + 0.5):
        started = time.monotonic()
        result["one_client"] = await in_one_client(opener, name_of("fair-client"), setting)
        settings.progress(
            _fair_line("one client", result["one_client"], time.monotonic() - started)
        )
    return result


def _line(mode: str, record: dict[str, Any]) -> str:
    handoff = record["handoff"]
    p50 = f"{handoff['p50_ms']:.3g}" if handoff.get("n") else "-"
    return (
        f"    {mode} x{record['contenders']}: {record['per_second']:.0f}/s, handoff p50 {p50} "
        f"ms, retaken {record['retaken_share']:.0%}, fewest {record['min_per_worker']}"
    )


def _fair_line(mode: str, record: dict[str, Any], seconds: float) -> str:
    return (
        f"    fairness, {mode}: {record['granted']} of {record['waiters']} granted, "
        f"displacement max {record['max_displacement']}, mean "
        f"{record['mean_displacement']:.1f} ({seconds:.1f} s)"
    )
