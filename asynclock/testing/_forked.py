"""Python worker processes forked from a server that has already imported what they use.

The fault, safety and primitive tests start about 450 worker processes in a run of the suite.
A fresh interpreter spends ~0.35 s of CPU importing Python, asyncio, asynclock and a driver
before it does anything (``python -c "import asynclock, asynclock.backends.redis.backend"``:
0.39 s here), about a sixth of the whole suite's CPU on two cores. Forked from a server that
has imported them, a worker starts in a few ms of CPU. The server has no threads and no event
loop, so forking it is safe (forking the test process, with its loop and threads, is not);
multiprocessing's forkserver would do the forking too, but it imports the parent's
``__main__`` again in every child.

A worker is still a process of its own (SIGSTOP, SIGKILL, its own event loop and connections),
runs its module as ``__main__`` as ``python -m`` would, and exits with the code ``python -m``
would give.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import anyio

__all__ = ("PIPE", "ForkedPython")

#: ``stdout=PIPE``: read the worker's standard output from :attr:`ForkedPython.stdout`.
PIPE = -1

#: Imported once by the server; a module that is not installed is skipped.
_PRELOAD = (
    "asynclock",
    "asynclock.backends.sqlite",
    "asynclock.backends.redis.backend",
    "asynclock.backends.postgres.backend",
    "asynclock.backends.etcd.backend",
    "asynclock.backends.zookeeper.backend",
    "asynclock.testing._safety_worker",
)
_STATUS = struct.Struct("!i")
_lock = threading.Lock()
_server: tuple[subprocess.Popen[bytes], socket.socket] | None = None


def _connection() -> socket.socket:
    """The socket to this process's fork server, started on first use."""
    global _server
    if _server is None or _server[0].poll() is not None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            process = subprocess.Popen(
                [sys.executable, "-c", f"from {__name__} import _serve; _serve({theirs.fileno()})"],
                stdin=subprocess.DEVNULL,
                pass_fds=[theirs.fileno()],
            )
        _server = (process, ours)
        atexit.register(_stop_server)
    return _server[1]


def _stop_server() -> None:
    """At exit: the server ends when its socket closes (its workers have been closed)."""
    global _server
    if _server is not None:
        process, connection = _server
        _server = None
        connection.close()
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class ForkedPython:
    """``python -m module *argv`` as a forked worker, with the parts of
    :class:`subprocess.Popen`'s interface the tests use, and an awaitable :meth:`exited`.

    ``stdout``: :data:`PIPE` (read :attr:`stdout`), a file open for writing, or ``None`` (this
    process's standard output); ``stderr``: a file, or ``None`` (this process's).
    """

    def __init__(
        self,
        module: str,
        argv: Sequence[str] = (),
        *,
        stdout: int | IO[Any] | None = None,
        stderr: IO[Any] | None = None,
        cwd: str | Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        #: What ran, as ``python -m`` would have been told.
        self.args = [module, *argv]
        self.stdout: IO[str] | None = None
        self._exitcode: int | None = None
        self._closed = False
        self._reader: threading.Thread | None = None
        status_r, status_w = os.pipe()
        read_end = None
        if stdout == PIPE:
            read_end, out_fd = os.pipe()
        else:
            out_fd = os.dup(1 if stdout is None else stdout.fileno())  # type: ignore[union-attr]
        err_fd = os.dup(2 if stderr is None else stderr.fileno())
        request = {
            "module": module,
            "argv": list(argv),
            "cwd": None if cwd is None else str(cwd),
            "env": None if env is None else dict(env),
        }
        try:
            with _lock:
                server = _connection()
                socket.send_fds(server, [json.dumps(request).encode()], [out_fd, err_fd, status_w])
                reply = json.loads(server.recv(4096))
        except BaseException:
            for fd in (status_r, read_end):
                if fd is not None:
                    os.close(fd)
            raise
        finally:
            for fd in (out_fd, err_fd, status_w):
                os.close(fd)
        self.pid: int = reply["pid"]
        os.set_blocking(status_r, False)
        self._status = status_r
        if read_end is not None:
            self.stdout = open(read_end, encoding="utf-8")  # noqa: SIM115 (closed by close())

    @property
    def returncode(self) -> int | None:
        """The exit code (negative: the signal that ended it), or ``None`` while it runs."""
        if self._exitcode is None and not self._closed:
            try:
                data = os.read(self._status, _STATUS.size)  # non-blocking
            except BlockingIOError:
                return None
            if len(data) != _STATUS.size:
                raise RuntimeError(f"the fork server ended before worker {self.pid}")
            (self._exitcode,) = _STATUS.unpack(data)
        return self._exitcode

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        """Block until the worker exits (``None`` if ``timeout`` passes first)."""
        if self.returncode is None:
            poller = select.poll()
            poller.register(self._status, select.POLLIN)
            poller.poll(None if timeout is None else timeout * 1000)
        return self.returncode

    async def exited(self) -> int:
        """Wait, without blocking the event loop, until the worker exits; its exit code."""
        while self.returncode is None:
            await anyio.wait_readable(self._status)
        assert self._exitcode is not None
        return self._exitcode

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        """Read standard output to its end (with ``stdout=PIPE``) and wait for the exit, both
        within ``timeout`` (else :class:`subprocess.TimeoutExpired`, as ``Popen`` raises)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        out: list[str] = []
        if self.stdout is not None:
            stdout = self.stdout
            # A thread, so that a worker that never closes its output cannot outlast timeout;
            # close() joins it once the worker is gone.
            self._reader = threading.Thread(target=lambda: out.append(stdout.read()), daemon=True)
            self._reader.start()
            self._reader.join(timeout)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if (self.stdout is not None and not out) or self.wait(left) is None:
            raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0.0)
        return "".join(out), None

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def close(self) -> None:
        """Kill the worker if it still runs (resumed first, should it be stopped), wait for its
        end, and close its pipes. Idempotent."""
        if self._closed:
            return
        if self.returncode is None:
            self.send_signal(signal.SIGCONT)
            self.kill()
            self.wait()
        self._closed = True
        os.close(self._status)
        if self._reader is not None:
            self._reader.join()  # the worker is gone: its output has ended
        if self.stdout is not None:
            self.stdout.close()


# -- the server ---------------------------------------------------------------------------


def _serve(fd: int) -> None:
    """The fork server: preload, then fork a worker per request and report each one's end."""
    for module in _PRELOAD:
        with contextlib.suppress(ImportError):
            __import__(module)
    requests = socket.socket(fileno=fd)
    wakeup_r, wakeup_w = os.pipe()
    os.set_blocking(wakeup_w, False)
    signal.set_wakeup_fd(wakeup_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C of the test run is not for us
    status: dict[int, int] = {}  # worker pid -> the pipe its end is reported on
    while True:
        readable, _, _ = select.select([requests.fileno(), wakeup_r], [], [])
        if wakeup_r in readable:
            os.read(wakeup_r, 4096)
            _reap(status)
        if requests.fileno() in readable:
            message, fds, _, _ = socket.recv_fds(requests, 65536, 3)
            if not message:
                return  # the test process is gone
            pid = os.fork()
            if pid == 0:
                _worker(json.loads(message), fds, [fd, wakeup_r, wakeup_w, *status.values()])
            os.close(fds[0])
            os.close(fds[1])
            status[pid] = fds[2]
            requests.send(json.dumps({"pid": pid}).encode())
            _reap(status)


def _reap(status: dict[int, int]) -> None:
    while True:
        try:
            pid, code = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        pipe = status.pop(pid, None)
        if pipe is not None:
            os.write(pipe, _STATUS.pack(os.waitstatus_to_exitcode(code)))
            os.close(pipe)


def _worker(request: dict[str, Any], fds: list[int], inherited: list[int]) -> None:
    """In the forked worker: what ``python -m`` would have set up, then the module; never
    returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for fd in inherited:
            os.close(fd)
        out, err, status = fds
        os.close(status)
        null = os.open(os.devnull, os.O_RDONLY)
        for source, target in ((null, 0), (out, 1), (err, 2)):
            os.dup2(source, target)
            os.close(source)
        if request["cwd"] is not None:
            os.chdir(request["cwd"])
        if request["env"] is not None:
            os.environ.clear()
            os.environ.update(request["env"])
        code = _run(request["module"], request["argv"])
    finally:
        os._exit(code)


def _run(module: str, argv: list[str]) -> int:
    import atexit
    import runpy
    import traceback

    sys.argv = [module, *argv]
    # Preloaded for what it imports; as ``python -m`` would, run its code afresh as __main__
    # (runpy warns, in the worker's log, when that module was imported already).
    sys.modules.pop(module, None)
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    return code
