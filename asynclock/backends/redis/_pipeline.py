"""Redlock's link to each master: one pipelined connection per master, with a reader task each.

The connections are :mod:`._wire`'s (redis-py's handshake and parser); what this module adds
is the order.

Every request is written at once, in the order the client makes them, and the replies are
matched to the requests in that order by a reader task, so a caller that gives up on a reply
(its round was decided, it was cancelled) costs nothing and leaves the connection usable. The
order is also what makes cleanup sound: the release that follows an abandoned take reaches each
master after that take, on the same connection, so it cannot overtake it and leave the key
behind. A connection whose oldest request has waited ``op_timeout`` (a hung master) is closed
and every request on it fails; one that the server closed (restart, ``CLIENT KILL``) is replaced
at once, and the requests that were on it are sent again once on the new one (every script is
idempotent for its owner id).

The background work (connecting, reading replies, watching for a hung master) runs in the
backend's :class:`~asynclock.backends._kit.TaskHost`, which no caller's cancellation reaches.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import redis.exceptions
from redis.asyncio.connection import AbstractConnection

from .._kit import BackendTimeout, BackendUnavailable, HostPort, TaskHost, now
from ._urls import Settings
from ._wire import close_now, closing, pack, read, write_now

logger = logging.getLogger("asynclock")


@dataclass(slots=True, eq=False)
class Failed:
    """A master that did not answer (or answered with an error) in time."""

    error: BaseException

    def __repr__(self) -> str:
        return f"<failed: {self.error!r}>"


@dataclass(slots=True, eq=False)
class _Request:
    """One command for one master. ``keep``: send it even if its caller stopped waiting (a
    release must reach the server; a take that nobody waits for any more need not)."""

    data: bytes
    future: asyncio.Future[Any]
    keep: bool
    attempts: int = 0
    sent_at: float = 0.0

    @property
    def wanted(self) -> bool:
        return self.keep or not self.future.done()

    def resolve(self, reply: Any) -> None:
        if not self.future.done():  # done: abandoned by its caller, the reply is dropped
            self.future.set_result(reply)

    def fail(self, error: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(error)
            self.future.exception()  # marked retrieved: no log line if nobody waits for it


class _Link:
    """One open connection to a master: requests written in order, replies read in order."""

    def __init__(self, master: Master, conn: AbstractConnection) -> None:
        self.master = master
        self.conn = conn
        self.pending: deque[_Request] = deque()
        self.alive = True
        #: The scopes of its reader and watcher tasks: cancelled when it closes.
        self.scopes: list[anyio.CancelScope] = []
        self._busy = asyncio.Event()

    def send(self, request: _Request) -> None:
        request.attempts += 1
        request.sent_at = now()
        self.pending.append(request)
        write_now(self.conn, request.data)
        self._busy.set()

    async def read_replies(self) -> None:
        master = self.master
        try:
            while self.alive:
                try:
                    reply = await read(self.conn)
                except redis.exceptions.ResponseError as exc:
                    # An error reply is a whole reply: it answers its request, not the link.
                    self._next().fail(_unavailable(master, "answered with an error", exc))
                else:
                    self._next().resolve(reply)
        except (OSError, redis.exceptions.ConnectionError) as exc:
            master.lost(self, _unavailable(master, "closed the connection", exc), retry=True)
        except (redis.exceptions.RedisError, ValueError) as exc:
            master.lost(self, _unavailable(master, "broke the protocol", exc), retry=False)

    def _next(self) -> _Request:
        if not self.pending:
            raise redis.exceptions.InvalidResponse("a reply that no request asked for")
        return self.pending.popleft()

    async def watch(self) -> None:
        """Declare the connection dead when its oldest request has waited ``limit`` seconds:
        the master hangs, and every request on the connection fails with ``BackendTimeout``."""
        limit = self.master.settings.op_timeout
        while self.alive:
            if not self.pending:
                self._busy.clear()
                await self._busy.wait()
                continue
            head = self.pending[0]
            left = head.sent_at + limit - now()
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

    def close(self) -> asyncio.StreamWriter | None:
        """Close the connection now; its writer, to wait for (see ``finish_closing``)."""
        self.alive = False
        for scope in self.scopes:
            scope.cancel()
        return close_now(self.conn)


def _unavailable(master: Master, what: str, exc: BaseException) -> BackendUnavailable:
    return BackendUnavailable(f"Redis master {master.address} {what} ({exc!r})")


class Master:
    """One master: its connection (made when first needed, and again after it died) and the
    requests that wait for one."""

    def __init__(
        self,
        address: HostPort,
        settings: Settings,
        host: TaskHost,
    ) -> None:
        self.address = address
        self.settings = settings
        self._host = host
        self._pool = settings.pool(address)
        self._link: _Link | None = None
        self._connecting = False
        self._backlog: deque[_Request] = deque()
        self._closed = False
        #: Connections made so far (tests read it), and open now (``extra_info`` shows it):
        #: one, except for a moment while a dead one is replaced.
        self.connections_made = 0
        self.open_connections = 0

    def submit(
        self, args: Sequence[str | int | float | bytes], *, keep: bool = False
    ) -> asyncio.Future[Any]:
        """Queue a command and return the future of its reply. No await: a request made before
        a cancellation is on its way, in order, whatever happens to the caller."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._enqueue(_Request(pack(args), future, keep))
        return future

    def _enqueue(self, request: _Request) -> None:
        if self._closed:
            request.fail(
                BackendUnavailable(f"the connection to Redis master {self.address} is closed")
            )
            return
        link = self._link
        if link is not None and link.alive and closing(link.conn):
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
            if self._spawn(self._connect, f"connecting to Redis master {self.address}") is None:
                self._connecting = False
                self._fail_backlog(BackendUnavailable("the lock client is closed"))

    def _spawn(
        self, func: Callable[[], Coroutine[Any, Any, None]], what: str
    ) -> anyio.CancelScope | None:
        """Run ``func()`` in the backend's task host, which no caller's cancellation reaches,
        until it returns, its scope is cancelled or the backend closes; None once closed."""
        if self._closed or not self._host.running:
            return None
        scope = anyio.CancelScope()
        self._host.start_soon(_guarded, scope, func, what, name=f"asynclock: {what}")
        return scope

    def _fail_backlog(self, error: BaseException) -> None:
        backlog, self._backlog = self._backlog, deque()
        for request in backlog:
            request.fail(error)

    async def _connect(self) -> None:
        error: BaseException | None = None
        try:
            with anyio.fail_after(self.settings.op_timeout):
                conn = await self._open()
        except (TimeoutError, redis.exceptions.TimeoutError):
            error = BackendTimeout(
                f"Redis master {self.address} did not answer within "
                f"{self.settings.op_timeout:g} s while connecting"
            )
        except BackendUnavailable as exc:
            error = exc
        except (OSError, redis.exceptions.RedisError) as exc:
            # redis-py wraps the socket's error in words of its own: the socket's are shorter.
            cause = exc.__context__ if isinstance(exc.__context__, OSError) else exc
            error = BackendUnavailable(f"cannot connect to Redis master {self.address}: {cause}")
        except BaseException:
            self._connecting = False
            self._fail_backlog(BackendUnavailable("the lock client is closed"))
            raise
        self._connecting = False
        if error is not None:
            self._fail_backlog(error)
            return
        if self._closed:
            close_now(conn)
            self._fail_backlog(BackendUnavailable("the lock client is closed"))
            return
        link = _Link(self, conn)
        self._link = link
        self.connections_made += 1
        self.open_connections += 1
        for scope in (
            self._spawn(link.read_replies, f"reading replies of Redis master {self.address}"),
            self._spawn(link.watch, f"watching Redis master {self.address}"),
        ):
            if scope is not None:
                link.scopes.append(scope)
        backlog, self._backlog = self._backlog, deque()
        for request in backlog:
            if request.wanted:
                link.send(request)

    async def _open(self) -> AbstractConnection:
        """A connection set up by redis-py (TLS, AUTH, SELECT, CLIENT SETNAME)."""
        conn: AbstractConnection = self._pool.make_connection()  # type: ignore[no-untyped-call]
        try:
            await conn.connect()  # type: ignore[no-untyped-call]
        except (redis.exceptions.AuthenticationError, redis.exceptions.ResponseError) as exc:
            close_now(conn)
            step = "AUTH" if isinstance(exc, redis.exceptions.AuthenticationError) else "SELECT"
            raise BackendUnavailable(
                f"Redis master {self.address} refused {step}: {exc}; check the user, password "
                "and database number"
            ) from exc
        except BaseException:
            close_now(conn)
            raise
        return conn

    def lost(
        self, link: _Link, error: BaseException, *, retry: bool
    ) -> asyncio.StreamWriter | None:
        """``link`` died: close it, and send its requests again once (``retry``: the server
        closed it, so none of them runs later) or fail them. Returns its writer, to wait for
        (see ``finish_closing``), or None if it was closed already."""
        if not link.alive:
            return None
        writer = link.close()
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
        return writer

    @property
    def busy(self) -> bool:
        """Requests are on their way (or waiting for a connection)."""
        return bool((self._link is not None and self._link.pending) or self._backlog)

    def close(self) -> asyncio.StreamWriter | None:
        """Close the connection; its writer, to wait for (see ``finish_closing``)."""
        self._closed = True
        link, self._link = self._link, None
        error = BackendUnavailable(f"the connection to Redis master {self.address} is closed")
        writer = None if link is None else self.lost(link, error, retry=False)
        self._fail_backlog(error)
        return writer


def _outcome(future: asyncio.Future[Any]) -> Any:
    if future.cancelled():
        return Failed(BackendTimeout("no answer before the round was decided"))
    error = future.exception()
    return Failed(error) if error is not None else future.result()


async def gather(
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
    deadline = now() + timeout
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
                deadline = min(deadline, now() + grace)
            left = deadline - now()
            if left <= 0:
                if second_look:
                    break
                # As after a pause of this process: read what has arrived before the verdict.
                second_look = True
                for _ in range(2):
                    await asyncio.sleep(0)
                continue
            out = [future for index, future in enumerate(futures) if results[index] is None]
            await _first_done(out, left)
    finally:
        for future in futures:
            if not future.done():
                future.cancel()
    late = (
        "no answer yet when a majority had answered"
        if settled
        else f"no answer within {timeout:g} s"
    )
    return [Failed(BackendTimeout(late)) if result is None else result for result in results]


async def _guarded(
    scope: anyio.CancelScope, func: Callable[[], Coroutine[Any, Any, None]], what: str
) -> None:
    with scope:
        try:
            await func()
        except Exception:
            logger.exception("asynclock: %s failed", what)


async def _first_done(futures: Sequence[asyncio.Future[Any]], timeout: float) -> None:
    """Wait until one of ``futures`` is done, or ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[None] = loop.create_future()

    def wake(_: object = None) -> None:
        if not waiter.done():
            waiter.set_result(None)

    for future in futures:
        future.add_done_callback(wake)
    timer = loop.call_later(timeout, wake)
    try:
        await waiter
    finally:
        timer.cancel()
        for future in futures:
            future.remove_done_callback(wake)
