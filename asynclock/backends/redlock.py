"""``redlock://h1:6379,h2:6379,h3:6379/0``: Redlock over several independent Redis masters.

The algorithm as antirez describes it (and Kleppmann analyses it): send the take to every
master at once, with a per-request time bound small against the ttl; the lock is ours when a
majority said yes and time is left, the validity being ``ttl - elapsed - drift``. Otherwise
release on every master that may have said yes and retry after a jittered, capped delay.
Renew extends the key on every master and holds on a majority; release deletes on all. Every
time is read from the monotonic clock, and the validity starts before the first request of the
round was sent.

Many waiters, one client: the tasks of one client that wait for the same name queue locally
(first come, first served), and only the first of them runs rounds, with the backoff; a release
by this client wakes it at once. So 1,000 waiting tasks cost the masters what one waiter costs,
and they never split the masters' votes among themselves.

Connections: one per master, pipelined. Every request is written at once, in the order the
client makes them, and the replies are matched to the requests in that order by a reader task,
so a caller that gives up on a reply (its round was decided, it was cancelled) costs nothing and
leaves the connection usable. The order is also what makes cleanup sound: the release that
follows an abandoned take reaches each master after that take, on the same connection, so it
cannot overtake it and leave the key behind. A connection whose oldest request has waited
``op_timeout`` (a hung master) is closed and every request on it fails; one that the server
closed (restart, ``CLIENT KILL``) is replaced at once, and the requests that were on it are sent
again once on the new one (every script here is idempotent for its owner id).

Redlock has no sound fencing token: the masters share no counter, so nothing orders two
acquisitions. ``capabilities.fencing`` is False, grants carry no token, and ``lease.token`` /
``asynclock.current_token()`` raise :class:`asynclock.UnsupportedFeature`. Use it for efficiency
locks (work done twice costs time, not correctness); its safety rests on bounded network
delays, process pauses and clock drift, which real systems do not guarantee.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import ssl
from collections import deque
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Self

import anyio

from .._errors import BackendTimeout, BackendUnavailable, InvalidArgument, InvalidURL
from .._registry import redact
from .._shield import finish
from .._validate import Options
from ..abc import Backend, Capabilities, Grant, LockRequest, Lost, Renewed, RenewOutcome, Unknown
from . import _redis_scripts as lua

__all__ = ("RedlockBackend", "RedlockGrant")

logger = logging.getLogger("asynclock")

_EXAMPLE = "redlock://127.0.0.1:6379,127.0.0.1:6380,127.0.0.1:6381/0"
#: Fewer masters than this are refused (see ``_check_master_count``).
MIN_MASTERS: Final = 3
_DEFAULT_DRIFT = 0.01
#: Fixed part of the drift allowance (antirez: "plus 2 milliseconds").
_DRIFT_FLOOR = 0.002
_DEFAULT_MAX_RETRY_DELAY = 0.1
_FIRST_RETRY_DELAY = 0.002
#: Per-master request bound in a round, as a share of the ttl (and never above op_timeout).
_REQUEST_SHARE = 0.1
#: Least time a release waits for the masters' answers.
_MIN_RELEASE_WAIT = 0.05
#: How long a release waits for the slower masters once a majority answered.
_RELEASE_GRACE = 0.01
#: How long opening waits for the slower masters once a majority answered.
_OPEN_GRACE = 0.25
#: How long closing the client waits for requests still on their way (releases) to be answered.
_DRAIN_ON_CLOSE = 0.5

# The scripts, kept here rather than shared with redis://, so that the two backends can change
# theirs independently. Each is idempotent for one owner id: a request sent again on a new
# connection after the old one died finds the same state, not a new one.

#: Take on one master. KEYS: lock key. ARGV: owner id, ttl in ms.
#: Returns {1, 0} when the lock is ours now, {0, pttl of the holder} otherwise.
_TAKE: Final = """
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

#: Renew many locks. KEYS: lock keys. ARGV: owner ids, then ttls in ms, one each.
#: Returns one code per key: 1 renewed, 0 the key is gone, -1 another owner holds it.
_RENEW: Final = """
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

#: Delete the lock if, and only if, its value is our owner id. KEYS: lock key. ARGV: owner id.
_RELEASE: Final = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


@dataclass(eq=False, slots=True)
class RedlockGrant(Grant):
    """A Redlock grant: ``ttl`` is the validity (requested ttl less the drift allowance);
    ``ttl_ms`` the expiry set on each master."""

    ttl_ms: int = 0


class _Failed:
    """A master that did not answer (or answered with an error) in time."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __repr__(self) -> str:
        return f"<failed: {self.error!r}>"


# -- the wire: RESP2 over one pipelined connection per master -------------------------------


class _ErrorReply(str):
    """A RESP error reply (``-ERR ...``)."""

    __slots__ = ()


class _ProtocolError(Exception):
    """The server sent something that is not a reply to what was asked."""


def _pack(args: Sequence[str | int | float | bytes]) -> bytes:
    """One command in RESP."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


async def _read_reply(reader: asyncio.StreamReader) -> Any:
    """One RESP2 reply. An error reply comes back as an :class:`_ErrorReply` value."""
    line = await reader.readuntil(b"\r\n")
    kind, rest = line[:1], line[1:-2]
    if kind == b":":
        return int(rest)
    if kind == b"$":
        size = int(rest)
        if size < 0:
            return None
        return (await reader.readexactly(size + 2))[:-2]
    if kind == b"*":
        count = int(rest)
        if count < 0:
            return None
        return [await _read_reply(reader) for _ in range(count)]
    if kind == b"+":
        return rest
    if kind == b"-":
        return _ErrorReply(rest.decode("utf-8", "replace"))
    raise _ProtocolError(f"unexpected reply line {line[:40]!r}")


def _now() -> float:
    return asyncio.get_running_loop().time()


class _Request:
    """One command for one master. ``keep``: send it even if its caller stopped waiting (a
    release must reach the server; a take that nobody waits for any more need not)."""

    __slots__ = ("attempts", "data", "future", "keep", "sent_at")

    def __init__(self, data: bytes, future: asyncio.Future[Any], keep: bool) -> None:
        self.data = data
        self.future = future
        self.keep = keep
        self.attempts = 0
        self.sent_at = 0.0

    @property
    def wanted(self) -> bool:
        return self.keep or not self.future.done()

    def resolve(self, reply: Any, address: lua.Address) -> None:
        if isinstance(reply, _ErrorReply):
            self.fail(BackendUnavailable(f"Redis master {address} answered with an error: {reply}"))
        elif not self.future.done():  # done: abandoned by its caller, the reply is dropped
            self.future.set_result(reply)

    def fail(self, error: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(error)
            self.future.exception()  # marked retrieved: no log line if nobody waits for it


class _Link:
    """One open connection to a master: requests written in order, replies read in order."""

    def __init__(
        self, master: _Master, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.master = master
        self.reader = reader
        self.writer = writer
        self.pending: deque[_Request] = deque()
        self.alive = True
        self.tasks: list[asyncio.Task[None]] = []
        self._busy = asyncio.Event()

    def send(self, request: _Request) -> None:
        request.attempts += 1
        request.sent_at = _now()
        self.pending.append(request)
        self.writer.write(request.data)
        self._busy.set()

    async def read_replies(self) -> None:
        master = self.master
        try:
            while self.alive:
                self._deliver(await _read_reply(self.reader))
        except (OSError, EOFError, asyncio.IncompleteReadError) as exc:
            master.lost(self, _unavailable(master, "closed the connection", exc), retry=True)
        except (_ProtocolError, ValueError, asyncio.LimitOverrunError) as exc:
            master.lost(self, _unavailable(master, "broke the protocol", exc), retry=False)

    def _deliver(self, reply: Any) -> None:
        if not self.pending:
            raise _ProtocolError("a reply that no request asked for")
        self.pending.popleft().resolve(reply, self.master.address)

    async def watch(self, limit: float) -> None:
        """Declare the connection dead when its oldest request has waited ``limit`` seconds:
        the master hangs, and every request on the connection fails with ``BackendTimeout``."""
        while self.alive:
            if not self.pending:
                self._busy.clear()
                await self._busy.wait()
                continue
            head = self.pending[0]
            left = head.sent_at + limit - _now()
            if left > 0:
                await asyncio.sleep(left)
                continue
            # After a pause of this process the reply may be in the socket already: let the
            # reader take what has arrived before judging.
            for _ in range(3):
                await asyncio.sleep(0)
            if self.alive and self.pending and self.pending[0] is head:
                error = BackendTimeout(
                    f"Redis master {self.master.address} did not answer within {limit:g} s"
                )
                self.master.lost(self, error, retry=False)

    def close(self) -> None:
        self.alive = False
        current = asyncio.current_task()
        for task in self.tasks:
            if task is not current:
                task.cancel()
        # close(), not abort(): what is written already (a release) still goes out.
        self.writer.close()


def _unavailable(master: _Master, what: str, exc: BaseException) -> BackendUnavailable:
    return BackendUnavailable(f"Redis master {master.address} {what} ({exc!r})")


class _Master:
    """One master: its connection (made when first needed, and again after it died) and the
    requests that wait for one."""

    def __init__(
        self,
        address: lua.Address,
        settings: lua.Settings,
        spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None] | None],
    ) -> None:
        self.address = address
        self.settings = settings
        self._spawn = spawn
        self._link: _Link | None = None
        self._connecting = False
        self._backlog: deque[_Request] = deque()
        self._closed = False
        #: Connections made so far, open now, and the most open at once (for tests and
        #: ``extra_info``): one, except for a moment while a dead one is replaced.
        self.connections_made = 0
        self.open_connections = 0
        self.peak_connections = 0

    def submit(
        self, args: Sequence[str | int | float | bytes], *, keep: bool = False
    ) -> asyncio.Future[Any]:
        """Queue a command and return the future of its reply. No await: a request made before
        a cancellation is on its way, in order, whatever happens to the caller."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._enqueue(_Request(_pack(args), future, keep))
        return future

    def _enqueue(self, request: _Request) -> None:
        if self._closed:
            request.fail(
                BackendUnavailable(f"the connection to Redis master {self.address} is closed")
            )
            return
        link = self._link
        if link is not None and link.alive and link.writer.transport.is_closing():
            # The server closed it and the reader has not seen it yet: replace it now.
            error = BackendUnavailable(f"Redis master {self.address} closed the connection")
            self.lost(link, error, retry=True)
            link = self._link
        if link is not None and link.alive:
            link.send(request)
            return
        self._backlog.append(request)
        if not self._connecting:
            self._connecting = True
            if self._spawn(self._connect()) is None:
                self._connecting = False
                self._fail_backlog(BackendUnavailable("the lock client is closed"))

    def _fail_backlog(self, error: BaseException) -> None:
        backlog, self._backlog = self._backlog, deque()
        for request in backlog:
            request.fail(error)

    async def _connect(self) -> None:
        error: BaseException | None = None
        try:
            with anyio.fail_after(self.settings.op_timeout):
                reader, writer = await self._open()
        except TimeoutError:
            error = BackendTimeout(
                f"Redis master {self.address} did not answer within "
                f"{self.settings.op_timeout:g} s while connecting"
            )
        except BackendUnavailable as exc:
            error = exc
        except OSError as exc:
            error = BackendUnavailable(f"cannot connect to Redis master {self.address}: {exc}")
        except BaseException:
            self._connecting = False
            self._fail_backlog(BackendUnavailable("the lock client is closed"))
            raise
        self._connecting = False
        if error is not None:
            self._fail_backlog(error)
            return
        if self._closed:
            writer.close()
            self._fail_backlog(BackendUnavailable("the lock client is closed"))
            return
        link = _Link(self, reader, writer)
        self._link = link
        self.connections_made += 1
        self.open_connections += 1
        self.peak_connections = max(self.peak_connections, self.open_connections)
        for task in (
            self._spawn(link.read_replies()),
            self._spawn(link.watch(self.settings.op_timeout)),
        ):
            if task is not None:
                link.tasks.append(task)
        backlog, self._backlog = self._backlog, deque()
        for request in backlog:
            if request.wanted:
                link.send(request)

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        settings = self.settings
        context = _ssl_context(settings) if settings.tls else None
        reader, writer = await asyncio.open_connection(
            self.address.host,
            self.address.port,
            ssl=context,
            server_hostname=self.address.host if context is not None else None,
        )
        try:
            await self._handshake(reader, writer)
        except BaseException as exc:
            writer.close()
            if isinstance(exc, asyncio.IncompleteReadError | _ProtocolError | ValueError):
                raise BackendUnavailable(
                    f"Redis master {self.address} closed the connection while it was being set "
                    f"up ({exc!r}); is it a Redis server?"
                ) from exc
            raise
        return reader, writer

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        settings = self.settings
        commands: list[tuple[str | int, ...]] = []
        if settings.password is not None:
            if settings.username:
                commands.append(("AUTH", settings.username, settings.password))
            else:
                commands.append(("AUTH", settings.password))
        if settings.db:
            commands.append(("SELECT", settings.db))
        if settings.client_name:
            commands.append(("CLIENT", "SETNAME", settings.client_name))
        commands.append(("PING",))
        writer.write(b"".join(_pack(command) for command in commands))
        for command in commands:
            reply = await _read_reply(reader)
            if isinstance(reply, _ErrorReply):
                raise BackendUnavailable(
                    f"Redis master {self.address} refused {command[0]}: {reply}; check the "
                    "user, password and database number"
                )

    def lost(self, link: _Link, error: BaseException, *, retry: bool) -> None:
        """``link`` died: close it, and send its requests again once (``retry``: the server
        closed it, so none of them runs later) or fail them."""
        if not link.alive:
            return
        link.close()
        self.open_connections -= 1
        if self._link is link:
            self._link = None
        pending, link.pending = link.pending, deque()
        logger.debug("asynclock: %s; %d requests on it", error, len(pending))
        for request in pending:
            if retry and request.attempts < 2 and request.wanted:
                self._enqueue(request)
            else:
                request.fail(error)

    @property
    def busy(self) -> bool:
        """Requests are on their way (or waiting for a connection)."""
        return bool((self._link is not None and self._link.pending) or self._backlog)

    def close(self) -> None:
        self._closed = True
        link, self._link = self._link, None
        error = BackendUnavailable(f"the connection to Redis master {self.address} is closed")
        if link is not None and link.alive:
            link.close()
            self.open_connections -= 1
            pending, link.pending = link.pending, deque()
            for request in pending:
                request.fail(error)
        self._fail_backlog(error)


def _ssl_context(settings: lua.Settings) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=settings.ssl_ca_certs)
    if settings.ssl_certfile:
        context.load_cert_chain(settings.ssl_certfile, settings.ssl_keyfile)
    if settings.ssl_cert_reqs == "none":
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    else:
        context.check_hostname = settings.ssl_check_hostname
        context.verify_mode = (
            ssl.CERT_OPTIONAL if settings.ssl_cert_reqs == "optional" else ssl.CERT_REQUIRED
        )
    return context


def _outcome(future: asyncio.Future[Any]) -> Any:
    if future.cancelled():
        return _Failed(BackendTimeout("no answer before the round was decided"))
    error = future.exception()
    return _Failed(error) if error is not None else future.result()


async def _gather(
    futures: Sequence[asyncio.Future[Any]],
    timeout: float,
    decided: Callable[[list[Any]], bool],
    *,
    grace: float = 0.0,
) -> list[Any]:
    """The replies of ``futures`` (one per master) as they come, until ``decided(results so
    far)`` (``None`` marks a master still out) and ``grace`` seconds more for the others, or
    ``timeout``; those still out are abandoned (their requests run on, their replies are
    dropped) and count as failed."""
    results: list[Any] = [None] * len(futures)
    deadline = _now() + timeout
    settled = second_look = False
    try:
        while True:
            for index, future in enumerate(futures):
                if results[index] is None and future.done():
                    results[index] = _outcome(future)
            if all(result is not None for result in results):
                break
            if not settled and decided(results):
                settled = True
                if grace <= 0:
                    break
                deadline = min(deadline, _now() + grace)
            left = deadline - _now()
            if left <= 0:
                if second_look:
                    break
                # As after a pause of this process: read what has arrived before the verdict.
                second_look = True
                for _ in range(2):
                    await asyncio.sleep(0)
                continue
            out = [future for index, future in enumerate(futures) if results[index] is None]
            await asyncio.wait(out, timeout=left, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for future in futures:
            if not future.done():
                future.cancel()
    late = (
        "no answer yet when a majority had answered"
        if settled
        else f"no answer within {timeout:g} s"
    )
    return [_Failed(BackendTimeout(late)) if result is None else result for result in results]


class _Room:
    """The tasks of this client waiting for one name: they take turns, first come first
    served, and only the one whose turn it is runs rounds."""

    __slots__ = ("kick", "turn", "users")

    def __init__(self) -> None:
        self.turn = asyncio.Lock()
        #: Set when this client released the name: the waiter whose turn it is looks again now.
        self.kick = asyncio.Event()
        self.users = 0


# -- the backend ------------------------------------------------------------------------------


class RedlockBackend(Backend[RedlockGrant]):
    """Redlock across independent Redis masters: efficiency locks that survive a minority of
    masters being down, paused or partitioned away."""

    schemes = ("redlock",)
    driver = "asyncio streams, plus redis-py"
    capabilities = Capabilities(
        fencing=False, fifo=False, loss_detection=True, quorum=True, cross_process=True
    )

    def __init__(
        self,
        addresses: Sequence[lua.Address],
        settings: lua.Settings,
        *,
        drift: float = _DEFAULT_DRIFT,
        max_retry_delay: float = _DEFAULT_MAX_RETRY_DELAY,
    ) -> None:
        _check_master_count(len(addresses))
        self.addresses = tuple(addresses)
        self.settings = settings
        self.drift = drift
        self.max_retry_delay = max_retry_delay
        self.quorum = len(self.addresses) // 2 + 1
        self._masters: list[_Master] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._rooms: dict[str, _Room] = {}
        self._closed = False

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_url(cls, url: str, options: Mapping[str, object]) -> Self:
        shown = redact(url)
        scheme, sep, rest = url.partition("://")
        if not sep or scheme.lower() != "redlock":
            raise InvalidURL(f"{shown!r} is not a redlock:// URL; e.g. {_EXAMPLE}")
        if "#" in rest:
            raise InvalidURL(f"{shown!r}: a Redlock URL has no #fragment; e.g. {_EXAMPLE}")
        netloc, slash, path = rest.partition("/")
        username, password, hosts = lua.split_userinfo(netloc)
        if not hosts:
            raise InvalidURL(f"{shown!r} names no masters; e.g. {_EXAMPLE}")
        addresses = [lua.parse_address(host, shown, _EXAMPLE) for host in hosts.split(",")]
        if len(set(addresses)) != len(addresses):
            raise InvalidURL(
                f"{shown!r} names a master twice; Redlock needs independent masters, e.g. "
                f"{_EXAMPLE}"
            )
        _check_master_count(len(addresses), shown)
        db = lua.parse_db(slash + path, shown, _EXAMPLE)
        opts = Options(options, "redlock://")
        tls = opts.flag("tls", False)
        settings = lua.common_settings(
            opts, source="redlock://", db=db, username=username, password=password, tls=tls
        )
        drift = opts.number("drift", _DEFAULT_DRIFT)
        if drift >= 0.5:
            raise InvalidArgument(
                f"option 'drift' of redlock:// is a share of the ttl below 0.5, got {drift!r}"
            )
        max_retry_delay = opts.number("max_retry_delay", _DEFAULT_MAX_RETRY_DELAY, minimum=0.001)
        opts.finish((*lua.COMMON_OPTIONS, "tls", "drift", "max_retry_delay"))
        return cls(addresses, settings, drift=drift, max_retry_delay=max_retry_delay)

    def describe(self) -> str:
        user = f"{self.settings.username}@" if self.settings.username else ""
        hosts = ",".join(str(address) for address in self.addresses)
        return f"redlock://{user}{hosts}/{self.settings.db}"

    def extra_info(self) -> Mapping[str, Any]:
        return {
            "masters": len(self.addresses),
            "quorum": self.quorum,
            "prefix": self.settings.prefix,
            "drift": self.drift,
            "connections_per_master": [master.open_connections for master in self._masters],
        }

    def lock_key(self, name: str) -> str:
        return lua.lock_key(self.settings.prefix, name)

    # -- life cycle --------------------------------------------------------------------------

    async def open(self) -> None:
        if self._masters or self._closed:
            raise RuntimeError("a RedlockBackend can be opened once")
        self._masters = [_Master(address, self.settings, self._spawn) for address in self.addresses]
        try:
            await self._check_masters()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.aclose()
            raise

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> asyncio.Task[None] | None:
        """Run a connection's background work (connect, read replies, watch) in a task of its
        own, which no caller's cancellation reaches; ``None`` once the backend is closed."""
        if self._closed:
            coroutine.close()
            return None
        task = asyncio.get_running_loop().create_task(coroutine, name="asynclock redlock")
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("asynclock: a Redlock connection task failed: %r", task.exception())

    async def _check_masters(self) -> None:
        futures = [master.submit(("PING",)) for master in self._masters]
        # A hung minority does not hold up the start for op_timeout: a majority and a moment
        # for the others is enough (a connection still being set up goes on in its own task).
        results = await _gather(
            futures, self.settings.op_timeout, self._majority_answered, grace=_OPEN_GRACE
        )
        down = [
            f"{master.address} ({_reason(result)})"
            for master, result in zip(self._masters, results, strict=True)
            if isinstance(result, _Failed)
        ]
        if len(self._masters) - len(down) < self.quorum:
            raise BackendUnavailable(
                f"cannot reach a majority of {self.describe()}: {len(down)} of "
                f"{len(self._masters)} masters did not answer ({'; '.join(down)}); check "
                "that redis-server runs on each and that the hosts, ports and password are "
                "right"
            )
        if down:
            logger.warning(
                "asynclock: %s: %d of %d masters did not answer (%s); locking goes on with "
                "the majority",
                self.describe(),
                len(down),
                len(self._masters),
                "; ".join(down),
            )

    async def aclose(self) -> None:
        if self._closed:
            return
        masters = self._masters
        # Releases just sent (by the client's close) get a moment to be answered.
        with anyio.CancelScope(shield=True), anyio.move_on_after(_DRAIN_ON_CLOSE):
            while any(master.busy for master in masters):  # noqa: ASYNC110
                await anyio.sleep(0.005)
        self._closed = True
        for master in masters:
            master.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            with anyio.CancelScope(shield=True):
                await asyncio.wait(tasks, timeout=1.0)

    # -- rounds ------------------------------------------------------------------------------

    def _live_masters(self) -> list[_Master]:
        if not self._masters or self._closed:
            raise BackendUnavailable(f"{self.describe()} is closed (or was never opened)")
        return self._masters

    def _request_timeout(self, ttl: float) -> float:
        return min(self.settings.op_timeout, max(0.005, ttl * _REQUEST_SHARE))

    def _drift_allowance(self, ttl: float) -> float:
        return ttl * self.drift + _DRIFT_FLOOR

    def check_ttl(self, ttl: float) -> None:
        lua.check_ttl_ms(ttl, "redlock://", minimum_ms=10)
        if self._drift_allowance(ttl) >= ttl / 2:
            raise InvalidArgument(
                f"a {ttl:g} s ttl leaves no validity after Redlock's drift allowance "
                f"({self._drift_allowance(ttl) * 1000:.1f} ms); use a longer ttl"
            )

    async def _round(self, request: LockRequest) -> tuple[RedlockGrant | None, int, int]:
        """One Redlock round: (grant or None, masters that answered, largest holder pttl)."""
        masters = self._live_masters()
        key = self.lock_key(request.name)
        ms = lua.ttl_ms(request.ttl)
        ttl = ms / 1000
        count = len(masters)

        def decided(results: list[Any]) -> bool:
            # Ours on a majority; or held elsewhere, as a majority of answers shows (masters
            # that failed prove nothing: the others are waited for, so that try_acquire can
            # tell "held" from "cannot tell").
            yes = sum(1 for r in results if _said(r) == 1)
            no = sum(1 for r in results if _said(r) == 0)
            return yes >= self.quorum or (count - no < self.quorum and yes + no >= self.quorum)

        sent_at = anyio.current_time()
        # Sent to every master before the first await: rounds of this client reach every
        # master in the same order, so they cannot split the votes among themselves.
        futures = [master.submit(("EVAL", _TAKE, 1, key, request.owner, ms)) for master in masters]
        try:
            results = await _gather(futures, self._request_timeout(ttl), decided)
        except BaseException:
            # Cancelled mid-round: any master may hold our key. The deletes are queued on each
            # connection behind the takes before the first await of the cleanup.
            await finish(
                functools.partial(self._release_on, masters, request.name, request.owner, ttl),
                timeout=self._release_wait(ttl) + 0.05,
                what=f"undoing a cancelled Redlock round for {request.name!r}",
                unfinished=functools.partial(_still_queued, request.name),
            )
            raise
        yes = sum(1 for r in results if _said(r) == 1)
        validity = ttl - (anyio.current_time() - sent_at) - self._drift_allowance(ttl)
        if yes >= self.quorum and validity > 0:
            grant = RedlockGrant(
                request.name,
                request.owner,
                None,
                sent_at,
                ttl - self._drift_allowance(ttl),
                ttl_ms=ms,
            )
            return grant, count, 0
        # Any master that said yes, or might have (no answer), may hold our key; one that
        # said no did not write it.
        # The deletes are waited for only where the take was answered: a master that did not
        # answer within the bound runs the delete right after the take whenever it does, and
        # waiting for it again would double the bound (try_acquire on hung masters).
        maybe = [m for m, r in zip(masters, results, strict=True) if _said(r) != 0]
        answered_yes = [m for m, r in zip(masters, results, strict=True) if _said(r) == 1]
        if maybe:
            await finish(
                functools.partial(
                    self._release_on,
                    maybe,
                    request.name,
                    request.owner,
                    ttl,
                    wait_for=answered_yes,
                ),
                timeout=self._release_wait(ttl) + 0.05,
                what=f"undoing a failed Redlock round for {request.name!r}",
                unfinished=functools.partial(_still_queued, request.name),
            )
        answered = sum(1 for r in results if isinstance(r, list))
        pttl = max((r[1] for r in results if _said(r) == 0), default=0)
        return None, answered, pttl

    async def try_acquire(self, request: LockRequest) -> RedlockGrant | None:
        grant, answered, _ = await self._round(request)
        if grant is None and answered < self.quorum:
            raise BackendUnavailable(
                f"only {answered} of {len(self._masters)} masters of {self.describe()} "
                f"answered; Redlock needs {self.quorum} to decide whether {request.name!r} is "
                "free"
            )
        return grant

    async def acquire(self, request: LockRequest) -> RedlockGrant:
        self._live_masters()
        room = self._rooms.get(request.name)
        if room is None:
            room = self._rooms[request.name] = _Room()
        room.users += 1
        try:
            async with room.turn:
                # No await between the grant and the return: the turn passes on at once.
                return await self._contend(request, room)
        finally:
            room.users -= 1
            if room.users == 0 and self._rooms.get(request.name) is room:
                del self._rooms[request.name]

    async def _contend(self, request: LockRequest, room: _Room) -> RedlockGrant:
        delay = _FIRST_RETRY_DELAY
        warned = False
        while True:
            room.kick.clear()
            grant, answered, pttl = await self._round(request)
            if grant is not None:
                return grant
            if answered < self.quorum and not warned:
                warned = True
                logger.warning(
                    "asynclock: only %d of %d masters of %s answer; acquiring %r keeps "
                    "retrying until a majority is back or the caller's timeout",
                    answered,
                    len(self._masters),
                    self.describe(),
                    request.name,
                )
            wait = lua.jittered(delay)
            if 0 < pttl / 1000 < wait:
                wait = pttl / 1000 + random.uniform(0.0005, 0.002)
            with anyio.move_on_after(wait):
                await room.kick.wait()
            delay = (
                _FIRST_RETRY_DELAY if room.kick.is_set() else min(delay * 2, self.max_retry_delay)
            )

    async def renew(self, grants: Sequence[RedlockGrant]) -> Sequence[RenewOutcome]:
        if not grants:
            return []
        masters = self._live_masters()
        keys = [self.lock_key(grant.name) for grant in grants]
        args: list[str | int] = [grant.owner for grant in grants]
        args += [grant.ttl_ms for grant in grants]
        count = len(masters)

        def codes(result: Any) -> list[int] | None:
            if isinstance(result, list) and len(result) == len(grants):
                return [int(code) for code in result]
            return None

        def decided(results: list[Any]) -> bool:
            replies = [codes(r) for r in results]
            for index in range(len(grants)):
                ok = sum(1 for r in replies if r is not None and r[index] == 1)
                no = sum(1 for r in replies if r is not None and r[index] != 1)
                if ok < self.quorum and count - no >= self.quorum:
                    return False
            return True

        sent_at = anyio.current_time()
        command = ("EVAL", _RENEW, len(keys), *keys, *args)
        futures = [master.submit(command) for master in masters]
        shortest = min(grant.ttl_ms for grant in grants) / 1000
        results = await _gather(futures, self._request_timeout(shortest), decided)
        elapsed = anyio.current_time() - sent_at
        replies = [codes(r) for r in results]
        failures = [r.error for r in results if isinstance(r, _Failed)]
        failures += [
            BackendUnavailable(f"unexpected reply from a lock script: {r!r}")
            for r, reply in zip(results, replies, strict=True)
            if reply is None and not isinstance(r, _Failed)
        ]
        outcomes: list[RenewOutcome] = []
        for index, grant in enumerate(grants):
            ttl = grant.ttl_ms / 1000
            ok = sum(1 for r in replies if r is not None and r[index] == 1)
            no = sum(1 for r in replies if r is not None and r[index] != 1)
            if ok >= self.quorum and ttl - elapsed - self._drift_allowance(ttl) > 0:
                outcomes.append(Renewed(sent_at, ttl - self._drift_allowance(ttl)))
            elif count - no < self.quorum:
                outcomes.append(
                    Lost(
                        f"{no} of {count} masters of {self.describe()} no longer hold lock "
                        f"{grant.name!r}, so no majority can"
                    )
                )
            else:
                error = failures[0] if failures else TimeoutError("renewal took too long")
                outcomes.append(
                    Unknown(
                        BackendUnavailable(
                            f"only {ok} of {count} masters of {self.describe()} renewed lock "
                            f"{grant.name!r} in time (first error: {error!r})"
                        )
                    )
                )
        return outcomes

    async def release(self, grant: RedlockGrant) -> None:
        masters = self._live_masters()
        answered = await self._release_on(
            masters, grant.name, grant.owner, grant.ttl_ms / 1000, wake_waiters=True
        )
        if answered < self.quorum:
            raise BackendUnavailable(
                f"releasing {grant.name!r}: only {answered} of {len(masters)} masters of "
                f"{self.describe()} answered; the others free it when its ttl runs out"
            )

    def _release_wait(self, ttl: float) -> float:
        return max(self._request_timeout(ttl), _MIN_RELEASE_WAIT)

    async def _release_on(
        self,
        masters: Sequence[_Master],
        name: str,
        owner: str,
        ttl: float,
        *,
        wake_waiters: bool = False,
        wait_for: Sequence[_Master] | None = None,
    ) -> int:
        """Delete our key on ``masters``; return how many of them answered. The deletes are
        queued before the first await (and go out even if nobody waits for them any more), so
        a cancellation cannot stop them; waiting for the answers is bounded by the request
        bound. Idempotent: running it twice deletes nothing of anybody else's.

        ``wake_waiters`` (a release of a grant, not the undo of a round): the task of this
        client whose turn it is to wait for ``name`` looks again at once. ``wait_for``: the
        masters whose answers are waited for (all of them by default; the count is of those)."""
        key = self.lock_key(name)
        futures = {
            master: master.submit(("EVAL", _RELEASE, 1, key, owner), keep=True)
            for master in masters
        }
        # Whoever of this client waits for the name may take it now: its take reaches every
        # master behind these deletes.
        room = self._rooms.get(name) if wake_waiters else None
        if room is not None:
            room.kick.set()
        if wait_for is None:
            waited = list(futures.values())
            # Every master is waited for until a majority answered, then briefly: a delete
            # not answered yet still runs (it is queued behind our take), so a hung minority
            # master costs a release only the grace.
            decided, grace = self._majority_answered, _RELEASE_GRACE
        else:
            waited = [futures[master] for master in wait_for]
            decided, grace = _never, 0.0
        if not waited:
            return 0
        results = await _gather(waited, self._release_wait(ttl), decided, grace=grace)
        return sum(1 for result in results if not isinstance(result, _Failed))

    def _majority_answered(self, results: list[Any]) -> bool:
        answered = sum(1 for r in results if r is not None and not isinstance(r, _Failed))
        return answered >= self.quorum


def _check_master_count(count: int, url: str | None = None) -> None:
    if count >= MIN_MASTERS:
        return
    where = f"{url!r} names" if url else "got"
    raise InvalidArgument(
        f"Redlock needs at least {MIN_MASTERS} independent masters; {where} {count}. A "
        f"majority of {count} master{'s' if count != 1 else ''} is "
        f"{'it' if count == 1 else 'all of them'}, so the lock would tolerate no failure "
        "while costing more than one server: use redis://host:port for a single Redis "
        f"server, or list {MIN_MASTERS} or more masters (5 tolerate 2 failing), e.g. {_EXAMPLE}"
    )


def _never(results: list[Any]) -> bool:
    return False


def _said(result: Any) -> int | None:
    """1: the master said yes; 0: it said no (someone else holds the key); None: no answer
    (or one that proves nothing)."""
    if isinstance(result, list) and len(result) == 2 and isinstance(result[0], int):
        return 1 if result[0] == 1 else 0
    return None


def _still_queued(name: str) -> None:
    logger.debug(
        "asynclock: the release of %r after an interrupted Redlock round is still on its way "
        "to a master that does not answer; its key expires with its ttl otherwise",
        name,
    )


def _reason(result: object) -> str:
    if isinstance(result, _Failed):
        error = result.error
        text = str(error) or type(error).__name__
        return text if len(text) < 120 else text[:117] + "..."
    return "ok"
