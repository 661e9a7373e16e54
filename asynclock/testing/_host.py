"""What a test server takes from the host: its program, loopback ports, a temp dir, log tails,
helper programs run to completion; and the errors the test servers raise."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Final

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


def retry_on_port_clash(
    start: Callable[[], object],
    undo: Callable[[], None],
    new_ports: Callable[[], None],
    *,
    attempts: int = 3,
) -> None:
    """Run ``start``; if another process took one of its ports between allocation and bind,
    pick ``new_ports`` and start again (``attempts`` in all).

    Whatever failed, ``undo`` runs first: nothing of a failed attempt may outlive it.
    """
    for attempt in range(attempts):
        try:
            start()
        except BaseException as exc:
            undo()
            clash = isinstance(exc, ServerStartError) and _port_clash(str(exc))
            if not clash or attempt + 1 == attempts:
                raise
            new_ports()
        else:
            return


def _port_clash(message: str) -> bool:
    lowered = message.lower()
    return "address already in use" in lowered or "bindexception" in lowered


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


def as_user(command: Sequence[str], user: str | None) -> list[str]:
    """``command``, run as ``user`` (a server that refuses to run as root) through ``setpriv``,
    which drops the privileges after its exec.

    Not ``subprocess.Popen(user=...)``: that makes CPython fork() instead of vfork(), and a
    fork() runs gRPC's fork handlers in the child. grpcio 1.80 to 1.85 crash there (SIGSEGV
    before the exec, grpc/grpc#43055) while a channel is active, as an etcd client in the same
    process keeps one: a PostgreSQL server then "exited with status -11 while starting".
    """
    if user is None:
        return list(command)
    return ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", "--", *command]


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
            as_user(command, user),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            cwd=cwd,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise ServerStartError(f"{what} did not finish within {timeout:g} s") from exc
    output = (result.stdout + result.stderr).decode("utf-8", "replace")
    if result.returncode != 0:
        raise ServerStartError(f"{what} failed with status {result.returncode}:\n{output}")
    return output
