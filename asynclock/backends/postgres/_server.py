"""What ``open()`` checks on the server: its version, the token sequence, the connection check."""

from __future__ import annotations

import logging
from typing import Any

import asyncpg

from .._kit import BackendUnavailable
from ._sql import lock_key

logger = logging.getLogger("asynclock")

#: How often a server process running one of our statements (a wait) checks that the client is
#: still there; a backstop for waits whose session we could not end ourselves (a killed
#: process). Probed at open: servers on platforms without the check refuse the setting.
CHECK_INTERVAL_MS = "1000"


def check_version(connection: Any, server: str) -> str:
    """The server's version ("15.4"); refused below 14."""
    version = connection.get_server_version()
    shown = f"{version.major}.{version.minor}"
    if version.major < 14:
        raise BackendUnavailable(
            f"{server} runs PostgreSQL {shown}; asynclock needs 14 or later (it relies on "
            "idle_session_timeout to expire the lease of a client that stopped renewing)"
        )
    return shown


async def ensure_sequence(
    connection: Any, *, sequence: str, schema: str, create: str, server: str
) -> None:
    """Create the token sequence if it is missing; refuse one that is not ``CACHE 1``.

    A missing schema and a missing right to create it are the translator's (``CHECKING``)."""
    if await connection.fetchval("SELECT to_regclass($1)", sequence) is None:
        async with connection.transaction():
            # Concurrent CREATE ... IF NOT EXISTS can still collide on the catalog's unique
            # index: one creator at a time.
            await connection.execute(
                "SELECT pg_advisory_xact_lock($1)", lock_key("create sequence", schema)
            )
            await connection.execute(create)
    cache = await connection.fetchval(
        "SELECT seqcache FROM pg_sequence WHERE seqrelid = to_regclass($1)", sequence
    )
    if cache is None:
        raise BackendUnavailable(
            f"{sequence} on {server} is not a sequence; drop it or choose another ?schema=..."
        )
    if cache != 1:
        # Sessions would draw from private caches: a later holder could get a smaller token.
        raise BackendUnavailable(
            f"the token sequence {sequence} has CACHE {cache}, so tokens would not increase "
            f"across sessions: ALTER SEQUENCE {sequence} CACHE 1"
        )


async def ensure_queue(connection: Any, *, queue: str, schema: str, create: str) -> None:
    """Create the waiters' queue table if it is missing (see ``_queue.py``)."""
    if await connection.fetchval("SELECT to_regclass($1)", queue) is None:
        async with connection.transaction():
            await connection.execute(
                "SELECT pg_advisory_xact_lock($1)", lock_key("create sequence", schema)
            )
            await connection.execute(create)


async def ensure_holders(
    connection: Any, *, holders: str, schema: str, create: str, sweep: str, server: str
) -> bool:
    """Create the holders' table if it is missing, and delete the rows of holds that ended while
    no client ran; False (with a warning) if this user may not: exclusive locks need no table,
    so a client whose owner has not created it yet still opens, and refuses the other kinds."""
    try:
        await ensure_queue(connection, queue=holders, schema=schema, create=create)
        await connection.fetchval(sweep, None, 0)
    except asyncpg.InsufficientPrivilegeError as exc:
        logger.warning(
            "asynclock: %s: %s; shared locks, semaphores and elections need the table %s "
            "(create it once as its owner with %s, and GRANT SELECT, INSERT, UPDATE, DELETE "
            "ON it TO the lock users)",
            server,
            exc,
            holders,
            " ".join(create.split()),
        )
        return False
    return True


async def probe_check_interval(connection: Any, *, local: bool) -> dict[str, str]:
    """``client_connection_check_interval``, as a setting to add, if the server has it; set on
    ``connection``'s session too, unless ``local`` (transaction pooling: the session is not
    ours, so it is set for this statement only)."""
    try:
        await connection.fetchval(
            "SELECT set_config('client_connection_check_interval', $1, $2)",
            CHECK_INTERVAL_MS,
            local,
        )
    except asyncpg.PostgresError:
        return {}  # a server platform without the check: the backstop is simply absent
    return {"client_connection_check_interval": CHECK_INTERVAL_MS}
