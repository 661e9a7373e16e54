"""``zookeeper://host:port[,host:port...]/chroot``: locks on a ZooKeeper ensemble.

The recipe is Curator's ``InterProcessMutex``:

* Taking a lock creates an *ephemeral sequential* znode ``<chroot>/<name>/_c_<owner>-lock-<seq>``.
  The lowest sequence number holds the lock; every other waiter watches only the node just
  before its own (FIFO, no herd). The node name carries the lease's owner id ("protected"
  mode), so a create whose reply was lost is found again after the reconnect and reused, never
  duplicated.
* The fencing token is the node's ``czxid`` (the zxid of the transaction that created it),
  returned by the same ``Create2`` round trip. It increases across every acquisition of a name,
  also when the parent node was deleted and recreated (the sequence suffix restarts then).
* The lease is the ZooKeeper *session*: the server deletes the node when it has not heard from
  the session for the negotiated session timeout, so a lock's ttl *is* a session timeout. The
  backend opens one session per distinct ttl (lazily) and refuses a ttl the server would
  negotiate to something else. Renewal asks the server whether each node still exists and is
  owned by the session (one pipelined round trip for all leases of a session).
* When the session expires (the server says so on reconnect, or the client has not heard from
  the server for a whole session timeout), every lease of that session is reported lost at
  once, and the next acquisition uses a new session: a new session never inherits a lock.
* The parent ``<chroot>/<name>`` is a container node, kept while it is in use and deleted once
  it has been empty and unused for ``_PARENT_LINGER`` seconds (the server deletes empty
  containers too, should the client die first).
* Read-write locks (:class:`ReadWriteLock`) put ``-read-`` nodes in the same queue: a reader
  waits for the writers before it, a writer for everyone before it.

The wire protocol (jute serialisation, request and response types, error codes) is aiozk's;
the session, connection and watch handling are our own, because aiozk's ``ZKClient`` retries
calls forever while disconnected, replaces an expired session silently, cannot authenticate and
starts tasks nobody owns. Everything here runs in tasks owned by the backend and every server
call is bounded by ``op_timeout``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import logging
import math
import random
import struct
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Literal, Self
from urllib.parse import unquote

import anyio
import anyio.abc
from aiozk import ACL as ZkACL
from aiozk import exc as zk_exc
from aiozk import protocol as zk
from aiozk.protocol.create import Create2Request

from .._errors import (
    BackendTimeout,
    BackendUnavailable,
    InvalidArgument,
    InvalidURL,
    UnsupportedFeature,
)
from .._shield import finish
from .._validate import Options
from ..abc import (
    Backend,
    Capabilities,
    Grant,
    LockInfo,
    LockRequest,
    Lost,
    Renewed,
    RenewOutcome,
    Unknown,
)

if TYPE_CHECKING:
    from .._client import LockClient
    from .._lease import Lease, OnLost

__all__ = ("ReadWriteLock", "ZooKeeperBackend", "ZooKeeperGrant", "encode_name")

logger = logging.getLogger("asynclock.zookeeper")

_EXAMPLE = "zookeeper://127.0.0.1:2181,127.0.0.2:2181/locks"
_DEFAULT_PORT = 2181
_DEFAULT_CHROOT = "/asynclock"
_OPTIONS = ("op_timeout", "session_timeout")

#: Prefix of every lock node: Curator's "protected" marker, then the lease owner id.
_PROTECTED = "_c_"
_EXCLUSIVE: Final = "lock"
_SHARED: Final = "read"
Kind = Literal["lock", "read"]

_CREATOR_ALL = 31  # READ | WRITE | CREATE | DELETE | ADMIN
_EPHEMERAL_SEQUENTIAL = 3
_CONTAINER = 4
_PING_XID = -2
_AUTH_XID = -4
_WATCH_XID = -1
_MAX_FRAME = 64 * 1024 * 1024
_NO_EVENT = -1

#: How often a create, or a read that found a parent missing, is tried before giving up.
_ATTEMPTS = 4
#: Pause between passes over the servers while a session reconnects: first, cap (each pause
#: is jittered down to half). The cap bounds how long after a leader election the client is
#: back: members refuse clients while they elect, and a cap of 0.5 s made locks work again only
#: 0.6-0.7 s after a leader kill although the election took 0.35 s. An attempt on a member that
#: refuses costs a TCP connect and close; the session timeout bounds how long it goes on.
_RECONNECT_MIN = 0.02
_RECONNECT_MAX = 0.1
#: A session for a ttl nobody uses any more is closed after this long.
_IDLE_SESSION = 60.0
#: A lock's parent node that nobody of this client used for this long is deleted (if empty).
#: Keeping it for a moment saves a create and a delete per acquisition of a busy lock.
_PARENT_LINGER = 2.0

# The lock kind the next acquire in this context takes (set by ReadWriteLock.read()).
_kind: contextvars.ContextVar[Kind] = contextvars.ContextVar(
    "asynclock_zookeeper_kind", default=_EXCLUSIVE
)


class _CreateContainerRequest(Create2Request):  # type: ignore[misc]
    """``createContainer`` (ZooKeeper 3.5+): a parent the server deletes once it is empty."""

    opcode = 19


def _response_class(opcode: int) -> Any:
    if opcode == _CreateContainerRequest.opcode:
        return zk.Create2Response
    return zk.response_xref[opcode]


class _ZKError(Exception):
    """A ZooKeeper error code aiozk does not know."""

    def __init__(self, code: int) -> None:
        super().__init__(f"ZooKeeper error code {code}")
        self.code = code


def _error(code: int) -> Exception:
    cls = zk_exc.response_error_xref.get(code)
    if cls is None or cls is zk_exc.UnknownError:
        return _ZKError(code)
    error: Exception = cls()
    return error


class _ConnectionLoss(Exception):
    """The request may or may not have been applied: the connection broke or did not answer."""


class _NotConnected(_ConnectionLoss):
    """No connection came up within ``op_timeout``: nothing was sent."""


class _SessionGone(Exception):
    """The session expired or was closed; nothing it created survives."""


# -- names and URLs -------------------------------------------------------------------------


def _forbidden(char: str) -> bool:
    # ZooKeeper's PathUtils.validatePath, on UTF-16 code units: characters outside the BMP
    # are surrogate pairs there, which it refuses too.
    code = ord(char)
    return (
        code < 0x20
        or 0x7F <= code <= 0x9F
        or 0xD800 <= code <= 0xF8FF
        or code >= 0xFFF0
        or char in "%/"
    )


def encode_name(name: str) -> str:
    """Encode a lock name as one znode name, injectively.

    ``%``, ``/`` and every character ZooKeeper refuses in a path become ``%XX`` escapes of
    their UTF-8 bytes; everything else stays as it is. The reserved names ``.``, ``..`` and
    ``zookeeper`` get their first character escaped. Decoding is plain percent-decoding, so
    distinct names always give distinct znodes.
    """
    encoded = "".join(
        "".join(f"%{byte:02X}" for byte in char.encode("utf-8")) if _forbidden(char) else char
        for char in name
    )
    if encoded in (".", "..", "zookeeper"):
        encoded = f"%{ord(encoded[0]):02X}{encoded[1:]}"
    return encoded


@dataclass(frozen=True, slots=True)
class _Settings:
    hosts: tuple[tuple[str, int], ...]
    chroot: str
    user: str | None
    password: str | None
    op_timeout: float
    session_timeout: float


def _parse_hosts(text: str, url: str) -> tuple[tuple[str, int], ...]:
    hosts: list[tuple[str, int]] = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            raise InvalidURL(f"empty host in {url!r}; expected for example {_EXAMPLE}")
        if item.startswith("["):
            host, sep, rest = item[1:].partition("]")
            if not sep or not host:
                raise InvalidURL(f"malformed IPv6 address {item!r} in {url!r}")
            port_text = rest[1:] if rest.startswith(":") else rest
            if rest and not rest.startswith(":"):
                raise InvalidURL(f"malformed host {item!r} in {url!r}")
        else:
            host, _, port_text = item.partition(":")
            if ":" in port_text:
                raise InvalidURL(
                    f"malformed host {item!r} in {url!r}: write IPv6 addresses in brackets, "
                    "for example zookeeper://[::1]:2181/locks"
                )
        if not host:
            raise InvalidURL(f"missing host in {item!r} of {url!r}; expected e.g. {_EXAMPLE}")
        port = _DEFAULT_PORT
        if port_text:
            if not port_text.isdigit() or not 0 < int(port_text) < 65536:
                raise InvalidURL(f"bad port {port_text!r} in {url!r}; expected e.g. {_EXAMPLE}")
            port = int(port_text)
        hosts.append((host, port))
    return tuple(hosts)


def _parse_chroot(path: str, url: str) -> str:
    """The chroot of a URL's path: ``/a/b``, each part one znode name (ZooKeeper's own rules:
    no empty part, so no ``//`` and no trailing ``/``; no ``.`` or ``..``; no ``/``, ``%`` or
    control characters once percent-decoded; not under ``/zookeeper``)."""
    if path in ("", "/"):
        return _DEFAULT_CHROOT
    assert path.startswith("/")

    def bad(problem: str) -> InvalidURL:
        return InvalidURL(f"bad chroot {path!r} in {url!r}: {problem}; expected e.g. {_EXAMPLE}")

    parts = path[1:].split("/")
    names = []
    for index, part in enumerate(parts):
        name = unquote(part)
        if not name:
            where = "a trailing '/'" if index == len(parts) - 1 else "a doubled '/'"
            raise bad(f"it has an empty part ({where}); each part must be a znode name")
        if name in (".", ".."):
            raise bad(f"{name!r} is not allowed as a part (ZooKeeper paths are absolute)")
        forbidden = sorted({char for char in name if _forbidden(char)})
        if forbidden:
            shown = ", ".join(repr(char) for char in forbidden)
            raise bad(f"part {name!r} contains {shown}, which ZooKeeper refuses in a znode name")
        names.append(name)
    if names[0] == "zookeeper":
        raise bad("/zookeeper is ZooKeeper's own subtree (quotas, config); choose another")
    return "/" + "/".join(names)


# -- the grant -------------------------------------------------------------------------------


@dataclass(eq=False, slots=True)
class ZooKeeperGrant(Grant):
    """A held lock: its znode, the session that owns it, and whether it is shared (read)."""

    path: str = ""
    kind: Kind = _EXCLUSIVE
    session: _Session | None = field(default=None, repr=False)


# -- one connection --------------------------------------------------------------------------


class _Connection:
    """One TCP connection to one server, framed as ZooKeeper frames (length-prefixed)."""

    def __init__(self, stream: anyio.abc.SocketStream, address: str) -> None:
        self.stream = stream
        self.address = address
        self.buffer = bytearray()
        self.last_sent = anyio.current_time()
        self.scope: anyio.CancelScope | None = None
        self._send_lock = anyio.Lock()

    async def send(self, data: bytes) -> None:
        async with self._send_lock:
            await self.stream.send(data)
        self.last_sent = anyio.current_time()

    def next_frame(self) -> bytes | None:
        if len(self.buffer) < 4:
            return None
        (size,) = struct.unpack_from("!i", self.buffer)
        if not 0 <= size <= _MAX_FRAME:
            raise ValueError(f"bad frame length {size}")
        if len(self.buffer) < 4 + size:
            return None
        frame = bytes(self.buffer[4 : 4 + size])
        del self.buffer[: 4 + size]
        return frame

    async def read_frame(self) -> bytes:
        while (frame := self.next_frame()) is None:
            self.buffer += await self.stream.receive()
        return frame

    def broken(self) -> None:
        """Drop the connection; its session reconnects."""
        if self.scope is not None:
            self.scope.cancel()

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
            await self.stream.aclose()


def _frame(payload: bytes) -> bytes:
    return struct.pack("!i", len(payload)) + payload


class _Reply:
    __slots__ = ("event", "opcode", "sent_at", "value")

    def __init__(self, opcode: int) -> None:
        self.opcode = opcode
        self.event = anyio.Event()
        self.value: Any = None
        self.sent_at = 0.0


_LOST: Final = object()


@dataclass(slots=True)
class _Held:
    on_lost: Callable[[str], None]
    callback: Callable[[int], None]


# -- one session -----------------------------------------------------------------------------


class _Session:
    """A ZooKeeper session: survives reconnects to any server until the server expires it.

    States: ``connected``, ``suspended`` (reconnecting; calls wait up to ``op_timeout``) and
    ``dead`` (expired or closed; final). Every lease taken in this session is reported lost
    when it dies.
    """

    def __init__(self, backend: ZooKeeperBackend, timeout_ms: int) -> None:
        self._backend = backend
        self._settings = backend._settings
        self.requested_ms = timeout_ms
        self.timeout = timeout_ms / 1000.0
        self.session_id = 0
        self._password = b"\x00" * 16
        self._last_zxid = 0
        self.state: Literal["new", "connected", "suspended", "dead"] = "new"
        self.dead_reason = ""
        self._conn: _Connection | None = None
        self._xid = 0
        self._pending: dict[int, _Reply] = {}
        self._watches: dict[str, set[Callable[[int], None]]] = {}
        self._listeners: set[Callable[[], None]] = set()
        self._changed = anyio.Event()
        self._held: dict[str, _Held] = {}
        self._to_arm: set[str] = set()
        self._orphans: dict[tuple[str, str], None] = {}
        self._work = anyio.Event()
        self._last_received = anyio.current_time()
        #: When the latest request (or ping) the server answered was sent: the server heard
        #: the session no earlier, so the session cannot expire before this plus its timeout.
        self.heard_sent_at = anyio.current_time()
        self._pings: collections.deque[float] = collections.deque()
        self._idle_since = anyio.current_time()
        self.users = 0
        self.reconnects = 0
        self.default = False
        self._scope = anyio.CancelScope()
        self._finished = anyio.Event()

    # -- lifecycle -----------------------------------------------------------------------

    @property
    def dead(self) -> bool:
        return self.state == "dead"

    @property
    def read_timeout(self) -> float:
        """Drop a connection that has not answered for this long (also bounds a stuck reply)."""
        return min(self.timeout * 2.0 / 3.0, self._settings.op_timeout)

    async def start(self) -> None:
        """Create the session on one of the servers, or raise ``BackendUnavailable``."""
        deadline = anyio.current_time() + self._settings.op_timeout
        try:
            conn = await self._connect(deadline, first=True)
        except BaseException:
            self.state = "dead"
            self.dead_reason = "could not be created"
            self._finished.set()
            raise
        self._install(conn)
        try:
            self._backend._host.start_soon(self._run)
        except BaseException:
            self.state = "dead"
            self._finished.set()
            await conn.aclose()
            raise

    def _install(self, conn: _Connection) -> None:
        self._conn = conn
        self._pings.clear()
        self._last_received = anyio.current_time()
        self._set_state("connected")
        self._to_arm = set(self._held)
        if self._to_arm or self._orphans:
            self._work.set()

    async def _connect(self, deadline: float, *, first: bool) -> _Connection:
        """One pass over the servers (and more passes until ``deadline`` while some answer)."""
        hosts = list(self._settings.hosts)
        random.shuffle(hosts)
        errors: list[str] = []
        pause = _RECONNECT_MIN
        while True:
            refused = 0
            for host, port in hosts:
                remaining = deadline - anyio.current_time()
                if remaining <= 0:
                    break
                per_host = min(remaining, max(0.25, self._settings.op_timeout / len(hosts)))
                try:
                    with anyio.fail_after(per_host):
                        return await self._handshake(host, port)
                except _SessionGone:
                    raise
                except TimeoutError:
                    errors.append(f"{host}:{port}: no answer within {per_host:.2g} s")
                except OSError as exc:
                    refused += 1
                    errors.append(f"{host}:{port}: {exc.strerror or exc}")
                except (
                    anyio.EndOfStream,
                    anyio.BrokenResourceError,
                    anyio.ClosedResourceError,
                    ValueError,
                    struct.error,
                ) as exc:
                    errors.append(f"{host}:{port}: closed the connection ({type(exc).__name__})")
            if first and refused == len(hosts):
                break
            if anyio.current_time() + pause >= deadline:
                break
            await anyio.sleep(pause * random.uniform(0.5, 1.0))
            pause = min(pause * 2, _RECONNECT_MAX)
        detail = "; ".join(dict.fromkeys(errors)) or "no time left"
        raise BackendUnavailable(
            f"cannot reach ZooKeeper at {self._backend.describe()} ({detail}); check that the "
            "servers run and that the URL lists their client ports"
        )

    async def _handshake(self, host: str, port: int) -> _Connection:
        stream = await anyio.connect_tcp(host, port)
        conn = _Connection(stream, f"{host}:{port}")
        try:
            await self._negotiate(conn)
        except BaseException:
            await conn.aclose()
            raise
        return conn

    async def _negotiate(self, conn: _Connection) -> None:
        sent_at = anyio.current_time()
        request = zk.ConnectRequest(
            protocol_version=0,
            last_seen_zxid=self._last_zxid,
            timeout=self.requested_ms,
            session_id=self.session_id,
            password=self._password,
            read_only=False,
        )
        await conn.send(_frame(request.serialize()))
        response = zk.ConnectResponse.deserialize(await conn.read_frame())
        if response.session_id == 0 or response.timeout <= 0:
            raise _SessionGone(
                f"ZooKeeper says session 0x{self.session_id:x} has expired or was closed (it "
                f"ends a session it has not heard from for the session timeout, {self.timeout:g} s)"
            )
        if self.session_id and response.session_id != self.session_id:
            raise _SessionGone(f"ZooKeeper replaced session 0x{self.session_id:x}")
        if self._settings.user is not None:
            auth = zk.AuthRequest(
                type=0,
                scheme="digest",
                auth=f"{self._settings.user}:{self._settings.password}".encode(),
            )
            await conn.send(_frame(auth.serialize(_AUTH_XID)))
            while True:
                frame = await conn.read_frame()
                xid, _, err = struct.unpack_from("!iqi", frame)
                if xid == _AUTH_XID:
                    break
            if err:
                raise _SessionGone(
                    f"ZooKeeper refused the credentials of {self._backend.describe()} "
                    f"(error {type(_error(err)).__name__})"
                )
        self.session_id = response.session_id
        self._password = response.password
        self.timeout = response.timeout / 1000.0
        self.heard_sent_at = max(self.heard_sent_at, sent_at)

    async def _run(self) -> None:
        try:
            with self._scope:
                while self.state != "dead":
                    conn = self._conn
                    assert conn is not None
                    async with anyio.create_task_group() as tg:
                        conn.scope = tg.cancel_scope
                        tg.start_soon(self._read_loop, conn)
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

    def _disconnected(self, conn: _Connection) -> None:
        if self._conn is conn:
            self._conn = None
        for reply in self._pending.values():
            reply.value = _LOST
            reply.event.set()
        self._pending.clear()
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
        except _SessionGone as exc:
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
        held, self._held = self._held, {}
        self._to_arm.clear()
        self._orphans.clear()
        self._watches.clear()
        for reply in self._pending.values():
            reply.value = _LOST
            reply.event.set()
        self._pending.clear()
        self._set_state("dead")
        self._listeners.clear()
        self._backend._forget_session(self)
        if self._conn is not None:
            self._conn.broken()
        if held:
            logger.warning(
                "asynclock: ZooKeeper session 0x%x is gone (%s); %d lease(s) lost",
                self.session_id,
                reason,
                len(held),
            )
        for entry in held.values():
            entry.on_lost(reason)

    async def aclose(self) -> None:
        """Close the session on the server (its nodes go at once) and stop its tasks."""
        try:
            if self.state == "connected":
                with anyio.move_on_after(min(self._settings.op_timeout, 2.0)):
                    with contextlib.suppress(Exception):
                        await self.call(zk.CloseRequest())
        finally:
            # Also when a native cancellation cut the close short: the tasks and the
            # connection end (the server then expires the session after its timeout).
            self._die("the lock client was closed")
            self._scope.cancel()
        if self.state != "new":
            with anyio.move_on_after(self._settings.op_timeout):
                await self._finished.wait()

    # -- background work -----------------------------------------------------------------

    async def _read_loop(self, conn: _Connection) -> None:
        try:
            while True:
                while (frame := conn.next_frame()) is not None:
                    self._dispatch(frame)
                chunk = await conn.stream.receive()
                self._last_received = anyio.current_time()
                conn.buffer += chunk
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass
        except (ValueError, struct.error, KeyError) as exc:
            logger.warning("asynclock: malformed reply from ZooKeeper %s: %r", conn.address, exc)
        conn.broken()

    def _dispatch(self, frame: bytes) -> None:
        xid, zxid, err = struct.unpack_from("!iqi", frame)
        if zxid > 0:
            self._last_zxid = max(self._last_zxid, zxid)
        body = frame[16:]
        if xid == _WATCH_XID:
            event = zk.WatchEvent.deserialize(body)
            if event.type == _NO_EVENT or not event.type:
                if event.state in (zk.WatchEvent.SESSION_EXPIRED, zk.WatchEvent.AUTH_FAILED):
                    self._die(
                        f"ZooKeeper ended session 0x{self.session_id:x} (state {event.state})"
                    )
                return
            for callback in self._watches.pop(event.path, ()):
                callback(event.type)
            return
        if xid == _PING_XID:
            if self._pings:
                self.heard_sent_at = max(self.heard_sent_at, self._pings.popleft())
            return
        reply = self._pending.pop(xid, None)
        if reply is None:  # a request whose caller gave up
            return
        self.heard_sent_at = max(self.heard_sent_at, reply.sent_at)
        reply.value = _error(err) if err else _response_class(reply.opcode).deserialize(body)
        reply.event.set()

    async def _ping_loop(self, conn: _Connection) -> None:
        interval = self.read_timeout / 2.0
        ping = _frame(zk.PingRequest().serialize(_PING_XID))
        while True:
            await anyio.sleep(interval)
            now = anyio.current_time()
            if now - self._last_received > self.read_timeout:
                logger.info(
                    "asynclock: ZooKeeper %s did not answer for %.2g s; reconnecting",
                    conn.address,
                    now - self._last_received,
                )
                conn.broken()
                return
            if now - conn.last_sent >= interval * 0.9:
                self._pings.append(now)
                try:
                    await conn.send(ping)
                except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                    conn.broken()
                    return
            if self._idle() and now - self._idle_since > _IDLE_SESSION and not self.default:
                self._backend._forget_session(self)
                self._backend._host.start_soon(self.aclose)
                return

    def _idle(self) -> bool:
        if self.users or self._held or self._orphans:
            self._idle_since = anyio.current_time()
            return False
        return True

    async def _maintain(self) -> None:
        """Arm watches on our own nodes and delete what cancelled or failed calls left."""
        while True:
            await self._work.wait()
            self._work = anyio.Event()
            try:
                await self._arm_watches()
                await self._clean_orphans()
            except _ConnectionLoss:
                await anyio.sleep(min(1.0, self.read_timeout))
                self._work.set()
            except _SessionGone:
                return

    async def _arm_watches(self) -> None:
        paths = [path for path in self._to_arm if path in self._held]
        self._to_arm.clear()
        if not paths:
            return
        for path in paths:
            self._watches.setdefault(path, set()).add(self._held[path].callback)
        replies = await self.call(*(zk.GetDataRequest(path=path, watch=True) for path in paths))
        for path, reply in zip(paths, replies, strict=True):
            if path not in self._held:
                continue
            if isinstance(reply, zk_exc.NoNode):
                self._lose(path, f"its znode {path} was deleted (by an operator or another client)")
            elif not isinstance(reply, Exception) and reply.stat.ephemeral_owner != self.session_id:
                self._lose(path, f"its znode {path} belongs to another session")

    async def _clean_orphans(self) -> None:
        while self._orphans:
            parent, prefix = next(iter(self._orphans))
            try:
                await self.delete_matching(parent, prefix)
            except BackendUnavailable as exc:  # refused (ACL): retrying cannot help
                logger.warning("asynclock: cannot delete %s/%s*: %s", parent, prefix, exc)
            self._orphans.pop((parent, prefix), None)

    def _on_own_event(self, path: str, event_type: int) -> None:
        if path not in self._held:
            return
        if event_type == zk.WatchEvent.DELETED:
            self._lose(path, f"its znode {path} was deleted (by an operator or another client)")
        else:
            self._to_arm.add(path)
            self._work.set()

    def _lose(self, path: str, reason: str) -> None:
        entry = self._held.pop(path, None)
        if entry is not None:
            self._drop_watch(path, entry.callback)
            entry.on_lost(reason)

    # -- what the backend uses -----------------------------------------------------------

    @property
    def usable(self) -> bool:
        return self.state in ("connected", "suspended")

    async def call(self, *requests: Any) -> list[Any]:
        """Send ``requests`` in one write and return their replies (errors as values).

        Raises ``_ConnectionLoss`` when the outcome is unknown (no connection within
        ``op_timeout``, the connection broke, or no reply within ``op_timeout``: the connection
        is then dropped) and ``_SessionGone`` when the session is dead.
        """
        if not requests:
            return []
        op_timeout = self._settings.op_timeout
        conn = await self._wait_connected(anyio.current_time() + op_timeout)
        replies: list[_Reply] = []
        xids: list[int] = []
        chunks: list[bytes] = []
        try:
            for request in requests:
                self._xid = self._xid % 0x7FFFFFFF + 1
                reply = _Reply(request.opcode)
                self._pending[self._xid] = reply
                replies.append(reply)
                xids.append(self._xid)
                chunks.append(_frame(request.serialize(self._xid)))
            sent_at = anyio.current_time()
            for reply in replies:
                reply.sent_at = sent_at
            try:
                await conn.send(b"".join(chunks))
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
                conn.broken()
                raise _ConnectionLoss(f"the connection to {conn.address} broke") from exc
            with anyio.move_on_after(op_timeout):
                for reply in replies:
                    await reply.event.wait()
            if not replies[-1].event.is_set():
                conn.broken()
                raise _ConnectionLoss(f"{conn.address} did not answer within {op_timeout:g} s")
        finally:
            # A reply that comes after we gave up is read and dropped by the read loop.
            for xid, reply in zip(xids, replies, strict=True):
                if not reply.event.is_set() and self._pending.get(xid) is reply:
                    del self._pending[xid]
        values = [reply.value for reply in replies]
        if any(value is _LOST for value in values):
            if self.state == "dead":
                raise _SessionGone(self.dead_reason)
            raise _ConnectionLoss(f"the connection to {conn.address} broke")
        return values

    async def _wait_connected(self, deadline: float) -> _Connection:
        while True:
            if self.state == "dead":
                raise _SessionGone(self.dead_reason)
            if self.state == "connected" and self._conn is not None:
                return self._conn
            changed = self._changed
            with anyio.move_on_at(deadline):
                await changed.wait()
            if anyio.current_time() >= deadline and self.state != "connected":
                if self.dead:
                    raise _SessionGone(self.dead_reason)
                raise _NotConnected(
                    f"not connected to ZooKeeper for {self._settings.op_timeout:g} s (op_timeout)"
                )

    async def call_retrying(self, *requests: Any) -> list[Any]:
        """``call`` for requests that are safe to repeat (reads, deletes, parent creates)."""
        for attempt in range(_ATTEMPTS):
            try:
                return await self.call(*requests)
            except _NotConnected:
                raise  # it waited op_timeout for a connection already
            except _ConnectionLoss:
                if attempt + 1 == _ATTEMPTS:
                    raise
        raise AssertionError("unreachable")

    def add_watch(self, path: str, callback: Callable[[int], None]) -> None:
        self._watches.setdefault(path, set()).add(callback)

    def _drop_watch(self, path: str, callback: Callable[[int], None]) -> None:
        callbacks = self._watches.get(path)
        if callbacks is not None:
            callbacks.discard(callback)
            if not callbacks:
                del self._watches[path]

    def add_listener(self, callback: Callable[[], None]) -> None:
        self._listeners.add(callback)

    def drop_listener(self, callback: Callable[[], None]) -> None:
        self._listeners.discard(callback)

    def hold(self, path: str, on_lost: Callable[[str], None]) -> None:
        """Report loss of the node at ``path`` through ``on_lost`` (watch, session death)."""

        def callback(event_type: int) -> None:
            self._on_own_event(path, event_type)

        self._held[path] = _Held(on_lost, callback)
        self._to_arm.add(path)
        self._work.set()

    def unhold(self, path: str) -> None:
        entry = self._held.pop(path, None)
        self._to_arm.discard(path)
        if entry is not None:
            self._drop_watch(path, entry.callback)

    def add_orphan(self, parent: str, prefix: str) -> None:
        """Delete the children of ``parent`` starting with ``prefix`` once connected again."""
        if self.usable:
            self._orphans[(parent, prefix)] = None
            self._work.set()

    async def delete_matching(self, parent: str, prefix: str) -> None:
        """Delete our nodes under ``parent`` whose names start with ``prefix``."""
        (children,) = await self.call_retrying(zk.GetChildrenRequest(path=parent, watch=False))
        if isinstance(children, Exception):
            return
        mine = [f"{parent}/{child}" for child in children.children if child.startswith(prefix)]
        await self.delete(mine, parent)

    async def delete(self, paths: Sequence[str], parent: str) -> None:
        """Delete ``paths`` (children of ``parent``); gone already is fine.

        The parent is left for a moment (the next acquisition reuses it) and deleted by the
        backend's janitor once it has been unused for ``_PARENT_LINGER`` seconds.
        """
        if paths:
            replies = await self.call_retrying(
                *(zk.DeleteRequest(path=path, version=-1) for path in paths)
            )
            for path, reply in zip(paths, replies, strict=True):
                if isinstance(reply, Exception) and not isinstance(reply, zk_exc.NoNode):
                    raise _backend_error(reply, f"deleting {path}", self._backend)
        self._backend._touch_parent(parent)

    def info(self) -> dict[str, Any]:
        return {
            "session_id": f"0x{self.session_id:x}",
            "timeout": self.timeout,
            "state": self.state,
            "reconnects": self.reconnects,
            "held": len(self._held),
            "waiting_calls": len(self._pending),
            "watches": sum(len(callbacks) for callbacks in self._watches.values()),
            "listeners": len(self._listeners),
            "orphans": len(self._orphans),
        }


def _backend_error(error: Exception, what: str, backend: ZooKeeperBackend) -> BackendUnavailable:
    if isinstance(error, zk_exc.NoAuth | zk_exc.InvalidACL | zk_exc.AuthFailed):
        return BackendUnavailable(
            f"{what} on {backend.describe()}: ZooKeeper refused access ({type(error).__name__}); "
            "the znodes belong to other credentials: give the right user:password in the URL"
        )
    return BackendUnavailable(f"{what} on {backend.describe()}: ZooKeeper error {error!r}")


# -- the task host ---------------------------------------------------------------------------


class _TaskHost:
    """Owns the task group every background task of the backend runs in.

    The core calls ``Backend.open()`` inside a cancel scope (its connect timeout), so a task
    group entered there could not outlive the call. The group lives in one host task instead,
    which ``aclose()`` cancels and awaits: no task outlives the backend.
    """

    def __init__(self) -> None:
        self._task_group: anyio.abc.TaskGroup | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise UnsupportedFeature("the zookeeper:// backend runs on asyncio only") from None
        ready = anyio.Event()
        self._task = loop.create_task(self._main(ready), name="asynclock zookeeper")
        await ready.wait()

    async def _main(self, ready: anyio.Event) -> None:
        try:
            async with anyio.create_task_group() as task_group:
                self._task_group = task_group
                ready.set()
                await anyio.sleep_forever()
        except Exception:
            logger.exception("asynclock: a ZooKeeper background task failed")
        finally:
            self._task_group = None
            ready.set()

    def start_soon(self, func: Callable[[], Coroutine[Any, Any, None]]) -> None:
        if self._task_group is None:
            raise BackendUnavailable("the zookeeper:// lock client is closed")
        self._task_group.start_soon(func)

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        if self._task_group is not None:
            self._task_group.cancel_scope.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.wait({task})
        if not task.cancelled() and task.exception() is not None:
            logger.error("asynclock: ZooKeeper task host failed: %r", task.exception())


# -- the backend -----------------------------------------------------------------------------


class ZooKeeperBackend(Backend[ZooKeeperGrant]):
    """Locks on ZooKeeper (``zookeeper://[user:password@]host:port[,host:port...][/chroot]``).

    Options: ``op_timeout`` (seconds, default 5) bounds every server call, including the wait
    for a connection; ``session_timeout`` (seconds, default 10) is the session opened at connect
    (locks whose ttl equals it share it; every other ttl opens its own session on first use).
    """

    schemes = ("zookeeper",)
    driver = "aiozk"
    capabilities = Capabilities(
        fencing=True, fifo=True, loss_detection=True, quorum=True, cross_process=True
    )

    def __init__(self, settings: _Settings) -> None:
        self._settings = settings
        self._sessions: dict[int, _Session] = {}
        #: Lock parent nodes this client created or used lately, and when it last did.
        self._parents: dict[str, float] = {}
        # Made in open(): from_url() may run outside of an event loop.
        self._session_lock: anyio.Lock | None = None
        self._host = _TaskHost()
        self._min_ms: int | None = None
        self._max_ms: int | None = None
        self._state: Literal["new", "open", "closed"] = "new"
        if settings.user is None:
            self._acl = [zk.UNRESTRICTED_ACCESS]
        else:
            # "auth" with an empty id: the server puts in the digest of our credentials.
            self._acl = [ZkACL.make("auth", "", True, True, True, True, True)]

    @classmethod
    def from_url(cls, url: str, options: Mapping[str, object]) -> Self:
        scheme, sep, rest = url.partition("://")
        if not sep or scheme.lower() != "zookeeper":
            raise InvalidURL(f"{url!r} is not a zookeeper:// URL; expected e.g. {_EXAMPLE}")
        if "#" in rest:
            raise InvalidURL(f"a zookeeper:// URL has no #fragment; expected e.g. {_EXAMPLE}")
        netloc, slash, path = rest.partition("/")
        userinfo, at, host_text = netloc.rpartition("@")
        if not at:
            host_text = netloc
        user = password = None
        if at:
            raw_user, colon, raw_password = userinfo.partition(":")
            user, password = unquote(raw_user), unquote(raw_password)
            if not colon or not user or ":" in user:
                raise InvalidURL(
                    "zookeeper:// credentials must be user:password (digest auth), with "
                    "special characters percent-encoded: "
                    "zookeeper://app:s3cret@127.0.0.1:2181/locks"
                )
        redacted = f"zookeeper://{'***@' if at else ''}{host_text}{slash}{path}"
        if not host_text:
            raise InvalidURL(f"{redacted!r} names no server; expected e.g. {_EXAMPLE}")
        hosts = _parse_hosts(host_text, redacted)
        chroot = _parse_chroot(slash + path, redacted)
        opts = Options(options, "zookeeper://")
        op_timeout = opts.number("op_timeout", 5.0, minimum=0.001)
        session_timeout = opts.number("session_timeout", 10.0, minimum=0.001)
        opts.finish(_OPTIONS)
        if round(session_timeout * 1000) > 0x7FFFFFFF:
            raise InvalidArgument(f"session_timeout {session_timeout:g} s is too large")
        return cls(
            _Settings(
                hosts=hosts,
                chroot=chroot,
                user=user,
                password=password,
                op_timeout=op_timeout,
                session_timeout=session_timeout,
            )
        )

    def describe(self) -> str:
        hosts = ",".join(
            f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            for host, port in self._settings.hosts
        )
        user = f"{self._settings.user}:***@" if self._settings.user is not None else ""
        return f"zookeeper://{user}{hosts}{self._settings.chroot}"

    def extra_info(self) -> Mapping[str, Any]:
        return {
            "chroot": self._settings.chroot,
            "op_timeout": self._settings.op_timeout,
            "session_timeout_bounds": (self._min_ms, self._max_ms),
            "known_parents": len(self._parents),
            "sessions": {ms: session.info() for ms, session in self._sessions.items()},
        }

    # -- lifecycle -------------------------------------------------------------------------

    async def open(self) -> None:
        if self._state != "new":
            raise RuntimeError("a ZooKeeperBackend can be opened once")
        self._state = "open"
        self._session_lock = anyio.Lock()
        await self._host.start()
        try:
            session = await self._new_session(_ms(self._settings.session_timeout))
            session.default = True
            self._sessions[round(session.timeout * 1000)] = session
            await self._ensure_chroot(session)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.aclose()
            raise
        self._host.start_soon(self._parent_janitor)

    async def aclose(self) -> None:
        if self._state == "closed":
            return
        self._state = "closed"
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(min(self._settings.op_timeout, 2.0)):
                await self._delete_parents(list(self._parents))
        sessions, self._sessions = list(self._sessions.values()), {}
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as tg:
                for session in sessions:
                    tg.start_soon(session.aclose)
            await self._host.aclose()

    async def _new_session(self, timeout_ms: int) -> _Session:
        session = _Session(self, timeout_ms)
        try:
            await session.start()
        except _SessionGone as exc:
            raise BackendUnavailable(str(exc)) from exc
        negotiated = round(session.timeout * 1000)
        if negotiated > timeout_ms:
            self._min_ms = negotiated
        elif negotiated < timeout_ms:
            self._max_ms = negotiated
        return session

    def _touch_parent(self, parent: str) -> None:
        self._parents[parent] = anyio.current_time()

    async def _parent_janitor(self) -> None:
        while True:
            await anyio.sleep(_PARENT_LINGER / 2)
            cutoff = anyio.current_time() - _PARENT_LINGER
            stale = [parent for parent, used in self._parents.items() if used < cutoff]
            if stale:
                await self._delete_parents(stale)

    async def _delete_parents(self, parents: list[str]) -> None:
        """Delete these lock parents if they are empty (one pipelined round trip)."""
        session = next((s for s in self._sessions.values() if s.state == "connected"), None)
        if session is None or not parents:
            return
        for parent in parents:
            self._parents.pop(parent, None)
        try:
            await session.call(*(zk.DeleteRequest(path=parent, version=-1) for parent in parents))
        except (_ConnectionLoss, _SessionGone) as exc:
            # Container nodes: the server deletes them once empty in any case.
            logger.debug("asynclock: deleting empty lock parents failed: %r", exc)

    def _forget_session(self, session: _Session) -> None:
        for ms, known in list(self._sessions.items()):
            if known is session:
                del self._sessions[ms]

    async def _session_for(self, ttl: float) -> _Session:
        ms = _ms(ttl)
        session = self._sessions.get(ms)
        if session is not None and session.usable:
            return session
        if self._state != "open":
            raise BackendUnavailable(f"the lock client for {self.describe()} is closed")
        assert self._session_lock is not None
        async with self._session_lock:
            session = self._sessions.get(ms)
            if session is not None and session.usable:
                return session
            self.check_ttl(ttl)
            session = await self._new_session(ms)
            if round(session.timeout * 1000) != ms:
                # Closed whatever cancels us (a native cancel goes through an anyio shield and
                # would leave the session and its connection open until the client closes).
                await finish(
                    session.aclose,
                    timeout=self._settings.op_timeout + 1.0,
                    what="closing a ZooKeeper session with a refused timeout",
                )
                self.check_ttl(ttl)  # the bounds just learned explain the refusal
                raise InvalidArgument(
                    f"ZooKeeper at {self.describe()} negotiated a session timeout of "
                    f"{session.timeout:g} s for a lock ttl of {ttl:g} s; use a ttl the "
                    "server allows"
                )
            self._sessions[ms] = session
            return session

    def check_ttl(self, ttl: float) -> None:
        ms = _ms(ttl)
        if ms <= 0 or ms > 0x7FFFFFFF:
            raise InvalidArgument(f"ttl {ttl:g} s is out of range for a ZooKeeper session")
        low, high = self._min_ms, self._max_ms
        if (low is not None and ms < low) or (high is not None and ms > high):
            raise InvalidArgument(_ttl_refusal(ttl, self.describe(), low, high))

    async def _ensure_chroot(self, session: _Session) -> None:
        parts = self._settings.chroot.strip("/").split("/")
        paths = ["/" + "/".join(parts[: index + 1]) for index in range(len(parts))]
        try:
            replies = await session.call_retrying(
                *(zk.CreateRequest(path=path, data=b"", acl=self._acl, flags=0) for path in paths)
            )
        except _ConnectionLoss as exc:
            raise BackendTimeout(
                f"creating {self._settings.chroot} on {self.describe()}: {exc}"
            ) from exc
        except _SessionGone as exc:
            raise BackendUnavailable(f"{self.describe()}: {exc}") from exc
        for path, reply in zip(paths, replies, strict=True):
            if isinstance(reply, Exception) and not isinstance(reply, zk_exc.NodeExists):
                raise _backend_error(reply, f"creating the chroot {path}", self)

    # -- the contract ----------------------------------------------------------------------

    def _parent(self, name: str) -> str:
        chroot = self._settings.chroot.rstrip("/")
        return f"{chroot}/{encode_name(name)}"

    async def inspect(self, name: str) -> LockInfo:
        session = await self._session_for(self._settings.session_timeout)
        parent = self._parent(name)
        try:
            (listed,) = await session.call_retrying(zk.GetChildrenRequest(path=parent, watch=False))
        except (_ConnectionLoss, _SessionGone) as exc:
            raise BackendTimeout(f"inspecting lock {name!r} on {self.describe()}: {exc}") from exc
        if isinstance(listed, zk_exc.NoNode):
            return LockInfo(name, held=False, waiters=0)
        if isinstance(listed, Exception):
            raise _backend_error(listed, f"inspecting lock {name!r}", self)
        queue = _queue(listed.children)
        if not queue:
            return LockInfo(name, held=False, waiters=0)
        # The lowest sequence holds it (a reader shares it with the readers right after it).
        # The owner part of its name is the lease's owner secret, which the core hashes.
        first = queue[0].child
        owner = unquote(queue[0].owner) or None
        try:
            (found,) = await session.call_retrying(
                zk.ExistsRequest(path=f"{parent}/{first}", watch=False)
            )
        except (_ConnectionLoss, _SessionGone) as exc:
            raise BackendTimeout(f"inspecting lock {name!r} on {self.describe()}: {exc}") from exc
        token = None if isinstance(found, Exception) else int(found.stat.created_zxid)
        holders = 1
        if queue[0].kind == _SHARED:  # every reader before the first writer holds it
            while holders < len(queue) and queue[holders].kind == _SHARED:
                holders += 1
        return LockInfo(name, held=True, owner=owner, token=token, waiters=len(queue) - holders)

    async def try_acquire(self, request: LockRequest) -> ZooKeeperGrant | None:
        return await self._acquire(request, _kind.get(), wait=False)

    async def acquire(self, request: LockRequest) -> ZooKeeperGrant:
        grant = await self._acquire(request, _kind.get(), wait=True)
        assert grant is not None
        return grant

    async def _acquire(
        self, request: LockRequest, kind: Kind, *, wait: bool
    ) -> ZooKeeperGrant | None:
        what = f"acquiring {request.name!r} on {self.describe()}"
        for _ in range(_ATTEMPTS):
            session = await self._session_for(request.ttl)
            try:
                return await _Attempt(self, session, request, kind).run(wait)
            except _SessionGone as exc:
                logger.info("asynclock: %s: session gone (%s); starting again", what, exc)
            except _ConnectionLoss as exc:
                raise BackendTimeout(f"{what}: {exc}") from exc
        raise BackendUnavailable(f"{what}: the ZooKeeper session kept expiring")

    async def renew(self, grants: Sequence[ZooKeeperGrant]) -> Sequence[RenewOutcome]:
        outcomes: list[RenewOutcome | None] = [None] * len(grants)
        by_session: dict[int, list[int]] = {}
        sessions: dict[int, _Session] = {}
        for index, grant in enumerate(grants):
            assert grant.session is not None
            by_session.setdefault(id(grant.session), []).append(index)
            sessions[id(grant.session)] = grant.session

        async def renew_session(session: _Session, indexes: list[int]) -> None:
            if session.state == "dead":
                for index in indexes:
                    outcomes[index] = Lost(f"its ZooKeeper session is gone: {session.dead_reason}")
                return
            if session.state != "connected":
                error = BackendUnavailable(
                    f"{self.describe()}: disconnected from ZooKeeper, reconnecting (session "
                    f"0x{session.session_id:x})"
                )
                for index in indexes:
                    outcomes[index] = Unknown(error)
                return
            sent_at = anyio.current_time()
            try:
                replies = await session.call(
                    *(zk.ExistsRequest(path=grants[index].path, watch=False) for index in indexes)
                )
            except _SessionGone as exc:
                for index in indexes:
                    outcomes[index] = Lost(f"its ZooKeeper session is gone: {exc}")
                return
            except _ConnectionLoss as exc:
                timeout = BackendTimeout(f"renewing on {self.describe()}: {exc}")
                for index in indexes:
                    outcomes[index] = Unknown(timeout)
                return
            for index, reply in zip(indexes, replies, strict=True):
                path = grants[index].path
                if isinstance(reply, zk_exc.NoNode):
                    outcomes[index] = Lost(
                        f"its znode {path} is gone (deleted by an operator or another client, "
                        "or the session expired)"
                    )
                elif isinstance(reply, Exception):
                    outcomes[index] = Unknown(_backend_error(reply, "renewing", self))
                elif reply.stat.ephemeral_owner != session.session_id:
                    outcomes[index] = Lost(f"its znode {path} belongs to another session now")
                else:
                    outcomes[index] = Renewed(sent_at, session.timeout)

        async with anyio.create_task_group() as tg:
            for key, indexes in by_session.items():
                tg.start_soon(renew_session, sessions[key], indexes)
        return [outcome if outcome is not None else Unknown(RuntimeError()) for outcome in outcomes]

    async def release(self, grant: ZooKeeperGrant) -> None:
        session = grant.session
        assert session is not None
        session.unhold(grant.path)
        if not session.usable:
            return  # the node went, or goes, with its session
        parent, _, node = grant.path.rpartition("/")
        if session.state != "connected":
            session.add_orphan(parent, node)
            return
        try:
            await session.delete([grant.path], parent)
        except _ConnectionLoss as exc:
            # Deleted in the background once connected again; until then the node holds the
            # lock, so it must not be forgotten while the session lives.
            session.add_orphan(parent, node)
            raise BackendTimeout(
                f"releasing {grant.name!r} on {self.describe()}: {exc}; it is deleted once the "
                "connection is back"
            ) from exc
        except _SessionGone:
            return

    # -- read-write locks (see ReadWriteLock) ----------------------------------------------


class _Attempt:
    """One pass of the queue recipe in one session; cleans up whatever it does not hand over."""

    def __init__(
        self, backend: ZooKeeperBackend, session: _Session, request: LockRequest, kind: Kind
    ) -> None:
        self.backend = backend
        self.session = session
        self.request = request
        self.kind = kind
        self.parent = backend._parent(request.name)
        self.prefix = f"{_PROTECTED}{encode_name(request.owner)}-{kind}-"
        #: Our node's name once we know it.
        self.node: str | None = None
        #: A create was sent whose outcome we do not know.
        self.unsure = False

    async def run(self, wait: bool) -> ZooKeeperGrant | None:
        session = self.session
        session.users += 1
        try:
            czxid, children, listed_at = await self._enqueue()
            while True:
                assert self.node is not None
                blockers = _blockers(children, self.node, self.kind)
                if blockers is None:
                    # Our node is gone (deleted by someone, or its session expired): queue again.
                    if session.dead:
                        raise _SessionGone(session.dead_reason)
                    self.node = None
                    czxid, children, listed_at = await self._enqueue()
                    continue
                if not blockers:
                    path = f"{self.parent}/{self.node}"
                    grant = ZooKeeperGrant(
                        name=self.request.name,
                        owner=self.request.owner,
                        token=czxid,
                        valid_from=listed_at,
                        ttl=session.timeout,
                        path=path,
                        kind=self.kind,
                        session=session,
                    )
                    session.hold(path, self.request.on_lost)
                    self.node = None  # handed over: nothing to clean up
                    return grant
                if not wait:
                    return None
                watched = blockers[-1]
                gone_since = await self._wait_for(f"{self.parent}/{watched}")
                if gone_since is not None and len(blockers) == 1:
                    # The only node ahead that blocked us is gone, and a node created later
                    # always gets a higher sequence number: the lock is ours, no need to list.
                    children = [child for child in children if child != watched]
                    listed_at = gone_since
                    continue
                listed_at = anyio.current_time()
                (reply,) = await session.call_retrying(
                    zk.GetChildrenRequest(path=self.parent, watch=False)
                )
                children = [] if isinstance(reply, zk_exc.NoNode) else self._check(reply).children
        finally:
            session.users -= 1
            if self.node is not None or self.unsure:
                # Survives native cancellation too (a second Task.cancel() would go through an
                # anyio shield and leave the node in a live session: stranded until close).
                await finish(
                    self._abandon,
                    timeout=self.backend._settings.op_timeout + 1.0,
                    what=f"deleting the lock node of a cancelled acquire of {self.request.name!r}",
                    unfinished=self._leave_to_janitor,
                )

    def _check(self, reply: Any) -> Any:
        if isinstance(reply, Exception):
            raise _backend_error(reply, f"acquiring {self.request.name!r}", self.backend)
        return reply

    async def _enqueue(self) -> tuple[int, list[str], float]:
        """Create our node (reusing it if a lost reply hid it) and list the queue."""
        session = self.session
        backend = self.backend
        for _ in range(_ATTEMPTS):
            # The parent is a container node: created here when we do not know it exists,
            # deleted by the janitor (or by the server) once empty.
            make_parent = self.parent not in backend._parents
            requests: list[Any] = [
                Create2Request(
                    path=f"{self.parent}/{self.prefix}",
                    data=b"",
                    acl=backend._acl,
                    flags=_EPHEMERAL_SEQUENTIAL,
                ),
                zk.GetChildrenRequest(path=self.parent, watch=False),
            ]
            if make_parent:
                requests.insert(
                    0,
                    _CreateContainerRequest(
                        path=self.parent,
                        data=self.request.name.encode(),
                        acl=backend._acl,
                        flags=_CONTAINER,
                    ),
                )
            sent_at = anyio.current_time()
            self.unsure = True
            try:
                *made_parent, created, listed = await session.call(*requests)
            except _NotConnected:
                self.unsure = False
                raise
            except _ConnectionLoss:
                found = await self._find_own()
                if found is not None:
                    return found
                continue
            if made_parent and isinstance(made_parent[0], zk_exc.NoNode):
                # Someone deleted the chroot: make it again.
                self.unsure = False
                await backend._ensure_chroot(session)
                continue
            if isinstance(created, zk_exc.NoNode):
                # The parent is gone (deleted once it was empty): make it again.
                self.unsure = False
                backend._parents.pop(self.parent, None)
                continue
            self._check(created)
            self.unsure = False
            self.node = created.path.rpartition("/")[2]
            backend._touch_parent(self.parent)
            return created.stat.created_zxid, self._check(listed).children, sent_at
        raise BackendUnavailable(
            f"acquiring {self.request.name!r} on {backend.describe()}: could not create the "
            f"lock node in {_ATTEMPTS} attempts"
        )

    async def _find_own(self) -> tuple[int, list[str], float] | None:
        """After a create whose reply was lost: find the node it made, if it made one."""
        sent_at = anyio.current_time()
        (listed,) = await self.session.call_retrying(
            zk.GetChildrenRequest(path=self.parent, watch=False)
        )
        if isinstance(listed, zk_exc.NoNode):
            self.unsure = False
            return None
        children = self._check(listed).children
        mine = sorted((c for c in children if c.startswith(self.prefix)), key=_sequence)
        if not mine:
            self.unsure = False
            return None
        # Keep the first; any later one is a duplicate from another lost reply (until they are
        # deleted, a cancellation cleans up by prefix: every node of this lease).
        self.node = mine[0]
        if mine[1:]:
            await self.session.delete([f"{self.parent}/{extra}" for extra in mine[1:]], self.parent)
            children = [c for c in children if c not in mine[1:]]
        self.unsure = False
        (stat,) = await self.session.call_retrying(
            zk.ExistsRequest(path=f"{self.parent}/{self.node}", watch=False)
        )
        if isinstance(stat, zk_exc.NoNode):
            self.node = None
            return None
        logger.info("asynclock: reusing lock node %s/%s after a lost reply", self.parent, self.node)
        return self._check(stat).stat.created_zxid, children, sent_at

    async def _wait_for(self, path: str) -> float | None:
        """Wait until ``path`` is gone or changed, or the session's state changed.

        Returns, when ``path`` is known to be gone, a time before a request the server answered
        after that (a valid ``valid_from``); None when something else woke us.
        """
        woken = anyio.Event()
        deleted = False

        def wake(event_type: int = _NO_EVENT) -> None:
            nonlocal deleted
            deleted = deleted or event_type == zk.WatchEvent.DELETED
            woken.set()

        def state_changed() -> None:
            woken.set()

        session = self.session
        session.add_watch(path, wake)
        session.add_listener(state_changed)
        try:
            sent_at = anyio.current_time()
            (reply,) = await session.call_retrying(zk.GetDataRequest(path=path, watch=True))
            if isinstance(reply, zk_exc.NoNode):
                return sent_at
            self._check(reply)
            await woken.wait()
            # The event came over a live connection of a live session; the last request the
            # server answered bounds when it last heard from us.
            return session.heard_sent_at if deleted and session.state == "connected" else None
        finally:
            session._drop_watch(path, wake)
            session.drop_listener(state_changed)

    def _orphan_prefix(self) -> str:
        # Unsure (a create or a duplicate delete whose outcome is unknown): every node of this
        # lease; otherwise just the one we know.
        if self.unsure or self.node is None:
            return self.prefix
        return self.node

    def _leave_to_janitor(self) -> None:
        self.session.add_orphan(self.parent, self._orphan_prefix())

    async def _abandon(self) -> None:
        """Delete what this attempt created (bounded; left to the session's janitor if not).

        Idempotent: :func:`asynclock._shield.finish` runs it again from the start when a native
        cancellation interrupted it.
        """
        session = self.session
        if not session.usable:
            return
        prefix = self._orphan_prefix()
        if session.state != "connected":
            session.add_orphan(self.parent, prefix)
            return
        try:
            with anyio.fail_after(self.backend._settings.op_timeout):
                if prefix == self.prefix:
                    await session.delete_matching(self.parent, prefix)
                else:
                    await session.delete([f"{self.parent}/{prefix}"], self.parent)
        except (_ConnectionLoss, TimeoutError, BackendUnavailable):
            session.add_orphan(self.parent, prefix)
        except _SessionGone:
            pass


def _sequence(child: str) -> int:
    suffix = child.rpartition("-")[2]
    return int(suffix) if suffix.isdigit() else -1


@dataclass(frozen=True, slots=True, order=True)
class _Queued:
    sequence: int
    child: str = field(compare=False)
    #: The encoded owner id (``encode_name(request.owner)``).
    owner: str = field(compare=False)
    kind: str = field(compare=False)


def _queue(children: Sequence[str]) -> list[_Queued]:
    """Our lock nodes among ``children`` (``_c_<owner>-<kind>-<sequence>``), in queue order;
    anything else takes no part in the order."""
    queue: list[_Queued] = []
    for child in children:
        head, _, suffix = child.rpartition("-")
        owner_part, _, child_kind = head.rpartition("-")
        owner = owner_part.removeprefix(_PROTECTED)
        if (
            not child.startswith(_PROTECTED)
            or not suffix.isdigit()
            or child_kind not in (_EXCLUSIVE, _SHARED)
            or not owner
        ):
            continue
        queue.append(_Queued(int(suffix), child, owner, child_kind))
    queue.sort()
    return queue


def _blockers(children: Sequence[str], node: str, kind: Kind) -> list[str] | None:
    """The nodes ahead of ``node`` that keep it from the lock, in queue order (empty: it holds
    the lock); None if ``node`` is not among ``children``."""
    queue = _queue(children)
    for index, entry in enumerate(queue):
        if entry.child == node:
            ahead = queue[:index]
            break
    else:
        return None
    if kind == _SHARED:
        ahead = [entry for entry in ahead if entry.kind == _EXCLUSIVE]
    return [entry.child for entry in ahead]


def _ttl_refusal(ttl: float, where: str, low: int | None, high: int | None) -> str:
    """Why ``ttl`` cannot be honoured, given the session timeout bounds learned so far (ms;
    None: not known, the server never had to clamp a request that way), and what to do."""
    if low is not None and high is not None:
        allowed = f"from {low / 1000:g} to {high / 1000:g} s"
    elif high is not None:
        allowed = f"of at most {high / 1000:g} s"
    else:
        assert low is not None
        allowed = f"of at least {low / 1000:g} s"
    if high is not None and _ms(ttl) > high:
        fix = (
            f"pass ttl={high / 1000:g} or less (locks.lock(name, ttl={high / 1000:g})), or raise "
            f"the server's maxSessionTimeout to at least {_ms(ttl)} ms (zoo.cfg; by default it "
            "is 20 times tickTime)"
        )
    else:
        assert low is not None
        fix = (
            f"pass ttl={low / 1000:g} or more, or lower the server's minSessionTimeout to at "
            f"most {_ms(ttl)} ms (zoo.cfg; by default it is 2 times tickTime)"
        )
    return (
        f"ttl {ttl:g} s cannot be honoured by ZooKeeper at {where}: a lock's ttl is the timeout "
        f"of its ZooKeeper session, and this server allows session timeouts {allowed}; {fix}"
    )


def _ms(seconds: float) -> int:
    if not math.isfinite(seconds):
        return -1
    return round(seconds * 1000)


# -- read-write locks ------------------------------------------------------------------------


class ReadWriteLock:
    """A read-write lock on ZooKeeper: many readers or one writer, served in arrival order.

    Readers queue in the same znode directory as writers (``-read-`` nodes next to ``-lock-``
    nodes): a reader waits only for writers that came before it, a writer for everyone before
    it, so a steady stream of readers cannot starve a writer. The write side *is* the plain
    lock: ``locks.lock(name)`` and ``ReadWriteLock(locks, name).write()`` exclude each other and
    every reader. Leases, renewal, loss and fencing tokens work as for ``locks.lock``::

        rw = ReadWriteLock(locks, "catalog")
        async with rw.read(ttl=10) as lease:
            ...
    """

    def __init__(self, locks: LockClient, name: str) -> None:
        if not isinstance(locks._backend, ZooKeeperBackend):
            raise UnsupportedFeature(
                f"read-write locks need the zookeeper:// backend, not {locks._backend.describe()}"
            )
        self._locks = locks
        self.name = name

    @contextlib.asynccontextmanager
    async def read(
        self, *, ttl: float = 30.0, timeout: float | None = None, on_lost: OnLost = "cancel"
    ) -> AsyncIterator[Lease]:
        """Hold the lock shared with other readers for the body of an ``async with``."""
        async with self._hold(_SHARED, ttl, timeout, on_lost) as lease:
            yield lease

    @contextlib.asynccontextmanager
    async def write(
        self, *, ttl: float = 30.0, timeout: float | None = None, on_lost: OnLost = "cancel"
    ) -> AsyncIterator[Lease]:
        """Hold the lock alone (no reader, no other writer) for the body of an ``async with``."""
        async with self._hold(_EXCLUSIVE, ttl, timeout, on_lost) as lease:
            yield lease

    @contextlib.asynccontextmanager
    async def _hold(
        self, kind: Kind, ttl: float, timeout: float | None, on_lost: OnLost
    ) -> AsyncIterator[Lease]:
        context = self._locks.lock(self.name, ttl=ttl, timeout=timeout, on_lost=on_lost)
        # The kind reaches the backend's acquire through this context variable, and only
        # that acquire: it is reset before the body runs.
        token = _kind.set(kind)
        pending = True
        try:
            async with context as lease:
                _kind.reset(token)
                pending = False
                yield lease
        finally:
            if pending:
                _kind.reset(token)
