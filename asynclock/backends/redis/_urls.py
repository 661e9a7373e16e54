"""How to reach Redis: the URL forms, the options every Redis backend shares, and TLS (one copy
for ``redis://``, ``redis+sentinel://``, ``redis+cluster://`` and ``redlock://``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import unquote

import redis.asyncio
import redis.exceptions
from redis.asyncio.connection import AbstractConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from .._kit import (
    HostPort,
    InvalidArgument,
    InvalidURL,
    Options,
    redact,
    split_userinfo,
)

#: Key prefix used when the ``prefix`` option is not given.
DEFAULT_PREFIX: Final = "asynclock:"
#: Bound of every single server call, in seconds, unless ``op_timeout`` says otherwise.
DEFAULT_OP_TIMEOUT: Final = 5.0
#: Name the connections carry in ``CLIENT LIST``.
DEFAULT_CLIENT_NAME: Final = "asynclock"

#: The port when a URL names none.
DEFAULT_PORT: Final = 6379

_SSL_CERT_REQS = ("none", "optional", "required")
_SSL_OPTIONS = (
    "ssl_ca_certs",
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_cert_reqs",
    "ssl_check_hostname",
)
#: Options every Redis-based backend understands.
COMMON_OPTIONS: Final = ("prefix", "op_timeout", "client_name", *_SSL_OPTIONS)


@dataclass(frozen=True, slots=True)
class Settings:
    """How to reach one or more Redis servers (everything but the address)."""

    db: int
    username: str | None
    password: str | None
    tls: bool
    prefix: str
    op_timeout: float
    client_name: str
    ssl_ca_certs: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_cert_reqs: str = "required"
    ssl_check_hostname: bool = True

    def pool(
        self,
        address: HostPort,
        connection_class: type[AbstractConnection] | None = None,
        **connection_kwargs: Any,
    ) -> redis.asyncio.ConnectionPool:
        """A redis-py connection factory for ``address`` (no I/O yet), for :mod:`._wire`.

        Reads have no socket timeout of their own: :mod:`._wire` bounds each call (the wake
        channel's reads wait for messages for ever by design, :mod:`._wakes`; Redlock's link
        bounds its oldest request). A failed connect is retried once, at once.
        ``connection_class`` and ``connection_kwargs``: a connection that finds its server by
        itself (Sentinel's), with what it needs for that.
        """
        extra: dict[str, Any] = dict(connection_kwargs)
        if connection_class is None:
            connection_class = redis.asyncio.Connection
        if self.tls:
            connection_class = _over_tls(connection_class)
            extra |= {
                "ssl_ca_certs": self.ssl_ca_certs,
                "ssl_certfile": self.ssl_certfile,
                "ssl_keyfile": self.ssl_keyfile,
                "ssl_cert_reqs": self.ssl_cert_reqs,
                # An unverified certificate names no host to check (else redis-py's context
                # refuses CERT_NONE with check_hostname on, at every connect).
                "ssl_check_hostname": self.ssl_check_hostname and self.ssl_cert_reqs != "none",
            }
        return redis.asyncio.ConnectionPool(
            connection_class=connection_class,
            host=address.host,
            port=address.port,
            db=self.db,
            username=self.username,
            password=self.password,
            socket_timeout=None,
            socket_connect_timeout=self.op_timeout,
            retry=Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,)),
            client_name=self.client_name or None,
            **extra,
        )


def _over_tls(connection_class: type[AbstractConnection]) -> type[AbstractConnection]:
    """``connection_class`` speaking TLS. redis-py's ``SSLConnection`` is its ``Connection``
    with TLS: a connection of ours that chooses its server (Cluster's, which tries one node
    after another) keeps its own steps and takes the TLS ones from there."""
    if issubclass(connection_class, redis.asyncio.SSLConnection):
        return connection_class
    if connection_class is redis.asyncio.Connection:
        return redis.asyncio.SSLConnection
    if connection_class not in _TLS:
        name = f"TLS{connection_class.__name__}"
        _TLS[connection_class] = type(name, (connection_class, redis.asyncio.SSLConnection), {})
    return _TLS[connection_class]


_TLS: dict[type[AbstractConnection], type[AbstractConnection]] = {}


@dataclass(frozen=True, slots=True)
class RedisURL:
    """A Redis URL taken apart: ``scheme://[user[:password]@]hosts[/db]``, or, for Sentinel,
    ``scheme://[user[:password]@]sentinels/service[/db]``."""

    scheme: str
    username: str | None
    password: str | None
    hosts: str
    db: int
    #: The master's name as the sentinels know it (Sentinel URLs only).
    service: str | None = None


def split_url(
    url: str, *, schemes: tuple[str, ...], example: str, service: bool = False
) -> RedisURL:
    """Take ``url`` apart (the hosts are left to the caller, for the kit's parser).

    With ``service``, the path's first segment is the name of the master the sentinels
    monitor (required) and the second, if any, the database number.
    """
    shown = redact(url)
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in schemes:
        wanted = " or ".join(f"{name}://" for name in schemes)
        raise InvalidURL(f"{shown!r} is not a {wanted} URL; e.g. {example}")
    if "#" in rest:
        raise InvalidURL(f"{shown!r}: a Redis URL has no #fragment; e.g. {example}")
    netloc, slash, path = rest.partition("/")
    userinfo, hosts = split_userinfo(netloc)
    username = password = None
    if userinfo is not None:
        user, colon, secret = userinfo.partition(":")
        username, password = (unquote(user) or None), (unquote(secret) if colon else None)
    if not service:
        db = _db(slash + path, shown, example)
        return RedisURL(scheme.lower(), username, password, hosts, db)
    name, _, db_path = path.strip("/").partition("/")
    if not name:
        raise InvalidURL(
            f"{shown!r} names no master: the path is /<service name>[/<db>], the name the "
            f"sentinels monitor (sentinel monitor <name> ...); e.g. {example}"
        )
    db = _db(db_path, shown, example)
    return RedisURL(scheme.lower(), username, password, hosts, db, unquote(name))


def _db(path: str, url: str, example: str) -> int:
    db_text = path.strip("/")
    if not db_text:
        return 0
    if not db_text.isdigit():
        raise InvalidURL(
            f"{url!r}: the path must be a database number such as /0, got {path!r}; expected "
            f"for example {example}"
        )
    return int(db_text)


def common_settings(opts: Options, *, source: str, url: RedisURL, tls: bool) -> Settings:
    """Read the options all Redis backends share (``opts.finish()`` is left to the caller)."""
    db, username, password = url.db, url.username, url.password
    prefix = opts.text("prefix", DEFAULT_PREFIX)
    op_timeout = opts.number("op_timeout", DEFAULT_OP_TIMEOUT, minimum=0.001)
    client_name = opts.text("client_name", DEFAULT_CLIENT_NAME)
    if any(ch.isspace() or ord(ch) < 0x21 for ch in client_name):
        raise InvalidArgument(
            f"option 'client_name' of {source} must be a name without spaces (or empty, to "
            f"send no CLIENT SETNAME), got {client_name!r}"
        )
    given_ssl = [key for key in _SSL_OPTIONS if key in opts]
    if given_ssl and not tls:
        raise InvalidArgument(
            f"{', '.join(given_ssl)} only apply to TLS connections: use "
            + ("rediss://" if source.startswith("redis") else "the option tls=true")
        )
    cert_reqs = opts.text("ssl_cert_reqs", "required").lower()
    if cert_reqs not in _SSL_CERT_REQS:
        raise InvalidArgument(
            f"option 'ssl_cert_reqs' of {source} must be one of {', '.join(_SSL_CERT_REQS)}, "
            f"got {cert_reqs!r}"
        )
    return Settings(
        db=db,
        username=username,
        password=password,
        tls=tls,
        prefix=prefix,
        op_timeout=op_timeout,
        client_name=client_name,
        ssl_ca_certs=opts.optional_text("ssl_ca_certs"),
        ssl_certfile=opts.optional_text("ssl_certfile"),
        ssl_keyfile=opts.optional_text("ssl_keyfile"),
        ssl_cert_reqs=cert_reqs,
        ssl_check_hostname=opts.flag("ssl_check_hostname", True),
    )
