"""PostgreSQL extras above the backend: :func:`transaction_lock`, a lock for one transaction.

It takes a :class:`asynclock.LockClient` (or a backend, a URL, an asyncpg connection), which is
why it lives here and not in :mod:`asynclock.backends.postgres` (which re-exports it).
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

import anyio
import asyncpg

from .._client import LockClient
from .._errors import AcquireTimeout, InvalidArgument
from .._registry import make_backend
from .._validate import lock_name, redact
from .._validate import timeout as check_timeout
from ..backends._kit import translate
from ..backends.postgres import PostgresBackend
from ..backends.postgres._sessions import Replacements
from ..backends.postgres._sql import (
    MAX_TIMEOUT_MS,
    RESET,
    XACT_TRY,
    XACT_WAIT,
    lock_key,
    sequence_name,
    timeout_ms,
)
from ..backends.postgres._translate import Errors, connection_broken, unmapped

__all__ = ("TransactionLock", "transaction_lock")

logger = logging.getLogger("asynclock")

#: The translator for a connection of the caller's (the backend's names its server).
_YOUR_CONNECTION = Errors("your asyncpg connection", 0.0, "", "", "")


class TransactionLock(NamedTuple):
    """What :func:`transaction_lock` yields: the connection in its transaction, and the token."""

    connection: Any
    token: int


@asynccontextmanager
async def transaction_lock(
    target: Any,
    name: str,
    *,
    timeout: float | None = None,
    idle_timeout: float | None = 30.0,
    isolation: str | None = None,
    schema: str = "public",
) -> AsyncIterator[TransactionLock]:
    """Hold lock ``name`` for one database transaction; yields ``(connection, token)``.

    For critical sections that are writes to this same database: the lock
    (``pg_advisory_xact_lock``) and the writes commit or roll back together, so a client that
    stalls or loses its connection loses its uncommitted writes along with the lock. The body
    runs inside the transaction on ``connection``; leaving the block normally commits, an
    exception rolls back. The lock excludes holders of ``locks.lock(name)`` (same name and
    schema) and the other way round.

    ``target`` is a :class:`asynclock.LockClient` on ``postgresql://`` or a
    :class:`PostgresBackend` (a dedicated connection is borrowed from it), a ``postgresql://``
    URL (a connection is opened for this block), or an asyncpg connection of yours (used as it
    is; inside a transaction of yours this one is a savepoint and the lock lasts until your
    outermost transaction ends). ``schema`` only applies to an asyncpg connection; the others
    use their own ``schema`` option.

    ``timeout``: ``None`` waits (in the server's FIFO queue), 0 tries once, a positive number
    bounds the wait; past it, :class:`asynclock.AcquireTimeout`. ``idle_timeout`` (seconds, or
    None to keep the session's setting) sets ``idle_in_transaction_session_timeout`` for the
    transaction: a client that stalls that long between two statements is disconnected by the
    server, its transaction rolled back and the lock freed. ``isolation`` is asyncpg's
    (``"serializable"``, ``"repeatable_read"``, ``"read_committed"``).

    The token comes from the same sequence as ``locks.lock()``'s and is never reused, also when
    the transaction rolls back.
    """
    name = lock_name(name)
    timeout = check_timeout(timeout)
    if idle_timeout is not None and (
        isinstance(idle_timeout, bool)
        or not isinstance(idle_timeout, int | float)
        or not 0 < idle_timeout * 1000 <= MAX_TIMEOUT_MS
    ):
        raise InvalidArgument(
            f"idle_timeout must be a number of seconds > 0 (at most {MAX_TIMEOUT_MS // 1000}) "
            f"or None, got {idle_timeout!r}"
        )
    if isinstance(target, str):
        opened = _backend_from_url(target)
        async with opened:
            async with _on_backend(opened, name, timeout, idle_timeout, isolation) as held:
                yield held
        return
    borrowed = _backend_of(target)
    if borrowed is not None:
        async with _on_backend(borrowed, name, timeout, idle_timeout, isolation) as held:
            yield held
        return
    if not isinstance(target, asyncpg.Connection | asyncpg.pool.PoolConnectionProxy):
        raise InvalidArgument(
            "transaction_lock needs a LockClient or PostgresBackend on postgresql://, a "
            f"postgresql:// URL or an asyncpg connection, not {type(target).__name__}"
        )
    take = _Take(name, lock_key(name, schema), sequence_name(schema), timeout, idle_timeout, 5.0)
    async with _transaction(target, take, isolation, _YOUR_CONNECTION) as held:
        yield held


def _backend_from_url(url: str) -> PostgresBackend:
    backend = make_backend(url, {"max_idle": 1})
    if not isinstance(backend, PostgresBackend):
        raise InvalidArgument(f"transaction_lock needs a postgresql:// URL, got {redact(url)!r}")
    return backend


def _backend_of(target: object) -> PostgresBackend | None:
    if isinstance(target, PostgresBackend):
        return target
    if isinstance(target, LockClient):
        backend = target._backend
        if not isinstance(backend, PostgresBackend):
            raise InvalidArgument(
                f"transaction_lock needs a lock client on postgresql://, not on "
                f"{backend.describe()}"
            )
        return backend
    return None


@asynccontextmanager
async def _on_backend(
    backend: PostgresBackend,
    name: str,
    timeout: float | None,
    idle_timeout: float | None,
    isolation: str | None,
) -> AsyncIterator[TransactionLock]:
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
            broken = connection_broken(connection, exc)
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
            await sessions.end_session(connection, name, unmapped(exc))
            if not replacements.again(exc, broken=broken, reused=reused):
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
) -> AsyncIterator[TransactionLock]:
    name, op_timeout = take.name, take.op_timeout
    transaction = connection.transaction(isolation=isolation)
    context = f"taking {name!r} for a transaction"
    with translate(errors, context), anyio.fail_after(op_timeout):
        await transaction.start()
    try:
        with translate(errors, context):
            token = await _take_in_transaction(connection, take)
        yield TransactionLock(connection, token)
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
