"""Throwaway Redis topologies: a Sentinel group (master, replica, three sentinels) and a Redis
Cluster of three masters, on loopback, tuned to fail over in about a second."""

from __future__ import annotations

import contextlib
import functools
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, Self

from ._host import ServerError, find_binary, run_checked
from ._lifecycle import StartStop
from ._process import SingleServer
from ._redis import RedisServer

#: The service name the sentinels monitor.
SERVICE: Final = "asynclock"
#: How long a silent master takes to count as down: short, so failover tests take seconds.
DOWN_AFTER_MS: Final = 400
#: Redis Cluster's node timeout (a silent master is failed over after about this long).
NODE_TIMEOUT_MS: Final = 800


def command(host: str, port: int, *args: str, timeout: float = 2.0) -> Any:
    """Send one command and return its decoded reply (RESP2; error replies raise ServerError).

    A few lines of protocol, so that the launchers need no Redis driver."""
    with socket.create_connection((host, port), timeout=timeout) as sock:
        payload = f"*{len(args)}\r\n" + "".join(f"${len(a.encode())}\r\n{a}\r\n" for a in args)
        sock.sendall(payload.encode())
        return _Reader(sock).reply()


class _Reader:
    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buffer = b""

    def _line(self) -> bytes:
        while b"\r\n" not in self._buffer:
            chunk = self._sock.recv(65536)
            if not chunk:
                raise ServerError("the server closed the connection")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\r\n")
        return line

    def _exactly(self, size: int) -> bytes:
        while len(self._buffer) < size + 2:
            chunk = self._sock.recv(65536)
            if not chunk:
                raise ServerError("the server closed the connection")
            self._buffer += chunk
        data, self._buffer = self._buffer[:size], self._buffer[size + 2 :]
        return data

    def reply(self) -> Any:
        line = self._line()
        kind, rest = line[:1], line[1:].decode()
        if kind in (b"+",):
            return rest
        if kind == b"-":
            raise ServerError(rest)
        if kind == b":":
            return int(rest)
        if kind == b"$":
            return None if rest == "-1" else self._exactly(int(rest)).decode()
        if kind == b"*":
            return None if rest == "-1" else [self.reply() for _ in range(int(rest))]
        raise ServerError(f"unexpected reply {line!r}")


def _wait(what: str, check: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError, ServerError, ValueError, IndexError, TypeError):
            if check():
                return
        if time.monotonic() > deadline:
            raise ServerError(f"{what}: not so after {timeout:g} s")
        time.sleep(0.05)


class RedisNode(RedisServer):
    """A :class:`RedisServer` with extra command-line settings (replication, cluster mode)."""

    kind = "redis"

    def __init__(self, *extra: str, start_timeout: float = 30.0) -> None:
        self._extra = list(extra)
        super().__init__(start_timeout=start_timeout)

    def _command(self) -> list[str]:
        # Diskless replication: a replica is in sync in milliseconds, not after an RDB file.
        return [
            *super()._command(),
            "--repl-diskless-sync", "yes",
            "--repl-diskless-sync-delay", "0",
            *self._extra,
        ]  # fmt: skip

    def call(self, *args: str, timeout: float = 2.0) -> Any:
        """One command to this node (see :func:`command`)."""
        return command(self.host, self.port, *args, timeout=timeout)

    def role(self) -> str:
        reply = self.call("ROLE")
        return str(reply[0])


class SentinelServer(SingleServer):
    """``redis-server <conf> --sentinel`` monitoring ``master_port`` as :data:`SERVICE`."""

    kind = "redis-sentinel"

    def __init__(self, master_port: int, *, quorum: int = 2) -> None:
        self._binary = find_binary("redis-server", "redis-server")
        self._master_port = master_port
        self._quorum = quorum
        super().__init__(start_timeout=30.0)

    @property
    def url(self) -> str:
        return f"redis+sentinel://{self.address}/{SERVICE}/0"

    @property
    def _conf(self) -> Path:
        return self.data_dir / "sentinel.conf"

    def _prepare(self) -> None:
        # Sentinel rewrites this file (the replicas and sentinels it found, the epochs): it is
        # written once, and a restart keeps what the sentinel learnt.
        self._conf.write_text(
            "\n".join(
                [
                    f"port {self.port}",
                    f"bind {self.host}",
                    f"dir {self.data_dir}",
                    f"logfile {self.data_dir / 'sentinel.log'}",
                    f"sentinel monitor {SERVICE} {self.host} {self._master_port} {self._quorum}",
                    f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}",
                    f"sentinel failover-timeout {SERVICE} 2000",
                    f"sentinel parallel-syncs {SERVICE} 1",
                    "",
                ]
            )
        )

    def _command(self) -> list[str]:
        return [self._binary, str(self._conf), "--sentinel"]

    def _log_files(self) -> list[Path]:
        return [self.data_dir / "sentinel.log", *super()._log_files()]

    def _probe(self, timeout: float) -> bool:
        return bool(command(self.host, self.port, "PING", timeout=timeout) == "PONG")

    def call(self, *args: str, timeout: float = 2.0) -> Any:
        return command(self.host, self.port, *args, timeout=timeout)


class RedisSentinelGroup(StartStop):
    """A master, a replica and three sentinels (quorum 2) on loopback.

    ``kill_master()`` / ``pause_master()`` and ``wait_for_failover()`` drive a failover; it
    takes about a second (``down-after-milliseconds`` is :data:`DOWN_AFTER_MS`).
    """

    def __init__(self, *, replicas: int = 1, sentinels: int = 3) -> None:
        self.nodes: list[RedisNode] = [RedisNode()]
        self._replicas = replicas
        self._sentinel_count = sentinels
        self.sentinels: list[SentinelServer] = []
        self._started = False

    @property
    def url(self) -> str:
        hosts = ",".join(sentinel.address for sentinel in self.sentinels)
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    def start(self) -> Self:
        if self._started:
            return self
        self._started = True
        try:
            master = self.nodes[0].start()
            for _ in range(self._replicas):
                node = RedisNode("--replicaof", master.host, str(master.port))
                self.nodes.append(node.start())
            for node in self.nodes[1:]:
                _wait(f"{node!r} replicates", functools.partial(_link_up, node), 10.0)
            for _ in range(self._sentinel_count):
                self.sentinels.append(SentinelServer(master.port).start())
            _wait("the sentinels know each other and the replicas", self._settled, 15.0)
        except BaseException:
            self.stop()
            raise
        return self

    def _settled(self) -> bool:
        for sentinel in self.sentinels:
            if len(sentinel.call("SENTINEL", "sentinels", SERVICE)) < len(self.sentinels) - 1:
                return False
            replicas = sentinel.call("SENTINEL", "replicas", SERVICE)
            if len(replicas) < self._replicas:
                return False
        return True

    def stop(self) -> None:
        for server in [*self.sentinels, *self.nodes]:
            with contextlib.suppress(Exception):
                server.stop()

    def master_address(self) -> str:
        """``host:port`` of the master, as the first sentinel that answers says."""
        for sentinel in self.sentinels:
            if not sentinel.is_running or sentinel.is_paused:
                continue
            with contextlib.suppress(OSError, ServerError):
                host, port = sentinel.call("SENTINEL", "get-master-addr-by-name", SERVICE)
                return f"{host}:{port}"
        raise ServerError("no sentinel answers")

    def master(self) -> RedisNode:
        address = self.master_address()
        for node in self.nodes:
            if node.address == address:
                return node
        raise ServerError(f"the sentinels name {address}, which is not one of {self.nodes}")

    def replicas(self) -> list[RedisNode]:
        master = self.master()
        return [node for node in self.nodes if node is not master]

    def wait_for_failover(self, old: RedisNode, timeout: float = 15.0) -> RedisNode:
        """Block until every running sentinel names a master other than ``old`` and that
        server says it is a master; return it."""

        def done() -> bool:
            named = {
                tuple(s.call("SENTINEL", "get-master-addr-by-name", SERVICE))
                for s in self.sentinels
                if s.is_running and not s.is_paused
            }
            if len(named) != 1:
                return False
            (address,) = named
            new = f"{address[0]}:{address[1]}"
            if new == old.address:
                return False
            return self.master().role() == "master"

        _wait(f"a failover away from {old!r}", done, timeout)
        return self.master()

    def kill_master(self) -> RedisNode:
        """SIGKILL the master (restart it with ``node.restart()``: the sentinels then make it a
        replica of the new master)."""
        master = self.master()
        master.kill()
        return master

    def pause_master(self) -> RedisNode:
        """SIGSTOP the master (``node.resume()`` brings it back, briefly a stale master)."""
        master = self.master()
        master.pause()
        return master

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.url}>"


def _link_up(node: RedisNode) -> bool:
    return "master_link_status:up" in node.call("INFO", "replication")


class RedisClusterNodes(StartStop):
    """A Redis Cluster of ``masters`` masters (and ``replicas`` replicas each), made with
    ``redis-cli --cluster create``; ``cluster-node-timeout`` is :data:`NODE_TIMEOUT_MS`."""

    def __init__(self, masters: int = 3, *, replicas: int = 0) -> None:
        self._cli = find_binary("redis-cli", "redis-tools")
        self._masters = masters
        self._replicas = replicas
        self.nodes: list[RedisNode] = []
        self._started = False

    @property
    def url(self) -> str:
        return f"redis+cluster://{','.join(node.address for node in self.nodes)}"

    def start(self) -> Self:
        if self._started:
            return self
        self._started = True
        try:
            for _ in range(self._masters * (1 + self._replicas)):
                node = RedisNode(
                    "--cluster-enabled", "yes",
                    "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
                    "--cluster-require-full-coverage", "no",
                )  # fmt: skip
                self.nodes.append(node.start())
            run_checked(
                [
                    self._cli,
                    "--cluster", "create",
                    *(node.address for node in self.nodes),
                    "--cluster-replicas", str(self._replicas),
                    "--cluster-yes",
                ],
                what="redis-cli --cluster create",
                timeout=30.0,
            )  # fmt: skip
            _wait("the cluster serves every slot", self._ok, 20.0)
        except BaseException:
            self.stop()
            raise
        return self

    def _ok(self) -> bool:
        return all("cluster_state:ok" in node.call("CLUSTER", "INFO") for node in self.nodes)

    def stop(self) -> None:
        for node in self.nodes:
            with contextlib.suppress(Exception):
                node.stop()

    def masters(self) -> list[RedisNode]:
        return [node for node in self.nodes if node.is_running and node.role() == "master"]

    def node_for_slot(self, slot: int) -> RedisNode:
        for start, end, master, *_ in self.nodes[0].call("CLUSTER", "SLOTS"):
            if start <= slot <= end:
                address = f"{master[0]}:{master[1]}"
                return next(node for node in self.nodes if node.address == address)
        raise ServerError(f"no node serves slot {slot}")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.url}>"


__all__ = (
    "DOWN_AFTER_MS",
    "NODE_TIMEOUT_MS",
    "SERVICE",
    "RedisClusterNodes",
    "RedisNode",
    "RedisSentinelGroup",
    "SentinelServer",
    "command",
)
