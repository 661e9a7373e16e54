"""Holds through a transaction-pooling connection pooler (``?pooler=transaction``): each lock is a
transaction-level advisory lock, in a transaction of its own on a connection of its own.

A pooler in transaction pooling (PgBouncer's ``pool_mode = transaction``) hands a server session
to another client as soon as a transaction ends, so nothing session-level survives: not a session
lock (the next client would hold it, and could take it again, since session locks are
re-entrant), not a ``SET``, not a ``LISTEN``. A transaction is the one thing that stays on one
server session from ``BEGIN`` to its end, and a transaction-level advisory lock lives exactly as
long as its transaction: while the hold's transaction is open no other client's statement runs
on that session, and exclusion is the server's lock manager's, as on a direct connection.

The lease is ``SET LOCAL idle_in_transaction_session_timeout = ttl``: the server ends a session
whose transaction sent nothing for ``ttl``, which frees the lock (renewals restart the timer, as
``idle_session_timeout`` does for a session lock). ``SET LOCAL`` ends with the transaction, so no
setting reaches the pooler's other clients. A release is ``ROLLBACK`` (nothing to commit).

A take costs two round trips (``BEGIN`` and its settings, then the try), a wait a third; a refused
try ends its transaction with a third. Tokens are drawn with ``nextval`` after the grant, in the
hold's statement, so they increase in hold order across clients. A waiter interrupted while it
waits in the server's queue is ended with ``pg_terminate_backend``, guarded by its server process
and its transaction's start, which no later client's transaction on that process shares.
"""

from __future__ import annotations

import logging

import anyio

from .._kit import Capabilities, LockRequest, now, translate
from ._lease import FRESH_WAIT, PostgresGrant
from ._queue import Answer
from ._sql import XACT_TAKE, XACT_WAIT, renew
from ._wire import Replacements, Wire

logger = logging.getLogger("asynclock")

ROLLBACK = "ROLLBACK"
#: What a client has through transaction pooling: shared holds, permits and leaders keep a row
#: in the holders' table that inspect() and followers read, which a hold's open transaction
#: cannot show to anyone else.
TRANSACTION_CAPABILITIES = Capabilities.every(
    quorum=False, shared_locks=False, semaphores=False, elections=False, ttl_change=False
)
TRANSACTION_LIMITS = (
    "through transaction pooling (?pooler=transaction) PostgreSQL has exclusive locks only: "
    "connect directly or through session pooling for the others"
)
#: What every hold's transaction sets for itself: waits are bounded by the caller, not by a
#: server default; a token's sequence record is flushed by the next commit on the server.
_LOCAL_SETTINGS = {
    "lock_timeout": "0",
    "statement_timeout": "0",
    "synchronous_commit": "on",
}


class TransactionHolds:
    """The takes of one backend in transaction pooling; renewals and releases are the dedicated
    connections' (``_lease.Renewals``, ``Waits.release``), with ``ROLLBACK`` as the unlock."""

    def __init__(self, wire: Wire) -> None:
        self._wire = wire
        self._sessions = wire.sessions
        #: What every hold's transaction sets (open() adds what it found the server has).
        self.settings = dict(_LOCAL_SETTINGS)

    def _begin(self, ttl_ms: int) -> str:
        # One simple query, values inlined: they are ours (integers and fixed words).
        settings = {**self.settings, "idle_in_transaction_session_timeout": str(ttl_ms)}
        return "BEGIN; " + " ".join(
            f"SET LOCAL {name} = '{value}';" for name, value in settings.items()
        )

    async def take(
        self, request: LockRequest, key: int, ttl_ms: int, *, wait: bool
    ) -> PostgresGrant | None:
        """Take the lock in a transaction of its own; if it is busy and ``wait``, wait for it in
        the server's queue (in order), else end the transaction and return None.

        A statement that fails or is cancelled half-way leaves its connection in a state nobody
        knows, so that connection is closed, never reused: the pooler then closes its server
        connection, whose transaction ends with it; a wait in the server's queue, which does not
        read its socket, is ended from another connection before this returns
        (``Sessions.end_session``). A pooled connection found dead is replaced, as in
        ``Waits``.
        """
        replacements = Replacements()
        while True:
            connection, reused = await self._sessions.take()
            started: tuple[int, object] | None = None
            try:
                with translate(self._wire.errors, f"taking {request.name!r}"):
                    with anyio.fail_after(self._wire.op_timeout):
                        await connection.execute(self._begin(ttl_ms))
                        sent_at = now()
                        taken, pid, began, token = await connection.fetchrow(
                            XACT_TAKE, key, self._wire.sequence
                        )
                    started = (pid, began)
                    if not taken and not wait:
                        await connection.execute(ROLLBACK, timeout=self._wire.op_timeout)
                        self._sessions.give_back(connection)
                        return None
                    if not taken:
                        # In the server's queue; the caller's cancel scope bounds the wait,
                        # from now on (the try was its first answer).
                        await Answer(request).now()
                        sent_at = now()
                        token = await connection.fetchval(XACT_WAIT, key, self._wire.sequence)
                        if now() - sent_at > ttl_ms * FRESH_WAIT / 1000.0:
                            # Its send time would leave little of the lease: restart the timer.
                            sent_at = now()
                            await connection.execute(renew(pid), timeout=self._wire.op_timeout)
            except BaseException as exc:
                if not await self._sessions.interrupted(
                    connection,
                    request.name,
                    exc,
                    replacements,
                    reused=reused,
                    transaction=started,
                    doing="taking",
                ):
                    raise
                continue
            return self._wire.hold(
                request,
                key,
                connection,
                token=token,
                pid=pid,
                sent_at=sent_at,
                release_sql=ROLLBACK,
                in_transaction=True,
            )
