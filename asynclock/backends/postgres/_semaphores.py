"""Semaphores: each permit a lease of its own, on a dedicated connection; FIFO waiters in the
queue table. The statements, and why they are safe, are in ``_sql.py``.

A permit holds a connection of its own (not a lane): its session ends, and frees exactly that
permit, when its idle timer (the permit's ttl) fires, the process dies or the connection is
terminated; and a release is ``pg_advisory_unlock_all()`` on a connection that holds nothing
else. Renewals and releases are those of every dedicated connection (``_lease.Renewals``,
``PostgresBackend.release``).
"""

from __future__ import annotations

import anyio

from .._kit import LockRequest, now, permits_mismatch, translate
from ._kinds import kind_key, permits_class, slot_keys
from ._lease import PostgresGrant
from ._queue import Answer
from ._sql import BEGIN_SEMAPHORE, RELEASE_SEMAPHORE, TAKE_SEMAPHORE, timeout_ms
from ._table import Queue
from ._wire import Replacements, Wire


class Semaphores:
    """The semaphore takes and waits of one backend."""

    def __init__(self, wire: Wire, queue: Queue) -> None:
        self._wire = wire
        self._sessions = wire.sessions
        self._queue = queue
        self._take_sql = TAKE_SEMAPHORE.format(queue=wire.queue, holders=wire.holders)
        self._release_sql = RELEASE_SEMAPHORE.format(queue=wire.queue, holders=wire.holders)

    async def take(self, request: LockRequest, *, wait: bool) -> PostgresGrant | None:
        """One try; if no permit is free and ``wait``, a place in the queue table, whose head
        tries again at each release it hears of (and every ``_table.POLL`` s: a holder that
        died tells nobody)."""
        key = kind_key(request.name, "semaphore", self._wire.schema)
        ttl_ms = timeout_ms(request.ttl)
        permits = (permits_class(request.name, self._wire.schema), request.permits)
        grant = await self._try(request, key, ttl_ms, permits, head=False)
        if grant is not None or not wait:
            return grant
        await Answer(request).now()  # the caller's timeout applies from here
        return await self._queue.wait(
            request,
            key,
            ttl_ms,
            lambda: self._try(request, key, ttl_ms, permits, head=True),
            permits=permits,
        )

    async def _try(
        self, request: LockRequest, key: int, ttl_ms: int, permits: tuple[int, int], *, head: bool
    ) -> PostgresGrant | None:
        """Take a free permit on a dedicated connection, which then holds it.

        As every statement on a dedicated connection (``_queue.Waits``): one interrupted half-way
        (or the transaction around it, ``BEGIN_SEMAPHORE``)
        is closed and its session ended before this returns, so a permit taken at the last
        moment is free again; a dead pooled connection is replaced."""
        # As text: a bigint[] would cost asyncpg a type introspection on each new connection
        # (``_sql.TAKE_SEMAPHORE``).
        slots = [str(slot) for slot in slot_keys(request.name, request.permits, self._wire.schema)]
        replacements = Replacements()
        while True:
            connection, reused = await self._sessions.take()
            try:
                with (
                    translate(self._wire.errors, f"taking a permit of {request.name!r}"),
                    # A try: it waits for nothing but other takes' transactions.
                    anyio.fail_after(self._wire.op_timeout),
                ):
                    await connection.execute(BEGIN_SEMAPHORE.format(key=int(key)))
                    # The lease starts with the take, after the wait for other takes'
                    # transactions (20 contending takes waited longer than a ttl of 1 s, and
                    # got permits that had expired before their bodies began): the server's
                    # idle timer only starts once the COMMIT below has ended the transaction.
                    sent_at = now()
                    row = await connection.fetchrow(
                        self._take_sql,
                        key,
                        self._wire.sequence,
                        str(ttl_ms),
                        head,
                        slots,
                        *permits,
                        request.owner,
                    )
                    await connection.execute("COMMIT")
            except BaseException as exc:
                if not await self._sessions.interrupted(
                    connection, request.name, exc, replacements, reused=reused
                ):
                    raise
                continue
            if row[0] is None:
                self._sessions.give_back(connection)  # it took nothing
                if row[1] is not None:
                    raise permits_mismatch(request.name, int(row[1]), request.permits)
                return None
            return self._wire.hold(
                request,
                int(row[0]),
                connection,
                token=row[2],
                pid=row[3],
                sent_at=sent_at,
                release_sql=self._release_sql,
                release_args=(self._wire.channel, key),
                kept_key=key,
            )
