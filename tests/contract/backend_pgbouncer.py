"""PostgreSQL through PgBouncer in session pooling (``?pooler=session``) in the contract suite:
one PgBouncer per test process, in front of its PostgreSQL server (transaction pooling:
``backend_pgbouncer_transaction.py``)."""

from __future__ import annotations

import functools
import uuid
from collections.abc import Iterator

import anyio
import asyncpg
import pytest

from asynclock.testing import PgBouncerServer, PostgresServer
from asynclock.testing._host import log_tail
from tests.contract.harness import BackendUnderTest

#: Advisory locks held or awaited by any server session: each test process has a server of
#: its own and runs one test at a time, so any found after a test is that test's.
ADVISORY = "SELECT pid, granted FROM pg_locks WHERE locktype = 'advisory'"


@pytest.fixture(scope="session")
def pgbouncer_server(postgres_server: PostgresServer) -> Iterator[PgBouncerServer]:
    with PgBouncerServer(postgres_server, pool_mode="session", pool_size=100) as server:
        yield server


@pytest.fixture
def pgbouncer_backend(
    postgres_server: PostgresServer, pgbouncer_server: PgBouncerServer
) -> BackendUnderTest:
    return through_pgbouncer("pgbouncer", "session", postgres_server, pgbouncer_server)


def through_pgbouncer(
    name: str, mode: str, postgres_server: PostgresServer, pgbouncer_server: PgBouncerServer
) -> BackendUnderTest:
    """The contract backend ``name``: PostgreSQL through ``pgbouncer_server`` in pool ``mode``."""
    application_name = f"asynclock-{name}-{uuid.uuid4().hex[:8]}"
    dsn = postgres_server.dsn
    query = f"pooler={mode}&application_name={application_name}"

    # Imported here: backend_postgres is a plugin module loaded after this one (name order), and
    # pytest can only rewrite the asserts of a module it imports itself.
    from tests.contract.backend_postgres import HOLDER_ROWS, revoke

    async def leftovers() -> list[str]:
        if not pgbouncer_server.is_running:
            # The test that ended PgBouncer fails, with its last words (PgBouncer before 1.20
            # exits on a cancel request whose sender hangs up: pgbouncer/pgbouncer#801), not
            # the tests after it with "connection refused".
            log = pgbouncer_server.data_dir / f"{pgbouncer_server.kind}.out"
            pytest.fail(f"PgBouncer is not running any more:\n{log_tail([log])}", pytrace=False)
        admin = await asyncpg.connect(dsn)
        try:
            # A client's server session is reset (DISCARD ALL) a moment after it let go.
            for _ in range(100):
                found = [
                    f"advisory lock of session {pid} ({granted=})"
                    for pid, granted in await admin.fetch(ADVISORY)
                ]
                if await admin.fetchval("SELECT to_regclass('asynclock_holders')") is not None:
                    found += [
                        f"the holders' row of key {held} (session {pid})"
                        for held, pid in await admin.fetch(HOLDER_ROWS, application_name)
                    ]
                if not found:
                    break
                await anyio.sleep(0.03)
        finally:
            await admin.close()
        return found

    return BackendUnderTest(
        name,
        f"{pgbouncer_server.url}?{query}",
        1.0,
        functools.partial(revoke, dsn),
        leftovers,
        servers=[pgbouncer_server],
        url_via=lambda addresses: f"postgresql://postgres@{addresses[0]}/postgres?{query}",
        url_for_hosts=lambda hosts: f"postgresql://postgres@{hosts}/postgres?{query}",
        many_hosts=True,
    )
