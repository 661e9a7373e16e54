"""Waits in the server's lock queue, each on a dedicated connection that then holds the lock."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import anyio

from .._kit import LockRequest, now, translate
from ._errors import Errors, connection_broken, unmapped
from ._lane import PostgresGrant
from ._sessions import Replacements, Sessions
from ._sql import RELEASE, RENEW, timeout_ms

logger = logging.getLogger("asynclock")

#: How long after a renewal was sent a release waits for its reply before closing the connection
#: instead (a statement in flight: the connection cannot be unlocked and kept before it ends).
_RENEWAL_WAIT = 0.05

#: A wait that lasted longer than this share of the ttl restarts the idle timer before it is
#: handed over (its own send time is the lease's start otherwise).
FRESH_WAIT = 0.05


class Waits:
    """Our waiters in the server's queue (at most ``max_waiting``, plus the queue table's heads)."""

    def __init__(
        self,
        sessions: Sessions,
        errors: Errors,
        sequence: str,
        op_timeout: float,
        held: dict[Any, PostgresGrant],
        *,
        on_closed: Callable[[Any], None],
    ) -> None:
        self._sessions = sessions
        self._errors = errors
        self.sequence = sequence
        self.op_timeout = op_timeout
        #: The grant each dedicated holding connection holds (the backend's).
        self._held = held
        self._connection_closed = on_closed
        self.waiting = 0

    async def wait(
        self,
        request: LockRequest,
        key: int,
        ttl_ms: int,
        *,
        head: bool,
        sql: str,
        args: tuple[object, ...] = (),
        release: tuple[str, tuple[object, ...]] = (RELEASE, ()),
        shared: bool = False,
        kept: bool = False,
        bound: float | None = None,
    ) -> PostgresGrant | None:
        """Wait in the server's queue on a dedicated connection, which then holds the lock;
        unless the queue table has places for the key (None: wait there, ``_queue.py``), or
        ``head``: this waiter is the table's head (None: its connection died; it checks its
        place again before it comes back, which may have expired meanwhile).

        A statement that fails or is cancelled half-way leaves its connection in a state nobody
        knows (asyncpg's protocol may still expect the reply), so that connection is closed, never
        reused, and its server session is ended before this returns (``Sessions.end_session``): a
        cancelled wait leaves the server's queue, a lock granted at the last moment is free
        again. A connection that turns out to be dead (a pooled one the server or a proxy closed
        while it was idle, or a waiter's session the server ended while this process was paused)
        is replaced and the wait starts again: that is no outage. Only a new connection that
        fails as well is reported.
        """
        # Counted before the first await: waiters that start together see each other.
        self.waiting += 1
        try:
            grant = await self._wait(
                request, key, ttl_ms, head=head, sql=sql, args=args, bound=bound
            )
        finally:
            self.waiting -= 1
        if grant is not None:
            grant.shared = shared
            grant.kept_key = key if kept else None
            grant.release_sql, grant.release_args = release
        return grant

    async def _wait(
        self,
        request: LockRequest,
        key: int,
        ttl_ms: int,
        *,
        head: bool,
        sql: str,
        args: tuple[object, ...],
        bound: float | None,
    ) -> PostgresGrant | None:
        replacements = Replacements()
        while True:
            connection, reused = await self._sessions.take()
            try:
                with (
                    translate(self._errors, f"waiting for {request.name!r}"),
                    anyio.fail_after(bound),  # a try (that does not wait): op_timeout
                ):
                    # Queue in the server; the caller's cancel scope bounds the wait.
                    sent_at = now()
                    row = await connection.fetchrow(sql, key, self.sequence, str(ttl_ms), *args)
                    if row is None:
                        self._sessions.give_back(connection)
                        return None
                    if now() - sent_at > ttl_ms * FRESH_WAIT / 1000.0:
                        # Its send time would leave little of the lease: restart the timer.
                        sent_at = now()
                        await connection.fetchval(RENEW, timeout=self.op_timeout)
            except BaseException as exc:
                broken = connection_broken(connection, exc)
                await self._sessions.end_session(connection, request.name, unmapped(exc))
                if not replacements.again(exc, broken=broken, reused=reused):
                    raise
                if head:
                    return None
                logger.info(
                    "asynclock: a connection to %s died while waiting for %r (%r); waiting on "
                    "another one",
                    self._errors.server,
                    request.name,
                    unmapped(exc),
                )
                continue
            return held_grant(
                request,
                key,
                connection,
                token=row[0],
                pid=row[1],
                sent_at=sent_at,
                held=self._held,
                on_closed=self._connection_closed,
            )

    async def release(self, grant: PostgresGrant) -> None:
        """Release a dedicated connection's lock (``PostgresBackend.release``): unlock and keep
        the connection, or close it (either frees the lock)."""
        connection = grant.connection
        self._held.pop(connection, None)
        if connection.is_closed():
            self._sessions.all.discard(connection)
            return
        try:
            renewal = grant.renewal
            if renewal is not None:
                # Its statement is in flight. A renewal just sent on a healthy server is back
                # within milliseconds; one that has not come back by now (a hung server, often
                # why the lease was lost) is not waited for: closing frees the lock just the same.
                left = renewal.sent_at + _RENEWAL_WAIT - now()
                if left <= 0 or not await renewal.finished(left):
                    self._sessions.discard(connection)
                    return
            if grant.in_transaction and not connection.is_in_transaction():
                # Nothing to roll back: whatever ended the transaction ended the lock, and the
                # lease should have been reported lost before this. Said, never ignored.
                logger.warning(
                    "asynclock: releasing %r on %s: its transaction had ended already, and "
                    "the lock with it",
                    grant.name,
                    self._errors.server,
                )
                self._sessions.discard(connection)
                return
            await connection.execute(
                grant.release_sql or RELEASE, *grant.release_args, timeout=self.op_timeout
            )
        except BaseException as exc:
            # Closed at once, never reused: whatever state the statement left, the session
            # ends with the connection, and the lock with it.
            gone = connection_broken(connection, exc)
            self._sessions.discard(connection)
            if not isinstance(exc, Exception):
                raise
            if not gone:
                logger.warning(
                    "asynclock: unlocking %r on %s failed (%r); closed its connection "
                    "instead, so the server frees the lock when it reads the close, at the "
                    "latest %g s after the last renewal it received",
                    grant.name,
                    self._errors.server,
                    exc,
                    grant.ttl,
                )
            return
        self._sessions.give_back(connection)


def held_grant(
    request: LockRequest,
    key: int,
    connection: Any,
    *,
    token: int,
    pid: int,
    sent_at: float,
    held: dict[Any, PostgresGrant],
    on_closed: Callable[[Any], None],
    **more: Any,
) -> PostgresGrant:
    """The grant of a lock ``connection`` holds on its own (after a wait in the server's queue,
    or in a transaction of its own), registered in ``held``; ``more``: PostgresGrant's fields."""
    grant = PostgresGrant(
        name=request.name,
        owner=request.owner,
        token=int(token),
        valid_from=sent_at,
        ttl=timeout_ms(request.ttl) / 1000.0,
        key=key,
        pid=int(pid),
        connection=connection,
        on_lost=request.on_lost,
        space=request.kind,
        **more,
    )
    held[connection] = grant
    if connection.is_closed():
        # Closed between the reply and now: the listener may have run already.
        on_closed(connection)
    return grant
