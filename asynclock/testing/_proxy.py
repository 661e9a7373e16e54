"""A TCP proxy that injects network faults between a client and one server."""

from __future__ import annotations

import contextlib
import errno
import socket
import struct
from dataclasses import dataclass, field
from types import TracebackType
from typing import Literal, Self

import anyio
from anyio.abc import TaskGroup, TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

ProxyMode = Literal["pass_through", "delay", "blackhole", "drop_replies"]

_CHUNK = 65536
# Chunks read but not yet written, per direction; beyond that the reader stops reading and TCP
# pushes back on the sender, as a slow link would.
_QUEUED_CHUNKS = 256
_EOF = b""


@dataclass(eq=False)
class _Link:
    """One client connection and the upstream connection it is relayed to."""

    client: socket.socket
    upstream: socket.socket | None = None
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    #: Close with RST instead of FIN.
    abort: bool = False


def _close(sock: socket.socket | None, *, rst: bool) -> None:
    if sock is None or sock.fileno() < 0:
        return
    if rst:
        # Linger on with a zero timeout: close() then sends RST and drops unsent data.
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    anyio.notify_closing(sock)
    sock.close()


async def _send_all(sock: socket.socket, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            sent = sock.send(view)
        except BlockingIOError:
            await anyio.wait_writable(sock)
        else:
            view = view[sent:]


class FaultProxy:
    """A TCP proxy on a free 127.0.0.1 port in front of ``target_host:target_port``.

    Point the client at :attr:`address` (or :attr:`port`) instead of the server, then switch
    faults while the test runs:

    - :meth:`pass_through`: relay everything (the initial mode);
    - :meth:`delay`: hold every chunk ``ms`` milliseconds in each direction, so a round trip
      gains twice that;
    - :meth:`blackhole`: relay nothing either way and keep connections open, like a network
      partition; what the peers send waits in the proxy and the kernel buffers and flows once
      the mode changes (as TCP would retransmit it), and new connections are accepted but not
      connected upstream until then;
    - :meth:`drop_replies`: relay client to server, discard server to client;
    - :meth:`cut`: a blackhole for some seconds, then the previous mode again;
    - :meth:`reset`: close every current connection with RST on both sides (a one-off action,
      the mode stays; new connections are accepted).

    Use it as an async context manager; the mode methods are plain functions, called from the
    event loop thread. Every task runs in a task group the proxy owns and :meth:`aclose` ends.
    """

    def __init__(
        self, target_host: str, target_port: int, *, host: str = "127.0.0.1", port: int = 0
    ) -> None:
        self.target_host = target_host
        self.target_port = target_port
        self._listen_host = host
        self._listen_port = port
        self._listener: socket.socket | None = None
        self._mode: ProxyMode = "pass_through"
        self._delay = 0.0
        # Bumped on every mode change, so that a cut() timer only restores its own cut.
        self._generation = 0
        self._changed: anyio.Event | None = None
        self._links: set[_Link] = set()
        self._outer: TaskGroup | None = None
        self._tasks: TaskGroup | None = None
        self._scope: anyio.CancelScope | None = None
        self._done: anyio.Event | None = None
        self._closed = False

    # -- properties ------------------------------------------------------------------------

    @property
    def host(self) -> str:
        """The address clients connect to."""
        return self._listen_host

    @property
    def port(self) -> int:
        """The port clients connect to (chosen when the proxy starts)."""
        if self._listener is None:
            raise RuntimeError("the proxy is not started: use 'async with FaultProxy(...)'")
        port: int = self._listener.getsockname()[1]
        return port

    @property
    def address(self) -> str:
        """``host:port`` of the proxy."""
        return f"{self.host}:{self.port}"

    @property
    def connections(self) -> int:
        """Client connections open right now."""
        return len(self._links)

    @property
    def mode(self) -> ProxyMode:
        return self._mode

    # -- faults ----------------------------------------------------------------------------

    def pass_through(self) -> None:
        """Relay everything, at once."""
        self._set_mode("pass_through")

    def delay(self, ms: float) -> None:
        """Relay every chunk ``ms`` milliseconds after it arrived, in both directions."""
        if ms < 0:
            raise ValueError("delay must be >= 0 ms")
        self._delay = ms / 1000
        self._set_mode("delay")

    def blackhole(self) -> None:
        """Relay nothing either way, keep the connections open."""
        self._set_mode("blackhole")

    def drop_replies(self) -> None:
        """Relay what clients send; discard what the server sends back."""
        self._set_mode("drop_replies")

    def cut(self, seconds: float) -> None:
        """Blackhole for ``seconds``, then go back to the mode before the cut (unless the mode
        was changed in the meantime)."""
        tasks = self._require_tasks()
        previous = self._mode
        self._set_mode("blackhole")
        tasks.start_soon(self._end_cut, seconds, self._generation, previous)

    def reset(self) -> None:
        """Close every current connection with RST, client and server side."""
        self._require_tasks()
        for link in list(self._links):
            link.abort = True
            link.scope.cancel()

    # -- life cycle ------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        if self._listener is not None or self._closed:
            raise RuntimeError("a FaultProxy can be started only once")
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((self._listen_host, self._listen_port))
            listener.listen(128)
            listener.setblocking(False)
        except BaseException:
            listener.close()
            raise
        self._listener = listener
        self._scope = anyio.CancelScope()
        self._changed = anyio.Event()
        self._done = anyio.Event()
        self._outer = anyio.create_task_group()
        await self._outer.__aenter__()
        try:
            await self._outer.start(self._run)
        except BaseException as exc:
            self._scope.cancel()
            _close(listener, rst=False)
            await self._outer.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        await self.aclose()
        assert self._outer is not None
        if exc is None or isinstance(exc, anyio.get_cancelled_exc_class()):
            return await self._outer.__aexit__(exc_type, exc, tb)
        # The task group would wrap the body's own error in an ExceptionGroup. After aclose()
        # no task is left, so leaving it "cleanly" cannot hide a task's error: only ours.
        await self._outer.__aexit__(None, None, None)
        return None

    async def aclose(self) -> None:
        """Stop accepting, close every connection and end every task; idempotent."""
        self._closed = True
        if self._scope is not None:
            self._scope.cancel()
        if self._done is not None:
            with anyio.CancelScope(shield=True):
                await self._done.wait()

    # -- machinery -------------------------------------------------------------------------

    def _require_tasks(self) -> TaskGroup:
        if self._tasks is None or self._closed:
            raise RuntimeError("the proxy is not running: use 'async with FaultProxy(...)'")
        return self._tasks

    def _set_mode(self, mode: ProxyMode) -> None:
        self._mode = mode
        self._generation += 1
        if self._changed is not None:
            self._changed.set()
            self._changed = anyio.Event()

    async def _end_cut(self, seconds: float, generation: int, previous: ProxyMode) -> None:
        await anyio.sleep(seconds)
        if self._generation == generation:
            self._set_mode(previous)

    async def _wait_unblocked(self) -> None:
        while self._mode == "blackhole":
            assert self._changed is not None
            await self._changed.wait()

    async def _run(self, *, task_status: TaskStatus[None]) -> None:
        assert self._listener is not None and self._done is not None and self._scope is not None
        try:
            with self._scope:
                async with anyio.create_task_group() as tasks:
                    self._tasks = tasks
                    task_status.started()
                    await self._accept_forever(tasks)
        finally:
            self._tasks = None
            _close(self._listener, rst=False)
            self._done.set()

    async def _accept_forever(self, tasks: TaskGroup) -> None:
        assert self._listener is not None
        while True:
            await anyio.wait_readable(self._listener)
            try:
                client, _ = self._listener.accept()
            except (BlockingIOError, ConnectionAbortedError):
                continue
            except OSError as exc:
                # Out of descriptors: back off instead of spinning.
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    await anyio.sleep(0.1)
                    continue
                raise
            client.setblocking(False)
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            link = _Link(client)
            self._links.add(link)
            tasks.start_soon(self._relay, link)

    async def _relay(self, link: _Link) -> None:
        try:
            with link.scope:
                # A partition also stops the handshake with the server.
                await self._wait_unblocked()
                link.upstream = await self._connect()
                async with anyio.create_task_group() as pipes:
                    pipes.start_soon(self._pipe, link, link.client, link.upstream, False)
                    pipes.start_soon(self._pipe, link, link.upstream, link.client, True)
        except OSError:
            # The server refused or reset: the client sees a reset, as it would without us.
            link.abort = True
        finally:
            self._links.discard(link)
            _close(link.client, rst=link.abort)
            _close(link.upstream, rst=link.abort)

    async def _connect(self) -> socket.socket:
        infos = await anyio.getaddrinfo(self.target_host, self.target_port, type=socket.SOCK_STREAM)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
        try:
            await self._handshake(sock, address)
        except BaseException:
            _close(sock, rst=False)
            raise
        return sock

    async def _handshake(self, sock: socket.socket, address: tuple[str, int]) -> None:
        sock.setblocking(False)
        code = sock.connect_ex(address)
        if code == errno.EINPROGRESS:
            await anyio.wait_writable(sock)
            code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if code:
            raise OSError(code, f"connect to {self.target_host}:{self.target_port}")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    async def _pipe(
        self, link: _Link, source: socket.socket, target: socket.socket, is_reply: bool
    ) -> None:
        """Relay one direction: a reader stamps each chunk with its due time, a writer sends it
        then, so that delays overlap like a long link's instead of adding up."""
        send, receive = anyio.create_memory_object_stream[tuple[float, bytes]](_QUEUED_CHUNKS)
        try:
            async with anyio.create_task_group() as pipe:
                pipe.start_soon(self._read, source, send)
                pipe.start_soon(self._write, target, receive, is_reply)
        except* OSError:
            # A broken side breaks the whole connection: reset the other one too.
            link.abort = True
            link.scope.cancel()

    async def _read(
        self, source: socket.socket, queue: MemoryObjectSendStream[tuple[float, bytes]]
    ) -> None:
        async with queue:
            while True:
                await self._wait_unblocked()
                await anyio.wait_readable(source)
                try:
                    data = source.recv(_CHUNK)
                except BlockingIOError:
                    continue
                delay = self._delay if self._mode == "delay" else 0.0
                await queue.send((anyio.current_time() + delay, data))
                if data == _EOF:
                    return

    async def _write(
        self,
        target: socket.socket,
        queue: MemoryObjectReceiveStream[tuple[float, bytes]],
        is_reply: bool,
    ) -> None:
        async with queue:
            async for due, data in queue:
                await anyio.sleep_until(due)
                await self._wait_unblocked()
                if data == _EOF:
                    # Half-close: the other direction may still have replies to relay.
                    with contextlib.suppress(OSError):
                        target.shutdown(socket.SHUT_WR)
                    return
                if is_reply and self._mode == "drop_replies":
                    continue
                await _send_all(target, data)
