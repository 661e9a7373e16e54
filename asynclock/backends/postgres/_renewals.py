"""The renewal of a lock's lease: one statement that restarts its session's idle timer (on a
lane for every lock of the lane, ``_lanes.py``; on a dedicated connection by :class:`Renewals`),
and what its answer says."""

from __future__ import annotations

import anyio

from .._kit import BackendTimeout, Lost, Renewed, RenewOutcome, TaskHost, Unknown
from ._lease import PostgresGrant, Renewal
from ._sql import RENEWED, renew

#: A renewal's verdict on a holding connection that closed.
CLOSED = "the connection holding the advisory lock closed; the lock ends with the session"


def renewed(same: bool, held_by: int, sent_at: float, ttl: float) -> RenewOutcome:
    """A renewal's answer: renewed from its send time if the session that held the lock
    (server process ``held_by``) answered (``same``), else lost."""
    if not same:
        return Lost(
            f"the connection no longer reaches server process {held_by}, which held the lock "
            "(a connection pooler in between?); the lock ended with that session"
        )
    return Renewed(sent_at, ttl)


class Renewals:
    """The renewal queries of one backend, run in its task group."""

    def __init__(self, host: TaskHost, server: str, op_timeout: float) -> None:
        self._host = host
        self._server = server
        self._op_timeout = op_timeout
        #: Renewal queries in flight; each ends with its query or its connection.
        self._running: set[Renewal] = set()

    async def renew(self, grant: PostgresGrant) -> RenewOutcome:
        """Restart the server's idle timer of one held connection.

        The query is never cancelled: a renewal that is slow (a network blip) still restarts
        the timer when it reaches the server, and its late reply is a valid renewal from its send
        time. Cancelling it would make asyncpg send a CancelRequest and, if that cannot get
        through either, close the connection at the next query, losing a lease that the blip
        alone would not have cost. So the query runs in a task of the backend's own, at most one
        per grant at a time; it ends with the query or with the connection (release and aclose
        close connections they cannot use), and this call waits for it up to ``op_timeout``.
        """
        connection = grant.connection
        if grant.released:
            return Lost("the lock was released")
        if connection.is_closed():
            return Lost(CLOSED)
        renewal = grant.renewal
        if renewal is None:
            renewal = grant.renewal = Renewal(anyio.current_time())
            self._running.add(renewal)
            self._host.start_soon(self._query, grant, renewal, name="asynclock: renew")
        if not await renewal.finished(self._op_timeout) or renewal.cancelled:
            return Unknown(
                BackendTimeout(
                    f"renewing {grant.name!r} on {self._server}: no answer for "
                    f"{anyio.current_time() - renewal.sent_at:.3g} s"
                )
            )
        if renewal.error is not None:
            if connection.is_closed():
                return Lost(
                    "the connection holding the advisory lock closed "
                    f"({type(renewal.error).__name__}); the lock ends with the session"
                )
            return Unknown(renewal.error)
        if grant.in_transaction and not connection.is_in_transaction():
            return Lost("the transaction holding the advisory lock ended; the lock ended with it")
        return renewed(renewal.same, grant.pid, renewal.sent_at, grant.ttl)

    async def _query(self, grant: PostgresGrant, renewal: Renewal) -> None:
        try:
            renewal.same = await grant.connection.execute(renew(grant.pid)) == RENEWED
        except Exception as exc:
            renewal.error = exc
        except BaseException:
            renewal.cancelled = True  # by aclose(), once the connections are closed
            raise
        finally:
            self._running.discard(renewal)
            if grant.renewal is renewal:
                grant.renewal = None
            renewal.done.set()

    async def wait_all(self, timeout: float) -> None:
        """Wait (shielded) up to ``timeout`` for the queries in flight to end."""
        with anyio.CancelScope(shield=True), anyio.move_on_after(timeout):
            for renewal in list(self._running):
                await renewal.done.wait()
