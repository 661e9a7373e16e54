"""The semaphore guard in PostgreSQL: one row of admitted tokens per resource, row-locked."""

from __future__ import annotations

from typing import Any, Protocol

from .._errors import InvalidArgument, StaleToken
from ._permits import PermitSlots
from ._postgres import _IDENTIFIER
from ._token import resolve


class _Connection(Protocol):
    """What the guard needs of a connection (asyncpg's ``Connection`` has it)."""

    async def execute(self, query: str, *args: Any) -> str: ...

    async def fetchrow(self, query: str, *args: Any) -> Any: ...

    def transaction(self) -> Any: ...


class PostgresSemaphoreGuard:
    """Fences a PostgreSQL resource that a semaphore of ``permits`` protects.

    The rule is :class:`MemorySemaphoreGuard`'s (at most ``permits`` tokens admitted; the oldest
    evicted for a newer one; a token that left never comes back). Call :meth:`check` first
    thing in the transaction that does the access::

        async with connection.transaction():
            await guard.check(connection, "exports")      # token from the held permit
            await connection.execute("INSERT INTO exports ...")

    It locks the resource's fence row until that transaction ends, so the check and the access
    are one step for every other holder. :meth:`leave` (in its own transaction, or the last
    one of the hold) frees the holder's slot.
    """

    def __init__(
        self, permits: int, *, table: str = "asynclock_permit_fences", schema: str = "public"
    ) -> None:
        if isinstance(permits, bool) or not isinstance(permits, int) or permits < 1:
            raise InvalidArgument(f"permits must be a positive int, got {permits!r}")
        for what, identifier in (("table", table), ("schema", schema)):
            if not _IDENTIFIER.match(identifier):
                raise InvalidArgument(
                    f"{what} {identifier!r} is not a plain SQL identifier (letters, digits, _)"
                )
        self.permits = permits
        self._table = f'"{schema}"."{table}"'

    async def create_table(self, connection: _Connection) -> None:
        """Create the fence table if it does not exist (idempotent)."""
        await connection.execute(
            f"CREATE TABLE IF NOT EXISTS {self._table} (resource text PRIMARY KEY, "
            "admitted bigint[] NOT NULL, floor bigint, departed bigint[] NOT NULL, "
            "highest bigint)"
        )

    async def _locked(self, connection: _Connection, resource: str) -> PermitSlots:
        await connection.execute(
            f"INSERT INTO {self._table} (resource, admitted, departed) "
            "VALUES ($1, '{}', '{}') ON CONFLICT (resource) DO NOTHING",
            resource,
        )
        row = await connection.fetchrow(
            f"SELECT admitted, floor, departed, highest FROM {self._table} "
            "WHERE resource = $1 FOR UPDATE",
            resource,
        )
        return PermitSlots(
            self.permits,
            admitted=sorted(row["admitted"]),
            floor=row["floor"],
            departed=set(row["departed"]),
            highest=row["highest"],
        )

    async def _store(self, connection: _Connection, resource: str, slots: PermitSlots) -> None:
        await connection.execute(
            f"UPDATE {self._table} SET admitted = $2, floor = $3, departed = $4, highest = $5 "
            "WHERE resource = $1",
            resource,
            slots.admitted,
            slots.floor,
            sorted(slots.departed),
            slots.highest,
        )

    async def check(
        self,
        connection: _Connection,
        resource: str,
        token: int | None = None,
        *,
        lock: str | None = None,
    ) -> int:
        """Admit ``token`` (default: the current lease's) or raise StaleToken; the fence row
        stays locked until the caller's transaction ends."""
        token = resolve(token, lock)
        # A savepoint inside the caller's transaction (or a transaction of its own): the row
        # lock lasts as long as the outermost one.
        async with connection.transaction():
            slots = await self._locked(connection, resource)
            newer = slots.admit(token)
            if newer is None:
                await self._store(connection, resource, slots)
        if newer is not None:
            raise StaleToken(resource, token, newer)
        return token

    async def leave(
        self,
        connection: _Connection,
        resource: str,
        token: int | None = None,
        *,
        lock: str | None = None,
    ) -> None:
        """The holder of ``token`` is done with ``resource``: free its slot (idempotent)."""
        token = resolve(token, lock)
        async with connection.transaction():
            slots = await self._locked(connection, resource)
            slots.leave(token)
            await self._store(connection, resource, slots)

    async def admitted(self, connection: _Connection, resource: str) -> tuple[int, ...]:
        """The tokens whose accesses ``resource`` accepts now, oldest first."""
        row = await connection.fetchrow(
            f"SELECT admitted FROM {self._table} WHERE resource = $1", resource
        )
        return () if row is None else tuple(sorted(row["admitted"]))
