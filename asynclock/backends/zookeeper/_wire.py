"""The wire: one TCP connection to one server, framed, and the handshake that opens or
resumes a session on it.

The requests and replies are ``_proto.py``'s; the handshake's (connect, credentials) and the
ping's are aiozk's classes, as are the error codes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import anyio
import anyio.lowlevel
from aiozk import protocol as zk

from .._kit import BackendUnavailable, HostPort, RetryPolicy, now
from ._errors import SessionGone, error_for
from ._proto import Request
from ._urls import Settings

__all__ = (
    "AUTH_XID",
    "LOST",
    "NO_EVENT",
    "PENDING",
    "PING_XID",
    "WATCH_XID",
    "Connection",
    "Identity",
    "Pending",
    "Reply",
    "Watches",
    "connect",
    "frame",
)

logger = logging.getLogger("asynclock.zookeeper")

PING_XID = -2
AUTH_XID = -4
WATCH_XID = -1
NO_EVENT = -1
_MAX_FRAME = 64 * 1024 * 1024
_INT = struct.Struct("!i")

#: Pauses between passes over the servers while a session reconnects (each jittered down to
#: half). The cap bounds how long after a leader election the client is back: members refuse
#: clients while they elect, and a cap of 0.5 s made locks work again only 0.6-0.7 s after a
#: leader kill although the election took 0.35 s. An attempt on a member that refuses costs a
#: TCP connect and close; the session timeout bounds how long it goes on.
RETRY = RetryPolicy(first=0.02, cap=0.1, factor=2.0, jitter=0.5)


def frame(payload: bytes) -> bytes:
    return struct.pack("!i", len(payload)) + payload


class Connection(asyncio.Protocol):
    """One TCP connection to one server, framed as ZooKeeper frames (length-prefixed).

    An asyncio protocol, not an anyio stream: a request is written to the transport as it is
    sent (one ``write``, whole frames, in the order of the calls: no lock, no await unless the
    transport asks to pause); the replies are read by the protocol and dispatched in the
    pump's task. Through anyio's stream each send took a lock and a checkpoint (two passes of
    the event loop more per request). ZooKeeper is asyncio-only here
    (aiozk's serialisation; ``trio`` is refused by name)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.buffer = bytearray()
        self.last_sent = now()
        #: The session's task group while the connection serves it: cancelled when it breaks.
        self.scope: anyio.CancelScope | None = None
        self._transport: asyncio.Transport | None = None
        #: Done when the connection is lost; ``_readable`` when bytes came (or it was lost).
        self._lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._readable: asyncio.Future[None] | None = None
        #: Told when bytes come, while :meth:`pump` runs (the session's read timeout).
        self._received: Callable[[], None] | None = None
        self._drained: asyncio.Future[None] | None = None

    # -- asyncio's callbacks -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self._received is not None:
            # The server was heard now, whenever the reader gets to the frames: a read timeout
            # measures the server's silence, not how long this process took over a burst.
            self._received()
        _wake(self._readable)

    def connection_lost(self, exc: Exception | None) -> None:
        _wake(self._lost)
        _wake(self._readable)
        _wake(self._drained)

    def pause_writing(self) -> None:
        if self._drained is None:
            self._drained = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        drained, self._drained = self._drained, None
        _wake(drained)

    # -- ours ----------------------------------------------------------------------------

    async def send(self, data: bytes) -> None:
        """Write ``data`` (whole frames) at once; wait only while the transport's buffer is
        full. On a connection that is lost or closing the data goes nowhere: the pump ends the
        connection, and its session fails the replies waited for (``Pending.fail_all``), as
        when the connection breaks after a send. Raising here instead, before the session
        knows, would spend a caller's retries at once."""
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        transport.write(data)
        self.last_sent = now()
        if self._drained is not None:
            await asyncio.shield(self._drained)

    def next_frame(self) -> bytes | None:
        if len(self.buffer) < 4:
            return None
        (size,) = _INT.unpack_from(self.buffer)
        if not 0 <= size <= _MAX_FRAME:
            raise ValueError(f"bad frame length {size}")
        if len(self.buffer) < 4 + size:
            return None
        frame = bytes(self.buffer[4 : 4 + size])
        del self.buffer[: 4 + size]
        return frame

    async def _readable_or_lost(self) -> None:
        """Until more bytes came or the connection is lost."""
        self._readable = asyncio.get_running_loop().create_future()
        try:
            await self._readable
        finally:
            self._readable = None

    async def read_frame(self) -> bytes:
        """The next frame, before :meth:`pump` takes over (the handshake's)."""
        while (frame := self.next_frame()) is None:
            if self._lost.done():
                raise anyio.EndOfStream
            await self._readable_or_lost()
        return frame

    async def pump(self, dispatch: Callable[[bytes], None], received: Callable[[], None]) -> None:
        """Read frames into ``dispatch`` (``received`` as bytes come) until the connection
        ends or sends garbage; then it is broken. Dispatched in this task, not in the protocol's
        callback: what a reply or a watch event sets off (anyio events, a session's death) needs
        a task."""
        self._received = received
        try:
            while True:
                while (frame := self.next_frame()) is not None:
                    dispatch(frame)
                if self._lost.done():
                    break
                await self._readable_or_lost()
        except (ValueError, struct.error, KeyError) as exc:
            logger.warning("asynclock: malformed reply from ZooKeeper %s: %r", self.address, exc)
        finally:
            self._received = None
        self.broken()

    def broken(self) -> None:
        """Drop the connection; its session reconnects."""
        if self.scope is not None:
            self.scope.cancel()

    async def aclose(self) -> None:
        """Close the socket: what is written goes first, if the peer reads it within a turn
        of the loop (a session's close request); then it is closed regardless. Idempotent."""
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        with contextlib.suppress(OSError):
            transport.write_eof()
        transport.close()
        with anyio.CancelScope(shield=True):
            await anyio.lowlevel.checkpoint()
        transport.abort()


def _wake(future: asyncio.Future[None] | None) -> None:
    """Resolve ``future`` unless it is done (or None)."""
    if future is not None and not future.done():
        future.set_result(None)


#: The value of a reply that has not come yet.
PENDING: Final = object()
#: The value of a reply whose connection broke before it came.
LOST: Final = object()


class Reply:
    __slots__ = ("read", "sent_at", "value", "waiter")

    def __init__(self, read: Callable[[bytes], Any]) -> None:
        #: Reads the reply's body (the request's ``read``, ``_proto.py``).
        self.read = read
        self.value: Any = PENDING
        self.sent_at = 0.0
        #: Woken when the reply comes or the connection breaks: the caller's, on the last reply
        #: of a call only (the server answers a session's requests in order). A bare future,
        #: not an event and a cancel scope per call: a tenth of a contended acquisition's
        #: client time went to those.
        self.waiter: asyncio.Future[None] | None = None

    async def wait(self, deadline: float) -> None:
        """Until the reply comes, the connection breaks, or the loop's clock reaches
        ``deadline``, whichever is first."""
        loop = asyncio.get_running_loop()
        waiter = self.waiter = loop.create_future()
        timer = loop.call_at(deadline, _wake, waiter)
        try:
            await waiter
        finally:
            timer.cancel()


class Pending:
    """The replies a session waits for, by xid."""

    def __init__(self) -> None:
        self._xid = 0
        self._replies: dict[int, Reply] = {}

    def __len__(self) -> int:
        return len(self._replies)

    def add(self, requests: Sequence[Request]) -> tuple[list[tuple[int, Reply]], bytes]:
        """Register ``requests``: their (xid, reply) pairs and the frames to send."""
        entries: list[tuple[int, Reply]] = []
        chunks: list[bytes] = []
        for request in requests:
            self._xid = self._xid % 0x7FFFFFFF + 1
            reply = Reply(request.read)
            self._replies[self._xid] = reply
            entries.append((self._xid, reply))
            chunks.append(frame(request.serialize(self._xid)))
        return entries, b"".join(chunks)

    def resolve(self, xid: int, err: int, body: bytes) -> Reply | None:
        """The reply ``xid`` came (None: its caller gave up): an error or a response."""
        reply = self._replies.pop(xid, None)
        if reply is not None:
            reply.value = error_for(err) if err else reply.read(body)
            _wake(reply.waiter)
        return reply

    def discard(self, entries: Sequence[tuple[int, Reply]]) -> None:
        """Forget what did not come (a reply that comes later is read and dropped)."""
        for xid, reply in entries:
            if reply.value is PENDING and self._replies.get(xid) is reply:
                del self._replies[xid]

    def fail_all(self) -> None:
        """The connection broke: every waiting caller gets :data:`LOST`."""
        replies, self._replies = self._replies, {}
        for reply in replies.values():
            reply.value = LOST
            _wake(reply.waiter)


class Watches:
    """Callbacks for watch events, by path (a watch fires once).

    A path's one callback is kept as it is, and a set made only when several wait for the
    same path: each waiter watches the node just before its own, so one each is the rule.
    """

    def __init__(self) -> None:
        self._callbacks: dict[str, _Callback | set[_Callback]] = {}

    def __len__(self) -> int:
        return sum(len(c) if isinstance(c, set) else 1 for c in self._callbacks.values())

    def add(self, path: str, callback: _Callback) -> None:
        known = self._callbacks.get(path)
        if known is None:
            self._callbacks[path] = callback
        elif isinstance(known, set):
            known.add(callback)
        elif known != callback:
            self._callbacks[path] = {known, callback}

    def drop(self, path: str, callback: _Callback) -> None:
        known = self._callbacks.get(path)
        if isinstance(known, set):
            known.discard(callback)
            if not known:
                del self._callbacks[path]
        elif known is not None and known == callback:
            del self._callbacks[path]

    def fire(self, path: str, event_type: int) -> None:
        known = self._callbacks.pop(path, None)
        if known is None:
            return
        for callback in known if isinstance(known, set) else (known,):
            callback(event_type)

    def clear(self) -> None:
        self._callbacks.clear()


_Callback = Callable[[int], None]


@dataclass(slots=True)
class Identity:
    """What a server needs to resume a session, and what it negotiated."""

    requested_ms: int
    timeout: float
    session_id: int = 0
    password: bytes = b"\x00" * 16
    last_zxid: int = 0


async def connect(
    settings: Settings, identity: Identity, where: str, deadline: float, *, first: bool
) -> tuple[Connection, float]:
    """One pass over the servers (and more passes until ``deadline`` while some answer).

    Returns the connection and when its handshake was sent (the server heard the session
    then). Raises :class:`SessionGone` if a server says the session is gone, and
    ``BackendUnavailable`` if no server took it.
    """
    hosts = list(settings.hosts)
    random.shuffle(hosts)
    errors: list[str] = []
    backoff = RETRY.backoff()
    while True:
        refused = 0
        for host in hosts:
            remaining = deadline - now()
            if remaining <= 0:
                break
            per_host = min(remaining, max(0.25, settings.op_timeout / len(hosts)))
            try:
                with anyio.fail_after(per_host):
                    return await _handshake(settings, identity, where, host)
            except SessionGone:
                raise
            except TimeoutError:
                errors.append(f"{host}: no answer within {per_host:.2g} s")
            except OSError as exc:
                refused += 1
                errors.append(f"{host}: {exc.strerror or exc}")
            except (
                anyio.EndOfStream,
                anyio.BrokenResourceError,
                anyio.ClosedResourceError,
                ValueError,
                struct.error,
            ) as exc:
                errors.append(f"{host}: closed the connection ({type(exc).__name__})")
        if first and refused == len(hosts):
            break
        pause = backoff.next_delay()
        if now() + pause >= deadline:
            break
        await anyio.sleep(pause)
    detail = "; ".join(dict.fromkeys(errors)) or "no time left"
    raise BackendUnavailable(
        f"cannot reach ZooKeeper at {where} ({detail}); check that the "
        "servers run and that the URL lists their client ports"
    )


async def _handshake(
    settings: Settings, identity: Identity, where: str, host: HostPort
) -> tuple[Connection, float]:
    _, conn = await asyncio.get_running_loop().create_connection(
        lambda: Connection(str(host)), host.host, host.port
    )
    try:
        sent_at = await _negotiate(conn, settings, identity, where)
    except BaseException:
        await conn.aclose()
        raise
    return conn, sent_at


async def _negotiate(conn: Connection, settings: Settings, identity: Identity, where: str) -> float:
    sent_at = now()
    request = zk.ConnectRequest(
        protocol_version=0,
        last_seen_zxid=identity.last_zxid,
        timeout=identity.requested_ms,
        session_id=identity.session_id,
        password=identity.password,
        read_only=False,
    )
    await conn.send(frame(request.serialize()))
    response = zk.ConnectResponse.deserialize(await conn.read_frame())
    if response.session_id == 0 or response.timeout <= 0:
        raise SessionGone(
            f"ZooKeeper says session 0x{identity.session_id:x} has expired or was closed (it "
            f"ends a session it has not heard from for the session timeout, "
            f"{identity.timeout:g} s)"
        )
    if identity.session_id and response.session_id != identity.session_id:
        raise SessionGone(f"ZooKeeper replaced session 0x{identity.session_id:x}")
    if settings.user is not None:
        auth = zk.AuthRequest(
            type=0, scheme="digest", auth=f"{settings.user}:{settings.password}".encode()
        )
        await conn.send(frame(auth.serialize(AUTH_XID)))
        while True:
            reply = await conn.read_frame()
            xid, _, err = struct.unpack_from("!iqi", reply)
            if xid == AUTH_XID:
                break
        if err:
            raise SessionGone(
                f"ZooKeeper refused the credentials of {where} "
                f"(error {type(error_for(err)).__name__})"
            )
    identity.session_id = response.session_id
    identity.password = response.password
    identity.timeout = response.timeout / 1000.0
    return sent_at
