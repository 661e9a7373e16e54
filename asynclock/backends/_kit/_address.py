"""Server addresses in lock URLs: ``host``, ``host:port``, ``[v6]``, ``[v6]:port``, lists of them.

Every backend that names servers in its URL reads them here, so that a port out of range, an
IPv6 address without brackets or an empty entry is refused in the same words everywhere.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from ..._errors import InvalidURL
from ..._validate import redact

__all__ = (
    "HostPort",
    "ServerURL",
    "parse_host",
    "parse_hosts",
    "split_server_url",
    "split_userinfo",
)


@dataclass(frozen=True, slots=True)
class HostPort:
    host: str
    port: int

    def __str__(self) -> str:
        # IPv6 addresses in brackets, as a URL writes them.
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def family(self) -> int | None:
        """4 or 6 for an IP address, None for a host name."""
        try:
            return ipaddress.ip_address(self.host).version
        except ValueError:
            return None


def parse_host(text: str, *, default_port: int, url: str, example: str) -> HostPort:
    """One ``host[:port]`` entry; IPv6 addresses in brackets, ports 1-65535."""

    def bad(problem: str) -> InvalidURL:
        """The error for ``problem``, which follows the URL (``" names ..."``, ``": ..."``)."""
        return InvalidURL(f"{redact(url)!r}{problem}; expected for example {example}")

    entry = text.strip()
    if not entry:
        raise bad(" names an empty host")
    if entry.startswith("["):
        host, closed, rest = entry[1:].partition("]")
        if not closed or not host:
            raise bad(f": unbalanced '[' in {entry!r}")
        if rest and not rest.startswith(":"):
            raise bad(f": unexpected {rest!r} after [{host}]")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise bad(f": [{host}] is not an IPv6 address") from None
        port_text = rest[1:] if rest else None
    else:
        if entry.count(":") > 1:
            raise bad(f": IPv6 addresses go in brackets, as in [::1]:{default_port}")
        host, colon, port_text_or_empty = entry.partition(":")
        port_text = port_text_or_empty if colon else None
        if not host:
            raise bad(f" names no host in {entry!r}")
        if not all(char.isalnum() or char in "-._%" for char in host):
            raise bad(f": {host!r} is not a host name or address")
    if port_text is None:
        return HostPort(host, default_port)
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise bad(f": port {port_text!r} is not a number from 1 to 65535")
    return HostPort(host, int(port_text))


def parse_hosts(
    text: str, *, default_port: int, url: str, example: str, one_family: bool = False
) -> tuple[HostPort, ...]:
    """A comma-separated list of ``host[:port]`` entries (at least one).

    ``one_family`` refuses a list that mixes IPv4 and IPv6 addresses (gRPC's resolver takes one).
    """
    hosts = tuple(
        parse_host(part, default_port=default_port, url=url, example=example)
        for part in text.split(",")
    )
    if one_family and len({host.family for host in hosts if host.family is not None}) > 1:
        raise InvalidURL(
            f"{redact(url)!r} mixes IPv4 and IPv6 addresses; list the servers by one family "
            f"(or by host name), for example {example}"
        )
    return hosts


def split_userinfo(netloc: str) -> tuple[str | None, str]:
    """``user:password@hosts`` -> (``user:password`` or None, ``hosts``); percent-encoding kept."""
    userinfo, at, hosts = netloc.rpartition("@")
    return (userinfo if at else None), hosts


@dataclass(frozen=True, slots=True)
class ServerURL:
    """The parts of ``scheme://[userinfo@]hosts[/path][?query][#fragment]``, unparsed."""

    scheme: str
    userinfo: str | None
    hosts: str
    path: str
    query: str
    fragment: str


def split_server_url(url: str, *, schemes: tuple[str, ...], example: str) -> ServerURL:
    """Split a server URL without judging its host list (``urllib.parse.urlsplit`` refuses a
    bracketed host it cannot read in words of its own): :func:`parse_hosts` reads that."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in schemes:
        wanted = " or ".join(f"{name}://" for name in schemes)
        raise InvalidURL(f"{redact(url)!r} is not a {wanted} URL; expected for example {example}")
    rest, _, fragment = rest.partition("#")
    rest, _, query = rest.partition("?")
    netloc, slash, path = rest.partition("/")
    userinfo, hosts = split_userinfo(netloc)
    return ServerURL(scheme.lower(), userinfo, hosts, slash + path, query, fragment)
