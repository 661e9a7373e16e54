"""LeaderTask across three processes against a real Redis: the leader stopped (SIGSTOP) past its
ttl, then the lock server paused past it; no two replicas' runs overlap while their terms are
valid, the tokens rise, and another replica takes over each time."""

from __future__ import annotations

import itertools
import os
import signal
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import anyio
import pytest
from anyio.abc import Process

import asynclock
from asynclock.testing import RedisServer

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

ROOT = Path(__file__).resolve().parents[2]
TTL = 1.0
SECONDS = 7.0


async def leader_pid(locks: asynclock.LockClient, name: str, other_than: int = 0) -> int:
    with anyio.fail_after(10):
        while True:
            leader = await locks.election(name).leader()
            if leader is not None and int(leader.value) != other_than:
                return int(leader.value)
            await anyio.sleep(0.02)


async def test_three_replicas_one_leader_at_a_time_through_a_stopped_leader_and_a_paused_server(
    tmp_path: Path,
) -> None:
    out = tmp_path / "runs.txt"
    name = "jobs/leader"
    with RedisServer() as server, ExitStack() as logs:
        url = f"{server.url}?prefix=leader:"
        workers: list[Process] = []
        try:
            for index in range(3):
                worker = await anyio.open_process(
                    [sys.executable, "-m", "tests.integrations.leader_worker",
                     url, name, str(TTL), str(SECONDS), str(out)],
                    cwd=ROOT, stdout=None, stderr=logs.enter_context((tmp_path / f"{index}.log").open("wb")),
                )  # fmt: skip
                workers.append(worker)
            async with asynclock.connect(url) as locks:
                first = await leader_pid(locks, name)
                await anyio.sleep(0.5)
                os.kill(first, signal.SIGSTOP)  # past its ttl: another replica takes over
                second = await leader_pid(locks, name, other_than=first)
                await anyio.sleep(2 * TTL)
                os.kill(first, signal.SIGCONT)
                await anyio.sleep(0.5)
                paused_at = time.monotonic()
                server.pause()  # past the ttl: every term ends, nobody can campaign
                await anyio.sleep(1.5 * TTL)
                server.resume()
                await leader_pid(locks, name)  # a replica leads again
            with anyio.fail_after(20):
                for worker in workers:
                    assert await worker.wait() == 0
        finally:
            for worker in workers:
                if worker.returncode is None:
                    worker.kill()
                    await worker.wait()
    runs = sorted(
        (float(start), float(end), int(pid), int(token))
        for pid, token, start, end in (line.split() for line in out.read_text().splitlines())
    )
    for before, after in itertools.pairwise(runs):
        if before[2] != after[2]:
            assert before[1] <= after[0], f"runs overlap: {before} and {after}"
        assert before[3] <= after[3], f"tokens went down: {before} then {after}"
    leaders = [pid for _, _, pid, _ in runs]
    assert first in leaders and second in leaders and second != first
    assert any(start > paused_at + 1.5 * TTL for start, _, _, _ in runs)  # it recovered
    assert len(runs) > 50
    for index in range(3):
        # Warnings are expected (lost terms, the paused server); errors are not.
        logged = (tmp_path / f"{index}.log").read_text()
        assert "Traceback" not in logged and "ERROR" not in logged, logged
