from __future__ import annotations

import uuid

import anyio
import asyncpg
import pytest

from asynclock.backends.postgres import lock_key
from asynclock.backends.postgres._kinds import kind_key, permits_class, split
from asynclock.testing import PostgresServer
from tests.contract.harness import BackendUnderTest

#: Advisory locks of the bigint form, by key, as pg_locks shows them.
HOLDERS_OF_KEY = """
SELECT pid FROM pg_locks
WHERE locktype = 'advisory' AND objsubid = 1 AND granted AND classid = $1 AND objid = $2
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
#: Rows of the holders' table (shared holds, permits, leaders) a client of this
#: application_name left.
HOLDER_ROWS = """
SELECT held, pid FROM asynclock_holders WHERE application_name = $1
"""


def key_parts(name: str, schema: str = "public") -> tuple[int, int]:
    """``(classid, objid)`` of the lock ``name`` in ``pg_locks``."""
    key = lock_key(name, schema) & 0xFFFFFFFFFFFFFFFF
    return key >> 32, key & 0xFFFFFFFF


async def terminate_holder(dsn: str, name: str, schema: str = "public") -> list[int]:
    """``pg_terminate_backend`` of every session holding lock ``name`` (or the election or a
    permit of the semaphore ``name``); waits until they end."""
    admin = await asyncpg.connect(dsn)
    try:
        parts = (
            *key_parts(name, schema),
            *split(kind_key(name, "election", schema)),
            permits_class(name, schema),
        )
        pids: list[int] = [row[0] for row in await admin.fetch(HOLDERS_OF_NAME, *parts)]
        for pid in pids:
            await admin.execute("SELECT pg_terminate_backend($1, 5000)", pid)
    finally:
        await admin.close()
    return pids


async def sessions_of(dsn: str, application_name: str) -> list[str]:
    """The server sessions with this application_name and the advisory locks they hold, and
    the holders' rows its clients left."""
    admin = await asyncpg.connect(dsn)
    try:
        if await admin.fetchval("SELECT to_regclass('asynclock_holders')") is not None:
            leaders = await admin.fetch(HOLDER_ROWS, application_name)
        else:
            leaders = []
        rows = await admin.fetch(
            """
            SELECT a.pid, a.state, count(l.pid) AS locks
            FROM pg_stat_activity AS a
            LEFT JOIN pg_locks AS l ON l.pid = a.pid AND l.locktype = 'advisory'
            WHERE a.application_name = $1
            GROUP BY a.pid, a.state
            """,
            application_name,
        )
    finally:
        await admin.close()
    return sorted(
        [f"session {row[0]} ({row[1]}, {row[2]} advisory locks)" for row in rows]
        + [f"the holders' row of key {row[0]} (session {row[1]})" for row in leaders]
    )


@pytest.fixture
def postgres_backend(postgres_server: PostgresServer) -> BackendUnderTest:
    # A name of its own, so that the sessions of this test (and only those) can be counted.
    application_name = f"asynclock-contract-{uuid.uuid4().hex[:8]}"
    dsn = postgres_server.dsn

    async def revoke(name: str) -> None:
        # An operator's action, not the body's work: the loss it causes is pushed to the client
        # within a millisecond and must cancel the body after revoke() returns, not inside it.
        with anyio.CancelScope(shield=True):
            holders = await terminate_holder(dsn, name)
        assert holders, f"nobody holds {name!r} on the server"

    async def leftovers() -> list[str]:
        # A closed connection's session ends a moment after the client let go of it.
        for _ in range(100):
            found = await sessions_of(dsn, application_name)
            if not found:
                break
            await anyio.sleep(0.03)
        return found

    return BackendUnderTest(
        "postgres",
        f"{postgres_server.url}?application_name={application_name}",
        1.0,
        revoke,
        leftovers,
        servers=[postgres_server],
        url_via=lambda addresses: (
            f"postgresql://postgres@{addresses[0]}/postgres?application_name={application_name}"
        ),
        url_for_hosts=lambda hosts: f"postgresql://postgres@{hosts}/postgres",
        many_hosts=True,
    )
