"""Throwaway Redis topologies: a Sentinel group (master, replica, three sentinels) and a Redis
Cluster of three masters, on loopback, tuned to fail over in about a second."""

from __future__ import annotations

import contextlib
import functools
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, Final, Self

from ._host import ServerError, find_binary, free_port, run_checked
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
        with sock.makefile("rb") as replies:
            return _reply(replies)


def _read(replies: BinaryIO, size: int | None = None) -> bytes:
    """A line, or ``size`` bytes and the CRLF after them; without the CRLF."""
    data = replies.readline() if size is None else replies.read(size + 2)
    if not data.endswith(b"\r\n"):
        raise ServerError("the server closed the connection")
    return data[:-2]


def _reply(replies: BinaryIO) -> Any:
    line = _read(replies)
    kind, rest = line[:1], line[1:].decode()
    if kind == b"+":
        return rest
    if kind == b"-":
        raise ServerError(rest)
    if kind == b":":
        return int(rest)
    if kind == b"$":
        return None if rest == "-1" else _read(replies, int(rest)).decode()
    if kind == b"*":
        return None if rest == "-1" else [_reply(replies) for _ in range(int(rest))]
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

    def __init__(self, *extra: str) -> None:
        self._extra = list(extra)
        super().__init__()

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
        return str(self.call("ROLE")[0])


class SentinelServer(SingleServer):
    """``redis-server <conf> --sentinel`` monitoring ``master_port`` as :data:`SERVICE`, with a
    quorum of 2."""

    kind = "redis-sentinel"

    def __init__(self, master_port: int) -> None:
        self._binary = find_binary("redis-server", "redis-server")
        self._master_port = master_port
        super().__init__()

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
                    f"sentinel monitor {SERVICE} {self.host} {self._master_port} 2",
                    f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}",
                    # Long enough that a loaded machine does not abort a failover half-way.
                    f"sentinel failover-timeout {SERVICE} 4000",
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
        if self.call("PING", timeout=timeout) != "PONG":
            return False
        # Sentinel's own periods (INFO every 10 s, hello every 2 s) would make a test wait
        # for minutes in all; Redis 7 lets them be shortened at run time.
        self.call(
            "SENTINEL", "DEBUG", "info-period", "200", "publish-period", "200", timeout=timeout
        )
        return True

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
        """Block until every running sentinel names a master other than ``old``, that server
        says it is a master, and ``old``, if it runs, says it is not; return the new master."""

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
            # Over, not merely under way: every sentinel is connected to the new master and
            # sees it up (a former master that returns earlier can confuse the last steps).
            for sentinel in self.sentinels:
                if sentinel.is_running and not sentinel.is_paused:
                    state = sentinel.call("SENTINEL", "master", SERVICE)
                    if dict(zip(state[::2], state[1::2], strict=True))["flags"] != "master":
                        return False
            if old.is_running and not old.is_paused and old.role() == "master":
                return False  # promoted, but the old master is not demoted yet
            return self.master().role() == "master"

        _wait(f"a failover away from {old!r}", done, timeout)
        return self.master()

    def restore(self, node: RedisNode, timeout: float = 15.0) -> None:
        """Bring back a killed or paused former master and block until the sentinels have
        made it a replica in sync, so that the next failover has somewhere to go."""
        if node.is_paused:
            node.resume()
        elif not node.is_running:
            node.restart()

        def back() -> bool:
            if node.role() != "slave" or not _link_up(node):
                return False
            replicas = self.sentinels[0].call("SENTINEL", "replicas", SERVICE)
            fields = [dict(zip(r[::2], r[1::2], strict=True)) for r in replicas]
            return any(
                f"{f['ip']}:{f['port']}" == node.address
                and f["flags"] == "slave"
                and f["master-link-status"] == "ok"
                for f in fields
            )

        _wait(f"{node!r} is a replica again", back, timeout)

    def fail_over_losing(self, *patterns: str) -> RedisNode:
        """The failover nemesis: the master is killed, then the replicas lose the keys matching
        ``patterns`` (what the master had not replicated yet); the sentinels promote a replica
        about a second later. Returns the killed node (see :meth:`restore`).

        In that order: deleted while the master lived, a key could come back with a write of
        the master still on its way (a CI run: the lock taken just before came back on the
        replica, and the failover lost nothing). A replica applies all the master sent before
        it sees the link down. The replicas are the ones of before the kill: the sentinels may
        have promoted one by the time they are all down."""
        replicas = self.replicas()
        master = self.kill_master()
        deadline = time.monotonic() + 5.0
        while any("master_link_status:up" in node.call("INFO", "replication") for node in replicas):
            if time.monotonic() > deadline:
                raise ServerError("a replica still sees its master up 5 s after it was killed")
            time.sleep(0.002)
        for node in replicas:
            node.call("CONFIG", "SET", "replica-read-only", "no")
            try:
                for pattern in patterns:
                    cursor = "0"
                    while True:
                        cursor, keys = node.call("SCAN", cursor, "MATCH", pattern, "COUNT", "1000")
                        if keys:
                            node.call("DEL", *keys)
                        if cursor == "0":
                            break
            finally:
                node.call("CONFIG", "SET", "replica-read-only", "yes")
        return master

    def fail_over(self, attempts: int = 3) -> tuple[RedisNode, RedisNode]:
        """A graceful failover (``SENTINEL FAILOVER``): the replica is promoted, then the
        master demoted; returns (old, new). Asked again if it does not finish (a sentinel
        aborts a failover whose steps outlast ``failover-timeout``)."""
        old = self.master()
        for attempt in range(attempts):
            with contextlib.suppress(ServerError):  # INPROG: one is under way already
                self.sentinels[attempt % len(self.sentinels)].call("SENTINEL", "FAILOVER", SERVICE)
            try:
                return old, self.wait_for_failover(old, timeout=8.0)
            except ServerError:
                if attempt == attempts - 1:
                    raise
        raise AssertionError("unreachable")

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
    """The replica ``node`` is connected and receives the master's writes.

    "Link up" is not enough: after a diskless sync the master streams writes only once the
    replica's first acknowledgement came, up to a second later. So a probe key is written on
    the master and looked for on the replica."""
    info = node.call("INFO", "replication")
    if "master_link_status:up" not in info:
        return False
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    master_host, master_port = fields["master_host"], int(fields["master_port"])
    probe = f"asynclock-testing:probe:{node.port}"
    command(master_host, master_port, "SET", probe, str(time.monotonic_ns()), "PX", "60000")
    expected = command(master_host, master_port, "GET", probe)
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:
        if node.call("GET", probe) == expected:
            return True
        time.sleep(0.01)
    return False


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
                # The bus port is given: port + 10000, the default, may be above 65535.
                node = RedisNode(
                    "--cluster-enabled", "yes",
                    "--cluster-port", str(free_port()),
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
        """The master of ``slot``, as the first running node says."""
        for asked in self.nodes:
            if not asked.is_running or asked.is_paused:
                continue
            for start, end, master, *_ in asked.call("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    address = f"{master[0]}:{master[1]}"
                    return next(node for node in self.nodes if node.address == address)
            break
        raise ServerError(f"no node serves slot {slot}")

    def replicas_of(self, master: RedisNode) -> list[RedisNode]:
        found = []
        for node in self.nodes:
            if node is master or not node.is_running or node.is_paused:
                continue
            info = node.call("INFO", "replication")
            if "role:slave" in info and f"master_port:{master.port}" in info:
                found.append(node)
        return found

    def wait_for_failover(self, slot: int, old: RedisNode, timeout: float = 15.0) -> RedisNode:
        """Block until every running node names a master other than ``old`` for ``slot``, the
        cluster is ok again, and that master says it is one; return it."""

        def done() -> bool:
            for asked in self.nodes:
                if asked is old or not asked.is_running or asked.is_paused:
                    continue
                if "cluster_state:ok" not in asked.call("CLUSTER", "INFO"):
                    return False
                for start, end, master, *_ in asked.call("CLUSTER", "SLOTS"):
                    if start <= slot <= end and f"{master[0]}:{master[1]}" == old.address:
                        return False
            return self.node_for_slot(slot).role() == "master"

        _wait(f"a failover of slot {slot} away from {old!r}", done, timeout)
        return self.node_for_slot(slot)

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
