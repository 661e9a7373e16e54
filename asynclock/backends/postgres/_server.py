"""What ``open()`` checks and creates on the server: its version, a connection pooler's mode, the
token sequence, the queue table, the holders' table, the connection check."""

from __future__ import annotations

import logging
from typing import Any

import anyio
import asyncpg

from .._kit import BackendUnavailable, UnsupportedFeature, translate
from ._errors import CHECKING
from ._kinds import holders_advice
from ._sql import CREATE, CREATE_HOLDERS, CREATE_QUEUE, SWEEP, lock_key
from ._wire import Wire

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


async def check_server(
    connection: Any, wire: Wire, *, local: bool
) -> tuple[str, bool, dict[str, str]]:
    """Check and create on ``connection`` what the backend needs (the translator's ``CHECKING``:
    a missing schema, a missing right to create); the server's version, whether the holders'
    table is there, and the settings to add to every connection (:func:`probe_check_interval`,
    ``local``: transaction pooling)."""
    version = check_version(connection, wire.errors.server)
    await ensure_sequence(connection, wire)
    await ensure(connection, wire, wire.queue, CREATE_QUEUE.format(queue=wire.queue))
    holders = await ensure_holders(connection, wire)
    return version, holders, await probe_check_interval(connection, local=local)


async def check_pooler(wire: Wire, pooler: str | None) -> None:
    """Refuse a connection pooler unless the URL names its pool mode; then look for
    evidence that the mode is not what the URL says (which a client can find, but not
    rule out)."""
    if pooler == "transaction":
        await _check_transactions(wire)
        return
    if not wire.sessions.pooled:
        return
    if pooler is None:
        raise UnsupportedFeature(
            f"{wire.errors.server} is a connection pooler, not PostgreSQL itself (the server "
            "process id it gave at connect is not pg_backend_pid()), and a session lock is "
            "only safe when every client connection keeps a server session of its own. "
            "Say which pool mode it runs in the URL: with PgBouncer's pool_mode = "
            "transaction, add ?pooler=transaction (each lock is held in a transaction of "
            "its own; exclusive locks only); with pool_mode = session, ?pooler=session (the "
            "pool then needs a server connection for each of the client's connections: "
            "one per ttl in use, one per waiter up to max_waiting, up to max_idle idle "
            "ones). Statement pooling cannot hold a lock"
        )
    # In transaction or statement pooling a second connection, made while the first is
    # idle, reaches the first one's server session, and finds its mark (Sessions).
    second, _ = await wire.sessions.take()
    wire.sessions.give_back(second)


async def _check_transactions(wire: Wire) -> None:
    """Refuse a pooler that does not keep a transaction on one server session: statement
    pooling (PgBouncer closes the connection at ``BEGIN``)."""
    connection, _ = await wire.sessions.take()
    try:
        with translate(wire.errors, CHECKING), anyio.fail_after(wire.op_timeout):
            # Two statements: the pooler judges each reply, and only the first leaves a
            # transaction open.
            await connection.execute("BEGIN")
            await connection.execute("ROLLBACK")
    except BaseException as exc:
        wire.sessions.discard(connection)
        if isinstance(exc, BackendUnavailable) and connection.is_closed():
            raise UnsupportedFeature(
                f"{wire.errors.server} closed the connection at BEGIN ({exc.__cause__}): a "
                "connection pooler in statement pooling mode, which ends every transaction "
                "after one statement, so no lock can be held through it. Use PgBouncer's "
                "pool_mode = transaction (?pooler=transaction) or session "
                "(?pooler=session), or connect to PostgreSQL directly"
            ) from exc
        raise
    wire.sessions.give_back(connection)


async def ensure_sequence(connection: Any, wire: Wire) -> None:
    """Create the token sequence if it is missing; refuse one that is not ``CACHE 1``."""
    sequence, server = wire.sequence, wire.errors.server
    await ensure(connection, wire, sequence, CREATE.format(sequence=sequence))
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


async def ensure(connection: Any, wire: Wire, name: str, create: str) -> None:
    """Run ``create`` unless the relation ``name`` exists."""
    if await connection.fetchval("SELECT to_regclass($1)", name) is None:
        async with connection.transaction():
            # Concurrent CREATE ... IF NOT EXISTS can still collide on the catalog's unique
            # index: one creator at a time.
            await connection.execute(
                "SELECT pg_advisory_xact_lock($1)", lock_key("create sequence", wire.schema)
            )
            await connection.execute(create)


async def ensure_holders(connection: Any, wire: Wire) -> bool:
    """Create the holders' table if it is missing, and delete the rows of holds that ended while
    no client ran; False (with a warning) if this user may not: exclusive locks need no table,
    so a client whose owner has not created it yet still opens, and refuses the other kinds."""
    holders = wire.holders
    try:
        await ensure(connection, wire, holders, CREATE_HOLDERS.format(holders=holders))
        await connection.fetchval(SWEEP.format(holders=holders), None, 0)
    except asyncpg.InsufficientPrivilegeError as exc:
        logger.warning(
            "asynclock: %s: %s; shared locks, semaphores and elections need the table %s (%s)",
            wire.errors.server,
            exc,
            holders,
            holders_advice(holders),
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
