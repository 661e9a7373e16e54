"""The process-level contract of semaphores and elections, on every backend that has them.

Client *processes* (tests/contract/primitive_worker.py) contend; the resource they use is served
from this process (:class:`ResourceServer`: a shared counter of bodies inside, and a fencing
guard that accepts or refuses each write by token), so one history in arrival order holds what
every process did.

- semaphore, 3 permits, 20 tasks over 2 processes: never more than 3 bodies inside at once, and
  every task gets in;
- a holder process killed: exactly its permit is free again within its ttl, the others keep theirs;
- a holder process SIGSTOPped past its ttl: its permit goes to another, its body is cancelled when
  it resumes, its writes with the old token are refused, the others keep theirs;
- election, 5 candidates on 3 processes: one leader at a time, terms' tokens rise, ``observe()``
  sees the changes in order; the leader's process SIGSTOPped past its ttl: another leads, the
  paused one's body is cancelled when it resumes and its old-term writes are refused.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from asynclock.testing._forked import ForkedPython
from tests.contract.harness import BackendUnderTest, report
from tests.contract.primitive_worker import ResourceServer

pytestmark = [pytest.mark.anyio, pytest.mark.not_on("memory", reason="in-process only")]

_ROOT = Path(__file__).parents[2]


@asynccontextmanager
async def serving(permits: int | None) -> AsyncIterator[ResourceServer]:
    server = ResourceServer(permits)
    async with anyio.create_task_group() as tg:
        await tg.start(server.serve)
        yield server
        tg.cancel_scope.cancel()


@contextmanager
def workers(
    backend: BackendUnderTest, tmp_path: Path, configs: list[dict[str, Any]], *, first: int = 0
) -> Iterator[list[ForkedPython]]:
    """Start one worker process per config; on the way out, none is left running or stopped."""
    processes: list[ForkedPython] = []
    try:
        for index, config in enumerate(configs, start=first):
            config = {"worker": index, "url": backend.url, "options": backend.options, **config}
            log = (tmp_path / f"worker-{index}.log").open("wb")
            with log:
                processes.append(
                    ForkedPython(
                        "tests.contract.primitive_worker",
                        [json.dumps(config)],
                        stdout=log,
                        stderr=log,
                        cwd=_ROOT,
                    )
                )
        yield processes
    except BaseException:
        for process in processes:
            process.close()
        # What the workers saw, for the failure's report (pytest shows what a failed test
        # printed).
        for index in range(first, first + len(processes)):
            output = (tmp_path / f"worker-{index}.log").read_text(errors="replace")[-3000:]
            print(f"--- worker {index}:\n{output}")
        raise
    finally:
        for process in processes:
            process.close()


async def finished(processes: list[ForkedPython], tmp_path: Path, timeout: float) -> None:
    """Wait for every worker to exit, and fail with its output if one did not exit cleanly."""
    with anyio.fail_after(timeout):
        for process in processes:
            await process.exited()
    for process in processes:
        index = json.loads(process.args[-1])["worker"]
        output = (tmp_path / f"worker-{index}.log").read_text(errors="replace")[-3000:]
        assert process.returncode == 0, f"worker {index} exited {process.returncode}:\n{output}"


def started_from(server: ResourceServer, count: int) -> bool:
    return len(server.of("ready")) >= count


# -- semaphores ------------------------------------------------------------------------------


@pytest.mark.needs("semaphores")
async def test_semaphore_20_tasks_over_2_processes_never_more_than_3_inside(
    backend: BackendUnderTest, name: str, tmp_path: Path
) -> None:
    ttl = backend.ttl
    async with serving(3) as server:
        common = {
            "mode": "semaphore", "port": server.port, "name": name, "permits": 3, "tasks": 10,
            "ttl": ttl, "timeout": 30.0, "hold": 0.05, "every": 0.02,
        }  # fmt: skip
        started = anyio.current_time()
        with workers(backend, tmp_path, [common, common]) as processes:
            await finished(processes, tmp_path, timeout=60)
        took = anyio.current_time() - started
    entered = server.of("enter")
    assert sorted(event["who"] for event in entered) == sorted(
        f"{worker}/{task}" for worker in range(2) for task in range(10)
    ), "every task got in, once"
    assert server.most_inside <= 3
    assert server.most_inside >= 2, "the permits were contended"
    tokens = [event["token"] for event in entered]
    assert len(set(tokens)) == 20, "each permit its own token"
    assert server.of("write", ok=False) == [] and server.of("lost") == []
    report("semaphore_20_tasks", backend, most_inside=server.most_inside, seconds=round(took, 2))


@pytest.mark.needs("semaphores")
async def test_a_killed_holder_process_frees_exactly_its_permit_within_its_ttl(
    backend: BackendUnderTest, name: str, tmp_path: Path
) -> None:
    ttl = backend.ttl
    async with serving(3) as server, backend.connect() as locks:
        sem = locks.semaphore(name, permits=3)
        config = {
            "mode": "semaphore", "port": server.port, "name": name, "permits": 3, "tasks": 1,
            "ttl": ttl, "timeout": 30.0, "hold": 60.0, "every": 0.05,
        }  # fmt: skip
        with workers(backend, tmp_path, [config]) as (holder,):
            await server.wait_for(lambda: server.of("enter"), timeout=30)
            mine = [await sem.acquire(ttl=ttl, timeout=5) for _ in range(2)]
            assert await sem.try_acquire(ttl=ttl) is None  # all three permits held
            holder.kill()
            killed_at = anyio.current_time()
            holder.wait()
            freed = await sem.acquire(ttl=ttl, timeout=ttl * 1.5 + 1)
            free_after = anyio.current_time() - killed_at
            # Exactly one permit came back: the two others are still ours, and nothing more.
            assert await sem.try_acquire(ttl=ttl) is None
            assert not any(lease.lost for lease in mine)
            for lease in (*mine, freed):
                await lease.release()
    assert free_after < ttl * 1.5 + 1
    report("semaphore_holder_killed", backend, ttl=ttl, free_after=round(free_after, 3))


@pytest.mark.needs("semaphores")
async def test_a_paused_holder_process_loses_only_its_permit_and_its_late_writes(
    backend: BackendUnderTest, name: str, tmp_path: Path
) -> None:
    ttl = backend.ttl
    async with serving(3) as server, backend.connect() as locks:
        sem = locks.semaphore(name, permits=3)
        config = {
            "mode": "semaphore", "port": server.port, "name": name, "permits": 3, "tasks": 1,
            "ttl": ttl, "timeout": 30.0, "hold": 60.0, "every": 0.05,
        }  # fmt: skip
        with workers(backend, tmp_path, [config]) as (holder,):
            await server.wait_for(lambda: server.of("write", ok=True), timeout=30)
            (paused_token,) = {event["token"] for event in server.of("enter")}
            # The two other holders: this process, writing through the same guard.
            mine = [await sem.acquire(ttl=ttl, timeout=5) for _ in range(2)]
            for lease in mine:
                server.handle({"op": "write", "who": "test", "token": lease.token})
            await backend.stop_client(holder.pid)
            try:
                # Its permit is free once its lease expires on the server; a newer holder takes
                # it and uses the resource, which evicts the paused token from the guard.
                newer = await sem.acquire(ttl=ttl, timeout=ttl * 3 + 2)
                assert server.handle({"op": "write", "who": "test", "token": newer.token})["ok"]
                await anyio.sleep(max(0.0, ttl * 0.5))
            finally:
                os.kill(holder.pid, signal.SIGCONT)
            await server.wait_for(lambda: server.of("lost"), timeout=ttl * 3 + 5)
            assert not any(lease.lost for lease in (*mine, newer))
            for lease in mine:  # the others keep theirs, and still write
                assert server.handle({"op": "write", "who": "test", "token": lease.token})["ok"]
            for lease in (*mine, newer):
                await lease.release()
            await finished([holder], tmp_path, timeout=30)
    (lost,) = server.of("lost")
    assert lost["token"] == paused_token
    taken_over = server.of("write", ok=True, token=newer.token)[0]["t"]
    late = [e for e in server.of("write", token=paused_token) if e["t"] > taken_over]
    assert late and not any(event["ok"] for event in late), late
    assert server.of("write", late=True, ok=False), "the write after the loss was refused"
    report(
        "semaphore_holder_paused",
        backend,
        ttl=ttl,
        refused=len(server.of("write", ok=False)),
        late_writes_refused=len(late),
    )


# -- elections -------------------------------------------------------------------------------


async def collect_leaders(
    election: Any, seen: list[tuple[int | None, bytes]], *, task_status: Any
) -> None:
    first = True
    async for leader in election.observe():
        if leader is not None:
            seen.append((leader.token, leader.value))
        if first:
            first = False
            task_status.started()


def terms(server: ResourceServer) -> list[dict[str, Any]]:
    return server.of("enter")


@pytest.mark.needs("elections")
async def test_election_5_candidates_on_3_processes_one_leader_at_a_time(
    backend: BackendUnderTest, name: str, tmp_path: Path
) -> None:
    ttl = backend.ttl
    seconds = 30.0
    async with serving(None) as server, backend.connect() as locks:
        election = locks.election(name)
        observed: list[tuple[int | None, bytes]] = []
        async with anyio.create_task_group() as tg:
            await tg.start(collect_leaders, election, observed)
            configs = [
                {
                    "mode": "campaign", "port": server.port, "name": name, "tasks": tasks,
                    "ttl": ttl, "hold": 0.25, "every": 0.05, "seconds": seconds,
                    "pause_between": 0.05,
                }
                for tasks in (2, 2, 1)
            ]  # fmt: skip
            with workers(backend, tmp_path, configs) as processes:
                await server.wait_for(lambda: len(terms(server)) >= 8, timeout=seconds)
                server.stopping = True
                await finished(processes, tmp_path, timeout=30)
            await anyio.sleep(0.2)
            tg.cancel_scope.cancel()
        assert await election.leader() is None
    # Refused writes and lost terms first: a body cancelled by a lost term sends its "exit" late,
    # which the counter below would show as two leaders at once.
    assert server.of("write", ok=False) == [] and server.of("lost") == []
    assert server.most_inside == 1, "one leader at a time"
    held = [event["token"] for event in terms(server)]
    assert len(held) >= 5, held
    assert held == sorted(set(held)), f"terms' tokens rise: {held}"
    leaders = {event["who"] for event in terms(server)}
    assert len(leaders) >= 3, leaders
    tokens = [token for token, _ in observed]
    assert None not in tokens, f"observe() yielded a leader without its term's token: {observed}"
    known = [token for token in tokens if token is not None]
    assert known == sorted(set(known)), f"observe() in order, no repeats: {observed}"
    by_token = {event["token"]: event["who"].encode() for event in terms(server)}
    # Each leader observed is a term the resource saw, with its value; but for a candidate's
    # last term, elected as its worker stopped (the workers stop one after another, so others
    # lead on) and cancelled before its first access: then that candidate never leads again.
    unknown = [
        (token, value)
        for token, value in observed
        if token is not None
        and by_token.get(token) != value
        and any(later > token for later, who in by_token.items() if who == value)
    ]
    assert unknown == [], f"observed leaders the resource never saw: {unknown} of {observed}"
    assert len(observed) >= len(held) // 2, (observed, held)
    report(
        "election_rotating", backend, terms=len(held), observed=len(observed), leaders=len(leaders)
    )


@pytest.mark.needs("elections")
async def test_election_leader_paused_past_its_ttl_is_replaced_and_fenced(
    backend: BackendUnderTest, name: str, tmp_path: Path
) -> None:
    ttl = backend.ttl
    seconds = ttl * 4 + 6
    async with serving(None) as server, backend.connect() as locks:
        election = locks.election(name)
        observed: list[tuple[int | None, bytes]] = []
        async with anyio.create_task_group() as tg:
            await tg.start(collect_leaders, election, observed)
            configs = [
                {
                    "mode": "campaign", "port": server.port, "name": name, "tasks": tasks,
                    "ttl": ttl, "hold": 60.0, "every": 0.05, "seconds": seconds,
                }
                for tasks in (1, 2, 2)
            ]  # fmt: skip
            # The first process leads alone, so the one paused has no other candidate.
            with workers(backend, tmp_path, configs[:1]) as (paused,):
                await server.wait_for(lambda: server.of("write", ok=True), timeout=30)
                with workers(backend, tmp_path, configs[1:], first=1) as others:
                    await server.wait_for(lambda: started_from(server, 3), timeout=30)
                    await anyio.sleep(0.3)  # the other four are waiting in line
                    # The paused process's term now (on a starved machine, the one it began
                    # with may already have lost a renewal race and been won again).
                    index = len(terms(server)) - 1
                    first = terms(server)[index]
                    assert first["who"].startswith("0/"), "the first process leads alone"
                    await backend.stop_client(paused.pid)
                    stopped_at = anyio.current_time()
                    try:
                        await server.wait_for(lambda: len(terms(server)) > index + 1, ttl * 3 + 2)
                        replaced_after = anyio.current_time() - stopped_at
                        second = terms(server)[index + 1]
                        await server.wait_for(
                            lambda: server.of("write", ok=True, token=second["token"]), 5
                        )
                        await anyio.sleep(0.2)
                    finally:
                        os.kill(paused.pid, signal.SIGCONT)
                    await server.wait_for(
                        lambda: server.of("lost", token=first["token"]), timeout=ttl * 3 + 5
                    )
                    await server.wait_for(
                        lambda: server.of("write", late=True, token=first["token"]), timeout=5
                    )
                    server.stopping = True
                    await finished([paused, *others], tmp_path, timeout=seconds + 30)
            await anyio.sleep(0.2)
            tg.cancel_scope.cancel()
    assert second["who"] != first["who"] and second["token"] > first["token"]
    assert replaced_after < ttl * 3 + 2
    taken_over = server.of("write", ok=True, token=second["token"])[0]["t"]
    late = [e for e in server.of("write", token=first["token"]) if e["t"] > taken_over]
    assert late and not any(event["ok"] for event in late), late
    held = [event["token"] for event in terms(server)]
    assert held == sorted(set(held)), held
    tokens = [token for token, _ in observed]
    assert None not in tokens, f"observe() yielded a leader without its term's token: {observed}"
    known = [token for token in tokens if token is not None]
    assert known == sorted(set(known)), observed
    assert first["token"] in tokens, observed
    assert tokens[tokens.index(first["token"]) :][:2] == [first["token"], second["token"]], observed
    # The resource accepted the terms' writes in term order: none from an old term after a
    # newer term had written.
    accepted = [event["token"] for event in server.of("write", ok=True)]
    assert accepted == sorted(accepted)
    report(
        "election_leader_paused",
        backend,
        ttl=ttl,
        replaced_after=round(replaced_after, 3),
        refused=len(server.of("write", ok=False)),
        observed=len(observed),
    )
