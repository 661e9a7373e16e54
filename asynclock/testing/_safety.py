"""Jepsen-style safety runs: worker processes, a shared resource behind a guard, and faults.

:func:`run_safety` starts N worker *processes* that contend for one lock and do a
read-modify-write (read a counter, pause, write counter + 1) on a shared resource: a PostgreSQL
row or a Redis list. Faults are injected where they hurt, between the read and the write: the
worker process is stopped (SIGSTOP, the GC-pause case: resumed only once another worker's newer
hold has used the resource, see :func:`_resume_stopped`) or its event loop blocked by synchronous
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
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

import anyio
import anyio.abc

from .._errors import UnsupportedFeature
from ..fencing import PostgresGuard, RedisGuard
from ._forked import ForkedPython
from ._safety_checks import check_lock, check_permits
from ._safety_config import SafetyConfig as SafetyConfig
from ._safety_config import SafetyReport as SafetyReport
from ._safety_permits import PERMIT_LOG, OneConnection, permit_log, pg_connection, prepare_permits

#: The module each worker process runs.
_WORKER = "asynclock.testing._safety_worker"

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
        async with contextlib.aclosing(_PostgresResource(url, run)) as resource:
            yield resource
    elif scheme == "redis":
        import redis.asyncio

        async with redis.asyncio.Redis.from_url(url) as client:
            yield _RedisResource(client, run)
    else:
        raise ValueError(f"unknown resource {url!r}: use postgresql://... or redis://...")


async def _prepare(spec: str) -> None:
    url, run = _split(spec)
    if urlsplit(url).scheme.startswith("postgres"):
        async with pg_connection(url) as connection:
            await connection.execute(_PG_TABLES)
            await PostgresGuard(table="asynclock_safety_fences").create_table(connection)
            await connection.execute(
                "INSERT INTO asynclock_safety_counter (run, value) VALUES ($1, 0)", run
            )


#: A lock's or an election's accepted writes in commit order, (token, value).
_LOCK_LOG = "SELECT token, value FROM asynclock_safety_writes WHERE run = $1 ORDER BY seq"


def _parse_redis_log(entries: Sequence[bytes | str]) -> list[tuple[int | None, int]]:
    log: list[tuple[int | None, int]] = []
    for entry in entries:
        text = entry.decode() if isinstance(entry, bytes) else entry
        token, _, value = text.partition(":")
        log.append((int(token) if token else None, int(value)))
    return log


async def _resource_log(spec: str) -> list[tuple[int | None, int]]:
    """Accepted writes in commit order: (token of the writer's lease, value written)."""
    url, run = _split(spec)
    if urlsplit(url).scheme.startswith("postgres"):
        async with pg_connection(url) as connection:
            rows = await connection.fetch(_LOCK_LOG, run)
            await connection.execute("DELETE FROM asynclock_safety_writes WHERE run = $1", run)
            await connection.execute("DELETE FROM asynclock_safety_counter WHERE run = $1", run)
            await connection.execute("DELETE FROM asynclock_safety_fences WHERE resource = $1", run)
        return [(row["token"], int(row["value"])) for row in rows]
    import redis.asyncio

    async with redis.asyncio.Redis.from_url(url) as client:
        key = f"asynclock:safety:{run}:writes"
        entries = await client.lrange(key, 0, -1)
        await client.delete(key, f"asynclock:safety:{run}:fence:counter")
    return _parse_redis_log(entries)


#: Reads the resource's log so far (not deleting it): (token, value written or access).
LogReader = Callable[[], Awaitable[Sequence[tuple[int | None, object]]]]


@contextlib.asynccontextmanager
async def _log_reader(spec: str, semaphore: bool) -> AsyncIterator[LogReader]:
    """The runner's own connection to the resource, to watch its log during the run."""
    url, run = _split(spec)
    if urlsplit(url).scheme.startswith("postgres"):
        query = PERMIT_LOG if semaphore else _LOCK_LOG
        async with pg_connection(url) as connection:

            async def read_rows() -> list[tuple[int | None, object]]:
                return [(row[0], row[1]) for row in await connection.fetch(query, run)]

            yield read_rows
        return
    import redis.asyncio

    async with redis.asyncio.Redis.from_url(url) as client:

        async def read_list() -> list[tuple[int | None, int]]:
            return _parse_redis_log(await client.lrange(f"asynclock:safety:{run}:writes", 0, -1))

        yield read_list


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


def _held_token(history: Path) -> int | None:
    """The token of the hold a stopped worker is in: its history's last "acquire" (the worker
    flushed it before it stopped itself; ``None`` where the backend has no tokens)."""
    for line in reversed(history.read_text().splitlines()):
        event = json.loads(line)
        if event["op"] == "acquire":
            return event["token"]  # type: ignore[no-any-return]
    return None


def newer_holders_at_once(
    log: Sequence[tuple[int | None, object]], token: int, permits: int
) -> bool:
    """Whether ``permits`` holds with tokens newer than ``token`` had accesses accepted at one
    moment, at the resource. For a lock (``permits=1``): one write of a newer token. For a
    semaphore: ``permits`` newer tokens entered and none of them exited yet, which is when its
    guard (at most ``permits`` admitted, the oldest evicted) no longer admits ``token``, and when
    an unguarded resource has ``permits + 1`` writers inside if ``token``'s holder is too."""
    inside: set[int] = set()
    for accepted, op in log:
        if accepted is None or accepted <= token:
            continue
        inside.add(accepted)
        if len(inside) >= permits:
            return True
        if op == "exit":
            inside.discard(accepted)
    return False


@dataclass
class _Stopped:
    since: float
    token: int | None
    #: Entries in the resource's log when the stop was seen (for a backend without tokens).
    log_length: int

    def taken_over(self, log: Sequence[tuple[int | None, object]], permits: int) -> bool:
        if self.token is None:
            return len(log) > self.log_length
        return newer_holders_at_once(log, self.token, permits)


class _Takeovers:
    """Stopped workers resumed after a takeover; ``enough`` once ``wanted`` were."""

    def __init__(self, wanted: int) -> None:
        self.wanted = wanted
        self.enough = anyio.Event()
        if wanted <= 0:
            self.enough.set()

    def seen(self) -> None:
        self.wanted -= 1
        if self.wanted <= 0:
            self.enough.set()


async def _resume_stopped(
    processes: Sequence[ForkedPython],
    histories: Sequence[Path],
    read_log: LogReader,
    config: SafetyConfig,
    report: SafetyReport,
    takeovers: _Takeovers,
) -> None:
    """The runner's half of a ``stop`` pause: SIGCONT a stopped worker once its pause has
    elapsed *and* its hold has been taken over at the resource (:func:`newer_holders_at_once`;
    without tokens: a write accepted since it stopped). Resuming on the pause alone made the
    outcome a race between the paused write and the next holder's, which a loaded host lost.

    The wait is bounded. When fewer than ``permits`` workers are running (the others stopped or
    finished), no takeover can come: the stopped worker with the newest token is resumed, one at
    a time, so that the older ones still find their hold taken over. And no worker stays stopped
    past ``pause + 5 x ttl``: time enough for the server to expire the lease and a waiter to take
    it and write even on a loaded host; the bound is for a server fault that keeps every worker
    from writing (the nemesis pausing or restarting the lock server)."""
    pause = config.pause if config.pause is not None else config.ttl * 1.5
    bound = pause + 5 * config.ttl
    permits = config.permits if config.primitive == "semaphore" else 1
    stopped: dict[int, _Stopped] = {}
    while True:
        now = time.monotonic()
        alive = [(i, p) for i, p in enumerate(processes) if p.returncode is None]
        now_stopped = [i for i, p in alive if _process_stopped(p.pid)]
        running = len(alive) - len(now_stopped)
        for index in now_stopped:
            if index not in stopped:
                token = _held_token(histories[index])
                length = len(await read_log()) if token is None else 0
                stopped[index] = _Stopped(now, token, length)
        # Newest hold first: resuming it is what can take over the older ones.
        now_stopped.sort(key=lambda index: stopped[index].token or 0, reverse=True)
        log: Sequence[tuple[int | None, object]] | None = None
        for index in now_stopped:
            stop = stopped[index]
            if now - stop.since < pause:
                continue
            if running >= permits and now - stop.since < bound:
                log = log if log is not None else await read_log()
                if not stop.taken_over(log, permits):
                    continue
                takeovers.seen()
            os.kill(processes[index].pid, signal.SIGCONT)
            del stopped[index]
            running += 1
            report.pauses += 1
        await anyio.sleep(0.01)


async def _end_run(histories: Sequence[Path], config: SafetyConfig, enough: anyio.Event) -> None:
    """Tell the workers to stop once the run has lasted ``config.duration`` and the faults it
    is asked for have happened (``config.min_takeovers``): a loaded host makes fewer holds in
    the same time, and a run without the fault it checks proves nothing."""
    await anyio.sleep(config.duration)
    # Bounded within the run's grace period, so that a run without the fault ends and its
    # checks say what it did.
    with anyio.move_on_after(max(20.0, 8 * config.ttl)):
        await enough.wait()
    histories[0].with_name("stop").touch()


async def _run_nemesis(
    schedule: Sequence[tuple[float, Callable[[], object]]], started: float
) -> None:
    for at, fault in sorted(schedule, key=lambda item: item[0]):
        await anyio.sleep(max(0.0, started + at - time.monotonic()))
        await anyio.to_thread.run_sync(fault)


async def _start_together(processes: Sequence[ForkedPython], histories: Sequence[Path]) -> float:
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
        processes: list[ForkedPython] = []
        try:
            for index, history in enumerate(histories):
                argv = [
                    "--url", config.url, "--lock", config.lock, "--resource", resource,
                    "--history", str(history), "--ttl", str(config.ttl),
                    "--hold", str(config.hold),
                    "--pause-probability", str(config.pause_probability),
                    "--pause-kind", config.pause_kind, "--pause", str(pause),
                    "--seed", str(config.seed * 1000 + index),
                    "--primitive", config.primitive, "--permits", str(config.permits),
                ]  # fmt: skip
                if config.fencing:
                    argv.append("--fencing")
                if not config.cancel_on_loss:
                    argv.append("--no-cancel")
                with Path(directory, f"worker-{index}.log").open("w") as log:  # noqa: ASYNC230
                    processes.append(ForkedPython(_WORKER, argv, stdout=log, stderr=log))
            started = await _start_together(processes, histories)
            with anyio.fail_after(config.duration + max(30.0, 10 * config.ttl)):
                async with (
                    _log_reader(resource, semaphore) as read_log,
                    anyio.create_task_group() as tg,
                ):
                    takeovers = _Takeovers(config.min_takeovers)
                    tg.start_soon(
                        _resume_stopped, processes, histories, read_log, config, report, takeovers
                    )
                    tg.start_soon(_end_run, histories, config, takeovers.enough)
                    tg.start_soon(_run_nemesis, config.nemesis, started)
                    for process in processes:
                        await process.exited()
                    tg.cancel_scope.cancel()
        finally:
            for process in processes:
                process.close()
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
