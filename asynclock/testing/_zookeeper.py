"""Throwaway ZooKeeper servers and ensembles."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Final

from ._cluster import Cluster
from ._host import ServerNotInstalled, find_binary, free_port
from ._process import Server, SingleServer

_JARS: Final = (
    ("/usr/share/java/zookeeper.jar", "zookeeper"),
    ("/usr/share/java/slf4j-log4j12.jar", "libslf4j-java"),
    ("/usr/share/java/log4j-1.2.jar", "liblog4j1.2-java"),
)

# Warnings and errors only, into a file in the server's own dir: the default INFO console log
# of a busy ensemble is megabytes per test.
_LOG4J: Final = """\
log4j.rootLogger=WARN, FILE
log4j.appender.FILE=org.apache.log4j.FileAppender
log4j.appender.FILE.File={log}
log4j.appender.FILE.Append=true
log4j.appender.FILE.layout=org.apache.log4j.PatternLayout
log4j.appender.FILE.layout.ConversionPattern=%d{{ISO8601}} [myid:%X{{myid}}] %-5p [%t] %c{{1}} - %m%n
"""


class _ZooKeeperProcess(Server):
    kind = "zookeeper"
    url_format = "zookeeper://{address}"

    def __init__(
        self,
        *,
        myid: int,
        tick_time_ms: int,
        max_session_timeout_ms: int | None,
        start_timeout: float,
        stop_timeout: float,
    ) -> None:
        self._java = find_binary("java", "default-jre-headless")
        for jar, package in _JARS:
            if not os.path.exists(jar):
                raise ServerNotInstalled(jar, package)
        self.myid = myid
        self.tick_time_ms = tick_time_ms
        self.max_session_timeout_ms = max_session_timeout_ms
        self.quorum_port = free_port()
        self.election_port = free_port()
        self._ensemble: list[_ZooKeeperProcess] = []
        super().__init__(start_timeout=start_timeout, stop_timeout=stop_timeout)

    def _reallocate_ports(self) -> None:
        super()._reallocate_ports()
        self.quorum_port = free_port()
        self.election_port = free_port()

    def four_letter_word(self, word: str, timeout: float = 1.0) -> str:
        """Send a four-letter command such as ``srvr`` or ``mntr`` and return the answer."""
        with socket.create_connection((self.host, self.port), timeout=timeout) as sock:
            sock.sendall(word.encode("ascii"))
            chunks = []
            while chunk := sock.recv(4096):
                chunks.append(chunk)
        return b"".join(chunks).decode("utf-8", "replace")

    def mode(self, timeout: float = 1.0) -> str | None:
        """``standalone``, ``leader`` or ``follower``; None while it does not serve."""
        for line in self.four_letter_word("srvr", timeout).splitlines():
            if line.startswith("Mode: "):
                return line.removeprefix("Mode: ").strip()
        return None

    def _prepare(self) -> None:
        conf = self.data_dir / "conf"
        data = self.data_dir / "data"
        conf.mkdir()
        data.mkdir()
        lines = [
            f"tickTime={self.tick_time_ms}",
            *(
                [f"maxSessionTimeout={self.max_session_timeout_ms}"]
                if self.max_session_timeout_ms is not None
                else []
            ),
            "initLimit=10",
            "syncLimit=5",
            f"dataDir={data}",
            f"clientPort={self.port}",
            f"clientPortAddress={self.host}",
            # Every client comes from 127.0.0.1, and the default limit is 60 per address.
            "maxClientCnxns=0",
            # Otherwise it serves an admin page on 0.0.0.0:8080.
            "admin.enableServer=false",
            "4lw.commands.whitelist=*",
            # Fsync and 64 MB log preallocation buy nothing for a throwaway server.
            "forceSync=no",
            "preAllocSize=1024",
        ]
        if self._ensemble:
            lines += [
                f"server.{m.myid}={m.host}:{m.quorum_port}:{m.election_port}"
                for m in self._ensemble
            ]
            (data / "myid").write_text(f"{self.myid}\n")
        (conf / "zoo.cfg").write_text("\n".join(lines) + "\n")
        (conf / "log4j.properties").write_text(_LOG4J.format(log=self.data_dir / "zookeeper.log"))

    def _command(self) -> list[str]:
        classpath = ":".join([str(self.data_dir / "conf"), *(jar for jar, _ in _JARS)])
        return [
            self._java,
            # Start-up time over peak throughput: a small heap, no JIT tiers beyond C1.
            "-Xmx256m",
            "-XX:+UseSerialGC",
            "-XX:TieredStopAtLevel=1",
            # No /tmp/hsperfdata_<user>/<pid> file left behind when the JVM is killed.
            "-XX:-UsePerfData",
            "-Djava.net.preferIPv4Stack=true",
            "-Dzookeeper.admin.enableServer=false",
            "-cp",
            classpath,
            "org.apache.zookeeper.server.quorum.QuorumPeerMain",
            str(self.data_dir / "conf" / "zoo.cfg"),
        ]

    def _log_files(self) -> list[Path]:
        return [self.data_dir / "zookeeper.log", *super()._log_files()]

    def _probe(self, timeout: float) -> bool:
        # "ruok" answers "imok" before the server serves; "srvr" has a Mode only once it does.
        return self.mode(timeout) is not None


class ZooKeeperServer(_ZooKeeperProcess, SingleServer):
    """A standalone ZooKeeper server on 127.0.0.1.

    ``tick_time_ms`` sets the shortest session timeout a client can get (2 ticks: 1 s at the
    default 500 ms); ``max_session_timeout_ms`` the longest (60 s by default, so that the
    client's default ttl of 30 s works; ``None`` keeps ZooKeeper's own 20 ticks).
    """

    def __init__(
        self,
        tick_time_ms: int = 500,
        *,
        max_session_timeout_ms: int | None = 60_000,
        start_timeout: float = 60.0,
        stop_timeout: float = 10.0,
    ) -> None:
        super().__init__(
            myid=1,
            tick_time_ms=tick_time_ms,
            max_session_timeout_ms=max_session_timeout_ms,
            start_timeout=start_timeout,
            stop_timeout=stop_timeout,
        )


class ZooKeeperMember(_ZooKeeperProcess):
    """One member of a :class:`ZooKeeperEnsemble`."""


class ZooKeeperEnsemble(Cluster[ZooKeeperMember]):
    """A ZooKeeper ensemble of ``size`` members on 127.0.0.1 (3 tolerates one failure)."""

    def __init__(
        self,
        size: int = 3,
        *,
        tick_time_ms: int = 500,
        max_session_timeout_ms: int | None = 60_000,
        start_timeout: float = 60.0,
        stop_timeout: float = 10.0,
    ) -> None:
        self.tick_time_ms = tick_time_ms
        self.max_session_timeout_ms = max_session_timeout_ms
        super().__init__(size, start_timeout=start_timeout, stop_timeout=stop_timeout)

    def _make_members(self) -> list[ZooKeeperMember]:
        members = [
            ZooKeeperMember(
                myid=i + 1,
                tick_time_ms=self.tick_time_ms,
                max_session_timeout_ms=self.max_session_timeout_ms,
                start_timeout=self.start_timeout,
                stop_timeout=self.stop_timeout,
            )
            for i in range(self.size)
        ]
        for member in members:
            member._ensemble = list(members)
        return members

    def _is_leader(self, member: ZooKeeperMember, timeout: float) -> bool:
        # A one-member ensemble runs standalone and leads itself.
        return member.mode(timeout) in {"leader", "standalone"}
