"""One test server process: its start, readiness, faults, shutdown and cleanup."""

from __future__ import annotations

import abc
import contextlib
import shutil
import signal
import subprocess
import time
import weakref
from pathlib import Path
from typing import ClassVar, Final, Self

from ._host import (
    LOOPBACK,
    ServerStartError,
    as_user,
    free_port,
    log_tail,
    make_temp_dir,
    retry_on_port_clash,
)
from ._lifecycle import StartStop
from ._signals import signal_tree


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


class Server(StartStop):
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

    #: The asynclock URL, ``{address}`` standing for ``host:port`` (a cluster's for all of its
    #: members' addresses).
    url_format: ClassVar[str]

    @abc.abstractmethod
    def _command(self) -> list[str]:
        """The command line that runs the server in the foreground."""

    @abc.abstractmethod
    def _probe(self, timeout: float) -> bool:
        """Whether the server answers requests now; may raise OSError."""

    def _prepare(self) -> None:
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
    def url(self) -> str:
        """The asynclock URL of this server."""
        return self.url_format.format(address=self.address)

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

    def _finish_start(self) -> None:
        try:
            self._wait_until_serving(self.start_timeout)
        except ServerStartError:
            self._resources.kill()
            raise

    def _launch(self) -> None:
        user = self._user()
        with self._output_path.open("ab") as output:
            self._resources.process = subprocess.Popen(
                as_user(self._command(), user),
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                cwd=self.data_dir,
                env=self._env(),
                # Its own process group, so that signals reach every process the server forks.
                start_new_session=True,
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

    def _terminate(self) -> None:
        process = self._resources.process
        if process is None or process.poll() is not None:
            return
        if self._stop_signalled != process.pid:
            # Redis, for one, takes a second SIGTERM as "exit now, skip the clean shutdown".
            self._stop_signalled = process.pid
            # A stopped process would hold the shutdown signal pending forever.
            if self._paused:
                signal_tree(process.pid, signal.SIGCONT)
            self._paused = False
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(self.stop_signal)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(self.stop_timeout)
        self._resources.kill()


class SingleServer(Server):
    """A server that starts alone (not as a cluster member): its first start retries on new
    ports if another process grabbed one between allocation and bind."""

    def start(self) -> Self:
        if self.is_running or self._prepared:
            return super().start()

        def undo() -> None:
            self._resources.cleanup()
            self._prepared = False

        retry_on_port_clash(super().start, undo, self._reallocate_ports)
        return self
