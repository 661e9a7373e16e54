"""PostgreSQL extras above the backend: :func:`transaction_lock`, a lock for one transaction.

It takes a :class:`asynclock.LockClient` (or a backend, a URL, an asyncpg connection), which is
why it lives here and not in :mod:`asynclock.backends.postgres`, which does the driver's half
(``xact_lock``).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, NamedTuple

from .._client import LockClient
from .._errors import InvalidArgument
from .._registry import make_backend
from .._validate import lock_name, redact
from .._validate import timeout as check_timeout
from ..backends.postgres import PostgresBackend, xact_lock

__all__ = ("TransactionLock", "transaction_lock")


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
    opened = _backend_from_url(target) if isinstance(target, str) else None
    held = xact_lock(
        opened or _backend_of(target),
        name,
        timeout=timeout,
        idle_timeout=idle_timeout,
        isolation=isolation,
        schema=schema,
    )
    async with contextlib.AsyncExitStack() as stack:
        if opened is not None:
            await stack.enter_async_context(opened)
        yield TransactionLock(*await stack.enter_async_context(held))


def _backend_from_url(url: str) -> PostgresBackend:
    backend = None
    if url.startswith(("postgresql://", "postgres://")):
        backend = make_backend(url, {"max_idle": 1})
    if not isinstance(backend, PostgresBackend):
        raise InvalidArgument(f"transaction_lock needs a postgresql:// URL, got {redact(url)!r}")
    return backend


def _backend_of(target: object) -> object:
    """A lock client's backend; anything else as it is (``xact_lock`` checks it)."""
    if isinstance(target, LockClient):
        backend = target._backend
        if not isinstance(backend, PostgresBackend):
            raise InvalidArgument(
                f"transaction_lock needs a lock client on postgresql://, not on "
                f"{backend.describe()}"
            )
        return backend
    return target
