"""What the ``redis://`` and ``redlock://`` backends share: Lua scripts, key names, connection
settings and the translation of redis-py's errors.

Imported only by those two backends, so redis-py is loaded only when one of them is used.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import random
import select
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import unquote

import anyio
import redis.asyncio
import redis.exceptions
from redis.asyncio.connection import AbstractConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from .._errors import (
    BackendTimeout,
    BackendUnavailable,
    ExceptionMapping,
    InvalidArgument,
    InvalidURL,
)
from .._validate import Options

logger = logging.getLogger("asynclock")

#: Key prefix used when the ``prefix`` option is not given.
DEFAULT_PREFIX: Final = "asynclock:"
#: Bound of every single server call, in seconds, unless ``op_timeout`` says otherwise.
DEFAULT_OP_TIMEOUT: Final = 5.0
#: Name the connections carry in ``CLIENT LIST``.
DEFAULT_CLIENT_NAME: Final = "asynclock"

# Each kind of key has its own tag; no tag is a prefix of another, and the lock name is the
# rest of the key, so distinct names (and kinds) always give distinct keys.
LOCK_TAG: Final = "lock:"
TOKEN_TAG: Final = "token:"
QUEUE_TAG: Final = "queue:"
QUEUE_TTL_TAG: Final = "queue-ttl:"
WAKE_TAG: Final = "wake:"
#: Deadlock detection's two keys (whole keys, not tags: no lock name follows).
WAITERS_KEY: Final = "deadlock:waiters"
WAITERS_TTL_KEY: Final = "deadlock:expiry"

#: Driver errors, most specific first (``map_exceptions`` takes the first match). The builtin
#: ``TimeoutError`` comes from our own ``anyio.fail_after`` bounds.
ERRORS: Final[ExceptionMapping] = {
    TimeoutError: BackendTimeout,
    redis.exceptions.TimeoutError: BackendTimeout,
    redis.exceptions.RedisError: BackendUnavailable,
    OSError: BackendUnavailable,
}


def lock_key(prefix: str, name: str) -> str:
    """The key that holds the lock ``name`` (its value is the owner id of the lease)."""
    return f"{prefix}{LOCK_TAG}{name}"


def token_key(prefix: str, name: str) -> str:
    """The fencing counter of ``name`` (the last token); it never expires. The take never
    hands out less than the server's clock in microseconds (see ``next_token`` in
    :data:`TAKE`), so a counter lost or restored old in a restart does not repeat tokens."""
    return f"{prefix}{TOKEN_TAG}{name}"


def queue_key(prefix: str, name: str) -> str:
    """Sorted set of the waiters for ``name``, scored by arrival."""
    return f"{prefix}{QUEUE_TAG}{name}"


def queue_ttl_key(prefix: str, name: str) -> str:
    """Sorted set of the same waiters, scored by when their place expires (server ms)."""
    return f"{prefix}{QUEUE_TTL_TAG}{name}"


def wake_prefix(prefix: str) -> str:
    """Prefix of the per-waiter wake lists (``<prefix>wake:<owner id>``)."""
    return f"{prefix}{WAKE_TAG}"


@dataclass(frozen=True, slots=True)
class Script:
    """A Lua script and its SHA1, for ``EVALSHA``."""

    text: str
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.text.encode()).hexdigest())


# -- Lua ------------------------------------------------------------------------------------
#
# Every script is idempotent for one owner id: redis-py retries a call once after reconnecting,
# and a retry of a call whose reply was lost must find the same state, not a new one.

#: Renew many locks in one call. KEYS: lock keys. ARGV: owner ids, then ttls in ms, one each.
#: Returns one code per key: 1 renewed, 0 the key is gone, -1 another owner holds it.
RENEW: Final = Script(
    """
local n = #KEYS
local out = {}
for i = 1, n do
  local holder = redis.call('GET', KEYS[i])
  if holder == ARGV[i] then
    redis.call('PEXPIRE', KEYS[i], ARGV[n + i])
    out[i] = 1
  elseif holder then
    out[i] = -1
  else
    out[i] = 0
  end
end
return out
"""
)

#: Which locks are still ours (after a restart, say), changing nothing. KEYS: lock keys. ARGV:
#: owner ids, one each. Returns one code per key, as :data:`RENEW` does.
HELD: Final = Script(
    """
local out = {}
for i = 1, #KEYS do
  local holder = redis.call('GET', KEYS[i])
  if holder == ARGV[i] then
    out[i] = 1
  elseif holder then
    out[i] = -1
  else
    out[i] = 0
  end
end
return out
"""
)

#: Redlock's take on one master. KEYS: lock key. ARGV: owner id, ttl in ms.
#: Returns {1, 0} when the lock is ours now, {0, pttl of the holder} otherwise.
REDLOCK_TAKE: Final = Script(
    """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {1, 0}
end
if holder then
  return {0, redis.call('PTTL', KEYS[1])}
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return {1, 0}
"""
)

#: Delete the lock if, and only if, its value is our owner id. KEYS: lock key. ARGV: owner id.
COMPARE_AND_DELETE: Final = Script(
    """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""
)

# The fair queue of the single-instance backend. KEYS, for all three scripts: the lock key, the
# fencing counter, the queue (arrival order) and the queue's expiry set. ARGV[1] is the owner id
# of the lease (which is also its name in the queue), ARGV[2] the wake-list prefix and ARGV[3] how
# long, in ms, a waiter's place lasts without a refresh.
_QUEUE_FUNCTIONS = """
local lock, counter, queue, expiry = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local owner, wake, waiter_ttl = ARGV[1], ARGV[2], tonumber(ARGV[3])

local function server_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- The next fencing token: one more than the last, but never below the server's clock in
-- microseconds. So a counter that Redis forgot (a restart without persistence, an eviction) or
-- brought back old (an RDB snapshot, the last second of an AOF lost in a crash) still gives a
-- token above every one handed out before, as long as the clock does not go back and the name
-- was taken fewer times than microseconds went by. Below 2^53: exact as a Lua number.
local function next_token()
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local last = redis.call('GET', counter)
  local token = math.max(last and tonumber(last) + 1 or 0, now)
  redis.call('SET', counter, string.format('%d', token))
  return token
end

-- Forget waiters whose place expired (their process died or stalled).
local function prune(now)
  local dead = redis.call('ZRANGEBYSCORE', expiry, '-inf', now)
  for _, member in ipairs(dead) do
    redis.call('ZREM', queue, member)
    redis.call('ZREM', expiry, member)
    redis.call('DEL', wake .. member)
  end
end

-- Tell the first live waiter to look again: its wake list gets one element, which its BLPOP
-- takes at once or on its next wait.
local function wake_head()
  if redis.call('EXISTS', queue) == 0 then
    return nil
  end
  prune(server_ms())
  local head = redis.call('ZRANGE', queue, 0, 0)[1]
  if head then
    redis.call('DEL', wake .. head)
    redis.call('RPUSH', wake .. head, 1)
    redis.call('PEXPIRE', wake .. head, waiter_ttl)
  end
  return head
end
"""

#: Take the lock, or (``ARGV[5] == 'wait'``) join or refresh the queue. ARGV[4]: ttl in ms.
#: Returns {1, token} when the lock is ours, else {0, hint}: ms until it is worth looking again
#: (-1: no idea, wait for a wake or the refresh interval).
TAKE: Final = Script(
    _QUEUE_FUNCTIONS
    + """
local ttl, mode = ARGV[4], ARGV[5]
local holder = redis.call('GET', lock)
if holder == owner then
  -- A retried take whose first reply was lost: the lock is ours already.
  redis.call('PEXPIRE', lock, ttl)
  return {1, tonumber(redis.call('GET', counter))}
end
if not holder and redis.call('EXISTS', queue) == 0 then
  -- Free and nobody waits: the common case.
  redis.call('SET', lock, owner, 'PX', ttl)
  redis.call('DEL', wake .. owner)
  return {1, next_token()}
end
local now = server_ms()
prune(now)
local head = redis.call('ZRANGE', queue, 0, 0)[1]
if not holder and (not head or head == owner) then
  redis.call('SET', lock, owner, 'PX', ttl)
  local token = next_token()
  redis.call('DEL', wake .. owner)
  if head then
    redis.call('ZREM', queue, owner)
    redis.call('ZREM', expiry, owner)
    -- The next in line is first now: wake it, so that it learns when this lease would expire
    -- and takes over on time if this holder dies or stalls without releasing.
    wake_head()
  end
  return {1, token}
end
if mode ~= 'wait' then
  return {0, -1}
end
if not redis.call('ZSCORE', queue, owner) then
  local last = redis.call('ZRANGE', queue, -1, -1, 'WITHSCORES')
  local score = 0
  if last[2] then
    score = tonumber(last[2]) + 1
  end
  redis.call('ZADD', queue, score, owner)
  if not head then
    head = owner
  end
end
redis.call('ZADD', expiry, now + waiter_ttl, owner)
for _, key in ipairs({queue, expiry}) do
  if redis.call('PTTL', key) < waiter_ttl then
    redis.call('PEXPIRE', key, waiter_ttl)
  end
end
if holder then
  if head == owner then
    return {0, redis.call('PTTL', lock)}
  end
  return {0, -1}
end
-- Free, but another waiter is first: make sure it knows, and look again when its place
-- would run out if it never comes.
wake_head()
return {0, math.floor(tonumber(redis.call('ZSCORE', expiry, head))) - now}
"""
)

#: What ``asynclock status`` shows, in one atomic read. KEYS as for TAKE. Returns {holder or
#: false, ms left, counter, live waiters}.
INSPECT: Final = Script(
    """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return {
  redis.call('GET', KEYS[1]),
  redis.call('PTTL', KEYS[1]),
  redis.call('GET', KEYS[2]),
  redis.call('ZCOUNT', KEYS[4], '(' .. now, '+inf'),
}
"""
)

#: Release: delete the lock if it is ours and wake the first waiter. Returns 1 if deleted.
RELEASE: Final = Script(
    _QUEUE_FUNCTIONS
    + """
if redis.call('GET', lock) ~= owner then
  return 0
end
redis.call('DEL', lock)
wake_head()
return 1
"""
)

#: Undo whatever an interrupted acquire may have left: the lock if it is ours (a take whose
#: reply never came), our place in the queue, our wake list; then, if the lock is free, wake
#: the next waiter (we may have been woken and are not going to take it).
LEAVE: Final = Script(
    _QUEUE_FUNCTIONS
    + """
if redis.call('GET', lock) == owner then
  redis.call('DEL', lock)
end
redis.call('ZREM', queue, owner)
redis.call('ZREM', expiry, owner)
redis.call('DEL', wake .. owner)
if redis.call('EXISTS', lock) == 0 then
  wake_head()
end
return 1
"""
)


# Deadlock detection's wait-for records: a hash of records and a sorted set of when each
# expires (server ms). KEYS: the hash, the sorted set.

#: ARGV: record key, value, ttl in ms.
PUBLISH_WAITER: Final = Script(
    """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[3])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[2], now + ttl, ARGV[1])
for _, key in ipairs(KEYS) do
  if redis.call('PTTL', key) < ttl then
    redis.call('PEXPIRE', key, ttl)
  end
end
return 1
"""
)

#: ARGV: record key.
WITHDRAW_WAITER: Final = Script(
    """
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
"""
)

#: Drop expired records, return the values of the others.
SCAN_WAITERS: Final = Script(
    """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for _, key in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)) do
  redis.call('HDEL', KEYS[1], key)
  redis.call('ZREM', KEYS[2], key)
end
return redis.call('HVALS', KEYS[1])
"""
)

# -- URLs and connections --------------------------------------------------------------------

_SSL_CERT_REQS = ("none", "optional", "required")
_SSL_OPTIONS = (
    "ssl_ca_certs",
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_cert_reqs",
    "ssl_check_hostname",
)
#: Options every Redis-based backend understands.
COMMON_OPTIONS: Final = ("prefix", "op_timeout", "client_name", *_SSL_OPTIONS)


@dataclass(frozen=True, slots=True)
class Address:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class Settings:
    """How to reach one or more Redis servers (everything but the address)."""

    db: int
    username: str | None
    password: str | None
    tls: bool
    prefix: str
    op_timeout: float
    client_name: str
    ssl_ca_certs: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_cert_reqs: str = "required"
    ssl_check_hostname: bool = True

    def pool(self, address: Address) -> redis.asyncio.ConnectionPool:
        """A redis-py connection factory for ``address`` (no I/O yet); :class:`Lane` uses it.

        Reads have no socket timeout of their own: :class:`Lane` bounds each call (BLPOP waits
        longer than ``op_timeout`` by design). A failed connect is retried once, at once.
        """
        extra: dict[str, Any] = {}
        connection_class: type[AbstractConnection] = redis.asyncio.Connection
        if self.tls:
            connection_class = redis.asyncio.SSLConnection
            extra = {
                "ssl_ca_certs": self.ssl_ca_certs,
                "ssl_certfile": self.ssl_certfile,
                "ssl_keyfile": self.ssl_keyfile,
                "ssl_cert_reqs": self.ssl_cert_reqs,
                "ssl_check_hostname": self.ssl_check_hostname,
            }
        return redis.asyncio.ConnectionPool(
            connection_class=connection_class,
            host=address.host,
            port=address.port,
            db=self.db,
            username=self.username,
            password=self.password,
            socket_timeout=None,
            socket_connect_timeout=self.op_timeout,
            retry=Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,)),
            client_name=self.client_name or None,
            **extra,
        )


def pack(args: Sequence[str | int | float | bytes]) -> bytes:
    """One command in RESP, the way redis-py's ``pack_command`` writes it but without its
    per-argument encoder calls (a third of a call's client-side time)."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


#: Idle connections a lane keeps; more are closed when their call ends.
_MAX_IDLE = 16
#: A timeout that fires this long after its deadline fired late: the event loop was stalled (the
#: process was paused, or something blocked the loop), and a reply may be waiting unread.
LATE_TIMER: Final = 0.02
#: How long a call whose timeout fired late, or found part of a reply already received, may
#: still read what has arrived.
LATE_GRACE: Final = 0.1
#: How long a connection with an interrupted call and its undo behind it is kept to read their
#: replies (and be reused) before it is closed; the server runs both in order either way.
_DRAIN_FOR = 30.0


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


def _write(conn: AbstractConnection, packed: bytes) -> None:
    """Hand ``packed`` to the transport, without an await (nothing can cut it in half)."""
    writer = conn._writer
    if writer is None or writer.transport.is_closing():
        raise redis.exceptions.ConnectionError("the connection was closed")
    writer.write(packed)


def _received(conn: AbstractConnection) -> bool:
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


class Lane:
    """Calls to one Redis server over redis-py connections, without its pool's per-call work.

    redis-py's client takes a lock, checks the socket, runs a retry wrapper and records metrics
    on every command; on loopback that is a quarter of a round trip, and a lock cycle is two
    round trips. A lane keeps idle connections in a list (last used first) and opens another
    when all are busy, so concurrent calls never wait for each other.

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

    def __init__(self, pool: redis.asyncio.ConnectionPool, op_timeout: float) -> None:
        self._pool = pool
        self._op_timeout = op_timeout
        self._idle: list[AbstractConnection] = []
        self._every: set[AbstractConnection] = set()
        self._drains: set[asyncio.Task[None]] = set()
        self._closed = False

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
        if conn._writer is not None:
            conn._writer.close()
        conn._reader = conn._writer = None

    async def _open(self, conn: AbstractConnection) -> None:
        # The handshake (AUTH, CLIENT SETNAME, SELECT) reads replies with no socket timeout of
        # its own: bound it, or a frozen server would hold us for ever.
        with anyio.CancelScope(deadline=anyio.current_time() + self._op_timeout) as scope:
            await conn.connect()  # type: ignore[no-untyped-call]
            return
        late = anyio.current_time() - scope.deadline > LATE_TIMER or _received(conn)
        # Fired late, or the server did answer: a stalled loop, not a slow server. The state of
        # the half-done handshake is unknown, so it is not resumed; the caller gets a connection
        # error and tries a new connection.
        kind = redis.exceptions.ConnectionError if late else redis.exceptions.TimeoutError
        raise kind(f"no reply to the connection handshake within {self._op_timeout:g} s")

    async def _read(self, conn: AbstractConnection, limit: float) -> Any:
        # disconnect_on_error=False: an interrupted read leaves the connection and hiredis's
        # buffer as they were (its only await is the socket read), so it can be read again.
        if limit == math.inf:
            return await conn.read_response(timeout=math.inf, disconnect_on_error=False)
        with anyio.CancelScope(deadline=anyio.current_time() + limit) as scope:
            return await conn.read_response(timeout=math.inf, disconnect_on_error=False)
        if anyio.current_time() - scope.deadline > LATE_TIMER or _received(conn):
            # The timer ran well after its deadline, after a stall in which the reply may well
            # have come, or the reply is here already (the stall ended just after the deadline):
            # it is in the socket, just not read yet. Read what has arrived.
            with anyio.move_on_after(LATE_GRACE):
                return await conn.read_response(timeout=math.inf, disconnect_on_error=False)
        raise redis.exceptions.TimeoutError(f"no reply within {limit:g} s")

    async def call(
        self,
        *args: str | int | float | bytes,
        timeout: float | None = None,
        undo: Undo | None = None,
    ) -> Any:
        """Send one command and return its reply.

        The reply must come within ``timeout`` seconds (``op_timeout`` by default; ``math.inf``
        waits for ever, for blocking commands that the caller bounds). With ``undo``, a call
        interrupted after its command went out (timeout, cancellation) writes the undo behind
        it on the same connection before the error propagates (see :class:`Undo`).
        """
        if self._closed:
            raise redis.exceptions.ConnectionError("the lock backend is closed")
        limit = self._op_timeout if timeout is None else timeout
        packed = pack(args)
        for attempt in (1, 2):
            # The retry always opens a new connection: the idle ones may all be dead alike.
            conn = self._idle_connection() if attempt == 1 else None
            if conn is None:
                conn = self._pool.make_connection()  # type: ignore[no-untyped-call]
                self._every.add(conn)
                try:
                    await self._open(conn)
                except redis.exceptions.ConnectionError:
                    self._discard(conn)
                    if attempt == 2 or self._closed:
                        raise
                    continue
                except BaseException:
                    # Half set up (an error reply to SELECT, say): never to be used.
                    self._discard(conn)
                    raise
            sent = False
            try:
                _write(conn, packed)
                sent = True
                if undo is not None:
                    undo.sent = True
                reply = await self._read(conn, limit)
            except redis.exceptions.ResponseError:
                self._checkin(conn)  # an error reply: the connection itself is fine
                raise
            except redis.exceptions.ConnectionError:
                self._discard(conn)
                if attempt == 2 or self._closed:
                    raise
                continue
            except BaseException:
                # No reply in time, or cancelled: the command may still run on the server.
                if not (sent and undo is not None and self._queue_undo(conn, undo)):
                    self._discard(conn)
                raise
            self._checkin(conn)
            return reply
        raise AssertionError("unreachable")

    def _queue_undo(self, conn: AbstractConnection, undo: Undo) -> bool:
        writer = conn._writer
        if writer is None or writer.transport.is_closing() or self._closed:
            return False
        writer.write(pack(undo.args))
        undo.queued = True
        task = asyncio.get_running_loop().create_task(self._drain(conn, 2))
        self._drains.add(task)
        task.add_done_callback(self._drains.discard)
        return True

    async def _drain(self, conn: AbstractConnection, replies: int) -> None:
        """Read the replies of an interrupted call and its undo, then reuse the connection."""
        try:
            with anyio.move_on_after(max(_DRAIN_FOR, self._op_timeout)):
                for _ in range(replies):
                    # An error reply (NOSCRIPT, say) is a whole reply too.
                    with contextlib.suppress(redis.exceptions.ResponseError):
                        await conn.read_response(timeout=math.inf, disconnect_on_error=False)
                self._checkin(conn)
                return
        except Exception as exc:
            logger.debug("asynclock: reading the replies of an undone call: %r", exc)
        finally:
            if conn in self._every and conn not in self._idle:
                self._discard(conn)

    def _checkin(self, conn: AbstractConnection) -> None:
        if len(self._idle) < _MAX_IDLE and not self._closed:
            self._idle.append(conn)
        else:
            # A burst of waiters (one connection each) is over: do not keep them all.
            self._discard(conn)

    async def script(
        self,
        script: Script,
        keys: Sequence[str],
        args: Sequence[str | int],
        undo: Undo | None = None,
    ) -> Any:
        """``EVALSHA``, loading the script first if the server does not know it (a restart
        flushes scripts)."""
        try:
            return await self.call("EVALSHA", script.sha, len(keys), *keys, *args, undo=undo)
        except redis.exceptions.NoScriptError:
            await self.call("SCRIPT", "LOAD", script.text)
            return await self.call("EVALSHA", script.sha, len(keys), *keys, *args, undo=undo)

    async def aclose(self) -> None:
        """Close every connection, busy ones included (their callers get a connection error)."""
        self._closed = True
        self._idle.clear()
        drains, self._drains = self._drains, set()
        for task in drains:
            task.cancel()
        every, self._every = self._every, set()
        for conn in every:
            if conn._writer is not None:
                conn._writer.close()
            conn._reader = conn._writer = None
        if drains:
            with anyio.CancelScope(shield=True), anyio.move_on_after(1.0):
                await asyncio.wait(drains)


def parse_address(text: str, url: str, example: str) -> Address:
    """``host``, ``host:port``, ``[v6]`` or ``[v6]:port``; the port defaults to 6379."""
    text = text.strip()
    if not text:
        raise InvalidURL(f"{url!r} names no host; expected for example {example}")
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not host:
            raise InvalidURL(f"{url!r}: unbalanced '[' in {text!r}; expected for example {example}")
        if rest and not rest.startswith(":"):
            raise InvalidURL(f"{url!r}: unexpected {rest!r} after {host!r}")
        port_text = rest[1:] if rest else ""
    else:
        if text.count(":") > 1:
            raise InvalidURL(
                f"{url!r}: IPv6 addresses go in brackets, as in [::1]:6379; expected for "
                f"example {example}"
            )
        host, _, port_text = text.partition(":")
        if not host:
            raise InvalidURL(f"{url!r} names no host in {text!r}; expected for example {example}")
    port = 6379
    if port_text:
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise InvalidURL(
                f"{url!r}: port {port_text!r} is not a number from 1 to 65535; expected for "
                f"example {example}"
            )
        port = int(port_text)
    return Address(host, port)


def parse_db(path: str, url: str, example: str) -> int:
    db_text = path.strip("/")
    if not db_text:
        return 0
    if not db_text.isdigit():
        raise InvalidURL(
            f"{url!r}: the path must be a database number such as /0, got {path!r}; expected "
            f"for example {example}"
        )
    return int(db_text)


def split_userinfo(netloc: str) -> tuple[str | None, str | None, str]:
    """``user:password@hosts`` into its (percent-decoded) parts; an empty user is no user."""
    userinfo, at, hosts = netloc.rpartition("@")
    if not at:
        return None, None, netloc
    user, colon, password = userinfo.partition(":")
    return (unquote(user) or None), (unquote(password) if colon else None), hosts


def common_settings(
    opts: Options,
    *,
    source: str,
    db: int,
    username: str | None,
    password: str | None,
    tls: bool,
) -> Settings:
    """Read the options all Redis backends share (``opts.finish()`` is left to the caller)."""
    prefix = opts.text("prefix", DEFAULT_PREFIX)
    op_timeout = opts.number("op_timeout", DEFAULT_OP_TIMEOUT, minimum=0.001)
    client_name = opts.text("client_name", DEFAULT_CLIENT_NAME)
    if any(ch.isspace() or ord(ch) < 0x21 for ch in client_name):
        raise InvalidArgument(
            f"option 'client_name' of {source} must be a name without spaces (or empty, to "
            f"send no CLIENT SETNAME), got {client_name!r}"
        )
    given_ssl = [key for key in _SSL_OPTIONS if key in opts]
    if given_ssl and not tls:
        raise InvalidArgument(
            f"{', '.join(given_ssl)} only apply to TLS connections: use "
            + ("rediss://" if source.startswith("redis") else "the option tls=true")
        )
    cert_reqs = opts.text("ssl_cert_reqs", "required").lower()
    if cert_reqs not in _SSL_CERT_REQS:
        raise InvalidArgument(
            f"option 'ssl_cert_reqs' of {source} must be one of {', '.join(_SSL_CERT_REQS)}, "
            f"got {cert_reqs!r}"
        )
    return Settings(
        db=db,
        username=username,
        password=password,
        tls=tls,
        prefix=prefix,
        op_timeout=op_timeout,
        client_name=client_name,
        ssl_ca_certs=opts.optional_text("ssl_ca_certs"),
        ssl_certfile=opts.optional_text("ssl_certfile"),
        ssl_keyfile=opts.optional_text("ssl_keyfile"),
        ssl_cert_reqs=cert_reqs,
        ssl_check_hostname=opts.flag("ssl_check_hostname", True),
    )


def ttl_ms(ttl: float) -> int:
    """The ttl in whole milliseconds as the server applies it (never rounded up)."""
    return math.floor(ttl * 1000 + 1e-6)


def check_ttl_ms(ttl: float, source: str, minimum_ms: int = 1) -> None:
    if ttl_ms(ttl) < minimum_ms:
        raise InvalidArgument(
            f"{source} stores ttls in whole milliseconds; {ttl!r} s is below {minimum_ms} ms"
        )


def jittered(seconds: float) -> float:
    """``seconds`` scaled by a random factor in [0.5, 1]: waiters that would retry together
    spread out."""
    return seconds * random.uniform(0.5, 1.0)


def codes(reply: object, expected: int) -> list[int]:
    """A script's list of integer codes, checked, so a surprise is an error and not a guess."""
    if not isinstance(reply, list) or len(reply) != expected:
        raise BackendUnavailable(f"unexpected reply from a lock script: {reply!r}")
    return [int(code) for code in reply]


def as_text(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)
