"""The connections to Redis, for every mode: redis-py's, with its handshake and hiredis.

Every connection here is a redis-py connection: redis-py opens it (TLS, AUTH, SELECT, CLIENT
SETNAME, as the URL says) and its parser (hiredis when installed) reads the replies. What this
module adds is writing and closing without an await, which redis-py does not offer, so that a
command and the undo behind it go out in order whatever happens to the caller. Two ways use it:

- :class:`Lane` (``redis://``, Sentinel, Cluster): a connection per call in flight, a few
  pooled; an interrupted call is undone behind it on the same connection;
- :mod:`._pipeline` (Redlock): one connection per master, every request written at once and
  the replies read in order, so a release never overtakes the take it undoes.

This is the one module that touches redis-py's private members (checked against redis-py
5.3.1, ``redis/asyncio/connection.py``'s ``AbstractConnection``); each use says why:

- ``_writer``: to write without an await (``send_packed_command`` awaits ``drain()`` and can be
  cancelled half-way), to see that the transport is closing, and to close without an await
  (``disconnect()`` awaits a lock, so a cancelled caller could leave the socket open);
- ``_reader`` (and the asyncio ``StreamReader``'s ``_buffer``): whether reply bytes have arrived
  unread, to tell a stalled event loop from a slow server; ``_reader = _writer = None`` is how
  redis-py itself marks a connection closed (``is_connected``);
- ``_connect()``: the step that opens the socket, overridden by :class:`Dialled` for connections
  that choose their server when they connect (Sentinel's master, any cluster node).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import select
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, cast

import anyio
import redis.asyncio
import redis.exceptions
from redis.asyncio.connection import AbstractConnection

try:
    from hiredis import pack_command as _hiredis_pack
except ImportError:  # pragma: no cover - hiredis comes with the redis extra
    _hiredis_pack = None  # type: ignore[assignment]

from .._kit import TaskHost, cancel_scope, now
from ._scripts import Arg, Script

logger = logging.getLogger("asynclock")


#: Calls in flight at once (so connections, draining ones aside); more calls wait their turn,
#: in order. No call blocks on the server, so a few connections serve any number of tasks.
MAX_BUSY: Final = 8
#: Idle connections a lane keeps; more are closed when their call ends.
_MAX_IDLE = MAX_BUSY
#: A timeout that fires this long after its deadline fired late: the event loop was stalled (the
#: process was paused, or something blocked the loop), and a reply may be waiting unread.
LATE_TIMER: Final = 0.02
#: How long a call whose timeout fired late, or found part of a reply already received, may
#: still read what has arrived.
LATE_GRACE: Final = 0.1
#: How long a connection with an interrupted call and its undo behind it is kept to read their
#: replies (and be reused) before it is closed; the server runs both in order either way.
_DRAIN_FOR = 30.0
#: How long a closing client waits for its connections to close (a TLS one waits for the
#: server's close_notify) before it aborts them.
CLOSE_GRACE: Final = 0.5


def pack(args: Sequence[str | int | float | bytes]) -> bytes:
    """One command in RESP: by hiredis (a lock script's call 1.1 us) unless it refuses ``args``
    (a list, a bool); else as redis-py writes it but without its per-argument encoders (4.8 us)."""
    if _hiredis_pack is not None and type(args) is tuple:
        try:
            return cast("bytes", _hiredis_pack(args))
        except TypeError:
            pass
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


def write_now(conn: AbstractConnection, packed: bytes) -> None:
    """Hand ``packed`` to the transport, without an await (nothing can cut it in half)."""
    writer = conn._writer
    if writer is None or writer.transport.is_closing():
        raise redis.exceptions.ConnectionError("the connection was closed")
    writer.write(packed)


def closing(conn: AbstractConnection) -> bool:
    """``conn`` is closed, or its transport is closing (the server closed it, say)."""
    writer = conn._writer
    return writer is None or writer.transport.is_closing()


def close_now(conn: AbstractConnection) -> asyncio.StreamWriter | None:
    """Close ``conn`` without an await (so no cancellation can keep it open). ``close()``, not
    ``abort()``: what is written already (a release) still goes out. Returns its writer, for
    :func:`finish_closing`."""
    writer = conn._writer
    if writer is not None:
        writer.close()
    conn._reader = conn._writer = None
    return writer


async def finish_closing(writers: Sequence[asyncio.StreamWriter], within: float) -> None:
    """Wait, shielded and for at most ``within`` seconds, until ``writers`` (closed already)
    have closed their sockets, and abort those that have not by then. A TLS connection's close
    sends its close_notify and closes the socket only when the peer has answered: a client whose
    event loop ends first leaves the socket open ("unclosed transport" when it is collected)."""
    left = list(writers)
    with anyio.CancelScope(shield=True), anyio.move_on_after(within):
        while left:
            with contextlib.suppress(Exception):  # how it ended is no matter here: it did
                await left[0].wait_closed()
            left.pop(0)
    for writer in left:
        writer.transport.abort()


def received(conn: AbstractConnection) -> bool:
    """Bytes (or the end of the stream) have arrived on ``conn`` that nobody has read yet:
    in the stream reader's buffer, or still in the kernel's socket buffer.

    The kernel is asked too because a process stopped just after the event loop polled its
    sockets runs its due timers, on resuming, before it polls again: the reply is then in the
    socket but not in the reader yet.
    """
    reader, writer = conn._reader, conn._writer
    if reader is None or writer is None:
        return False
    # StreamReader keeps them in ``_buffer``; there is no public way to ask without reading.
    if getattr(reader, "_buffer", b""):
        return True
    sock = writer.transport.get_extra_info("socket")
    if sock is None:
        return False
    try:
        if hasattr(select, "poll"):  # no limit on the descriptor's number, unlike select()
            poller = select.poll()
            poller.register(sock.fileno(), select.POLLIN)
            return bool(poller.poll(0))
        readable, _, _ = select.select([sock.fileno()], [], [], 0)
    except (OSError, ValueError):
        return False
    return bool(readable)


def _usable(conn: AbstractConnection) -> bool:
    """An idle connection that the server (or a proxy) has not closed meanwhile."""
    reader, writer = conn._reader, conn._writer
    if reader is None or writer is None or writer.transport.is_closing():
        return False
    return not reader.at_eof() and reader.exception() is None


async def read(conn: AbstractConnection) -> Any:
    """The next reply on ``conn``, for as long as it takes (the caller bounds the wait).

    ``disconnect_on_error=False``: an interrupted read leaves the connection and the parser's
    buffer as they were (its only await is the socket read), so it can be read again.
    ``timeout=None``: the connections have no socket timeout (``Settings.pool``), and any other
    value, ``math.inf`` too, costs a timeout context per read."""
    return await conn.read_response(timeout=None, disconnect_on_error=False)


class Dialled(redis.asyncio.Connection):
    """A redis-py connection that chooses its server when it connects: :meth:`dial` is given
    the step that opens the socket to ``self.host``/``self.port`` and calls it as it sees fit."""

    async def dial(self, open_socket: Callable[[], Any]) -> None:
        await open_socket()

    async def _connect(self) -> None:
        await self.dial(super()._connect)


class Undo:
    """What a :class:`Lane` sends after a call that was interrupted with its command in flight.

    A command whose reply did not come in time, or whose caller was cancelled after it was
    sent, may still run on the server. The lane then writes ``args`` on the *same* connection,
    right behind it and without an await, so the server runs the undo after the command, in
    that order, whenever it gets to them (also after a freeze), and nothing can cancel it.
    ``sent`` tells whether the command was written at least once (it may have run), ``queued``
    whether the undo went out behind it (then nothing is left to clean up).
    """

    __slots__ = ("args", "queued", "sent")

    def __init__(self, *args: str | int | float | bytes) -> None:
        self.args = args
        self.sent = False
        self.queued = False


class NotReplicated(redis.exceptions.RedisError):
    """``WAIT`` counted fewer replicas than asked for within its timeout: the write happened
    on the master but may be lost in a failover (the caller undoes a take)."""


@dataclass(frozen=True, slots=True)
class Wait:
    """``WAIT replicas timeout_ms`` sent behind a call on its connection, so that it counts
    the replicas that have that very write; ``needed(reply)`` tells whether this reply's
    write must be on them (a take that got the lock), else a shortfall is ignored."""

    replicas: int
    timeout_ms: int
    needed: Callable[[Any], bool]


class Lane:
    """Calls to one Redis server over redis-py connections, without its pool's per-call work.

    redis-py's client takes a lock, checks the socket, runs a retry wrapper and records metrics
    on every command; on loopback that is a quarter of a round trip, and a lock cycle is two
    round trips. A lane keeps idle connections in a list (last used first) and opens another
    when all are busy, up to :data:`MAX_BUSY` calls in flight; a call beyond that waits for
    one to end (first come, first served), never for the server.

    A connection that fails or is cancelled in mid-call is closed and never reused, so a late
    reply cannot reach the wrong caller (or, with an :class:`Undo`, it is reused only after both
    replies were read). An idle connection the server closed meanwhile (``CLIENT KILL``, a
    restart, a proxy reset) is dropped when it is next picked. A call that fails on a
    connection error is retried once on a fresh connection: every script here is idempotent for
    its owner id, so running it twice is safe.

    Timeouts are the lane's own, not the driver's: one that fires late (the loop was stalled, for
    example by a paused process), or finds reply bytes received but not read yet, lets the call
    read what arrived, for up to :data:`LATE_GRACE` seconds, before it counts as a timeout.
    """

    def __init__(
        self, pool: redis.asyncio.ConnectionPool, op_timeout: float, host: TaskHost
    ) -> None:
        self._pool = pool
        self._host = host
        self._op_timeout = op_timeout
        self._idle: list[AbstractConnection] = []
        self._every: set[AbstractConnection] = set()
        #: The drains running in the backend's task host (each stops when its scope is cancelled).
        self._drains: set[anyio.CancelScope] = set()
        self._closed = False
        #: Calls in flight, and the calls waiting for one of them to end.
        self._busy = 0
        self._turns: deque[anyio.Event] = deque()
        #: :class:`Wait` behind every call of these scripts (by sha). Set by backends that
        #: offer ``wait_replicas``; empty: no WAIT.
        self.wait_for: dict[str, Wait] = {}
        #: While the backend opens: calls and handshakes wait for as long as the client's
        #: ``connect_timeout`` lets them (the caller's scope), not ``op_timeout``.
        self.connecting = False

    @property
    def connections(self) -> int:
        """Open connections (idle and busy)."""
        return sum(1 for conn in self._every if conn.is_connected)

    @property
    def draining(self) -> int:
        """Connections that still wait for the replies of an interrupted call and its undo."""
        return len(self._drains)

    def _idle_connection(self) -> AbstractConnection | None:
        while self._idle:
            conn = self._idle.pop()
            if _usable(conn):
                return conn
            self._discard(conn)
        return None

    def _discard(self, conn: AbstractConnection) -> None:
        """Close ``conn`` now, without an await (so no cancellation can keep it open)."""
        self._every.discard(conn)
        close_now(conn)

    async def _open(self, conn: AbstractConnection) -> None:
        # The handshake (AUTH, CLIENT SETNAME, SELECT) reads replies with no socket timeout of
        # its own: bound it, or a frozen server would hold us for ever.
        limit = math.inf if self.connecting else self._op_timeout
        with cancel_scope(deadline=now() + limit) as scope:
            await conn.connect()  # type: ignore[no-untyped-call]
            return
        late = now() - scope.deadline > LATE_TIMER or received(conn)
        # Fired late, or the server did answer: a stalled loop, not a slow server. The state of
        # the half-done handshake is unknown, so it is not resumed; the caller gets a connection
        # error and tries a new connection.
        kind = redis.exceptions.ConnectionError if late else redis.exceptions.TimeoutError
        raise kind(f"no reply to the connection handshake within {self._op_timeout:g} s")

    async def _read(self, conn: AbstractConnection, limit: float) -> Any:
        # read_response() itself, not read(): one coroutine frame less on every call.
        if limit == math.inf:
            return await conn.read_response(timeout=None, disconnect_on_error=False)
        with cancel_scope(deadline=now() + limit) as scope:
            return await conn.read_response(timeout=None, disconnect_on_error=False)
        if now() - scope.deadline > LATE_TIMER or received(conn):
            # The timer ran well after its deadline, after a stall in which the reply may well
            # have come, or the reply is here already (the stall ended just after the deadline):
            # it is in the socket, just not read yet. Read what has arrived.
            with anyio.move_on_after(LATE_GRACE):
                return await read(conn)
        raise redis.exceptions.TimeoutError(f"no reply within {limit:g} s")

    async def call(
        self,
        *args: str | int | float | bytes,
        undo: Undo | None = None,
        wait: Wait | None = None,
    ) -> Any:
        """Send one command and return its reply.

        The reply must come within ``op_timeout`` seconds (while :attr:`connecting`, within the
        caller's scope). With ``undo``, a call interrupted after its command went out (timeout,
        cancellation) writes the undo behind it on the same connection before the error
        propagates (see :class:`Undo`). With ``wait``, ``WAIT`` follows the command on its
        connection, and fewer replicas than asked raise :class:`NotReplicated` after the command
        ran (if ``wait.needed(reply)``).
        """
        if self._closed:
            raise redis.exceptions.ConnectionError("the lock backend is closed")
        if self._busy < MAX_BUSY:
            self._busy += 1  # no await on the common path
        else:
            await self._wait_for_turn()
        try:
            return await self._call(args, undo, wait)
        finally:
            self._end_turn()

    async def _wait_for_turn(self) -> None:
        turn = anyio.Event()
        self._turns.append(turn)
        try:
            await turn.wait()
        except BaseException:
            if turn.is_set():
                self._end_turn()  # given to us as we were cancelled: pass it on
            else:
                self._turns.remove(turn)
            raise

    def _end_turn(self) -> None:
        # The next waiting call takes this one's place directly (the count stays).
        if self._turns:
            self._turns.popleft().set()
        else:
            self._busy -= 1

    async def _call(
        self,
        args: tuple[str | int | float | bytes, ...],
        undo: Undo | None,
        wait: Wait | None = None,
    ) -> Any:
        if self._closed:  # closed while this call waited for its turn
            raise redis.exceptions.ConnectionError("the lock backend is closed")
        limit = math.inf if self.connecting else self._op_timeout
        packed = pack(args)
        if wait is not None:
            packed += pack(("WAIT", wait.replicas, wait.timeout_ms))
        for attempt in (1, 2):
            # The retry always opens a new connection: the idle ones may all be dead alike.
            conn = self._idle_connection() if attempt == 1 else None
            if conn is None:
                conn = self._pool.make_connection()  # type: ignore[no-untyped-call]
                self._every.add(conn)
                try:
                    await self._open(conn)
                except redis.exceptions.ConnectionError:
                    if not self._retry_after_dropping(conn, attempt):
                        raise
                    continue
                except BaseException:
                    # Half set up (an error reply to SELECT, say): never to be used.
                    self._discard(conn)
                    raise
                if self._closed:
                    # aclose() ran during the handshake: it closed what it found, and this
                    # connection had no socket yet. Closed here, or nobody ever closes it.
                    self._discard(conn)
                    raise redis.exceptions.ConnectionError("the lock backend is closed")
            sent = False
            acked: Any = None
            try:
                write_now(conn, packed)
                sent = True
                if undo is not None:
                    undo.sent = True
                reply = await self._read(conn, limit)
                if wait is not None:
                    acked = await self._read(conn, limit + wait.timeout_ms / 1000)
            except redis.exceptions.ResponseError:
                if wait is None:
                    self._checkin(conn)  # an error reply: the connection itself is fine
                else:
                    self._discard(conn)  # WAIT's reply may still be on its way
                raise
            except redis.exceptions.ConnectionError:
                if not self._retry_after_dropping(conn, attempt):
                    raise
                continue
            except BaseException:
                # No reply in time, or cancelled: the command may still run on the server.
                replies = 2 if wait is None else 3
                if not (sent and undo is not None and self._queue_undo(conn, undo, replies)):
                    self._discard(conn)
                raise
            self._checkin(conn)
            if wait is not None and int(acked) < wait.replicas and wait.needed(reply):
                raise NotReplicated(
                    f"{int(acked)} of the {wait.replicas} replica(s) asked for (wait_replicas) "
                    f"had the write within {wait.timeout_ms} ms (wait_timeout)"
                )
            return reply
        raise AssertionError("unreachable")

    def _retry_after_dropping(self, conn: AbstractConnection, attempt: int) -> bool:
        """``conn`` broke: close it; True if the call may be tried once more (on a new one)."""
        self._discard(conn)
        return attempt == 1 and not self._closed

    def _queue_undo(self, conn: AbstractConnection, undo: Undo, replies: int = 2) -> bool:
        if closing(conn) or self._closed or not self._host.running:
            return False
        write_now(conn, pack(undo.args))
        undo.queued = True
        scope = anyio.CancelScope()
        self._drains.add(scope)
        self._host.start_soon(
            self._drain, conn, replies, scope, name="asynclock: redis undo replies"
        )
        return True

    async def _drain(
        self, conn: AbstractConnection, replies: int, scope: anyio.CancelScope
    ) -> None:
        """Read the replies of an interrupted call and its undo, then reuse the connection."""
        try:
            with scope, anyio.move_on_after(max(_DRAIN_FOR, self._op_timeout)):
                for _ in range(replies):
                    # An error reply (NOSCRIPT, say) is a whole reply too.
                    with contextlib.suppress(redis.exceptions.ResponseError):
                        await read(conn)
                self._checkin(conn)
                return
        except Exception as exc:
            logger.debug("asynclock: reading the replies of an undone call: %r", exc)
        finally:
            self._drains.discard(scope)
            if conn in self._every and conn not in self._idle:
                self._discard(conn)

    def _checkin(self, conn: AbstractConnection) -> None:
        if len(self._idle) < _MAX_IDLE and not self._closed:
            self._idle.append(conn)
        else:
            # A burst is over: do not keep every connection it needed.
            self._discard(conn)

    async def script(
        self,
        script: Script,
        keys: Sequence[str],
        args: Sequence[Arg],
        undo: Undo | None = None,
    ) -> Any:
        """``EVALSHA``, loading the script first if the server does not know it (a restart
        flushes scripts), followed by ``WAIT`` if :attr:`wait_for` names the script."""
        wait = self.wait_for.get(script.sha)
        command = ("EVALSHA", script.sha, len(keys), *keys, *args)
        try:
            return await self.call(*command, undo=undo, wait=wait)
        except redis.exceptions.NoScriptError:
            await self.call("SCRIPT", "LOAD", script.text)
            return await self.call(*command, undo=undo, wait=wait)

    async def aclose(self) -> None:
        """Close every connection, busy ones included (their callers get a connection error)."""
        self._closed = True
        self._idle.clear()
        # The drains end with the backend's task host; their connections are closed here.
        for scope in list(self._drains):
            scope.cancel()
        every, self._every = self._every, set()
        writers = [writer for conn in every if (writer := close_now(conn)) is not None]
        await finish_closing(writers, CLOSE_GRACE)
