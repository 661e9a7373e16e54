"""``zookeeper://[user:password@]host[:port][,host[:port]...][/chroot]`` and the backend's
settings."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import unquote

from .._kit import (
    HostPort,
    InvalidArgument,
    InvalidURL,
    Options,
    parse_hosts,
    redact,
    split_server_url,
)
from ._names import forbidden

__all__ = ("Settings", "describe", "parse_url")

_EXAMPLE = "zookeeper://127.0.0.1:2181,127.0.0.2:2181/locks"
_DEFAULT_PORT = 2181
_DEFAULT_CHROOT = "/asynclock"
_OPTIONS = ("op_timeout", "session_timeout")


@dataclass(frozen=True, slots=True)
class Settings:
    hosts: tuple[HostPort, ...]
    chroot: str
    user: str | None
    password: str | None
    op_timeout: float
    session_timeout: float


def parse_url(url: str, options: Mapping[str, object]) -> Settings:
    shown = redact(url)
    parts = split_server_url(url, schemes=("zookeeper",), example=_EXAMPLE)
    if "#" in url:
        raise InvalidURL(f"a zookeeper:// URL has no #fragment; expected e.g. {_EXAMPLE}")
    if parts.query:
        raise InvalidURL(f"{shown!r}: pass the options to from_url(), not in the URL")
    userinfo, host_text = parts.userinfo, parts.hosts
    user = password = None
    if userinfo is not None:
        raw_user, colon, raw_password = userinfo.partition(":")
        user, password = unquote(raw_user), unquote(raw_password)
        if not colon or not user or ":" in user:
            raise InvalidURL(
                "zookeeper:// credentials must be user:password (digest auth), with "
                "special characters percent-encoded: "
                "zookeeper://app:s3cret@127.0.0.1:2181/locks"
            )
    redacted = f"zookeeper://{'***@' if userinfo is not None else ''}{host_text}{parts.path}"
    if not host_text:
        raise InvalidURL(f"{redacted!r} names no server; expected e.g. {_EXAMPLE}")
    hosts = parse_hosts(host_text, default_port=_DEFAULT_PORT, url=redacted, example=_EXAMPLE)
    chroot = _parse_chroot(parts.path, redacted)
    opts = Options(options, "zookeeper://")
    op_timeout = opts.number("op_timeout", 5.0, minimum=0.001)
    session_timeout = opts.number("session_timeout", 10.0, minimum=0.001)
    opts.finish(_OPTIONS)
    if round(session_timeout * 1000) > 0x7FFFFFFF:
        raise InvalidArgument(f"session_timeout {session_timeout:g} s is too large")
    return Settings(hosts, chroot, user, password, op_timeout, session_timeout)


def describe(settings: Settings) -> str:
    hosts = ",".join(str(host) for host in settings.hosts)
    user = f"{settings.user}:***@" if settings.user is not None else ""
    return f"zookeeper://{user}{hosts}{settings.chroot}"


def _parse_chroot(path: str, url: str) -> str:
    """The chroot of a URL's path: ``/a/b``, each part one znode name (ZooKeeper's own rules:
    no empty part, so no ``//`` and no trailing ``/``; no ``.`` or ``..``; no ``/``, ``%`` or
    control characters once percent-decoded; not under ``/zookeeper``)."""
    if path in ("", "/"):
        return _DEFAULT_CHROOT
    assert path.startswith("/")

    def bad(problem: str) -> InvalidURL:
        return InvalidURL(f"bad chroot {path!r} in {url!r}: {problem}; expected e.g. {_EXAMPLE}")

    parts = path[1:].split("/")
    names = []
    for index, part in enumerate(parts):
        name = unquote(part)
        if not name:
            where = "a trailing '/'" if index == len(parts) - 1 else "a doubled '/'"
            raise bad(f"it has an empty part ({where}); each part must be a znode name")
        if name in (".", ".."):
            raise bad(f"{name!r} is not allowed as a part (ZooKeeper paths are absolute)")
        refused = sorted({char for char in name if forbidden(char)})
        if refused:
            shown = ", ".join(repr(char) for char in refused)
            raise bad(f"part {name!r} contains {shown}, which ZooKeeper refuses in a znode name")
        names.append(name)
    if names[0] == "zookeeper":
        raise bad("/zookeeper is ZooKeeper's own subtree (quotas, config); choose another")
    return "/" + "/".join(names)
