"""A throwaway redis-server, optionally on a fake clock that tests can move."""

from __future__ import annotations

import glob
import os
import re
import shutil
import socket
from pathlib import Path
from typing import Final

from ._host import ServerNotInstalled, find_binary
from ._process import SingleServer

#: The server program when ``RedisServer`` is given none: a path or a name on ``PATH``, such as
#: ``valkey-server`` (Valkey, the Redis fork); unset: ``redis-server``.
BINARY_VARIABLE: Final = "ASYNCLOCK_REDIS_SERVER"

_OFFSET = re.compile(r"^([+-]\d+(?:\.\d+)?)([smhdy]?)$")
_UNIT_SECONDS: Final = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "y": 365 * 86400}


def parse_clock_offset(spec: str) -> float:
    """Seconds from a libfaketime relative offset such as ``"+0"``, ``"-1.5"`` or ``"+2h"``."""
    match = _OFFSET.match(spec.strip())
    if match is None:
        raise ValueError(
            f"faketime={spec!r}: expected a relative offset such as '+0', '-90', '+1.5' or '+2h'"
        )
    return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]


def _find_library(name: str) -> str | None:
    for pattern in (
        f"/usr/lib/*/faketime/{name}",
        f"/usr/lib/faketime/{name}",
        f"/usr/lib/*/{name}",
    ):
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    return None


def server_binary(binary: str | os.PathLike[str] | None = None) -> str:
    """The path of the Redis-compatible server program: ``binary``, else the one
    :data:`BINARY_VARIABLE` names, else ``redis-server``."""
    chosen = os.fspath(binary) if binary is not None else os.environ.get(BINARY_VARIABLE)
    if not chosen:
        return find_binary("redis-server", "redis-server")
    found = shutil.which(chosen)
    if found is None:
        source = "binary=" if binary is not None else f"${BINARY_VARIABLE}="
        raise ServerNotInstalled(
            f"{chosen} ({source}{chosen!r}: not an executable file, nor a program on PATH)",
            "redis-server",
        )
    return found


class RedisServer(SingleServer):
    """A ``redis-server`` (or another server that speaks its protocol, such as Valkey's
    ``valkey-server``: ``binary``, or :data:`BINARY_VARIABLE`), listening only on 127.0.0.1,
    with an append-only file fsynced every second, as the docs recommend for locks (so clients
    give no ``RedisDurabilityWarning``); ``appendonly=False``: no persistence at all.

    With ``faketime`` (a libfaketime relative offset such as ``"+0"`` or ``"-30s"``) the server
    runs under Debian's libfaketime and :meth:`jump_clock` moves its wall clock while it runs,
    as an NTP step would: ``TIME`` and key expiry follow the jump. The monotonic clock is left
    alone, so the server's own timers keep working. ``DEBUG`` is enabled for local connections
    (``DEBUG SLEEP`` stalls the server on demand).
    """

    kind = "redis"
    url_format = "redis://{address}/0"

    def __init__(
        self,
        *,
        binary: str | os.PathLike[str] | None = None,
        appendonly: bool = True,
        faketime: str | None = None,
        start_timeout: float = 30.0,
        stop_timeout: float = 10.0,
    ) -> None:
        self._binary = server_binary(binary)
        self._appendonly = appendonly
        self._preload: str | None = None
        self._clock_offset = 0.0
        if faketime is not None:
            self._clock_offset = parse_clock_offset(faketime)
            libfaketime = _find_library("libfaketimeMT.so.1") or _find_library("libfaketime.so.1")
            if libfaketime is None:
                raise ServerNotInstalled("libfaketime", "faketime")
            # libfaketime and jemalloc (which Debian's redis-server links) recurse into each
            # other at start-up and redis dies (wolfcw/libfaketime#130). Preloading glibc's
            # malloc-debug shim first routes malloc/free to glibc, so jemalloc never starts its
            # clock-reading allocator; only its statistics calls remain.
            preload = [libfaketime]
            malloc_shim = _find_library("libc_malloc_debug.so.0")
            if malloc_shim is not None:
                preload.insert(0, malloc_shim)
            self._preload = ":".join(preload)
        super().__init__(start_timeout=start_timeout, stop_timeout=stop_timeout)

    @property
    def faketime(self) -> bool:
        """Whether the server runs on a fake clock that :meth:`jump_clock` can move."""
        return self._preload is not None

    @property
    def clock_offset(self) -> float:
        """Seconds the server's wall clock is ahead of the real one (negative: behind)."""
        return self._clock_offset

    def jump_clock(self, seconds: float) -> None:
        """Move the server's wall clock by ``seconds`` (negative moves it back), at once.

        Needs ``RedisServer(faketime=...)``. The offset survives :meth:`restart`.
        """
        if self._preload is None:
            raise RuntimeError("jump_clock() needs RedisServer(faketime='+0') or another offset")
        self._clock_offset += seconds
        if self._prepared and not self._stopped:
            self._write_clock_file()

    @property
    def _clock_file(self) -> Path:
        return self.data_dir / "faketime.rc"

    def _write_clock_file(self) -> None:
        # libfaketime rereads the file on every clock call (FAKETIME_NO_CACHE); replacing it
        # atomically means it never sees a half-written offset.
        temporary = self._clock_file.with_suffix(".tmp")
        temporary.write_text(f"{self._clock_offset:+.6f}\n")
        os.replace(temporary, self._clock_file)

    def _prepare(self) -> None:
        if self._preload is not None:
            self._write_clock_file()

    def _env(self) -> dict[str, str] | None:
        if self._preload is None:
            return None
        env = dict(os.environ)
        env.update(
            LD_PRELOAD=self._preload,
            FAKETIME_TIMESTAMP_FILE=str(self._clock_file),
            FAKETIME_NO_CACHE="1",
            FAKETIME_DONT_FAKE_MONOTONIC="1",
        )
        env.pop("FAKETIME", None)
        return env

    def _command(self) -> list[str]:
        directory = self.data_dir
        return [
            self._binary,
            "--port", str(self.port),
            "--bind", self.host,
            "--dir", str(directory),
            "--save", "",
            "--appendonly", "yes" if self._appendonly else "no",
            "--appendfsync", "everysec",
            "--daemonize", "no",
            "--unixsocket", "",
            "--logfile", str(directory / "redis.log"),
            "--enable-debug-command", "local",
        ]  # fmt: skip

    def _log_files(self) -> list[Path]:
        return [self.data_dir / "redis.log", *super()._log_files()]

    def _probe(self, timeout: float) -> bool:
        with socket.create_connection((self.host, self.port), timeout=timeout) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
