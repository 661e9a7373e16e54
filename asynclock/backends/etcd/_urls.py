"""The ``etcd://`` URL, its options and the settings they make."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Final
from urllib.parse import quote, unquote

from .._kit import HostPort, InvalidArgument, InvalidURL, Options, parse_hosts, split_server_url

__all__ = (
    "DEFAULT_PORT",
    "DEFAULT_PREFIX",
    "MAX_TTL",
    "MIN_TTL",
    "Settings",
    "bucket",
    "check_ttl",
    "read_settings",
)

DEFAULT_PORT: Final = 2379
DEFAULT_PREFIX: Final = "/asynclock/"
#: etcd never grants a lease shorter than 1.5 election timeouts, rounded up to whole seconds:
#: 2 s with the default settings. A shorter ttl would silently live longer than asked.
MIN_TTL: Final = 2
#: etcd's own ceiling (``lease.MaxLeaseTTL``).
MAX_TTL: Final = 9_000_000_000

URL_EXAMPLE: Final = "etcd://127.0.0.1:2379 or etcd://10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379"


@dataclass(frozen=True, slots=True)
class Settings:
    """What an :class:`EtcdBackend` was made with, checked."""

    hosts: tuple[HostPort, ...]
    prefix: str = DEFAULT_PREFIX
    op_timeout: float = 5.0
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    tls: bool = False
    ca_cert: str | None = None
    cert_cert: str | None = None
    cert_key: str | None = None
    tls_server_name: str | None = None

    def __post_init__(self) -> None:
        if not self.hosts:
            raise InvalidURL(f"etcd:// needs at least one host, for example {URL_EXAMPLE}")
        if not self.prefix.endswith("/"):
            raise InvalidArgument(
                f"option 'prefix' of etcd:// must end with '/' (got {self.prefix!r}), so that "
                "the keys of two prefixes never overlap: for example prefix=/myapp/locks/"
            )
        if (self.user is None) != (self.password is None):
            raise InvalidArgument("etcd:// needs both 'user' and 'password', or neither")
        if (self.cert_cert is None) != (self.cert_key is None):
            raise InvalidArgument(
                "etcd:// needs both 'cert_cert' (client certificate) and 'cert_key' (its "
                "private key), or neither"
            )
        if self.ca_cert is not None or self.cert_cert is not None:
            object.__setattr__(self, "tls", True)

    def describe(self) -> str:
        user = f"{quote(self.user, safe='')}@" if self.user else ""
        return f"etcd://{user}{','.join(str(host) for host in self.hosts)}"


def read_settings(url: str, options: Mapping[str, object]) -> Settings:
    """What an ``EtcdBackend`` for ``url`` with ``options`` is made with, checked."""
    hosts, url_user, url_password = _parse_url(url)
    opts = Options(options, "etcd://")
    user = opts.optional_text("user")
    password = opts.optional_text("password")
    if url_user is not None:
        if user is not None or password is not None:
            raise InvalidArgument("etcd:// got a user in the URL and as an option: give it once")
        user, password = url_user, url_password
    settings = Settings(
        hosts,
        prefix=opts.text("prefix", DEFAULT_PREFIX),
        op_timeout=opts.number("op_timeout", 5.0, minimum=0.001),
        user=user,
        password=password,
        tls=opts.flag("tls", False),
        ca_cert=opts.optional_text("ca_cert"),
        cert_cert=opts.optional_text("cert_cert"),
        cert_key=opts.optional_text("cert_key"),
        tls_server_name=opts.optional_text("tls_server_name"),
    )
    # Every setting but the hosts is an option of its name.
    opts.finish(tuple(each.name for each in fields(Settings) if each.name != "hosts"))
    return settings


def _parse_url(url: str) -> tuple[tuple[HostPort, ...], str | None, str | None]:
    parts = split_server_url(url, schemes=("etcd",), example=URL_EXAMPLE)
    if len(parts.path) > 1 or parts.fragment or "#" in url:
        raise InvalidURL(
            f"etcd URLs take no path: got {url!r}. Set the key prefix with the prefix option "
            f"(?prefix=/myapp/locks/); for example {URL_EXAMPLE}"
        )
    userinfo, host_text = parts.userinfo, parts.hosts
    user: str | None = None
    password: str | None = None
    if userinfo is not None:
        name, colon, secret = userinfo.partition(":")
        if not name or not colon:
            raise InvalidURL(
                "etcd URLs carry credentials as user:password@host (percent-encoded), for "
                "example etcd://root:secret@127.0.0.1:2379"
            )
        user, password = unquote(name), unquote(secret)
    shown = f"etcd://{'***@' if userinfo is not None else ''}{host_text}"
    if not host_text:
        raise InvalidURL(f"etcd URL {shown!r} names no host; for example {URL_EXAMPLE}")
    hosts = parse_hosts(
        host_text, default_port=DEFAULT_PORT, url=shown, example=URL_EXAMPLE, one_family=True
    )
    return hosts, user, password


def check_ttl(ttl: float) -> None:
    if ttl < MIN_TTL:
        raise InvalidArgument(
            f"ttl {ttl:g} s is below etcd's minimum lease of {MIN_TTL} s (1.5 election "
            f"timeouts, rounded up): etcd would keep the lock for {MIN_TTL} s or more. Use "
            f"ttl >= {MIN_TTL}"
        )
    if ttl > MAX_TTL:
        raise InvalidArgument(f"ttl {ttl:g} s is above etcd's maximum lease of {MAX_TTL} s")


def bucket(ttl: float) -> int:
    """etcd leases have whole seconds: round up, so the lease never ends before the ttl."""
    return max(MIN_TTL, math.ceil(ttl))
