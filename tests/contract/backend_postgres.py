"""PostgreSQL in the contract suite (``postgres_backend``), and the one fixtures module of the
PostgreSQL tests: the ``pg`` fixture (a test's own application_name, lock name and admin
connection, with what the server shows of them) and holders in processes of their own."""

from __future__ import annotations

import functools
import inspect
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import pytest
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream

import asynclock
from asynclock.backends.postgres import PostgresBackend, lock_key
from asynclock.backends.postgres._kinds import kind_key, permits_class, split
from asynclock.testing import PostgresServer
from tests.contract.harness import BackendUnderTest

#: Advisory locks of the bigint form, by key, as pg_locks shows them ($3: granted or waiting).
LOCKERS_OF_KEY = """
SELECT pid FROM pg_locks
WHERE locktype = 'advisory' AND objsubid = 1 AND granted = $3 AND classid = $1 AND objid = $2
"""
#: Every holder of the lock, the election and the semaphore (its permits lock) of a name.
HOLDERS_OF_NAME = """
SELECT DISTINCT pid FROM pg_locks
WHERE locktype = 'advisory' AND granted AND (
    (objsubid = 1 AND classid = $1 AND objid = $2)
    OR (objsubid = 1 AND classid = $3 AND objid = $4)
    OR (objsubid = 2 AND classid = $5::int::oid)
)
"""
#: The sessions of an application_name with their advisory locks.
SESSIONS = """
SELECT a.pid, a.state, count(l.pid) FROM pg_stat_activity AS a
LEFT JOIN pg_locks AS l ON l.pid = a.pid AND l.locktype = 'advisory'
WHERE a.application_name = $1 GROUP BY a.pid, a.state
"""
#: Rows of the holders' table (shared holds, permits, leaders) of an application_name.
HOLDER_ROWS = "SELECT held, pid FROM asynclock_holders WHERE application_name = $1"

ROOT = Path(__file__).resolve().parents[2]

#: A lock in a process of its own (sys.argv: url, name, ttl, seconds to hold, "shared" or not):
#: prints "held" once it holds.
HOLDER = """
import sys, anyio, asynclock

async def main(url, name, ttl, hold, shared):
    async with asynclock.connect(url) as locks:
        async with locks.lock(name, ttl=float(ttl), shared=shared == "shared", timeout=30):
            print("held", flush=True)
            await anyio.sleep(float(hold))

anyio.run(main, *sys.argv[1:])
"""


def key_parts(name: str, schema: str = "public") -> tuple[int, int]:
    """``(classid, objid)`` of the lock ``name`` in ``pg_locks``."""
    return split(lock_key(name, schema))


async def terminate_holder(dsn: str, name: str, schema: str = "public") -> list[int]:
    """``pg_terminate_backend`` of every session holding lock ``name`` (or the election or a
    permit of the semaphore ``name``); waits until they end."""
    parts = (
        *key_parts(name, schema),
        *split(kind_key(name, "election", schema)),
        permits_class(name, schema),
    )
    admin = await asyncpg.connect(dsn)
    try:
        pids: list[int] = [row[0] for row in await admin.fetch(HOLDERS_OF_NAME, *parts)]
        for pid in pids:
            await admin.execute("SELECT pg_terminate_backend($1, 5000)", pid)
    finally:
        await admin.close()
    return pids


async def revoke(dsn: str, name: str) -> None:
    """The contract's ``revoke``: an operator ends the holder's session. The loss it causes is
    pushed to the client within a millisecond and must cancel the body after this returns, not
    inside it."""
    with anyio.CancelScope(shield=True):
        holders = await terminate_holder(dsn, name)
    assert holders, f"nobody holds {name!r} on the server"


async def sessions_of(admin: asyncpg.Connection, application_name: str) -> list[str]:
    """The server sessions with this application_name and the advisory locks they hold, and
    the holders' rows its clients left."""
    rows = []
    if await admin.fetchval("SELECT to_regclass('asynclock_holders')") is not None:
        rows = await admin.fetch(HOLDER_ROWS, application_name)
    sessions = await admin.fetch(SESSIONS, application_name)
    return sorted(
        [f"session {pid} ({state}, {locks} advisory locks)" for pid, state, locks in sessions]
        + [f"the holders' row of key {held} (session {pid})" for held, pid in rows]
    )


async def until(check: Callable[[], object], within: float, step: float = 0.01) -> None:
    """Poll ``check`` (sync or async) until it is true; fail after ``within`` seconds."""
    with anyio.fail_after(within):
        while not (await result if inspect.isawaitable(result := check()) else result):  # noqa: ASYNC110
            await anyio.sleep(step)


def backend_of(locks: asynclock.LockClient) -> PostgresBackend:
    backend = locks._backend
    assert isinstance(backend, PostgresBackend)
    return backend


async def start_holder(
    url: str,
    name: str,
    *,
    ttl: float = 30,
    hold: float = 60,
    shared: bool = False,
    held: bool = True,
) -> tuple[Process, BufferedByteReceiveStream]:
    """A :data:`HOLDER` process and its output (once it holds, if ``held``)."""
    args = [url, name, str(ttl), str(hold), "shared" if shared else "exclusive"]
    process = await anyio.open_process([sys.executable, "-c", HOLDER, *args], cwd=ROOT, stderr=None)
    assert process.stdout is not None
    output = BufferedByteReceiveStream(process.stdout)
    if held:
        with anyio.fail_after(20):
            assert await output.receive_until(b"\n", 100) == b"held"
    return process, output


@dataclass
class Pg:
    """A PostgreSQL test's own lock name and application_name on the shared server, and an
    admin connection to look at what the server holds for them."""

    server: PostgresServer
    admin: asyncpg.Connection
    name: str = field(default_factory=lambda: f"pg/{uuid.uuid4().hex[:12]}")
    app: str = field(default_factory=lambda: f"pg-{uuid.uuid4().hex[:8]}")

    @property
    def url(self) -> str:
        return f"{self.server.url}?application_name={self.app}"

    def connect(self, **options: Any) -> asynclock.LockClient:
        return asynclock.connect(self.url, **options)

    def backend(self, **options: Any) -> PostgresBackend:
        return PostgresBackend.from_url(self.url, options)

    async def holders(self, name: str | None = None, schema: str = "public") -> list[int]:
        """The sessions that hold the lock ``name`` (the test's name by default)."""
        parts = key_parts(name or self.name, schema)
        return [row[0] for row in await self.admin.fetch(LOCKERS_OF_KEY, *parts, True)]

    async def waiters(self) -> list[int]:
        parts = key_parts(self.name)
        return [row[0] for row in await self.admin.fetch(LOCKERS_OF_KEY, *parts, False)]

    async def wait_for_waiters(self, count: int, within: float = 10) -> None:
        with anyio.fail_after(within):
            while len(await self.waiters()) != count:  # noqa: ASYNC110 (polling the server)
                await anyio.sleep(0.002)

    async def until_free(self, within: float, step: float = 0.01) -> None:
        """Until nobody holds the test's lock; fail after ``within`` seconds."""
        with anyio.fail_after(within):
            while await self.holders():  # noqa: ASYNC110 (polling the server)
                await anyio.sleep(step)

    async def until_queued(self, count: int, within: float) -> None:
        """Until the lock has ``count`` places in the queue table at least."""
        with anyio.fail_after(within):
            while await self.queue_rows() < count:  # noqa: ASYNC110 (polling the server)
                await anyio.sleep(0.005)

    async def queue_rows(self) -> int:
        query = "SELECT count(*) FROM asynclock_waiters WHERE key = $1"
        count: int = await self.admin.fetchval(query, lock_key(self.name))
        return count

    async def sessions(self) -> list[tuple[int, int]]:
        """(pid, advisory locks held) of every session of the test's application_name."""
        return sorted((pid, locks) for pid, _, locks in await self.admin.fetch(SESSIONS, self.app))

    async def settle_sessions(self, expected: int) -> int:
        """Sessions once closed ones have ended (a session ends just after its socket)."""
        for _ in range(100):
            count = len(await self.sessions())
            if count <= expected:
                break
            await anyio.sleep(0.03)
        return count

    async def nothing_left(self) -> None:
        """No session, advisory lock or holders' row of the test's clients, and no place in
        the queue table of its semaphore or election, within 5 s."""
        keys = [kind_key(self.name, kind) for kind in ("lock", "semaphore", "election")]
        places = "SELECT count(*) FROM asynclock_waiters WHERE key = ANY($1::bigint[])"
        left: list[str] = []
        with anyio.move_on_after(5):
            while True:
                left = await sessions_of(self.admin, self.app)
                if count := await self.admin.fetchval(places, keys):
                    left.append(f"{count} places in the queue table")
                if not left:
                    break
                await anyio.sleep(0.02)
        assert left == [], "left on the server"


@pytest.fixture
async def pg(postgres_server: PostgresServer) -> AsyncIterator[Pg]:
    admin = await asyncpg.connect(postgres_server.dsn)
    try:
        yield Pg(postgres_server, admin)
    finally:
        await admin.close()


@pytest.fixture
def postgres_backend(postgres_server: PostgresServer) -> BackendUnderTest:
    # A name of its own, so that the sessions of this test (and only those) can be counted.
    application_name = f"asynclock-contract-{uuid.uuid4().hex[:8]}"
    dsn = postgres_server.dsn

    async def leftovers() -> list[str]:
        admin = await asyncpg.connect(dsn)
        try:
            # A closed connection's session ends a moment after the client let go of it.
            for _ in range(100):
                if not (found := await sessions_of(admin, application_name)):
                    break
                await anyio.sleep(0.03)
        finally:
            await admin.close()
        return found

    return BackendUnderTest(
        "postgres",
        f"{postgres_server.url}?application_name={application_name}",
        1.0,
        functools.partial(revoke, dsn),
        leftovers,
        servers=[postgres_server],
        url_via=lambda addresses: (
            f"postgresql://postgres@{addresses[0]}/postgres?application_name={application_name}"
        ),
        url_for_hosts=lambda hosts: f"postgresql://postgres@{hosts}/postgres",
        many_hosts=True,
    )
