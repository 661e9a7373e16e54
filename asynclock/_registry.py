"""Backends by URL scheme, imported lazily so that a driver is loaded only when it is used."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import parse_qsl

from ._errors import InvalidURL, MissingDependency
from ._validate import redact
from .abc import Backend, Grant


@dataclass(frozen=True, slots=True)
class _Entry:
    #: The module (relative to ``asynclock.backends`` when it starts with a dot) and its class.
    module: str
    cls: str
    #: The pip extra that installs the driver, and the driver's top-level modules.
    extra: str | None = None
    drivers: tuple[str, ...] = ()


_BACKENDS: dict[str, _Entry] = {
    "memory": _Entry(".memory", "MemoryBackend"),
    "sqlite": _Entry(".sqlite", "SQLiteBackend"),
    "redis": _Entry(".redis", "RedisBackend", "redis", ("redis",)),
    "rediss": _Entry(".redis", "RedisBackend", "redis", ("redis",)),
    "redis+sentinel": _Entry(".redis.sentinel", "RedisSentinelBackend", "redis", ("redis",)),
    "redis+cluster": _Entry(".redis.cluster", "RedisClusterBackend", "redis", ("redis",)),
    "rediss+cluster": _Entry(".redis.cluster", "RedisClusterBackend", "redis", ("redis",)),
    "redlock": _Entry(".redis", "RedlockBackend", "redis", ("redis",)),
    "etcd": _Entry(".etcd", "EtcdBackend", "etcd", ("aetcd", "grpc")),
    "zookeeper": _Entry(".zookeeper", "ZooKeeperBackend", "zookeeper", ("aiozk",)),
    "postgresql": _Entry(".postgres", "PostgresBackend", "postgres", ("asyncpg",)),
    "postgres": _Entry(".postgres", "PostgresBackend", "postgres", ("asyncpg",)),
}

_EXAMPLES = (
    "sqlite:///tmp/locks.db, redis://127.0.0.1:6379/0, etcd://127.0.0.1:2379, "
    "zookeeper://127.0.0.1:2181/locks, postgresql://user@127.0.0.1:5432/db, memory://"
)


def schemes() -> tuple[str, ...]:
    return tuple(sorted(_BACKENDS))


def split_url(url: object) -> tuple[str, dict[str, str]]:
    """Check the URL's form and return its scheme and query-string options."""
    if not isinstance(url, str):
        raise InvalidURL(f"the lock URL must be a str, not {type(url).__name__}")
    if "://" not in url:
        raise InvalidURL(
            f"{url!r} is not a lock URL: expected scheme://..., for example {_EXAMPLES}"
        )
    # Only the scheme and the query are read here: the server list is the backend's to read
    # (with the kit), so that a malformed address gets the same words on every backend.
    scheme = url.partition("://")[0].lower()
    query_text = url.partition("?")[2].partition("#")[0]
    try:
        query = parse_qsl(query_text, keep_blank_values=True, strict_parsing=bool(query_text))
    except ValueError as exc:
        raise InvalidURL(
            f"malformed lock URL {redact(url)!r}: {exc}; for example {_EXAMPLES}"
        ) from None
    if scheme not in _BACKENDS:
        raise InvalidURL(
            f"unknown lock backend {scheme!r} in {redact(url)!r}; known schemes: "
            f"{', '.join(schemes())}"
        )
    options: dict[str, str] = {}
    for key, value in query:
        if key in options:
            raise InvalidURL(f"option {key!r} is given twice in {redact(url)!r}")
        options[key] = value
    return scheme, options


def backend_class(scheme: str) -> type[Backend[Grant]]:
    entry = _BACKENDS[scheme]
    try:
        module = importlib.import_module(entry.module, "asynclock.backends")
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").split(".")[0]
        if entry.extra and missing in entry.drivers:
            raise MissingDependency(
                f"the {scheme}:// backend needs the {missing!r} package: "
                f"pip install 'asynclock[{entry.extra}]'"
            ) from exc
        raise
    cls: type[Backend[Grant]] = getattr(module, entry.cls)
    return cls


def make_backend(
    url: str, options: Mapping[str, object], client: Mapping[str, object] | None = None
) -> Backend[Grant]:
    """The backend of ``url``, with the query's options, then ``options`` (keywords win), and
    those of ``client`` (``connect()``'s own keywords, as given) that it reads too."""
    scheme, query = split_url(url)
    cls = backend_class(scheme)
    merged: dict[str, object] = dict(query)
    merged.update(
        (name, value) for name, value in (client or {}).items() if name in cls.client_keywords
    )
    merged.update(options)
    base = url.split("?", 1)[0]
    return cls.from_url(base, merged)


__all__ = ("backend_class", "make_backend", "redact", "schemes", "split_url")
