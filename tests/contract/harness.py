"""What the contract suite needs to know about a backend, beyond its URL."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import signal
import sqlite3
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import (
    AbstractAsyncContextManager,
    AbstractContextManager,
    contextmanager,
    nullcontext,
)
from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest

import asynclock
from asynclock.abc import Kind
from asynclock.testing import Server
from tests.contract.kinds import holds

#: How many wait for a lock name now, as the server says.
WaiterCount = Callable[[str], Awaitable[int]]


@dataclass
class BackendUnderTest:
    name: str
    url: str
    #: A short ttl the backend honours (etcd grants at least 2 s, ZooKeeper negotiates).
    ttl: float
    #: Remove the lock ``name`` on the server behind the holder's back (an operator's delete,
    #: a revoked lease, an expired session): the server-side proof of loss.
    revoke: Callable[[str], Awaitable[None]]
    #: What the backend left on the server (keys, rows, znodes, leases); empty when clean.
    leftovers: Callable[[], Awaitable[list[str]]]
    options: dict[str, Any] = field(default_factory=dict)
    #: The real server processes behind the URL, for the fault contract (none: in-process).
    servers: list[Server] = field(default_factory=list)
    #: The URL of the same store reached through other ``host:port`` addresses, one per server
    #: in ``servers`` order (a fault proxy in front of each).
    url_via: Callable[[list[str]], str] | None = None
    #: Make the store stop answering this client (a server SIGSTOPped, or what stands for it
    #: on an in-process store) for the duration of the ``with`` block.
    hang: Callable[[asynclock.LockClient], AbstractContextManager[None]] | None = None
    #: The URL for servers at ``hosts`` (a ``host:port`` list as the URL writes it), for the
    #: checks of malformed URLs and unreachable servers; None for in-process stores.
    url_for_hosts: Callable[[str], str] | None = None
    #: The URL takes a list of servers (``a:1,b:2``).
    many_hosts: bool = False
    #: The server forgets nothing it promised to keep when it restarts (Redis without
    #: persistence does forget its keys: the fault contract then checks tokens still rise).
    persistent: bool = True
    #: Options for a client whose waiters wait long, a thousand in line (test_scale): a store
    #: that keeps each waiter's place alive refreshes it less often, so that what is measured
    #: is the hand-overs, not refreshes that grow with how long the line takes to pass.
    long_waits: dict[str, Any] = field(default_factory=dict)
    #: A counter of the waiters of a lock name that asks the server without listing the queue
    #: (ZooKeeper's child count, etcd's count-only range), for test_scale, which asks after
    #: each of 1,000 waiters: through inspect(), which lists the queue, that was quadratic and
    #: most of the test's time (ZooKeeper: 8-16 s of each 1,000 queued, 1.5-4.5 s to pass them).
    #: None: inspect().waiters.
    counter: Callable[[], AbstractAsyncContextManager[WaiterCount]] | None = None
    #: Hold back every client process from writing to the store for the ``with`` block, so
    #: that a process stopped inside it holds nothing that stops the others. A process stopped
    #: inside one of SQLite's write transactions (a millisecond, more while the disk syncs)
    #: keeps the file write-locked: every client of the file then waits for it, up to its
    #: busy_timeout, as all clients of a stopped server would (that is ``hang``'s case, not a
    #: stopped holder's). None: a server finishes what a stopped client sent.
    between_writes: Callable[[], AbstractContextManager[None]] | None = None

    def connect(self, **options: Any) -> asynclock.LockClient:
        return asynclock.connect(self.url, **{**self.options, **options})

    def connect_via(self, addresses: list[str], **options: Any) -> asynclock.LockClient:
        assert self.url_via is not None
        return asynclock.connect(self.url_via(addresses), **{**self.options, **options})

    def hung(self, client: asynclock.LockClient) -> AbstractContextManager[None]:
        if self.hang is not None:
            return self.hang(client)
        return paused(self.servers)

    async def stop_client(self, pid: int) -> None:
        """SIGSTOP the client process ``pid`` between two of its writes to the store, and
        return once every thread of it has stopped."""
        between = self.between_writes() if self.between_writes is not None else nullcontext()
        await stop_process(pid, between=between)


async def stop_process(pid: int, *, between: AbstractContextManager[None]) -> None:
    """SIGSTOP ``pid`` inside ``between``; return once every thread of it has stopped (one
    still running could write as ``between`` ends)."""
    with between:
        os.kill(pid, signal.SIGSTOP)
        with anyio.fail_after(5):
            while not stopped(pid):  # noqa: ASYNC110 - another process's state
                await anyio.sleep(0.002)


def stopped(pid: int) -> bool:
    """Every thread of process ``pid`` is stopped (SIGSTOP), as /proc says."""
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/stat", encoding="ascii") as stat:
            # "pid (comm) S ...": the state follows the command's closing parenthesis.
            if stat.read().rpartition(") ")[2][:1] != "T":
                return False
    return True


def report(
    test: str, backend: BackendUnderTest, variable: str = "ASYNCLOCK_FAULT_REPORT", **values: Any
) -> None:
    """Measurements, to the file named by the environment ``variable`` (JSON lines), when set."""
    path = os.environ.get(variable)
    if path:
        with open(path, "a", encoding="utf-8") as file:
            file.write(json.dumps({"test": test, "backend": backend.name, **values}) + "\n")


@contextmanager
def paused(servers: list[Server]) -> Iterator[None]:
    """Every server SIGSTOPped inside the block (SIGCONT on the way out, whatever happens)."""
    try:
        for server in servers:
            server.pause()
        yield
    finally:
        for server in servers:
            server.resume()


@contextmanager
def sqlite_write_locked(path: str) -> Iterator[None]:
    """The database file write-locked by another connection: every statement of the backend
    waits (up to its busy_timeout), as on a server that stopped answering."""
    started = threading.Event()
    stop = threading.Event()

    def hold() -> None:
        db = sqlite3.connect(path, isolation_level=None)
        try:
            db.execute("BEGIN EXCLUSIVE")
            started.set()
            stop.wait(60)
            db.execute("ROLLBACK")
        finally:
            db.close()

    thread = threading.Thread(target=hold, name="sqlite write lock", daemon=True)
    thread.start()
    assert started.wait(5), "could not write-lock the database"
    try:
        yield
    finally:
        stop.set()
        thread.join(10)


async def until(
    check: Callable[[], bool] | Callable[[], Awaitable[bool]], timeout: float = 5.0
) -> None:
    """Poll ``check`` until it is true; fail after ``timeout`` seconds."""
    with anyio.fail_after(timeout):
        while True:
            result = check()
            if await result if inspect.isawaitable(result) else result:
                return
            await anyio.sleep(0.005)


async def warm_up_for_wait_until_free(
    backend: BackendUnderTest, client: asynclock.LockClient, kind: Kind = "lock"
) -> None:
    """Take and release a scratch name at the ttl ``wait_until_free`` uses, so that a tight
    ``within`` measures the lock being freed, not ``client`` opening its first connection for
    that ttl (PostgreSQL opens a session per ttl: over 100 ms beside the other CI workers)."""
    lease = await holds(client, kind).acquire(f"warm-up/{id(client)}", ttl=backend.ttl * 5)
    await lease.release()


async def wait_until_free(
    backend: BackendUnderTest,
    client: asynclock.LockClient,
    name: str,
    within: float,
    kind: Kind = "lock",
) -> float:
    """Take and release ``name`` with ``client`` as soon as it is free; the seconds it took.

    Fails when a try that started ``within`` seconds or more after the call finds the lock
    busy, saying how long each try took. The probe's own round trips do not count against
    ``within``: a try started in time may come back later on a loaded machine (8 test
    processes on 2 cores delayed a ZooKeeper create's reply by 180 ms) and still prove the
    lock free. A try that hangs fails after ``within`` + 10 s."""
    started = anyio.current_time()
    tries: list[str] = []

    def failure(what: str) -> AssertionError:
        return AssertionError(f"{name!r} {what}; tries: {', '.join(tries)}")

    try:
        with anyio.fail_after(within + 10):
            while True:
                tried = anyio.current_time()
                try:
                    lease = await holds(client, kind).try_acquire(name, ttl=backend.ttl * 5)
                except asynclock.BackendUnavailable:
                    lease = None  # the server is still coming back
                finally:
                    tries.append(f"{(anyio.current_time() - tried) * 1000:.1f} ms")
                if lease is not None:
                    await lease.release()
                    return anyio.current_time() - started
                tries[-1] += " (busy)"
                if tried - started >= within:
                    raise failure(
                        f"busy at a try started {tried - started:.3f} s in (within {within:g} s)"
                    )
                await anyio.sleep(0.01)
    except TimeoutError:
        raise failure(f"not known free: the last try hung past {within + 10:g} s") from None


async def hold_until_cancelled(context: asynclock.LockContext) -> None:
    """Take the hold and keep it until cancelled (a body that never ends by itself)."""
    async with context:
        await anyio.sleep(30)


async def cancel_while_waiting(context: asynclock.LockContext, cancels: int) -> None:
    """Wait for the hold in a task of its own, then cancel that task natively ``cancels``
    times in a row (as a disconnect and a timeout may both do); it ends cancelled."""
    task = asyncio.create_task(hold_until_cancelled(context))
    await anyio.sleep(0.1)
    for _ in range(cancels):
        task.cancel()
        await asyncio.sleep(0)
    with pytest.raises(asyncio.CancelledError):
        await task
