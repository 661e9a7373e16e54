"""One contender process: ``python -m benchmarks._worker CONFIG_JSON``.

It opens its own client (asynclock's ``connect(url)``, or with ``"peer"`` in the config that
peer library's own client, see ``_peers``), says ``{"ready": true}`` on stdout, then answers one
order a line on stdin:

* ``{"started", "ended", "hold", "grace"}``: take the lock in turn between those monotonic times
  (one clock for every process on a Linux host) and answer with the holds;
* ``{"fairness": {"starts": [[index, at], ...], "until": t}}``: one waiter per start, each
  starting at its monotonic time, all on this process's client; each releases as soon as it is
  granted; answer with ``[grant time, index]`` per grant (``_fairness``);
* ``{"exit": true}`` ends it.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import anyio
import anyio.to_thread

from ._contend import AsyncHold, AsyncWorkerFactory, SyncHold, SyncWorkerFactory
from ._fairness import freeze_heap, run_waiters


def _say(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def asynclock_factory(locks: Any, name: str, ttl: float) -> AsyncWorkerFactory:
    """Workers that share the client ``locks`` and take ``name`` with ``locks.lock()``."""
    import asynclock

    @asynccontextmanager
    async def hold(timeout: float) -> AsyncIterator[bool]:
        try:
            async with locks.lock(name, ttl=ttl, timeout=timeout):
                yield True
        except asynclock.AcquireTimeout:
            yield False

    @asynccontextmanager
    async def worker(index: int) -> AsyncIterator[AsyncHold]:
        yield hold

    return worker


async def _contend(hold: AsyncHold, order: dict[str, Any]) -> dict[str, Any]:
    started, ended = float(order["started"]), float(order["ended"])
    pause, grace = float(order["hold"]), float(order["grace"])
    holds: list[tuple[float, float]] = []
    failures = 0
    await anyio.sleep(max(0.0, started - time.monotonic()))
    with anyio.move_on_at(anyio.current_time() + (ended + grace - time.monotonic())):
        while time.monotonic() < ended:
            async with hold(max(0.05, ended + grace - time.monotonic())) as got:
                if not got:
                    failures += 1
                    continue
                acquired = time.monotonic()
                if pause:
                    await anyio.sleep(pause)
                released = time.monotonic()
            holds.append((acquired, released))
    return {"holds": holds, "failed_attempts": failures}


def _contend_sync(hold: SyncHold, order: dict[str, Any]) -> dict[str, Any]:
    """:func:`_contend` for a blocking library, in this (worker) thread; the lock is left to
    finish a turn that is under way at the end."""
    started, ended = float(order["started"]), float(order["ended"])
    pause, grace = float(order["hold"]), float(order["grace"])
    holds: list[tuple[float, float]] = []
    failures = 0
    time.sleep(max(0.0, started - time.monotonic()))
    while time.monotonic() < ended:
        with hold(max(0.05, ended + grace - time.monotonic())) as got:
            if not got:
                failures += 1
                continue
            acquired = time.monotonic()
            if pause:
                time.sleep(pause)
            released = time.monotonic()
        holds.append((acquired, released))
    return {"holds": holds, "failed_attempts": failures}


async def _orders(answer: Callable[[dict[str, Any]], Any]) -> None:
    """Read orders until ``exit`` (or stdin closes), answering each with ``answer``."""
    while True:
        line = await anyio.to_thread.run_sync(sys.stdin.readline)
        if not line:
            return
        order = json.loads(line)
        if order.get("exit"):
            return
        _say(await answer(order))


async def _main(config: dict[str, Any]) -> None:
    name: str = config["name"]
    if "peer" in config:
        from ._peers import peer_from_config

        peer = peer_from_config(config["peer"])
        if peer.sync:
            await anyio.to_thread.run_sync(_main_sync, peer, name)
            return
        async with peer.session() as make:  # type: ignore[attr-defined]
            await _serve(make(name))
        return
    import asynclock

    async with asynclock.connect(config["url"], **config["options"]) as locks:
        await _serve(asynclock_factory(locks, name, float(config["ttl"])))


async def _serve(factory: AsyncWorkerFactory) -> None:
    async with factory(0) as hold, AsyncExitStack() as stack:
        freeze_heap()
        _say({"ready": True})
        prepared: list[AsyncHold] = []

        async def answer(order: dict[str, Any]) -> dict[str, Any]:
            if "prepare" in order:
                # Every waiter's own lock object (or connection) is opened before the
                # schedule is set, so that connecting does not delay its start.
                prepared[:] = [
                    await stack.enter_async_context(factory(i)) for i in order["prepare"]
                ]
                freeze_heap()
                return {"prepared": len(prepared)}
            if "fairness" in order:
                spec = order["fairness"]
                starts = [(int(i), float(at)) for i, at in spec["starts"]]
                if len(prepared) != len(starts):
                    prepared[:] = [await stack.enter_async_context(factory(i)) for i, _ in starts]
                try:
                    grants = await run_waiters(list(prepared), starts, float(spec["until"]))
                finally:
                    prepared.clear()
                    await stack.aclose()  # and empty, for the next run
                return {"grants": grants}
            return await _contend(hold, order)

        await _orders(answer)


def _main_sync(peer: Any, name: str) -> None:
    make: Callable[[str], SyncWorkerFactory]
    with peer.session() as make, make(name)(0) as hold:
        freeze_heap()
        _say({"ready": True})
        for line in sys.stdin:
            order = json.loads(line)
            if order.get("exit"):
                return
            if "fairness" in order:
                _say({"error": f"{peer.name}: no fairness run for a blocking library"})
                continue
            _say(_contend_sync(hold, order))


def main() -> None:
    config = json.loads(sys.argv[1])
    try:
        anyio.run(_main, config)
    except Exception as exc:
        _say({"error": f"{type(exc).__name__}: {exc}"})
        raise SystemExit(1) from None


if __name__ == "__main__":
    threading.current_thread().name = "bench-worker"
    main()
