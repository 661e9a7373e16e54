"""Locks for one transaction (``pg_advisory_xact_lock``): the driver's half of
:func:`asynclock.extras.postgres.transaction_lock`, on a connection borrowed from a backend or on
one of the caller's.

The lock and the body's writes commit or roll back together; the token comes from the same
sequence as the session locks' tokens.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import asyncpg

from .._kit import AcquireTimeout, InvalidArgument, translate
from ._errors import Errors
from ._sql import MAX_TIMEOUT_MS, RESET, XACT_TRY, XACT_WAIT, lock_key, sequence_name, timeout_ms
from ._wire import Replacements
from .backend import PostgresBackend

logger = logging.getLogger("asynclock")

#: The translator for a connection of the caller's (the backend's names its server).
_YOUR_CONNECTION = Errors("your asyncpg connection", 0.0, "", "", "")


def xact_lock(
    target: PostgresBackend | Any,
    name: str,
    *,
    timeout: float | None,
    idle_timeout: float | None,
    isolation: str | None,
    schema: str,
) -> AbstractAsyncContextManager[tuple[Any, int]]:
    """Hold ``name`` for one transaction on ``target`` (a backend, whose connection is borrowed,
    or an asyncpg connection, used as it is); yields the connection and the token. The arguments
    are checked at the call, before anything connects (``name`` and ``timeout`` by the caller);
    ``schema`` applies to a connection only."""
    if idle_timeout is not None and (
        isinstance(idle_timeout, bool)
        or not isinstance(idle_timeout, int | float)
        or not 0 < idle_timeout * 1000 <= MAX_TIMEOUT_MS
    ):
        raise InvalidArgument(
            f"idle_timeout must be a number of seconds > 0 (at most {MAX_TIMEOUT_MS // 1000}) "
            f"or None, got {idle_timeout!r}"
        )
    if isinstance(target, PostgresBackend):
        return _on_backend(target, name, timeout, idle_timeout, isolation)
    if not isinstance(target, asyncpg.Connection | asyncpg.pool.PoolConnectionProxy):
        raise InvalidArgument(
            "transaction_lock needs a LockClient or PostgresBackend on postgresql://, a "
            f"postgresql:// URL or an asyncpg connection, not {type(target).__name__}"
        )
    take = _Take(name, lock_key(name, schema), sequence_name(schema), timeout, idle_timeout, 5.0)
    return _transaction(target, take, isolation, _YOUR_CONNECTION)


@asynccontextmanager
async def _on_backend(
    backend: PostgresBackend,
    name: str,
    timeout: float | None,
    idle_timeout: float | None,
    isolation: str | None,
) -> AsyncIterator[tuple[Any, int]]:
    sessions = backend._sessions
    replacements = Replacements()
    key = lock_key(name, backend.schema)
    take = _Take(name, key, backend.sequence, timeout, idle_timeout, backend.op_timeout)
    while True:
        connection, reused = await sessions.take()
        body_ran = False
        try:
            async with _transaction(connection, take, isolation, backend._translator) as held:
                body_ran = True
                yield held
            # The body may have changed the session (SET, LISTEN, temporary tables, a session
            # advisory lock): undo it before the connection is used for a lease. RESET ALL
            # returns to the settings the connection was opened with, which are ours.
            await connection.execute(RESET, timeout=backend.op_timeout)
        except BaseException as exc:
            # Reused only after a clean refusal (timeout 0: the try ran to its end and was
            # rolled back). A body may have left anything behind: closed. An interrupted take
            # leaves the connection in a state nobody knows, and its session perhaps in the
            # lock queue: closed, and the session ended (as for a session lock's take).
            refused = isinstance(exc, AcquireTimeout) and timeout == 0
            if body_ran:
                sessions.discard(connection)
                raise
            if refused and not connection.is_closed() and not connection.is_in_transaction():
                sessions.give_back(connection)
                raise
            if not await sessions.interrupted(connection, name, exc, replacements, reused=reused):
                raise
            continue  # a dead connection (pooled, or ended while waiting): take it on another
        sessions.give_back(connection)
        return


@dataclass(frozen=True, slots=True)
class _Take:
    """What one transaction_lock takes, and how long it may wait."""

    name: str
    key: int
    sequence: str
    timeout: float | None
    idle_timeout: float | None
    op_timeout: float


@asynccontextmanager
async def _transaction(
    connection: Any, take: _Take, isolation: str | None, errors: Errors
) -> AsyncIterator[tuple[Any, int]]:
    name, op_timeout = take.name, take.op_timeout
    transaction = connection.transaction(isolation=isolation)
    context = f"taking {name!r} for a transaction"
    with translate(errors, context), anyio.fail_after(op_timeout):
        await transaction.start()
    try:
        with translate(errors, context):
            token = await _take_in_transaction(connection, take)
        yield connection, token
    except BaseException:
        with anyio.CancelScope(shield=True), anyio.move_on_after(op_timeout):
            try:
                await transaction.rollback()
            except Exception as exc:
                # A closed connection's transaction ended with its session: nothing to undo.
                if not connection.is_closed():
                    logger.warning(
                        "asynclock: rolling back the transaction of %r failed: %r", name, exc
                    )
        raise
    with translate(errors, f"committing the transaction of {name!r}"):
        await transaction.commit()


async def _take_in_transaction(connection: Any, take: _Take) -> int:
    if take.idle_timeout is not None:
        await connection.execute(
            "SELECT set_config('idle_in_transaction_session_timeout', $1, true)",
            str(timeout_ms(take.idle_timeout)),
            timeout=take.op_timeout,
        )
    if take.timeout == 0:
        token = await connection.fetchval(
            XACT_TRY, take.key, take.sequence, timeout=take.op_timeout
        )
        if token is None:
            raise AcquireTimeout(take.name, 0.0)
        return int(token)
    # At the timeout asyncpg cancels the wait in the server; the caller's rollback frees the
    # lock if it was granted at that very moment.
    with anyio.move_on_after(math.inf if take.timeout is None else take.timeout) as scope:
        token = await connection.fetchval(XACT_WAIT, take.key, take.sequence)
    if scope.cancelled_caught:
        raise AcquireTimeout(take.name, take.timeout or 0.0)
    return int(token)
