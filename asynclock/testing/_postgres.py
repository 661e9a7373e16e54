"""A throwaway PostgreSQL server."""

from __future__ import annotations

import atexit
import os
import pwd
import shutil
import signal
import subprocess
import threading
from pathlib import Path
from typing import Final

from ._host import ServerStartError, find_binary, make_temp_dir, run_checked
from ._process import SingleServer

_PG_BIN_DIRS: Final = ("/usr/lib/postgresql/*/bin",)
_OS_USER: Final = "postgres"


class PostgresFamily(SingleServer):
    """What :class:`PostgresServer` and :class:`PgBouncerServer` share: ``pg_isready`` as the
    probe, and the OS user to run as.

    The OS user is ``postgres`` when we are root (PostgreSQL and PgBouncer, ``server``, refuse
    root), else ourselves (None); it owns the data dir and the output file.
    """

    url_format = "postgresql://postgres@{address}/postgres"

    def __init__(self, server: str, *, start_timeout: float, stop_timeout: float) -> None:
        self._pg_isready = find_binary("pg_isready", "postgresql", extra_dirs=_PG_BIN_DIRS)
        self._os_user: str | None = None
        if os.geteuid() == 0:
            try:
                pwd.getpwnam(_OS_USER)
            except KeyError:
                raise ServerStartError(
                    f"{server} refuses to run as root and there is no 'postgres' OS user (the "
                    "postgresql package creates it)"
                ) from None
            self._os_user = _OS_USER
        super().__init__(start_timeout=start_timeout, stop_timeout=stop_timeout)

    def _user(self) -> str | None:
        return self._os_user

    def _prepare(self) -> None:
        if self._os_user is not None:
            shutil.chown(self.data_dir, self._os_user, self._os_user)

    def _launch(self) -> None:
        super()._launch()
        if self._os_user is not None:
            # Created by us as root; the server only writes through the inherited descriptor,
            # but a human reading it as postgres should be able to.
            shutil.chown(self._output_path, self._os_user, self._os_user)

    def _probe(self, timeout: float) -> bool:
        """Whether the server (or the pooler in front of one) accepts connections."""
        command = [
            self._pg_isready,
            "-h", self.host,
            "-p", str(self.port),
            "-U", "postgres",
            "-d", "postgres",
            "-t", str(max(1, round(timeout))),
        ]  # fmt: skip
        result = subprocess.run(
            command, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout + 5, check=False
        )
        return result.returncode == 0


class PostgresServer(PostgresFamily):
    """A fresh PostgreSQL cluster on 127.0.0.1, user ``postgres`` with trust authentication.

    When run as root it runs as the ``postgres`` OS user (PostgreSQL refuses root). ``fsync``
    is off, which loses nothing when only the server process dies (the OS still has the
    writes), so :meth:`restart` after :meth:`kill` keeps committed rows. ``max_connections`` is
    300 by default: many tests share one server, each client with a few connections (held
    locks share one per ttl, up to ``max_waiting`` waiters wait on one each).
    """

    kind = "postgres"
    # Fast shutdown: SIGTERM ("smart") waits for every client to disconnect.
    stop_signal = signal.SIGINT

    def __init__(
        self,
        *,
        max_connections: int = 300,
        start_timeout: float = 60.0,
        stop_timeout: float = 10.0,
    ) -> None:
        self._postgres = find_binary("postgres", "postgresql", extra_dirs=_PG_BIN_DIRS)
        self._initdb = find_binary("initdb", "postgresql", extra_dirs=_PG_BIN_DIRS)
        self.max_connections = max_connections
        super().__init__("PostgreSQL", start_timeout=start_timeout, stop_timeout=stop_timeout)

    @property
    def dsn(self) -> str:
        """The libpq/asyncpg connection string (the same as :attr:`url`)."""
        return self.url

    def _prepare(self) -> None:
        super()._prepare()
        template = _initialised_cluster(self._initdb, self._os_user)
        # A copy of one cluster made once per process: initdb costs 0.8 s of CPU (a suite
        # starts about 30 servers), a copy of its 39 MB 0.08 s. cp -a keeps owner and modes
        # (PostgreSQL refuses a data directory others may read).
        run_checked(
            ["cp", "-a", str(template), str(self.data_dir / "data")], what="copying the cluster"
        )

    def _command(self) -> list[str]:
        return [
            self._postgres,
            "-D", str(self.data_dir / "data"),
            "-p", str(self.port),
            "-c", f"listen_addresses={self.host}",
            # TCP only: no socket file and lock file to go stale after kill().
            "-c", "unix_socket_directories=",
            "-c", "fsync=off",
            "-c", "full_page_writes=off",
            "-c", f"max_connections={self.max_connections}",
            # Shared memory segments in the data directory, not /dev/shm: a killed server
            # leaves them behind (42 of 1 MB in /dev/shm after a day of suite runs).
            "-c", "dynamic_shared_memory_type=mmap",
        ]  # fmt: skip


_templates: dict[tuple[str, str | None], Path] = {}
_templates_lock = threading.Lock()


def _initialised_cluster(initdb: str, user: str | None) -> Path:
    """A data directory made by ``initdb`` in this process (the first time it is asked for);
    removed when the process exits."""
    with _templates_lock:
        template = _templates.get((initdb, user))
        if template is None:
            parent = make_temp_dir("postgres-template")
            atexit.register(shutil.rmtree, parent, ignore_errors=True)
            if user is not None:
                shutil.chown(parent, user, user)
            command = [
                initdb,
                "-D", str(parent / "data"),
                "-U", "postgres",
                "-A", "trust",
                "-E", "UTF8",
                "--locale=C",
                "--no-sync",
            ]  # fmt: skip
            run_checked(command, what="initdb", user=user, cwd=parent)
            template = _templates[(initdb, user)] = parent / "data"
        return template
