"""What the FastAPI and aiohttp integrations share: options, names from requests, the answers.

Every lock error that reaches a handler through one of our locks becomes a documented answer
(:class:`Refusal`), never a 500:

========================  ======  =====================  ==============
what happened             status  ``error``              ``Retry-After``
========================  ======  =====================  ==============
bad lock name             400     invalid_lock_name, ..  no
busy (AcquireTimeout)     423     lock_busy              yes
deadlock victim           409     deadlock               yes
lease lost in the body    503     lease_lost             no
lock server unavailable   503     lock_unavailable       yes
========================  ======  =====================  ==============

A body that ran to completion keeps its answer; a loss learned only afterwards is reported in
the :data:`LEASE_LOST_HEADER` response header (and the core's WARNING), never as "retry".
"""

from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TypedDict
from urllib.parse import quote

from .. import _validate
from .._client import LockClient
from .._errors import (
    AcquireTimeout,
    BackendUnavailable,
    DeadlockDetected,
    InvalidArgument,
    LeaseLost,
    LockError,
)
from .._lease import Lease
from . import template_fields

logger = logging.getLogger("asynclock")

#: The response header that reports a lease lost after its body had completed.
LEASE_LOST_HEADER = "Asynclock-Lease-Lost"

# Printable ASCII stays as it is in the header; '%' and everything else is percent-encoded
# (UTF-8), so any loss reason is a valid header value and decodes with urllib.parse.unquote.
_HEADER_SAFE = "".join(chr(code) for code in range(0x20, 0x7F) if chr(code) != "%")


class LockOptions(TypedDict, total=False):
    """The keyword options of ``@locked`` and ``lock_dependency``, with their defaults."""

    #: Lease time to live, seconds (renewed in the background). Default 30.
    ttl: float
    #: 0 (the default) answers busy at once; a number waits that long first; None waits.
    timeout: float | None
    #: The status of a busy answer. Default 423 (Locked).
    busy_status: int
    #: The status of a lease lost while the body ran. Default 503.
    lost_status: int
    #: Seconds sent in ``Retry-After`` with busy, deadlock and lock-unavailable answers. Default 1.
    retry_after: int
    #: Take a permit of a semaphore of this many permits instead of the lock: up to ``permits``
    #: requests run the handler at once (busy: all of them are in use). Default None: the lock.
    permits: int | None


@dataclass(frozen=True, slots=True)
class Settings:
    """Checked :class:`LockOptions` and the template, made once per decorated endpoint."""

    template: str
    fields: frozenset[str]
    ttl: float = 30.0
    timeout: float | None = 0
    busy_status: int = 423
    lost_status: int = 503
    retry_after: int = 1
    permits: int | None = None

    @classmethod
    def make(cls, template: str, options: Mapping[str, object]) -> Settings:
        unknown = set(options) - set(LockOptions.__annotations__)
        if unknown:
            raise InvalidArgument(
                f"unknown option{'s' if len(unknown) > 1 else ''} "
                f"{', '.join(sorted(unknown))}; the options are "
                f"{', '.join(LockOptions.__annotations__)}"
            )
        defaults = cls(template, frozenset())
        return cls(
            template,
            frozenset(template_fields(template)),
            ttl=_validate.positive_seconds(options.get("ttl", defaults.ttl), "ttl"),
            timeout=_validate.timeout(options.get("timeout", defaults.timeout)),
            busy_status=_status(options.get("busy_status", defaults.busy_status), "busy_status"),
            lost_status=_status(options.get("lost_status", defaults.lost_status), "lost_status"),
            retry_after=_retry_after(options.get("retry_after", defaults.retry_after)),
            permits=_permits(options.get("permits")),
        )


def _status(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 400 <= value <= 599:
        raise InvalidArgument(f"{what} must be an HTTP error status (400-599), got {value!r}")
    return value


def _permits(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgument(f"permits must be a whole number >= 1 (or None), got {value!r}")
    return value


def _retry_after(value: object) -> int:
    # Retry-After takes whole seconds (RFC 9110 10.2.3): a float would be an invalid header.
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgument(f"retry_after must be whole seconds >= 0, got {value!r}")
    return value


class Refusal(Exception):
    """A request answered by the integration instead of the handler: status, JSON body, headers."""

    def __init__(
        self,
        status: int,
        error: str,
        message: str,
        lock: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.error = error
        self.message = message
        self.lock = lock
        self.headers = dict(headers or {})

    def body(self) -> dict[str, object]:
        body: dict[str, object] = {"error": self.error, "message": self.message}
        if self.lock is not None:
            body["lock"] = self.lock
        return body


def lock_name(settings: Settings, path: Mapping[str, object], query: Mapping[str, str]) -> str:
    """The lock name from a request: path parameters first, then the query string."""
    try:
        name = settings.template.format_map(_Fields(path, query))
    except KeyError as exc:
        raise Refusal(
            400,
            "missing_lock_name_part",
            f"the lock name {settings.template!r} needs {exc.args[0]!r} from the path or the "
            "query string",
        ) from None
    return checked_name(name)


def checked_name(name: str) -> str:
    try:
        return _validate.lock_name(name)
    except InvalidArgument as exc:
        # The name is made of request data, so a bad one is the request's fault.
        raise Refusal(400, "invalid_lock_name", str(exc)) from None


class _Fields:
    __slots__ = ("_path", "_query")

    def __init__(self, path: Mapping[str, object], query: Mapping[str, str]) -> None:
        self._path = path
        self._query = query

    def __getitem__(self, key: str) -> str:
        if key in self._path:
            return str(self._path[key])
        value = self._query.get(key)
        if value is None:
            raise KeyError(key)
        return value


@asynccontextmanager
async def holding(locks: LockClient, name: str, settings: Settings) -> AsyncIterator[Lease]:
    """Hold ``name`` for the body; our lock's errors become a :class:`Refusal`.

    Errors the body raises itself (from locks it took, or anything else) pass through as they
    are: only an exception that is not the body's own, raised by this lock's acquire or exit,
    is answered. After the block, ``lease.lost_reason`` tells whether a completed body's lease
    turned out lost (the core returns normally then; see :func:`loss_header`).
    """
    lease: Lease | None = None
    body_error: BaseException | None = None
    if settings.permits is None:
        held = locks.lock(name, ttl=settings.ttl, timeout=settings.timeout)
    else:
        held = locks.semaphore(name, permits=settings.permits).lock(
            ttl=settings.ttl, timeout=settings.timeout
        )
    try:
        async with held as lease:
            try:
                yield lease
            except BaseException as exc:
                body_error = exc
                raise
    except LockError as exc:
        if exc is body_error:
            raise
        if lease is not None and body_error is None:
            # The body returned, so its work is done and its answer stands: never "retry" for
            # committed work. This is a LeaseLost when the loss was signalled while the body
            # ran but it returned before reaching a checkpoint (so it was never stopped), or an
            # error of the release (which does not raise for I/O today).
            logger.warning(
                "asynclock: %s; the body had completed, so its answer stands", exc, exc_info=False
            )
            return
        refusal = _refusal(exc, name, settings, acquired=lease is not None)
        if refusal is None:
            raise
        raise refusal from exc


def _refusal(exc: LockError, name: str, settings: Settings, *, acquired: bool) -> Refusal | None:
    retry = {"Retry-After": str(settings.retry_after)}
    if isinstance(exc, AcquireTimeout) and not acquired:
        held_by = (
            "is held by another request"
            if settings.permits is None
            else f"has all its {settings.permits} permits in use by other requests"
        )
        return Refusal(
            settings.busy_status, "lock_busy", f"{name!r} {held_by}; try again later", name, retry
        )
    if isinstance(exc, DeadlockDetected) and not acquired:
        # Chosen as the victim of a wait cycle: the body never ran, so a retry is safe, and the
        # conflict is with other requests (409), not a fault of the server.
        return Refusal(409, "deadlock", f"{exc}; nothing was done, retry later", name, retry)
    if isinstance(exc, LeaseLost):
        what = "lock" if settings.permits is None else "semaphore permit of"
        return Refusal(
            settings.lost_status,
            "lease_lost",
            f"the {what} {name!r} was lost while the request ran, so it was stopped "
            f"({exc.reason}); its effects may be partial",
            name,
        )
    if isinstance(exc, BackendUnavailable):
        logger.warning("asynclock: answered 503 for the lock %r: %s", name, exc)
        return Refusal(
            503,
            "lock_unavailable",
            f"the lock server is unavailable, so {name!r} could not be taken; nothing was done, "
            "retry later",
            name,
            retry,
        )
    return None


def loss_header(lease: Lease) -> tuple[str, str] | None:
    """The header reporting that a completed body's lease turned out lost, if it did."""
    reason = lease.lost_reason
    if reason is None:
        return None
    return LEASE_LOST_HEADER, quote(reason, safe=_HEADER_SAFE)


def refuse_if_registered(
    func: Callable[..., object], route_of: Callable[[object, object], str | None], framework: str
) -> None:
    """Raise if ``func`` is already an endpoint of a route: ``@locked`` was put above it.

    Route decorators (``@app.post``, ``@routes.post``) register the function and return it
    unchanged, so a ``@locked`` above them wraps a function that the router will call without
    the wrapper, and no lock would ever be taken. ``gc.get_referrers`` finds the routes holding
    ``func``; it costs one pass over the tracked objects per decorated endpoint, at import time
    only (measured: 2 ms with 54,000 tracked objects, 9 ms with 450,000, 19 ms with a million).
    """
    for referrer in gc.get_referrers(func):
        owners = [referrer]
        if isinstance(referrer, dict):
            # A route's attributes may live in its __dict__: look one step further, but only
            # for dicts that hold func under a route's attribute name (a rare second pass).
            if not any(referrer.get(key) is func for key in ("endpoint", "_handler", "handler")):
                continue
            owners = gc.get_referrers(referrer)
        for owner in owners:
            route = route_of(owner, func)
            if route is not None:
                raise InvalidArgument(
                    f"@locked was applied to {func.__qualname__}, which is already the endpoint "
                    f"of the {framework} route {route}, so the route would call it without the "
                    "lock: put @locked *below* the route decorator (closest to the function), "
                    "or register the decorated function"
                )
