"""A fence row per resource in PostgreSQL, checked inside the caller's own transaction."""

from __future__ import annotations

import re
from typing import Any, Protocol

from .._errors import InvalidArgument, StaleToken
from ._permits import PermitSlots, checked_permits
from ._token import resolve

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


class _Connection(Protocol):
    """What the guard needs of a connection (asyncpg's ``Connection`` has it)."""

    async def execute(self, query: str, *args: Any) -> str: ...

    async def fetchval(self, query: str, *args: Any) -> Any: ...

    async def fetchrow(self, query: str, *args: Any) -> Any: ...

    def transaction(self) -> Any: ...


class PostgresGuard:
    """Fences accesses to PostgreSQL resources with a row per resource of accepted tokens.

    Call :meth:`check` first thing in the transaction that does the access::

        async with connection.transaction():
            await guard.check(connection, "orders/42")        # token from the held lock
            await connection.execute("UPDATE orders SET ... WHERE id = 42")

    The check locks the fence row until the transaction ends, so a newer holder's check waits
    for this transaction and then re-evaluates against the committed tokens: check and access are
    one atomic step. A stale token raises :class:`asynclock.StaleToken` before anything is written
    (and inside ``transaction()`` anything written earlier is rolled back).

    ``permits=1``: one upsert of the highest token (``strict=True``: each token for one access
    only). ``permits=N`` (the semaphore's N) keeps :class:`PermitSlots`' rule in the row (at most
    N tokens admitted; the oldest evicted for a newer one); :meth:`leave`, in its own transaction
    or the last one of the hold, frees a holder's slot. There is no ``entered``: its check belongs
    inside the transaction of the access and its leave in a later one, which one context manager
    around both cannot give. The two rules keep different columns, so the default ``table``
    follows ``permits`` (``asynclock_fences`` for 1, ``asynclock_permit_fences`` for more); a
    ``table`` given explicitly must not be shared by guards of 1 and of more permits.

    When the resource is one row, the fence can also live in the row itself, with no guard:
    ``UPDATE orders SET ..., fence = $1 WHERE id = 42 AND fence <= $1`` and check the row count.
    """

    def __init__(
        self,
        *,
        permits: int = 1,
        strict: bool = False,
        table: str | None = None,
        schema: str = "public",
    ) -> None:
        self.permits = checked_permits(permits, strict=strict)
        self.strict = strict
        if table is None:
            table = "asynclock_fences" if permits == 1 else "asynclock_permit_fences"
        for what, identifier in (("table", table), ("schema", schema)):
            if not _IDENTIFIER.match(identifier):
                raise InvalidArgument(
                    f"{what} {identifier!r} is not a plain SQL identifier (letters, digits, _)"
                )
        self._table = f'"{schema}"."{table}"'
        op = "<" if strict else "<="
        self._upsert = (
            f"INSERT INTO {self._table} (resource, token) VALUES ($1, $2) "
            f"ON CONFLICT (resource) DO UPDATE SET token = EXCLUDED.token "
            f"WHERE {self._table}.token {op} EXCLUDED.token RETURNING token"
        )
        column = "token" if permits == 1 else "highest"
        self._highest = f"SELECT {column} FROM {self._table} WHERE resource = $1"

    async def create_table(self, connection: _Connection) -> None:
        """Create the fence table if it does not exist (idempotent)."""
        columns = (
            "token bigint NOT NULL"
            if self.permits == 1
            else "admitted bigint[] NOT NULL, floor bigint, departed bigint[] NOT NULL, "
            "highest bigint"
        )
        await connection.execute(
            f"CREATE TABLE IF NOT EXISTS {self._table} (resource text PRIMARY KEY, {columns})"
        )

    async def check(
        self,
        connection: _Connection,
        resource: str,
        token: int | None = None,
        *,
        lock: str | None = None,
    ) -> int:
        """Accept ``token`` (default: the current lock's) or raise StaleToken; the fence row
        stays locked until the caller's transaction ends."""
        token = resolve(token, lock)
        if self.permits == 1:
            if await connection.fetchval(self._upsert, resource, token) is None:
                highest = await connection.fetchval(self._highest, resource)
                raise StaleToken(resource, token, int(highest))
            return token
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
        """The holder of ``token`` is done with ``resource``: free its slot (idempotent).

        Nothing to do with one permit (see ``_token.HighestToken.leave``): no statement."""
        token = resolve(token, lock)
        if self.permits == 1:
            return
        async with connection.transaction():
            slots = await self._locked(connection, resource)
            slots.leave(token)
            await self._store(connection, resource, slots)

    async def admitted(self, connection: _Connection, resource: str) -> tuple[int, ...]:
        """The tokens whose accesses ``resource`` accepts now, oldest first."""
        if self.permits == 1:
            highest = await self.highest(connection, resource)
            return () if highest is None else (highest,)
        row = await connection.fetchrow(
            f"SELECT admitted FROM {self._table} WHERE resource = $1", resource
        )
        return () if row is None else tuple(sorted(row["admitted"]))

    async def highest(self, connection: _Connection, resource: str) -> int | None:
        """The highest token this guard has accepted for ``resource``."""
        value = await connection.fetchval(self._highest, resource)
        return None if value is None else int(value)

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
