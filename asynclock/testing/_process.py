"""The machinery every test server shares: ports, temp dirs, process groups, readiness, cleanup."""

from __future__ import annotations

import abc
import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar, Final, Generic, Self, TypeVar

#: Every server listens here and nowhere else.
LOOPBACK: Final = "127.0.0.1"

_LOG_TAIL_LINES: Final = 30


class ServerError(Exception):
    """Base class of the errors raised by the test servers."""


class ServerNotInstalled(ServerError):
    """A program a test server needs is not installed; the message names the apt package."""

    def __init__(self, binary: str, apt_package: str) -> None:
        super().__init__(
            f"{binary} is not installed; install it with: apt-get install {apt_package}"
        )
        self.binary = binary
        self.apt_package = apt_package

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled as its constructor's arguments (the default would pass only the message).
        return (type(self), (self.binary, self.apt_package), self.__dict__)


class ServerStartError(ServerError):
    """A test server did not start or did not become ready in time; the message ends with its log."""


def find_binary(name: str, apt_package: str, *, extra_dirs: Iterable[str] = ()) -> str:
    """Return the path of the program ``name``, or raise :class:`ServerNotInstalled`.

    ``PATH`` is searched first, then ``extra_dirs`` (shell globs, newest match first, for tools
    such as PostgreSQL's that Debian keeps out of ``PATH``).
    """
    found = shutil.which(name)
    if found is not None:
        return found
    for pattern in extra_dirs:
        for directory in sorted(glob.glob(pattern), key=_version_key, reverse=True):
            found = shutil.which(name, path=directory)
            if found is not None:
                return found
    raise ServerNotInstalled(name, apt_package)


def _version_key(path: str) -> tuple[int, ...]:
    # "/usr/lib/postgresql/15/bin" must sort after ".../9.6/bin", which string order gets wrong.
    return tuple(int(part) for part in path.replace("/", ".").split(".") if part.isdigit())


_ports_lock = threading.Lock()
_ports_handed_out: set[int] = set()


def free_port() -> int:
    """Return a loopback TCP port that is free now and was not handed out before in this process.

    Remembering the ports matters when a cluster asks for nine ports before any member binds:
    the kernel could otherwise hand out the same ephemeral port twice.
    """
    with _ports_lock:
        for _ in range(100):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind((LOOPBACK, 0))
                port: int = sock.getsockname()[1]
            if port not in _ports_handed_out:
                _ports_handed_out.add(port)
                return port
    raise ServerError("no free loopback port found")


def make_temp_dir(kind: str) -> Path:
    """A fresh directory for one server, in RAM when ``/dev/shm`` is usable (etcd and ZooKeeper
    start 20-40 % faster there)."""
    shm = "/dev/shm"
    base = shm if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) else None
    return Path(tempfile.mkdtemp(prefix=f"asynclock-{kind}-", dir=base))


def log_tail(paths: Iterable[Path], lines: int = _LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of each existing file, labelled, for error messages."""
    parts = []
    for path in paths:
        try:
            with path.open("rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 16384))
                text = f.read().decode("utf-8", "replace")
        except OSError:
            continue
        tail = "\n".join(text.splitlines()[-lines:])
        if tail:
            parts.append(f"--- {path} ---\n{tail}")
    return "\n".join(parts) if parts else "(the server wrote no log)"


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _descendants(root: int) -> list[int]:
    """Live descendants of ``root``, parents before children (from /proc; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    for entry in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(entry) as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may contain spaces and parentheses.
        fields = stat.rpartition(")")[2].split()
        if len(fields) > 1 and fields[0] not in {"Z", "X"}:
            children.setdefault(int(fields[1]), []).append(int(stat.split(" ", 1)[0]))
    found: list[int] = []
    queue = [root]
    while queue:
        for child in children.get(queue.pop(0), []):
            found.append(child)
            queue.append(child)
    return found


def signal_tree(pid: int, sig: signal.Signals) -> None:
    """Send ``sig`` to the process group of ``pid`` and to every descendant of ``pid``.

    The group alone is not enough: PostgreSQL puts each backend in a session of its own, so
    that a signal to the postmaster's group would leave the backends serving.
    """
    if sig == signal.SIGCONT:
        # Children first, so that a resumed parent finds its children running.
        for child in reversed(_descendants(pid)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(child, sig)
        _signal_group(pid, sig)
        return
    # Freeze the parent first, so that it forks no child we would miss, and list the children
    # before a SIGKILL reparents them to init.
    _signal_group(pid, signal.SIGSTOP)
    descendants = _descendants(pid)
    for child in descendants:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(child, signal.SIGSTOP)
    if sig == signal.SIGSTOP:
        _wait_stopped([pid, *descendants])
        return
    _signal_group(pid, sig)
    for child in descendants:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(child, sig)


def _wait_stopped(pids: Iterable[int], timeout: float = 2.0) -> None:
    """Wait until every thread of ``pids`` has stopped.

    kill() only queues SIGSTOP: the 23 threads of a busy JVM take up to 8 ms to stop, time
    enough to answer a request sent right after pause() returned.
    """
    deadline = time.monotonic() + timeout
    for pid in pids:
        while time.monotonic() < deadline:
            running = False
            for entry in glob.glob(f"/proc/{pid}/task/*/stat"):
                try:
                    with open(entry) as f:
                        state = f.read().rpartition(")")[2].split()[0]
                except (OSError, IndexError):
                    continue
                if state not in {"T", "t", "Z", "X"}:
                    running = True
                    break
            if not running:
                break
            time.sleep(0.0005)


class _Resources:
    """What must be cleaned up even if the owning server object is never stopped.

    The weakref finalizer holds this object, never the server, so it does not keep the server
    alive; at interpreter exit (including after Ctrl-C) it kills what is left.
    """

    def __init__(self) -> None:
        self.process: subprocess.Popen[bytes] | None = None
        self.directory: Path | None = None

    def kill(self) -> None:
        process = self.process
        if process is None:
            return
        # Only signal the group while its leader is unreaped: afterwards its id may be reused.
        if process.poll() is None:
            signal_tree(process.pid, signal.SIGKILL)
            process.wait()

    def cleanup(self) -> None:
        self.kill()
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None


class Server(abc.ABC):
    """One server process on a free loopback port, in its own temp dir and process group.

    Use it as a context manager, or call :meth:`start` and :meth:`stop`. :meth:`start` returns
    once the server answers requests. The fault methods (:meth:`pause`, :meth:`resume`,
    :meth:`kill`, :meth:`restart`) signal the process group and every descendant, so servers
    that fork workers (PostgreSQL) are frozen or killed as a whole. :meth:`stop` is final and
    idempotent: it leaves no process and no directory behind. A server that is never stopped is
    killed (SIGKILL) and its directory deleted when it is garbage-collected or, at the latest,
    at interpreter exit (also after Ctrl-C; not when the interpreter itself is SIGKILLed).
    """

    #: Short lowercase name used in temp dir names and messages.
    kind: ClassVar[str]
    #: The signal that asks the server to shut down cleanly.
    stop_signal: ClassVar[signal.Signals] = signal.SIGTERM

    host: Final[str] = LOOPBACK

    def __init__(self, *, start_timeout: float = 30.0, stop_timeout: float = 10.0) -> None:
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self._port = free_port()
        self._resources = _Resources()
        self._finalizer = weakref.finalize(self, self._resources.cleanup)
        self._prepared = False
        self._stopped = False
        self._paused = False
        self._stop_signalled: int | None = None

    # -- what each server defines ----------------------------------------------------------

    @property
    @abc.abstractmethod
    def url(self) -> str:
        """The asynclock URL of this server."""

    @abc.abstractmethod
    def _command(self) -> list[str]:
        """The command line that runs the server in the foreground."""

    @abc.abstractmethod
    def _probe(self, timeout: float) -> bool:
        """Whether the server answers requests now; may raise OSError."""

    def _prepare(self) -> None:  # noqa: B027 (an optional hook, not an abstract method)
        """Write configuration into the fresh data dir; runs before the first launch only."""

    def _reallocate_ports(self) -> None:
        """Pick new ports after a clash; servers with more than one port extend this."""
        self._port = free_port()

    def _env(self) -> dict[str, str] | None:
        return None

    def _user(self) -> str | None:
        """The OS user to run as, for servers that refuse to run as root."""
        return None

    def _log_files(self) -> list[Path]:
        return [self._output_path]

    # -- public surface --------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The client port; it stays the same across :meth:`restart`."""
        return self._port

    @property
    def address(self) -> str:
        """``host:port``, the form most drivers accept."""
        return f"{self.host}:{self._port}"

    @property
    def data_dir(self) -> Path:
        """The server's own temp dir (data, configuration and logs); gone after :meth:`stop`."""
        if self._resources.directory is None:
            raise RuntimeError(f"{self!r} has no data dir: it was never started or is stopped")
        return self._resources.directory

    @property
    def pid(self) -> int | None:
        """Process id of the running server (also its process group id), or None."""
        process = self._resources.process
        return process.pid if process is not None and process.poll() is None else None

    @property
    def is_running(self) -> bool:
        """True while the process exists, paused or not."""
        return self.pid is not None

    @property
    def is_paused(self) -> bool:
        """True between :meth:`pause` and :meth:`resume` (or a kill)."""
        return self._paused and self.is_running

    def start(self) -> Self:
        """Start the server and wait until it serves; does nothing if it is already running."""
        if self.is_running:
            return self
        self._begin_start()
        self._finish_start()
        return self

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until the server answers requests (after :meth:`resume`, say), or raise
        :class:`ServerStartError`; the server keeps running either way."""
        self._require_running()
        self._wait_until_serving(self.start_timeout if timeout is None else timeout)

    def stop(self) -> None:
        """Shut the server down (gracefully, then SIGKILL after ``stop_timeout``) and delete its
        data dir. Idempotent; a stopped server cannot be started again."""
        if self._stopped:
            return
        self._stopped = True
        try:
            self._terminate()
        finally:
            self._finalizer()

    def kill(self) -> None:
        """SIGKILL the server and every process it forked, as a crash would; the data dir stays
        for :meth:`restart`."""
        self._paused = False
        self._resources.kill()

    def pause(self) -> None:
        """Freeze the server with SIGSTOP: connections stay open but nothing is answered.

        Returns once every thread of every process of the server has stopped.
        """
        pid = self._require_running()
        signal_tree(pid, signal.SIGSTOP)
        self._paused = True

    def resume(self) -> None:
        """Undo :meth:`pause` with SIGCONT."""
        pid = self.pid
        if pid is not None:
            signal_tree(pid, signal.SIGCONT)
        self._paused = False

    def restart(self) -> None:
        """Stop the server gracefully if it runs, and start it again on the same port with the
        same data dir; returns once it serves."""
        if self._stopped:
            raise RuntimeError(f"{self!r} is stopped; create a new server")
        if not self._prepared:
            self.start()
            return
        self._terminate()
        self._launch()
        self._finish_start()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        if self._stopped:
            state = "stopped"
        elif self.is_paused:
            state = f"paused pid={self.pid}"
        elif self.is_running:
            state = f"running pid={self.pid}"
        else:
            state = "not running"
        return f"<{type(self).__name__} {self.address} {state}>"

    # -- machinery -------------------------------------------------------------------------

    @property
    def _output_path(self) -> Path:
        return self.data_dir / f"{self.kind}.out"

    def _require_running(self) -> int:
        pid = self.pid
        if pid is None:
            raise RuntimeError(f"{self!r} is not running")
        return pid

    def _begin_start(self) -> None:
        """Create the data dir and configuration on first use, then launch the process."""
        if self._stopped:
            raise RuntimeError(f"{self!r} is stopped; create a new server")
        if not self._prepared:
            self._resources.directory = make_temp_dir(self.kind)
            self._prepare()
            self._prepared = True
        self._launch()

    def _finish_start(self, timeout: float | None = None) -> None:
        try:
            self._wait_until_serving(self.start_timeout if timeout is None else timeout)
        except ServerStartError:
            self._resources.kill()
            raise

    def _launch(self) -> None:
        user = self._user()
        with self._output_path.open("ab") as output:
            self._resources.process = subprocess.Popen(
                self._command(),
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                cwd=self.data_dir,
                env=self._env(),
                # Its own process group, so that signals reach every process the server forks.
                start_new_session=True,
                user=user,
                group=user,
                extra_groups=[] if user is not None else None,
            )
        self._paused = False

    def _wait_until_serving(self, timeout: float) -> None:
        process = self._resources.process
        if process is None:
            raise RuntimeError(f"{self!r} was not launched")
        deadline = time.monotonic() + timeout
        pause = 0.005
        while True:
            code = process.poll()
            if code is not None:
                raise ServerStartError(
                    f"{self.kind} on port {self._port} exited with status {code} while starting"
                    f"\n{log_tail(self._log_files())}"
                )
            remaining = deadline - time.monotonic()
            try:
                # A server that is up answers on loopback in milliseconds; a short probe
                # timeout only matters when something else holds the port.
                if self._probe(max(0.05, min(0.5, remaining))) and process.poll() is None:
                    return
            except OSError:
                pass
            if remaining <= 0:
                raise ServerStartError(
                    f"{self.kind} on port {self._port} did not serve within {timeout:g} s"
                    f"\n{log_tail(self._log_files())}"
                )
            time.sleep(min(pause, max(0.0, remaining)))
            pause = min(pause * 2, 0.1)

    def _signal_stop(self) -> None:
        process = self._resources.process
        if process is None or process.poll() is not None or self._stop_signalled == process.pid:
            return
        # Redis, for one, takes a second SIGTERM as "exit now, skip the clean shutdown".
        self._stop_signalled = process.pid
        # A stopped process would hold the shutdown signal pending forever.
        if self._paused:
            signal_tree(process.pid, signal.SIGCONT)
        self._paused = False
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(self.stop_signal)

    def _terminate(self) -> None:
        process = self._resources.process
        if process is None or process.poll() is not None:
            return
        self._signal_stop()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(self.stop_timeout)
        self._resources.kill()

    def _start_fresh_on_clash(self, attempts: int = 3) -> None:
        """First start, retrying on new ports if another process took a port in the meantime."""
        for attempt in range(attempts):
            try:
                self._begin_start()
                self._finish_start()
            except BaseException as exc:
                # Whatever failed, nothing of this attempt may outlive it.
                self._resources.cleanup()
                self._prepared = False
                retry = isinstance(exc, ServerStartError) and _port_clash(str(exc))
                if not retry or attempt + 1 == attempts:
                    raise
                self._reallocate_ports()
            else:
                return


def _port_clash(message: str) -> bool:
    lowered = message.lower()
    return "address already in use" in lowered or "bindexception" in lowered


class SingleServer(Server):
    """A server that starts alone (not as a cluster member): its first start retries on new
    ports if another process grabbed one between allocation and bind."""

    def start(self) -> Self:
        if self.is_running:
            return self
        if self._prepared:
            super().start()
        else:
            self._start_fresh_on_clash()
        return self


M = TypeVar("M", bound=Server)


class Cluster(abc.ABC, Generic[M]):
    """Several members of one replicated service, started together.

    Every member is a :class:`Server` with its own pause/resume/kill/restart. A member's
    :meth:`Server.restart` waits until that member serves, which needs a quorum; to bring back
    a whole cluster use :meth:`restart`.
    """

    def __init__(self, size: int, *, start_timeout: float, stop_timeout: float) -> None:
        if size < 1:
            raise ValueError("a cluster needs at least one member")
        self.size = size
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self._members: list[M] = self._make_members()
        self._started = False

    @abc.abstractmethod
    def _make_members(self) -> list[M]:
        """Create (not start) the members, each configured with all members' ports."""

    @abc.abstractmethod
    def _is_leader(self, member: M, timeout: float) -> bool:
        """Whether ``member`` is the leader right now; may raise OSError."""

    @property
    @abc.abstractmethod
    def url(self) -> str:
        """The asynclock URL listing every member."""

    @property
    def members(self) -> list[M]:
        """The members, in a new list; fault-inject them one by one."""
        return list(self._members)

    @property
    def address(self) -> str:
        """``host:port,host:port,...`` of all members."""
        return ",".join(member.address for member in self._members)

    def start(self) -> Self:
        """Start every member and wait until each serves."""
        if self._started:
            return self
        for attempt in range(3):
            try:
                _start_together(self._members, self._members)
            except BaseException as exc:
                for member in self._members:
                    member.stop()
                retry = isinstance(exc, ServerStartError) and _port_clash(str(exc))
                if not retry or attempt == 2:
                    raise
                self._members = self._make_members()
            else:
                self._started = True
                return self
        raise AssertionError("unreachable")

    def stop(self) -> None:
        """Stop every member and delete its data; idempotent."""
        errors = []
        for member in self._shutdown_order():
            try:
                member.stop()
            except Exception as exc:  # one member's failure must not leak the others
                errors.append(exc)
        if errors:
            raise errors[0]

    def restart(self) -> None:
        """Stop every running member, then start all of them together on the same ports with the
        same data; returns once each serves."""
        for member in self._shutdown_order():
            member._terminate()
        _start_together(self._members, [])

    def _shutdown_order(self) -> Iterator[M]:
        """Members one at a time, each time the current leader first if there is one.

        A stopping etcd leader hands leadership to a peer it believes alive and waits up to six
        seconds for it; stopping leaders first means that peer is alive. Stopping members in
        parallel or followers first makes the last leader wait the full six seconds.
        """
        remaining = list(self._members)
        while remaining:
            chosen = remaining[0]
            for member in remaining:
                if member.is_running and not member.is_paused:
                    with contextlib.suppress(OSError, ValueError):
                        if self._is_leader(member, 0.5):
                            chosen = member
                            break
            remaining.remove(chosen)
            yield chosen

    def leader(self, timeout: float = 10.0) -> M:
        """The current leader, waiting up to ``timeout`` seconds for an election to finish."""
        deadline = time.monotonic() + timeout
        while True:
            for member in self._members:
                if not member.is_running or member.is_paused:
                    continue
                with contextlib.suppress(OSError, ValueError):
                    if self._is_leader(member, 1.0):
                        return member
            if time.monotonic() >= deadline:
                raise ServerError(f"{type(self).__name__} has no leader after {timeout:g} s")
            time.sleep(0.05)

    def kill_leader(self, timeout: float = 10.0) -> M:
        """SIGKILL the current leader and return it (restart it with ``member.restart()``)."""
        member = self.leader(timeout)
        member.kill()
        return member

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.address}>"


def _start_together(members: Sequence[Server], fresh: Sequence[Server]) -> None:
    """Launch all members before waiting for any: a member only serves once a quorum runs."""
    for member in members:
        if member in fresh:
            member._begin_start()
        else:
            member._launch()
    for member in members:
        member._finish_start()


def run_checked(
    command: Sequence[str],
    *,
    what: str,
    user: str | None = None,
    cwd: Path | None = None,
    timeout: float = 60.0,
) -> str:
    """Run a helper program to completion and return its output, or raise ServerStartError."""
    try:
        result = subprocess.run(
            command,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            cwd=cwd,
            timeout=timeout,
            user=user,
            group=user,
            extra_groups=[] if user is not None else None,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise ServerStartError(f"{what} did not finish within {timeout:g} s") from exc
    output = (result.stdout + result.stderr).decode("utf-8", "replace")
    if result.returncode != 0:
        raise ServerStartError(f"{what} failed with status {result.returncode}:\n{output}")
    return output
