"""The resource of a semaphore's safety run: a PostgreSQL log of accesses, behind a permit guard.

Each hold of a permit *enters* the resource, waits, and *exits* it: two accesses, each fenced by
:class:`asynclock.fencing.PostgresGuard` of ``permits=N`` (when fencing is on) and logged with the
holder's token in commit order. A worker paused past its ttl between the two is the fault: its
permit goes to another worker, and its exit arrives afterwards. Fenced, the guard refuses it;
unfenced, the log shows one permit more in use than the semaphore has.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

from ..fencing import PostgresGuard

_TABLES = """
CREATE TABLE IF NOT EXISTS asynclock_safety_permit_writes (
    seq bigserial PRIMARY KEY, run text NOT NULL, token bigint, op text NOT NULL
);
"""


def _fences(permits: int) -> str:
    """The guard's table: a guard of one permit keeps the lock rule's columns, so a table of its
    own (a run of 1 and a run of N on one server must not meet in one table)."""
    return "asynclock_safety_permit_fences" + ("" if permits > 1 else "_of_one")


def _split(spec: str) -> tuple[str, str]:
    url, _, run = spec.partition("#")
    if not run or not urlsplit(url).scheme.startswith("postgres"):
        raise ValueError(
            f"a semaphore's safety run needs a postgresql://...#run resource, not {spec!r}"
        )
    return url, run


@contextlib.asynccontextmanager
async def pg_connection(url: str) -> AsyncIterator[Any]:
    """One asyncpg connection to ``url``, closed on exit."""
    import asyncpg

    connection = await asyncpg.connect(url)
    try:
        yield connection
    finally:
        await connection.close()


class OneConnection:
    """A worker's one connection to a PostgreSQL resource, opened on first use."""

    def __init__(self, url: str, run: str) -> None:
        self._url = url
        self._run = run
        self._db: Any = None

    @contextlib.asynccontextmanager
    async def _connection(self) -> AsyncIterator[Any]:
        import asyncpg

        if self._db is None:
            self._db = await asyncpg.connect(self._url)
        try:
            yield self._db
        except BaseException:
            # A statement cancelled half-way leaves the connection in an unknown state (an open
            # transaction, a cancel request still in flight): never reuse it.
            self._db.terminate()
            self._db = None
            raise

    async def aclose(self) -> None:
        if self._db is not None:
            await self._db.close()


class PermitResource(OneConnection):
    """What a worker of a semaphore's run uses: fenced, logged accesses."""

    def __init__(self, url: str, run: str, permits: int) -> None:
        super().__init__(url, run)
        self._guard = PostgresGuard(permits=permits, table=_fences(permits))

    async def access(self, op: str, token: int | None, logged_token: int | None) -> None:
        """Log ``op`` with ``logged_token``; fenced by ``token`` (StaleToken if refused)."""
        insert = "INSERT INTO asynclock_safety_permit_writes (run, token, op) VALUES ($1, $2, $3)"
        async with self._connection() as db:
            if token is None:
                await db.execute(insert, self._run, logged_token, op)
                return
            async with db.transaction():
                await self._guard.check(db, self._run, token)
                await db.execute(insert, self._run, logged_token, op)

    async def leave(self, token: int) -> None:
        async with self._connection() as db:
            await self._guard.leave(db, self._run, token)


@contextlib.asynccontextmanager
async def open_permits(spec: str, permits: int) -> AsyncIterator[PermitResource]:
    url, run = _split(spec)
    async with contextlib.aclosing(PermitResource(url, run, permits)) as resource:
        yield resource


async def prepare_permits(spec: str, permits: int) -> None:
    url, _ = _split(spec)
    async with pg_connection(url) as connection:
        await connection.execute(_TABLES)
        await PostgresGuard(permits=permits, table=_fences(permits)).create_table(connection)


#: The accepted accesses of a run in commit order, (token, op).
PERMIT_LOG = "SELECT token, op FROM asynclock_safety_permit_writes WHERE run = $1 ORDER BY seq"


async def permit_log(spec: str, permits: int) -> list[tuple[int | None, str]]:
    """Accepted accesses in commit order, (token, op); the run's rows are deleted."""
    url, run = _split(spec)
    async with pg_connection(url) as connection:
        rows = await connection.fetch(PERMIT_LOG, run)
        await connection.execute("DELETE FROM asynclock_safety_permit_writes WHERE run = $1", run)
        await connection.execute(f"DELETE FROM {_fences(permits)} WHERE resource = $1", run)
    return [(row["token"], str(row["op"])) for row in rows]
