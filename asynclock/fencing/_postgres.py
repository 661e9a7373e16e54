"""A fence row per resource in PostgreSQL, checked inside the caller's own transaction."""

from __future__ import annotations

import re
from typing import Any, Protocol

from .._errors import InvalidArgument, StaleToken
from ._token import resolve

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


class _Connection(Protocol):
    """What the guard needs of a connection (asyncpg's ``Connection`` has it)."""

    async def execute(self, query: str, *args: Any) -> str: ...

    async def fetchval(self, query: str, *args: Any) -> Any: ...


class PostgresGuard:
    """Fences writes to PostgreSQL resources with a row per resource holding the highest token.

    Call :meth:`check` first thing in the transaction that does the write::

        async with connection.transaction():
            await guard.check(connection, "orders/42")        # token from the held lock
            await connection.execute("UPDATE orders SET ... WHERE id = 42")

    The upsert locks the fence row until the transaction ends, so a newer holder's check waits
    for this transaction and then re-evaluates against the committed token: check and write are
    one atomic step. A stale token raises :class:`asynclock.StaleToken` before anything is written
    (and inside ``transaction()`` anything written earlier is rolled back).

    When the resource is one row, the fence can also live in the row itself, with no guard:
    ``UPDATE orders SET ..., fence = $1 WHERE id = 42 AND fence <= $1`` and check the row count.
    """

    def __init__(
        self, *, table: str = "asynclock_fences", schema: str = "public", strict: bool = False
    ) -> None:
        for what, identifier in (("table", table), ("schema", schema)):
            if not _IDENTIFIER.match(identifier):
                raise InvalidArgument(
                    f"{what} {identifier!r} is not a plain SQL identifier (letters, digits, _)"
                )
        self.strict = strict
        self._table = f'"{schema}"."{table}"'
        op = "<" if strict else "<="
        self._upsert = (
            f"INSERT INTO {self._table} (resource, token) VALUES ($1, $2) "
            f"ON CONFLICT (resource) DO UPDATE SET token = EXCLUDED.token "
            f"WHERE {self._table}.token {op} EXCLUDED.token RETURNING token"
        )
        self._highest = f"SELECT token FROM {self._table} WHERE resource = $1"

    async def create_table(self, connection: _Connection) -> None:
        """Create the fence table if it does not exist (idempotent)."""
        await connection.execute(
            f"CREATE TABLE IF NOT EXISTS {self._table} "
            "(resource text PRIMARY KEY, token bigint NOT NULL)"
        )

    async def check(
        self,
        connection: _Connection,
        resource: str,
        token: int | None = None,
        *,
        lock: str | None = None,
    ) -> int:
        token = resolve(token, lock)
        accepted = await connection.fetchval(self._upsert, resource, token)
        if accepted is None:
            highest = await connection.fetchval(self._highest, resource)
            raise StaleToken(resource, token, int(highest))
        return token

    async def highest(self, connection: _Connection, resource: str) -> int | None:
        value = await connection.fetchval(self._highest, resource)
        return None if value is None else int(value)
