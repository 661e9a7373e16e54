"""Fencing tokens over HTTP: the header format, the outgoing side, and what both servers share.

The holder of a lock sends ``Fencing-Token: <token>`` and ``Fencing-Lock: <percent-encoded lock
name>`` with each request it makes while it holds the lock; the receiving service reads them,
checks the token with a guard and refuses stale ones (see :mod:`._asgi` and :mod:`._aiohttp`).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar
from urllib.parse import quote, unquote

from .. import _validate
from .._errors import InvalidArgument, StaleToken, UnsupportedFeature
from .._fencing import held_leases
from ._token import MAX_TOKEN

if TYPE_CHECKING:
    import httpx

#: The header that carries the fencing token (a decimal integer, 0 to 2**63-1).
TOKEN_HEADER = "Fencing-Token"
#: The header that carries the lock's name, percent-encoded (UTF-8).
LOCK_HEADER = "Fencing-Lock"

_MAX_DIGITS = len(str(MAX_TOKEN))
# RFC 9110 field-name: a token of tchar.
_FIELD_NAME = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
# Visible ASCII only, and every '%' starts a two-digit hex escape.
_ENCODED_NAME = re.compile(r"^(?:[\x21-\x24\x26-\x7e]|%[0-9A-Fa-f]{2})+$")

_incoming: ContextVar[int | None] = ContextVar("asynclock_incoming_token", default=None)


class Guard(Protocol):
    """What the server middlewares need of a guard: :class:`MemoryGuard` and
    :class:`RedisGuard` have it. ``check`` records ``token`` for ``resource`` and returns it, or
    raises :class:`asynclock.StaleToken`."""

    async def check(self, resource: str, token: int, /) -> int: ...


def _show(value: str) -> str:
    return repr(value if len(value) <= 40 else value[:40] + "...")


def parse_token(value: str) -> int:
    """The fencing token in a header value, or :class:`asynclock.InvalidArgument` saying why not.

    Strict: ASCII digits only (leading zeros allowed, as in ``Content-Length``), no sign, space,
    '+', exponent or separator, and at most ``2**63-1`` (:data:`MAX_TOKEN`).

    >>> parse_token("0042")
    42
    >>> parse_token("-1")
    Traceback (most recent call last):
    asynclock.InvalidArgument: the fencing token '-1' is not a decimal integer: only the ASCII digits 0-9 are allowed (no sign, space, '+', '.' or exponent)
    """
    if not isinstance(value, str):
        raise InvalidArgument(f"a fencing token header value is a str, not {type(value).__name__}")
    if not value:
        raise InvalidArgument("the fencing token is empty; send a decimal integer 0..2**63-1")
    if "," in value:
        raise InvalidArgument(
            f"the fencing token {_show(value)} carries several values; send exactly one"
        )
    if not (value.isascii() and value.isdigit()):
        raise InvalidArgument(
            f"the fencing token {_show(value)} is not a decimal integer: only the ASCII digits "
            "0-9 are allowed (no sign, space, '+', '.' or exponent)"
        )
    digits = value.lstrip("0") or "0"
    if len(digits) > _MAX_DIGITS or int(digits) > MAX_TOKEN:
        raise InvalidArgument(
            f"the fencing token {_show(value)} is larger than 2**63-1, the largest token there is"
        )
    return int(digits)


def encode_lock_name(name: str) -> str:
    """``name`` as a header value: percent-encoded UTF-8, so '/', '%', ',' and non-ASCII survive."""
    return quote(name, safe="")


def parse_lock_name(value: str) -> str:
    """Decode a ``Fencing-Lock`` header value (percent-encoded UTF-8) into a lock name.

    Raises :class:`asynclock.InvalidArgument` on raw non-ASCII or control characters, a broken
    ``%`` escape, bytes that are not UTF-8, or a name the lock API would refuse.
    """
    if not value:
        raise InvalidArgument("the fencing lock name is empty")
    if not _ENCODED_NAME.match(value):
        raise InvalidArgument(
            f"the fencing lock name {_show(value)} is not percent-encoded: send visible ASCII, "
            "with everything else (and '%') as %XX escapes of its UTF-8 bytes"
        )
    try:
        name = unquote(value, errors="strict")
    except UnicodeDecodeError:
        raise InvalidArgument(
            f"the fencing lock name {_show(value)} does not decode to UTF-8 text"
        ) from None
    return _validate.lock_name(name)


def check_header_name(name: str, what: str) -> str:
    if not isinstance(name, str) or not _FIELD_NAME.match(name):
        raise InvalidArgument(
            f"{what} must be an HTTP header name (letters, digits, -), got {name!r}"
        )
    return name


def fencing_headers(
    lock: str | None = None, *, header: str = TOKEN_HEADER, lock_header: str | None = LOCK_HEADER
) -> dict[str, str]:
    """The headers to send for the lock held in this context (innermost, or the one on ``lock``).

    Empty when no such lock is held (or it was released), and when its backend issues no fencing
    tokens (Redlock): nothing is sent rather than a token that would mean nothing.
    ``lock_header=None`` leaves the lock's name out. For clients other than httpx and aiohttp.
    """
    for lease in reversed(held_leases()):
        if lease.released or (lock is not None and lease.name != lock):
            continue
        try:
            token = lease.token
        except UnsupportedFeature:
            return {}
        headers = {header: str(token)}
        if lock_header is not None:
            headers[lock_header] = encode_lock_name(lease.name)
        return headers
    return {}


def httpx_request_hook(
    *, header: str = TOKEN_HEADER, lock_header: str | None = LOCK_HEADER, lock: str | None = None
) -> Callable[[httpx.Request], Awaitable[None]]:
    """An ``httpx.AsyncClient`` request hook that sends the current lock's fencing headers.

    ``httpx.AsyncClient(event_hooks={"request": [asynclock.fencing.httpx_request_hook()]})``.
    The hook runs in the task that makes the request, so it sees the lock held there; it adds
    nothing when no lock is held, or when the request already carries ``header``.
    """
    check_header_name(header, "header")
    if lock_header is not None:
        check_header_name(lock_header, "lock_header")

    async def fencing_hook(request: httpx.Request) -> None:
        if header not in request.headers:
            request.headers.update(fencing_headers(lock, header=header, lock_header=lock_header))

    return fencing_hook


def incoming_token() -> int | None:
    """The fencing token of the request being handled, once a fencing middleware accepted it.

    ``None`` outside such a request, or when the request carried no token. Pass it to a check
    made in the same transaction as the write (``PostgresGuard.check(conn, resource, token)``).
    """
    return _incoming.get()


# -- what the ASGI and aiohttp middlewares share ------------------------------------------------


@dataclass(frozen=True, slots=True)
class Refusal:
    """A response the middleware sends instead of calling the application."""

    status: int
    body: dict[str, object] = field(default_factory=dict)


#: The request, as a middleware sees it: an ASGI scope, an aiohttp request.
R = TypeVar("R")


class Door(Generic[R]):
    """Reads the fencing headers of one request and checks the token with the guard.

    The token is checked for ``resource(request)``, else the lock name sent in ``lock_header``,
    else ``path(request)``.
    """

    __slots__ = ("guard", "header", "lock_header", "path", "required", "resource")

    def __init__(
        self,
        *,
        guard: Guard | None,
        header: str,
        lock_header: str | None,
        required: bool,
        resource: Callable[[R], str] | None,
        path: Callable[[R], str],
    ) -> None:
        if guard is not None and not callable(getattr(guard, "check", None)):
            raise InvalidArgument(
                f"guard must have an async check(resource, token) method, got {guard!r}"
            )
        self.guard = guard
        self.header = check_header_name(header, "header")
        self.lock_header = (
            None if lock_header is None else check_header_name(lock_header, "lock_header")
        )
        self.required = required
        self.resource = resource
        self.path = path

    async def check(
        self, request: R, token_values: Sequence[str], lock_values: Sequence[str]
    ) -> tuple[int | None, str | None] | Refusal:
        """The token and the resource to run ``request`` with (``None, None`` when it sent no
        token and none is required), or the response to refuse it with (428, 400 or 409)."""
        if not token_values:
            if self.required:
                return Refusal(
                    428,
                    {
                        "error": "fencing_token_required",
                        "detail": f"this service needs a {self.header} header on every request",
                    },
                )
            return None, None
        try:
            token, lock_name = self._parse(token_values, lock_values)
        except InvalidArgument as exc:
            return Refusal(400, {"error": "invalid_fencing_header", "detail": str(exc)})
        if self.resource is not None:
            name = self.resource(request)
        else:
            name = lock_name if lock_name is not None else self.path(request)
        if self.guard is not None:
            try:
                await self.guard.check(name, token)
            except StaleToken as exc:
                return Refusal(
                    409,
                    {
                        "error": "stale_fencing_token",
                        "detail": str(exc),
                        "resource": exc.resource,
                        "token": exc.token,
                        "highest": exc.highest,
                    },
                )
        return token, name

    def _parse(
        self, token_values: Sequence[str], lock_values: Sequence[str]
    ) -> tuple[int, str | None]:
        if len(token_values) > 1:
            raise InvalidArgument(
                f"the request has {len(token_values)} {self.header} headers; send exactly one"
            )
        try:
            token = parse_token(token_values[0])
        except InvalidArgument as exc:
            raise InvalidArgument(f"{self.header}: {exc}") from None
        if self.lock_header is None or not lock_values:
            return token, None
        if len(lock_values) > 1:
            raise InvalidArgument(
                f"the request has {len(lock_values)} {self.lock_header} headers; send at most one"
            )
        try:
            return token, parse_lock_name(lock_values[0])
        except InvalidArgument as exc:
            raise InvalidArgument(f"{self.lock_header}: {exc}") from None


@contextlib.contextmanager
def entered(token: int | None) -> Iterator[None]:
    """Make ``token`` what :func:`incoming_token` returns inside the block."""
    reset = _incoming.set(token)
    try:
        yield
    finally:
        _incoming.reset(reset)
