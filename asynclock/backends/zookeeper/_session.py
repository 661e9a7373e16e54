"""A ZooKeeper session: survives reconnects to any server until the server expires it.

It owns its connection (reads replies and watch events, pings the server) in a task of the
backend's task host, and sends pipelined calls bounded by ``op_timeout``. What a lock needs
on top of it (its own nodes watched, loss reported, leftovers deleted) is in ``_lease``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import anyio
from aiozk import protocol as zk

from .._kit import BackendUnavailable, TaskHost, now
from . import _proto
from ._errors import ConnectionLoss, NotConnected, SessionGone
from ._urls import Settings
from ._wire import (
    LOST,
    NO_EVENT,
    PENDING,
    PING_XID,
    WATCH_XID,
    Connection,
    Identity,
    Pending,
    Watches,
    connect,
    frame,
)

__all__ = ("ATTEMPTS", "IDLE_SESSION", "Context", "Session", "Wake")

logger = logging.getLogger("asynclock.zookeeper")

#: How often a call that is safe to repeat is tried before its connection loss is final.
ATTEMPTS = 4
#: A session for a ttl nobody uses any more is closed after this long.
IDLE_SESSION = 60.0

State = Literal["new", "connected", "suspended", "dead"]


@dataclass(frozen=True, slots=True)
class Context:
    """What every session of one backend shares: its settings, task host, URL (for messages)
    and ``forget(session)``, told when a session dies or is closed as idle."""

    settings: Settings
    host: TaskHost
    where: str
    forget: Callable[[Session], None]


class Session:
    """States: ``connected``, ``suspended`` (reconnecting; calls wait up to ``op_timeout``)
    and ``dead`` (expired or closed; final).

    Subclasses hook in with :meth:`_on_connected`, :meth:`_on_death`, :meth:`_maintain` (a
    task per connection) and :meth:`_busy`.
    """

    def __init__(self, context: Context, timeout_ms: int) -> None:
        self._settings = context.settings
        self._host = context.host
        self.where = context.where
        self._forget = context.forget
        self._id = Identity(requested_ms=timeout_ms, timeout=timeout_ms / 1000.0)
        self.state: State = "new"
        self.dead_reason = ""
        self._conn: Connection | None = None
        self._pending = Pending()
        self._watches = Watches()
        self._listeners: set[Callable[[], None]] = set()
        self._changed = anyio.Event()
        self._last_received = now()
        #: When the latest request (or ping) the server answered was sent: the server heard
        #: the session no earlier, so the session cannot expire before this plus its timeout.
        self.heard_sent_at = now()
        self._pings: collections.deque[float] = collections.deque()
        self._idle_since = now()
        #: Calls in progress that need the session (an acquire waiting in the queue).
        self.users = 0
        self.reconnects = 0
        #: The session opened at connect: never closed for being idle.
        self.default = False
        self._scope = anyio.CancelScope()
        self._finished = anyio.Event()

    # -- hooks -------------------------------------------------------------------------------

    def _on_connected(self) -> None:
        """A connection was installed (the first one, or after a reconnect)."""

    def _on_death(self, reason: str) -> None:
        """The session died (after its state became ``dead``)."""

    async def _maintain(self) -> None:
        """Background work while connected (cancelled when the connection goes)."""

    def _busy(self) -> bool:
        """Whether the session has work that keeps it from being closed as idle."""
        return False

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def timeout(self) -> float:
        return self._id.timeout

    @property
    def session_id(self) -> int:
        return self._id.session_id

    @property
    def dead(self) -> bool:
        return self.state == "dead"

    @property
    def usable(self) -> bool:
        return self.state in ("connected", "suspended")

    @property
    def read_timeout(self) -> float:
        """Drop a connection that has not answered for this long (also bounds a stuck reply)."""
        return min(self.timeout * 2.0 / 3.0, self._settings.op_timeout)

    async def start(self, *, connecting: bool = False) -> None:
        """Create the session on one of the servers, or raise ``BackendUnavailable``: within
        ``op_timeout``, or while the client connects, for as long as the caller's scope
        (``connect_timeout``) lets it while servers accept connections."""
        deadline = math.inf if connecting else now() + self._settings.op_timeout
        try:
            conn = await self._connect(deadline, first=True)
        except BaseException:
            self.state = "dead"
            self.dead_reason = "could not be created"
            self._finished.set()
            raise
        self._install(conn)
        try:
            self._host.start_soon(self._run, name="asynclock zookeeper session")
        except BackendUnavailable:  # the backend closed while the session was made
            self.state = "dead"
            self._finished.set()
            await conn.aclose()
            raise

    async def _connect(self, deadline: float, *, first: bool) -> Connection:
        conn, sent_at = await connect(self._settings, self._id, self.where, deadline, first=first)
        self.heard_sent_at = max(self.heard_sent_at, sent_at)
        return conn

    def _install(self, conn: Connection) -> None:
        self._conn = conn
        self._pings.clear()
        self._last_received = now()
        self._set_state("connected")
        self._on_connected()

    async def _run(self) -> None:
        try:
            with self._scope:
                while self.state != "dead":
                    conn = self._conn
                    assert conn is not None
                    async with anyio.create_task_group() as tg:
                        conn.scope = tg.cancel_scope
                        tg.start_soon(conn.pump, self._dispatch, self._received)
                        tg.start_soon(self._ping_loop, conn)
                        tg.start_soon(self._maintain)
                    if not self.dead:
                        self._disconnected(conn)
                    await conn.aclose()
                    if self.dead:
                        break
                    await self._reconnect()
        except Exception as exc:  # a bug here must not take the other sessions down
            logger.exception("asynclock: ZooKeeper session 0x%x failed", self.session_id)
            self._die(f"internal error in the ZooKeeper session: {exc!r}")
        finally:
            if self._conn is not None:
                await self._conn.aclose()
            if self.state != "dead":
                self._die("the lock client was closed")
            self._finished.set()

    def _disconnected(self, conn: Connection) -> None:
        if self._conn is conn:
            self._conn = None
        self._pending.fail_all()
        self._set_state("suspended")
        logger.info(
            "asynclock: lost the connection to ZooKeeper %s (session 0x%x); reconnecting",
            conn.address,
            self.session_id,
        )

    async def _reconnect(self) -> None:
        # The server expires the session a session timeout after it last heard from us, so
        # once that has passed without contact there is nothing left to go back to.
        expires = self._last_received + self.timeout
        try:
            conn = await self._connect(expires, first=False)
        except SessionGone as exc:
            self._die(str(exc))
            return
        except BackendUnavailable:
            self._die(
                f"no ZooKeeper server answered for longer than the session timeout "
                f"({self.timeout:g} s); the server expires the session"
            )
            return
        logger.info(
            "asynclock: reconnected to ZooKeeper %s (session 0x%x)", conn.address, self.session_id
        )
        self.reconnects += 1
        self._install(conn)

    def _set_state(self, state: Literal["connected", "suspended", "dead"]) -> None:
        self.state = state
        changed, self._changed = self._changed, anyio.Event()
        changed.set()
        for listener in list(self._listeners):
            listener()

    def _die(self, reason: str) -> None:
        if self.state == "dead":
            return
        self.dead_reason = reason
        self._watches.clear()
        self._pending.fail_all()
        self._set_state("dead")
        self._listeners.clear()
        self._forget(self)
        if self._conn is not None:
            self._conn.broken()
        self._on_death(reason)

    async def aclose(self) -> None:
        """Close the session on the server (its nodes go at once) and stop its tasks."""
        try:
            if self.state == "connected":
                with anyio.move_on_after(min(self._settings.op_timeout, 2.0)):
                    with contextlib.suppress(Exception):
                        await self.call(_proto.close())
        finally:
            # Also when a native cancellation cut the close short: the tasks and the
            # connection end (the server then expires the session after its timeout).
            self._die("the lock client was closed")
            self._scope.cancel()
        if self.state != "new":
            with anyio.move_on_after(self._settings.op_timeout):
                await self._finished.wait()

    # -- the connection's tasks --------------------------------------------------------------

    def _received(self) -> None:
        self._last_received = now()

    def _dispatch(self, data: bytes) -> None:
        xid, zxid, err = struct.unpack_from("!iqi", data)
        if zxid > 0:
            self._id.last_zxid = max(self._id.last_zxid, zxid)
        body = data[16:]
        if xid == WATCH_XID:
            event = _proto.read_event(body)
            if event.type == NO_EVENT or not event.type:
                if event.state in (zk.WatchEvent.SESSION_EXPIRED, zk.WatchEvent.AUTH_FAILED):
                    self._die(
                        f"ZooKeeper ended session 0x{self.session_id:x} (state {event.state})"
                    )
                return
            self._watches.fire(event.path, event.type)
            return
        if xid == PING_XID:
            if self._pings:
                self.heard_sent_at = max(self.heard_sent_at, self._pings.popleft())
            return
        reply = self._pending.resolve(xid, err, body)
        if reply is not None:  # None: a request whose caller gave up
            self.heard_sent_at = max(self.heard_sent_at, reply.sent_at)

    async def _ping_loop(self, conn: Connection) -> None:
        # ZooKeeper's own keepalive (the protocol's ping, a share of the read timeout), not a
        # lease renewal: the core renews leases, on its own schedule.
        interval = self.read_timeout / 2.0
        ping = frame(zk.PingRequest().serialize(PING_XID))
        while True:
            await anyio.sleep(interval)
            current = now()
            if current - self._last_received > self.read_timeout:
                logger.info(
                    "asynclock: ZooKeeper %s did not answer for %.2g s; reconnecting",
                    conn.address,
                    current - self._last_received,
                )
                conn.broken()
                return
            if current - conn.last_sent >= interval * 0.9:
                self._pings.append(current)
                await conn.send(ping)
            if self._idle() and current - self._idle_since > IDLE_SESSION and not self.default:
                self._forget(self)
                if self._host.running:
                    self._host.start_soon(self.aclose, name="asynclock zookeeper idle session")
                return

    def _idle(self) -> bool:
        if self.users or self._busy():
            self._idle_since = now()
            return False
        return True

    # -- calls -------------------------------------------------------------------------------

    async def call(self, *requests: _proto.Request) -> list[Any]:
        """Send ``requests`` in one write and return their replies (errors as values).

        Raises ``ConnectionLoss`` when the outcome is unknown (no connection within
        ``op_timeout``, the connection broke, or no reply while the server said nothing for
        ``op_timeout`` or answered a later request: the connection is then dropped) and
        ``SessionGone`` when the session is dead.
        """
        if not requests:
            return []
        op_timeout = self._settings.op_timeout
        conn = await self._wait_connected(now() + op_timeout)
        entries, data = self._pending.add(requests)
        replies = [reply for _, reply in entries]
        last = replies[-1]
        try:
            sent_at = now()
            for reply in replies:
                reply.sent_at = sent_at
            await conn.send(data)  # a broken connection fails the replies (LOST)
            # A burst's requests are written at once, and the last of a thousand waits while
            # the server answers the ones before it: op_timeout runs from the last reply heard
            # while those come. The server answers a session's requests in order, so once it
            # answered one sent after ours (a ping, say), ours is lost: given up then.
            deadline = sent_at + op_timeout
            while last.value is PENDING:
                await last.wait(deadline)
                if last.value is not PENDING:
                    break
                heard = max(sent_at, self._last_received)
                if self.heard_sent_at > sent_at or now() - heard >= op_timeout:
                    conn.broken()
                    raise ConnectionLoss(f"{conn.address} did not answer for {op_timeout:g} s")
                deadline = heard + op_timeout
        finally:
            self._pending.discard(entries)
        values = [reply.value for reply in replies]
        if any(value is PENDING for value in values):
            # The last one came before an earlier one: not the order the server keeps.
            conn.broken()
            raise ConnectionLoss(f"{conn.address} answered out of order")
        if any(value is LOST for value in values):
            if self.state == "dead":
                raise SessionGone(self.dead_reason)
            raise ConnectionLoss(f"the connection to {conn.address} broke")
        return values

    async def _wait_connected(self, deadline: float) -> Connection:
        while True:
            if self.state == "dead":
                raise SessionGone(self.dead_reason)
            if self.state == "connected" and self._conn is not None:
                return self._conn
            changed = self._changed
            with anyio.move_on_at(deadline):
                await changed.wait()
            if now() >= deadline and self.state != "connected":
                if self.dead:
                    raise SessionGone(self.dead_reason)
                raise NotConnected(
                    f"not connected to ZooKeeper for {self._settings.op_timeout:g} s (op_timeout)"
                )

    async def call_retrying(self, *requests: _proto.Request) -> list[Any]:
        """``call`` for requests that are safe to repeat (reads, deletes, parent creates)."""
        for attempt in range(ATTEMPTS):
            try:
                return await self.call(*requests)
            except NotConnected:
                raise  # it waited op_timeout for a connection already
            except ConnectionLoss:
                if attempt + 1 == ATTEMPTS:
                    raise
        raise AssertionError("unreachable")

    # -- watches and state listeners ---------------------------------------------------------

    def add_watch(self, path: str, callback: Callable[[int], None]) -> None:
        self._watches.add(path, callback)

    def drop_watch(self, path: str, callback: Callable[[int], None]) -> None:
        self._watches.drop(path, callback)

    def add_listener(self, callback: Callable[[], None]) -> None:
        self._listeners.add(callback)

    def drop_listener(self, callback: Callable[[], None]) -> None:
        self._listeners.discard(callback)


class Wake:
    """What a waiter waits for: the event of its watch (called with the event's type) or a
    change of the session's state (called without). One small object and a future: an
    ``anyio.Event`` is an ``asyncio.Event`` with its deque and a future on top, three times
    the size, and one client may have thousands of waiters."""

    __slots__ = ("event", "future")

    def __init__(self) -> None:
        self.event = NO_EVENT
        self.future: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def __call__(self, event_type: int = NO_EVENT) -> None:
        if not self.future.done():
            self.event = event_type
            self.future.set_result(None)
