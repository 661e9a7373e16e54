"""What ``inspect()`` reads, per kind: holders from ``pg_locks``, an election's value from the
holders' table (only the rows of sessions that hold the lock now), waiters from both queues.
"""

from __future__ import annotations

import logging
from typing import Any

import anyio

from .._kit import HolderInfo, Kind, LockError, LockInfo, translate
from ._errors import connection_broken
from ._kinds import kind_key, permits_class, split
from ._sql import (
    INSPECT_HOLDS,
    INSPECT_PERMITS,
    INSPECT_QUEUE,
    INSPECT_SEMAPHORE,
    SWEEP,
    marker_key,
)
from ._table import Queue
from ._wire import Wire

logger = logging.getLogger("asynclock")

#: The longest wait_for_change() waits for a NOTIFY before it looks again (s).
CHANGE_POLL = 0.5
#: How long a release waits for the session of a lost leader to end, to delete its row (s).
SWEEP_WAIT = 1.0


def shown(info: LockInfo) -> tuple[object, ...]:
    """What two inspections compare: the holders may have changed if it differs."""
    return (info.held, info.owner, info.token, info.value, len(info.holders))


class Inspector:
    """``inspect()`` and ``wait_for_change()`` of one backend."""

    def __init__(self, wire: Wire, queue: Queue, *, poll_interval: float) -> None:
        self._wire = wire
        self._sessions = wire.sessions
        self._queue = queue
        self._queue_sql = INSPECT_QUEUE.format(queue=wire.queue)
        self._holds_sql = INSPECT_HOLDS.format(holders=wire.holders)
        self._semaphore_sql = INSPECT_SEMAPHORE.format(queue=wire.queue)
        self._permits_sql = INSPECT_PERMITS.format(holders=wire.holders)
        self._sweep_sql = SWEEP.format(holders=wire.holders)
        self._poll_interval = poll_interval

    async def inspect(self, name: str, kind: Kind) -> LockInfo:
        key = kind_key(name, kind, self._wire.schema)
        while True:
            connection, reused = await self._sessions.take()
            try:
                with (
                    translate(self._wire.errors, f"inspecting {kind} {name!r}"),
                    anyio.fail_after(self._wire.op_timeout),
                ):
                    # Rows left by holders whose sessions ended go first (none are shown).
                    await connection.fetchval(self._sweep_sql, key, 0)
                    if kind == "semaphore":
                        info = await self._inspect_semaphore(connection, name, key)
                    else:
                        info = await self._inspect_key(connection, name, kind, key)
            except BaseException as exc:
                broken = connection_broken(connection, exc)
                self._sessions.discard(connection)  # holds no lock: closing it is all
                if reused and broken and isinstance(exc, Exception):
                    continue  # died in the pool: ask on another connection
                raise
            self._sessions.give_back(connection)
            return info

    async def _inspect_key(self, connection: Any, name: str, kind: Kind, key: int) -> LockInfo:
        """A lock (exclusive or shared holds) or an election."""
        classid, objid = split(key)
        rows = await connection.fetch(self._holds_sql, classid, objid, key)
        queued = await connection.fetchval(
            self._queue_sql, key, classid, objid, *split(marker_key(key))
        )
        granted = [row for row in rows if row["granted"]]
        # In the server's queue, and in the queue table (its head, in both, once).
        waiters = len(rows) - len(granted) + int(queued)
        if not granted:
            return LockInfo(name, held=False, waiters=waiters, kind=kind)
        # Only the holds with a row (shared holds, leaders) are listed, lowest token first: an
        # exclusive lock's token and owner live in its holder's session only, and the server's
        # idle timer is not exposed to other sessions, so neither is shown for it.
        holders = tuple(
            HolderInfo(
                owner=row["owner"],
                token=row["token"],
                shared=row["mode"] == "ShareLock",
                value=bytes(row["value"]) if kind == "election" else None,
            )
            for row in granted
            if row["owner"] is not None
        )
        if kind == "election" and not holders:
            # Granted, but its take has not committed the leader's row yet (a hand-over in
            # progress): no leader is known until it has, and its NOTIFY comes then. Shown as
            # nobody, never as a leader without a value or token.
            return LockInfo(name, held=False, waiters=waiters, kind=kind)
        holder = f"{granted[0]['application_name'] or '?'} (backend pid {granted[0]['pid']})"
        return LockInfo.of(name, kind, holders, waiters=waiters, held=True, holder=holder)

    async def _inspect_semaphore(self, connection: Any, name: str, key: int) -> LockInfo:
        klass = permits_class(name, self._wire.schema)
        held, permits, waiters = await connection.fetchrow(self._semaphore_sql, klass, key)
        rows = await connection.fetch(self._permits_sql, key) if held else []
        holders = (HolderInfo(owner=row["owner"], token=row["token"]) for row in rows)
        return LockInfo.of(
            name,
            "semaphore",
            holders,
            waiters=int(waiters),
            permits=None if permits is None else int(permits),
            held=bool(held),
        )

    async def sweep(self, key: int, pid: int) -> None:
        """Delete the holders' rows of ``key`` whose sessions ended, waiting up to
        ``SWEEP_WAIT`` for the session ``pid`` to end (a connection just closed by us). Best
        effort: inspect never shows such a row, and the next leader's take overwrites it."""
        deadline = anyio.current_time() + SWEEP_WAIT
        try:
            async with self._sessions.pool.connection() as connection:
                with anyio.fail_after(self._wire.op_timeout + SWEEP_WAIT):
                    while await connection.fetchval(self._sweep_sql, key, pid):
                        if anyio.current_time() > deadline:
                            break
                        await anyio.sleep(0.01)
        except Exception as exc:
            logger.info("asynclock: cannot delete the row of a lost hold: %r", exc)

    async def wait_for_change(self, name: str, kind: Kind, seen: LockInfo, timeout: float) -> None:
        """Until a NOTIFY of the name's key (a leader's take and release send one; a waiter
        leaving the queue table, a permit freed while others wait), a change that inspect()
        shows, or ``timeout``; at most ``CHANGE_POLL`` (a holder whose session died tells
        nobody). On the client's one listening connection, interest registered first. The
        client closing ends it (the caller sees it closed), not with the error of an inspect
        whose connection the close took."""
        key = kind_key(name, kind, self._wire.schema)
        event = anyio.Event()
        observers = self._queue.observers.setdefault(key, set())
        observers.add(event)
        try:
            with anyio.move_on_after(timeout):
                if not await self._queue.listen():
                    await anyio.sleep(self._poll_interval)  # no listener: poll
                    return
                try:
                    now = await self.inspect(name, kind)
                except LockError:
                    if not self._sessions.open:
                        return
                    raise
                if shown(now) != shown(seen):
                    return
                with anyio.move_on_after(CHANGE_POLL):
                    await event.wait()
        finally:
            observers.discard(event)
            if not observers:
                self._queue.observers.pop(key, None)
