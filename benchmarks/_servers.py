"""The servers a run measures on: started through ``asynclock.testing``, or given with ``--url``.

Every server a run starts is entered on the caller's :class:`contextlib.ExitStack`, so it is
stopped (and its temp dir deleted) when the run ends, however it ends. Only loopback addresses
are accepted.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

#: Backends in the order they are measured, and the server kind each one needs.
BACKENDS: dict[str, str | None] = {
    "memory": None,
    "sqlite": None,
    "redis": "redis",
    "redlock": "redlock",
    "etcd": "etcd",
    "zookeeper": "zookeeper",
    "postgres": "postgres",
}

#: How many masters a Redlock run uses.
REDLOCK_MASTERS = 3


class NotAvailable(Exception):
    """A backend, server or peer that cannot be measured in this run; the message says why."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where one kind of server listens: the asynclock URL and the raw addresses behind it."""

    kind: str
    url: str
    addresses: tuple[tuple[str, int], ...]
    #: Started by this run (and stopped at its end), or given with --url.
    started: bool
    #: asyncpg's connection string (postgres only), ZooKeeper's chroot.
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def host(self) -> str:
        return self.addresses[0][0]

    @property
    def port(self) -> int:
        return self.addresses[0][1]

    @property
    def hosts(self) -> str:
        """``host:port,host:port`` as ZooKeeper and Redlock clients take it."""
        return ",".join(f"{host}:{port}" for host, port in self.addresses)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
        except OSError:
            return False


def endpoint_from_url(kind: str, url: str) -> Endpoint:
    """An endpoint for a server that is already running; refuses anything but loopback."""
    parts = urlsplit(url)
    netloc = parts.netloc.rsplit("@", 1)[-1]
    addresses: list[tuple[str, int]] = []
    default_port = {"redis": 6379, "redlock": 6379, "etcd": 2379, "zookeeper": 2181}.get(kind, 5432)
    for item in filter(None, netloc.split(",")):
        host, _, port = item.rpartition(":") if ":" in item else (item, "", "")
        host = host.strip("[]") or "127.0.0.1"
        addresses.append((host, int(port) if port else default_port))
    if not addresses:
        raise NotAvailable(f"--url {kind}={url}: no host:port in the URL")
    for host, _ in addresses:
        if not is_loopback(host):
            raise NotAvailable(
                f"--url {kind}={url}: {host} is not a loopback address; benchmarks only talk "
                "to 127.0.0.1 so that the figures measure the lock, not the network"
            )
    extra: dict[str, Any] = {}
    if kind == "postgres":
        extra["dsn"] = url.split("?", 1)[0].replace("postgres://", "postgresql://", 1)
    if kind == "zookeeper":
        extra["chroot"] = parts.path.rstrip("/") or None
    return Endpoint(kind, url, tuple(addresses), started=False, extra=extra)


def start(kind: str, stack: ExitStack) -> Endpoint:
    """Start a throwaway server of ``kind`` on loopback, stopped when ``stack`` closes.

    Raises :class:`NotAvailable` when the server is not installed or does not start.
    """
    from asynclock import testing

    try:
        if kind == "redis":
            redis = stack.enter_context(testing.RedisServer())
            return Endpoint(kind, redis.url, ((redis.host, redis.port),), started=True)
        if kind == "redlock":
            masters = [stack.enter_context(testing.RedisServer()) for _ in range(REDLOCK_MASTERS)]
            url = "redlock://" + ",".join(master.address for master in masters) + "/0"
            addresses = tuple((master.host, master.port) for master in masters)
            return Endpoint(kind, url, addresses, started=True)
        if kind == "etcd":
            etcd = stack.enter_context(testing.EtcdServer())
            return Endpoint(kind, etcd.url, ((etcd.host, etcd.port),), started=True)
        if kind == "zookeeper":
            zookeeper = stack.enter_context(testing.ZooKeeperServer())
            return Endpoint(
                kind,
                zookeeper.url,
                ((zookeeper.host, zookeeper.port),),
                started=True,
                extra={"chroot": None, "server": zookeeper},
            )
        if kind == "postgres":
            postgres = stack.enter_context(testing.PostgresServer())
            return Endpoint(
                kind,
                postgres.url,
                ((postgres.host, postgres.port),),
                started=True,
                extra={"dsn": postgres.dsn, "max_connections": postgres.max_connections},
            )
    except testing.ServerNotInstalled as exc:
        raise NotAvailable(str(exc)) from exc
    except testing.ServerError as exc:
        first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise NotAvailable(f"{kind} did not start: {first_line}") from exc
    raise NotAvailable(f"no launcher for {kind!r}")


def start_all(
    kinds: Collection[str],
    urls: Mapping[str, str],
    stack: ExitStack,
    say: Callable[[str], None],
) -> tuple[dict[str, Endpoint | NotAvailable], dict[str, Any]]:
    """The endpoints of ``kinds`` (given with --url, or started), and how long each took.

    The servers start all at once, each launcher in a thread of its own: a launcher mostly
    waits for its server to answer, so together they take about as long as the slowest. Each
    server goes on a stack of its own entered on ``stack`` before its thread starts, so that
    every one is stopped when ``stack`` closes, however the run ends (the pool is left, and so
    every launcher has returned, before that)."""
    wanted = [kind for kind in dict.fromkeys(BACKENDS.values()) if kind and kind in kinds]
    endpoints: dict[str, Endpoint | NotAvailable] = {}
    record: dict[str, Any] = {"started": {}, "given": []}
    for kind in wanted:
        if kind in urls:
            say(f"server {kind}: given")
            record["given"].append(kind)
            try:
                endpoints[kind] = endpoint_from_url(kind, urls[kind])
            except NotAvailable as exc:
                endpoints[kind] = exc
                say(f"  not available: {exc}")
    starting = [kind for kind in wanted if kind not in urls]
    if not starting:
        return endpoints, record
    stacks = {kind: stack.enter_context(ExitStack()) for kind in starting}

    def launch(kind: str) -> tuple[Endpoint | NotAvailable, float]:
        began = time.monotonic()
        try:
            endpoint: Endpoint | NotAvailable = start(kind, stacks[kind])
        except NotAvailable as exc:
            endpoint = exc
        return endpoint, time.monotonic() - began

    say(f"servers: starting {', '.join(starting)} at once")
    began = time.monotonic()
    with ThreadPoolExecutor(len(starting), thread_name_prefix="bench-server") as pool:
        futures = {pool.submit(launch, kind): kind for kind in starting}
        for future in as_completed(futures):
            kind = futures[future]
            endpoint, seconds = future.result()
            endpoints[kind] = endpoint
            if isinstance(endpoint, Endpoint):
                record["started"][kind] = seconds
                say(f"server {kind}: started in {seconds:.2f} s")
            else:
                say(f"server {kind}: not available: {endpoint}")
    record["all_s"] = time.monotonic() - began
    return {kind: endpoints[kind] for kind in wanted}, record
