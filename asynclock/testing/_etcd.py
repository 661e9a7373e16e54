"""Throwaway etcd servers and clusters."""

from __future__ import annotations

import http.client
import json
import uuid
from typing import Any

from ._cluster import Cluster
from ._host import find_binary, free_port
from ._process import Server, SingleServer


def _http_json(host: str, port: int, method: str, path: str, timeout: float) -> Any:
    connection = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        body = b"{}" if method == "POST" else None
        connection.request(method, path, body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        payload = response.read()
    except http.client.HTTPException as exc:
        # A half-started server can send garbage; callers retry on OSError.
        raise OSError(f"{method} {path}: {exc!r}") from exc
    finally:
        connection.close()
    if response.status != 200:
        raise OSError(f"{method} {path}: HTTP {response.status}")
    return json.loads(payload)


class _EtcdProcess(Server):
    """One etcd member; alone it is a one-member cluster."""

    kind = "etcd"
    url_format = "etcd://{address}"

    def __init__(
        self, *, name: str, election_timeout_ms: int, start_timeout: float, stop_timeout: float
    ) -> None:
        self._binary = find_binary("etcd", "etcd-server")
        self.name = name
        self.election_timeout_ms = election_timeout_ms
        self.peer_port = free_port()
        self._initial_cluster = f"{name}=http://127.0.0.1:{self.peer_port}"
        self._cluster_token = f"asynclock-{uuid.uuid4().hex[:12]}"
        super().__init__(start_timeout=start_timeout, stop_timeout=stop_timeout)

    @property
    def client_url(self) -> str:
        """The HTTP endpoint (``http://127.0.0.1:PORT``) for etcdctl or the JSON gateway."""
        return f"http://{self.address}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    def _reallocate_ports(self) -> None:
        super()._reallocate_ports()
        self.peer_port = free_port()
        self._initial_cluster = f"{self.name}={self.peer_url}"

    def status(self, timeout: float = 1.0) -> dict[str, Any]:
        """``/v3/maintenance/status`` of this member, decoded (uint64 fields are strings)."""
        result: dict[str, Any] = _http_json(
            self.host, self.port, "POST", "/v3/maintenance/status", timeout
        )
        return result

    def is_leader(self, timeout: float = 1.0) -> bool:
        """Whether this member is the cluster's leader right now."""
        status = self.status(timeout)
        leader = status.get("leader")
        return leader is not None and leader == status.get("header", {}).get("member_id")

    def _command(self) -> list[str]:
        return [
            self._binary,
            "--name", self.name,
            "--data-dir", str(self.data_dir / "data"),
            "--listen-client-urls", self.client_url,
            "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", self.peer_url,
            "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", self._initial_cluster,
            "--initial-cluster-token", self._cluster_token,
            # Ignored once the data dir exists, which is what restart() relies on.
            "--initial-cluster-state", "new",
            "--election-timeout", str(self.election_timeout_ms),
            "--heartbeat-interval", str(max(1, self.election_timeout_ms // 10)),
            "--logger", "zap",
            "--log-outputs", "stderr",
            "--log-level", "warn",
        ]  # fmt: skip

    def _probe(self, timeout: float) -> bool:
        health = _http_json(self.host, self.port, "GET", "/health", timeout)
        return isinstance(health, dict) and health.get("health") == "true"


class EtcdServer(_EtcdProcess, SingleServer):
    """A single-member etcd cluster on 127.0.0.1, data in its own temp dir.

    etcd is a Go program: libfaketime does not move its clock.
    """

    def __init__(self, *, start_timeout: float = 30.0, stop_timeout: float = 10.0) -> None:
        # With no peers to wait for, a short election timeout only makes the first election
        # (and every restart) 0.7 s faster.
        super().__init__(
            name="n1",
            election_timeout_ms=100,
            start_timeout=start_timeout,
            stop_timeout=stop_timeout,
        )


class EtcdMember(_EtcdProcess):
    """One member of an :class:`EtcdCluster`."""


class EtcdCluster(Cluster[EtcdMember]):
    """An etcd cluster of ``size`` members on 127.0.0.1 (3 tolerates one failure).

    ``election_timeout_ms`` is half etcd's default, so that a new leader takes over within about
    a second after :meth:`kill_leader`; the heartbeat interval is a tenth of it.
    """

    def __init__(
        self,
        size: int = 3,
        *,
        election_timeout_ms: int = 500,
        start_timeout: float = 60.0,
        stop_timeout: float = 10.0,
    ) -> None:
        self.election_timeout_ms = election_timeout_ms
        super().__init__(size, start_timeout=start_timeout, stop_timeout=stop_timeout)

    def _make_members(self) -> list[EtcdMember]:
        members = [
            EtcdMember(
                name=f"n{i + 1}",
                election_timeout_ms=self.election_timeout_ms,
                start_timeout=self.start_timeout,
                stop_timeout=self.stop_timeout,
            )
            for i in range(self.size)
        ]
        initial_cluster = ",".join(f"{m.name}={m.peer_url}" for m in members)
        token = members[0]._cluster_token
        for member in members:
            member._initial_cluster = initial_cluster
            member._cluster_token = token
        return members

    def _is_leader(self, member: EtcdMember, timeout: float) -> bool:
        return member.is_leader(timeout)
