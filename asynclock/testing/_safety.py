"""Jepsen-style safety runs: worker processes, a shared resource behind a guard, and faults.

:func:`run_safety` starts N worker *processes* that contend for one lock and do a
read-modify-write (read a counter, pause, write counter + 1) on a shared resource: a PostgreSQL
row or a Redis list. Faults are injected where they hurt, between the read and the write: the
worker process is stopped (SIGSTOP, the GC-pause case) or its event loop blocked by synchronous
work, for longer than the ttl; a schedule of server faults (pause, kill, restart, proxy cuts) can
run beside them.

Every accepted write is logged *at the resource*, in commit order, with the token of the lease
that made it. The checks read that log:

- lost updates: writes accepted minus the final counter (two holders wrote the same value);
- stale writes accepted: writes whose token is lower than one the resource had already accepted;
- overlapping holds: holds (acquire to release or loss, as each worker saw it) that overlapped a
  hold of another worker: what a lease alone cannot prevent;
- how long before the server-side expiry each lost body was cancelled (negative: after it).

With fencing on, the guard checks the token on the read and on the write, so the run must end
with no lost update and no stale write accepted, whatever the faults did.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

import anyio
import anyio.abc

from .._errors import UnsupportedFeature
from ..fencing import PostgresGuard, RedisGuard
from ._safety_checks import check_lock, check_permits
from ._safety_config import SafetyConfig as SafetyConfig
from ._safety_config import SafetyReport as SafetyReport
from ._safety_permits import OneConnection, permit_log, prepare_permits

_PG_TABLES = """
CREATE TABLE IF NOT EXISTS asynclock_safety_counter (run text PRIMARY KEY, value bigint NOT NULL);
CREATE TABLE IF NOT EXISTS asynclock_safety_writes (
    seq bigserial PRIMARY KEY, run text NOT NULL, token bigint, value bigint NOT NULL
);
"""


class Resource(Protocol):
    """The shared resource of a safety run, as a worker uses it."""

    async def read(self, token: int | None) -> int: ...

    async def write(self, value: int, token: int | None, logged_token: int | None) -> None: ...


class _PostgresResource(OneConnection):
    def __init__(self, url: str, run: str) -> None:
        super().__init__(url, run)
        self._guard = PostgresGuard(table="asynclock_safety_fences")

    async def read(self, token: int | None) -> int:
        async with self._connection() as db, db.transaction():
            if token is not None:
                await self._guard.check(db, self._run, token)
            value = await db.fetchval(
                "SELECT value FROM asynclock_safety_counter WHERE run = $1", self._run
            )
        return int(value)

    async def write(self, value: int, token: int | None, logged_token: int | None) -> None:
        async with self._connection() as db:
            if token is None:
                # One statement, one round trip: sent before the first await can be cancelled.
                await db.execute(self._WRITE, self._run, value, logged_token)
                return
            async with db.transaction():
                await self._guard.check(db, self._run, token)
                await db.execute(self._WRITE, self._run, value, logged_token)

    _WRITE = (
        "WITH counter AS (UPDATE asynclock_safety_counter SET value = $2 WHERE run = $1) "
        "INSERT INTO asynclock_safety_writes (run, token, value) VALUES ($1, $3, $2)"
    )


class _RedisResource:
    """A Redis list: each write appends ``token:value``; the last element is the counter."""

    def __init__(self, client: Any, run: str) -> None:
        self._client = client
        self._key = f"asynclock:safety:{run}:writes"
        self._guard = RedisGuard(client, prefix=f"asynclock:safety:{run}:fence:")

    async def read(self, token: int | None) -> int:
        command = ("LINDEX", self._key, "-1")
        last = (
            await self._guard.call("counter", *command, token=token)
            if token is not None
            else await self._client.execute_command(*command)
        )
        return 0 if last is None else int(last.split(b":")[1])

    async def write(self, value: int, token: int | None, logged_token: int | None) -> None:
        entry = f"{'' if logged_token is None else logged_token}:{value}"
        if token is not None:
            await self._guard.call("counter", "RPUSH", self._key, entry, token=token)
        else:
            await self._client.rpush(self._key, entry)


def _split(spec: str) -> tuple[str, str]:
    url, _, run = spec.partition("#")
    if not run:
        raise ValueError(f"resource {spec!r} needs a run id after '#'")
    return url, run


@contextlib.asynccontextmanager
async def open_resource(spec: str) -> AsyncIterator[Resource]:
    """Open ``postgresql://...#run`` or ``redis://...#run`` for a worker."""
    url, run = _split(spec)
    scheme = urlsplit(url).scheme
    if scheme in ("postgresql", "postgres"):
        resource = _PostgresResource(url, run)
        try:
            yield resource
        finally:
            await resource.aclose()
    elif scheme == "redis":
        import redis.asyncio

        client = redis.asyncio.Redis.from_url(url)
        try:
            yield _RedisResource(client, run)
        finally:
            await client.aclose()
    else:
        raise ValueError(f"unknown resource {url!r}: use postgresql://... or redis://...")


async def _prepare(spec: str) -> None:
    url, run = _split(spec)
    if urlsplit(url).scheme.startswith("postgres"):
        import asyncpg

        connection = await asyncpg.connect(url)
        try:
            await connection.execute(_PG_TABLES)
            await PostgresGuard(table="asynclock_safety_fences").create_table(connection)
            await connection.execute(
                "INSERT INTO asynclock_safety_counter (run, value) VALUES ($1, 0)", run
            )
        finally:
            await connection.close()


async def _resource_log(spec: str) -> list[tuple[int | None, int]]:
    """Accepted writes in commit order: (token of the writer's lease, value written)."""
    url, run = _split(spec)
    if urlsplit(url).scheme.startswith("postgres"):
        import asyncpg

        connection = await asyncpg.connect(url)
        try:
            rows = await connection.fetch(
                "SELECT token, value FROM asynclock_safety_writes WHERE run = $1 ORDER BY seq", run
            )
            await connection.execute("DELETE FROM asynclock_safety_writes WHERE run = $1", run)
            await connection.execute("DELETE FROM asynclock_safety_counter WHERE run = $1", run)
            await connection.execute("DELETE FROM asynclock_safety_fences WHERE resource = $1", run)
        finally:
            await connection.close()
        return [(row["token"], int(row["value"])) for row in rows]
    import redis.asyncio

    client = redis.asyncio.Redis.from_url(url)
    try:
        key = f"asynclock:safety:{run}:writes"
        entries = await client.lrange(key, 0, -1)
        await client.delete(key, f"asynclock:safety:{run}:fence:counter")
    finally:
        await client.aclose()
    log: list[tuple[int | None, int]] = []
    for entry in entries:
        text = entry.decode() if isinstance(entry, bytes) else entry
        token, _, value = text.partition(":")
        log.append((int(token) if token else None, int(value)))
    return log


def _capable(url: str, capability: str) -> bool:
    from .._registry import make_backend

    return bool(getattr(make_backend(url, {}).capabilities, capability))


def _process_stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            # The state follows the command name in parentheses, which may contain spaces.
            return stat.read().rsplit(")", 1)[1].split()[0] == "T"
    except (OSError, IndexError):
        return False


async def _resume_stopped(
    processes: Sequence[anyio.abc.Process], pause: float, report: SafetyReport
) -> None:
    stopped_since: dict[int, float] = {}
    while True:
        now = time.monotonic()
        for process in processes:
            if process.returncode is not None:
                continue
            if _process_stopped(process.pid):
                since = stopped_since.setdefault(process.pid, now)
                if now - since >= pause:
                    os.kill(process.pid, signal.SIGCONT)
                    del stopped_since[process.pid]
                    report.pauses += 1
        await anyio.sleep(0.01)


async def _run_nemesis(
    schedule: Sequence[tuple[float, Callable[[], object]]], started: float
) -> None:
    for at, fault in sorted(schedule, key=lambda item: item[0]):
        await anyio.sleep(max(0.0, started + at - time.monotonic()))
        await anyio.to_thread.run_sync(fault)


async def _start_together(
    processes: Sequence[anyio.abc.Process], histories: Sequence[Path]
) -> float:
    """Wait until every worker is connected (or has exited), then let them all go at once;
    returns when, the start of the nemesis schedule."""
    with anyio.fail_after(120):
        # Polling tiny local files that other processes make: nothing to wait on instead.
        while not all(  # noqa: ASYNC110
            Path(f"{history}.ready").exists() or process.returncode is not None  # noqa: ASYNC240
            for history, process in zip(histories, processes, strict=True)
        ):
            await anyio.sleep(0.01)
    histories[0].with_name("go").touch()
    return time.monotonic()


async def run_safety(config: SafetyConfig) -> SafetyReport:
    """Run ``config`` and check its history; bounded by ``config.duration`` plus a grace period."""
    scheme = config.url.split("://")[0]
    if config.fencing and not _capable(config.url, "fencing"):
        raise UnsupportedFeature(f"{scheme}:// issues no fencing tokens; run it with fencing=False")
    needed = {"semaphore": "semaphores", "election": "elections"}.get(config.primitive)
    if needed is not None and not _capable(config.url, needed):
        raise UnsupportedFeature(f"{scheme}:// has no {needed}")
    report = SafetyReport(config)
    run = uuid.uuid4().hex[:12]
    resource = f"{config.resource}#{run}"
    pause = config.pause if config.pause is not None else config.ttl * 1.5
    semaphore = config.primitive == "semaphore"
    await (prepare_permits(resource, config.permits) if semaphore else _prepare(resource))
    with tempfile.TemporaryDirectory(prefix="asynclock-safety-") as directory:
        histories = [Path(directory, f"worker-{index}.jsonl") for index in range(config.workers)]
        processes: list[anyio.abc.Process] = []
        try:
            for index, history in enumerate(histories):
                command = [
                    sys.executable, "-m", "asynclock.testing._safety_worker",
                    "--url", config.url, "--lock", config.lock, "--resource", resource,
                    "--history", str(history), "--ttl", str(config.ttl),
                    "--hold", str(config.hold), "--duration", str(config.duration),
                    "--pause-probability", str(config.pause_probability),
                    "--pause-kind", config.pause_kind, "--pause", str(pause),
                    "--seed", str(config.seed * 1000 + index),
                    "--primitive", config.primitive, "--permits", str(config.permits),
                ]  # fmt: skip
                if config.fencing:
                    command.append("--fencing")
                if not config.cancel_on_loss:
                    command.append("--no-cancel")
                log_file = Path(directory, f"worker-{index}.log").open("w")  # noqa: SIM115, ASYNC230
                processes.append(
                    await anyio.open_process(command, stdin=None, stdout=log_file, stderr=log_file)
                )
                log_file.close()
            started = await _start_together(processes, histories)
            with anyio.fail_after(config.duration + max(30.0, 10 * config.ttl)):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_resume_stopped, processes, pause, report)
                    tg.start_soon(_run_nemesis, config.nemesis, started)
                    for process in processes:
                        await process.wait()
                    tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                for process in processes:
                    if process.returncode is None:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(process.pid, signal.SIGCONT)
                            process.kill()
                        await process.wait()
                    await process.aclose()
        for index, process in enumerate(processes):
            if process.returncode != 0:
                output = Path(directory, f"worker-{index}.log").read_text()[-2000:]  # noqa: ASYNC240
                report.errors.append(f"worker {index} exited with {process.returncode}: {output}")
        events = [
            [json.loads(line) for line in path.read_text().splitlines() if line]
            if path.exists()
            else []
            for path in histories
        ]
    if semaphore:
        check_permits(report, events, await permit_log(resource, config.permits))
    else:
        check_lock(report, events, await _resource_log(resource))
    return report
