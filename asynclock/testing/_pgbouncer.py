"""A throwaway PgBouncer in front of a :class:`PostgresServer`."""

from __future__ import annotations

import signal
from collections.abc import Mapping
from typing import Literal

from ._host import find_binary
from ._postgres import PostgresFamily, PostgresServer


class PgBouncerServer(PostgresFamily):
    """PgBouncer on 127.0.0.1 in front of ``backend``, as Debian ships it (no
    ``ignore_startup_parameters``), in one ``pool_mode`` with ``pool_size`` server connections
    per database and user. ``settings`` adds lines to its ``[pgbouncer]`` section.

    When run as root it runs as the ``postgres`` OS user (PgBouncer refuses root). One process:
    :meth:`pause` and :meth:`kill` act on the whole pooler.
    """

    kind = "pgbouncer"
    # SIGINT: shut down once the clients are gone; the base class SIGKILLs after stop_timeout.
    stop_signal = signal.SIGINT

    def __init__(
        self,
        backend: PostgresServer,
        *,
        pool_mode: Literal["session", "transaction", "statement"] = "session",
        pool_size: int = 20,
        settings: Mapping[str, str] | None = None,
        start_timeout: float = 30.0,
        stop_timeout: float = 10.0,
    ) -> None:
        # Debian installs it in /usr/sbin, which is not on every user's PATH.
        self._pgbouncer = find_binary("pgbouncer", "pgbouncer", extra_dirs=("/usr/sbin",))
        self.backend = backend
        self.pool_mode = pool_mode
        self.pool_size = pool_size
        self.settings = dict(settings or {})
        super().__init__("PgBouncer", start_timeout=start_timeout, stop_timeout=stop_timeout)

    def _prepare(self) -> None:
        super()._prepare()
        (self.data_dir / "users.txt").write_text('"postgres" ""\n')
        lines = [
            "[databases]",
            f"* = host={self.backend.host} port={self.backend.port} user=postgres",
            "[pgbouncer]",
            f"listen_addr = {self.host}",
            f"listen_port = {self.port}",
            # TCP only: no socket file to go stale after kill().
            "unix_socket_dir =",
            "auth_type = trust",
            f"auth_file = {self.data_dir / 'users.txt'}",
            f"pool_mode = {self.pool_mode}",
            f"default_pool_size = {self.pool_size}",
            "max_client_conn = 1000",
            *(f"{key} = {value}" for key, value in self.settings.items()),
        ]
        (self.data_dir / "pgbouncer.ini").write_text("\n".join(lines) + "\n")

    def _command(self) -> list[str]:
        return [self._pgbouncer, str(self.data_dir / "pgbouncer.ini")]
