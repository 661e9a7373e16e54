"""``connect(url)``: check the options, make the backend, and hand both to a LockClient."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import fields
from typing import Any

from . import _validate
from ._client import LockClient
from ._errors import InvalidArgument, UnsupportedFeature
from ._host import check_event_loop
from ._registry import make_backend, redact
from .abc import Capabilities

_CAPABILITY_NAMES = tuple(field.name for field in fields(Capabilities))


class _Default(float):
    """A default of :func:`connect`, told apart from the same number given: a keyword that is
    an option of the backend too reaches the backend only when given."""


_DRIFT, _CONNECT_TIMEOUT = _Default(0.01), _Default(10.0)


def connect(
    url: str,
    /,
    *,
    require: Collection[str] = (),
    drift: float = _DRIFT,
    margin: float | None = None,
    connect_timeout: float = _CONNECT_TIMEOUT,
    release_timeout: float = 5.0,
    deadlock_detection: bool = False,
    deadlock_interval: float = 0.5,
    label: str | None = None,
    **options: Any,
) -> LockClient:
    """Make a lock client for ``url``; use it as ``async with asynclock.connect(url) as locks:``.

    The URL scheme picks the backend (``sqlite:///path``, ``redis://``, ``redlock://``,
    ``etcd://``, ``zookeeper://``, ``postgresql://``, ``memory://``). Backend options can be given
    in the query string or as keyword arguments; keyword arguments win.

    ``require`` names capabilities the backend must have (``"fencing"``, ``"fifo"``,
    ``"loss_detection"``, ``"quorum"``, ``"cross_process"``); a backend without one is refused with
    :class:`UnsupportedFeature` before anything connects.

    ``drift`` (share of the ttl) and ``margin`` (seconds; default ``min(1, ttl / 10)``) shorten the
    local deadline so that the body is cancelled before the server can expire the lock, even if
    the two clocks run at slightly different rates.

    ``connect_timeout`` bounds entering the client: a server that accepts connections but is
    slow to answer (many clients starting at once, a loaded host) is waited for until then,
    while one that refuses them fails at once. Once connected, each call is bounded by the
    backend's ``op_timeout``. Where a backend has an option of the same name (PostgreSQL's
    ``connect_timeout``, Redlock's ``drift``), the keyword, when given, sets it too.

    Nothing connects until the client is entered, and bad input is refused at once:

    >>> asynclock.connect("mysql://db.internal/locks")
    Traceback (most recent call last):
    asynclock.InvalidURL: unknown lock backend 'mysql' in 'mysql://db.internal/locks'; known schemes: etcd, memory, postgres, postgresql, redis, redis+cluster, redis+sentinel, rediss, rediss+cluster, redlock, sqlite, zookeeper
    >>> asynclock.connect("sqlite:///tmp/locks.db", ttl=5)
    Traceback (most recent call last):
    asynclock.InvalidArgument: unknown option(s) for sqlite://: ttl (known: busy_timeout, synchronous)

    ``deadlock_detection=True`` makes every wait longer than ``deadlock_interval`` publish who
    waits for what in the lock store, and fails the youngest waiter of any cycle with
    :class:`DeadlockDetected` (within about three intervals). ``label`` names this client in those
    records and errors (default: the host name).
    """
    given = _given(drift=drift, connect_timeout=connect_timeout)
    drift = _validate.positive_seconds(drift, "drift") if drift else 0.0
    if drift >= 0.5:
        raise InvalidArgument(f"drift is a share of the ttl below 0.5, got {drift!r}")
    if margin is not None:
        margin = _validate.positive_seconds(margin, "margin")
    connect_timeout = _validate.positive_seconds(connect_timeout, "connect_timeout")
    release_timeout = _validate.positive_seconds(release_timeout, "release_timeout")
    require = _capability_names(require)
    deadlock_interval = _validate.positive_seconds(deadlock_interval, "deadlock_interval")
    if label is not None and (not isinstance(label, str) or "/" in label or not label):
        raise InvalidArgument(f"label must be a non-empty str without '/', got {label!r}")
    backend = make_backend(url, options, given)
    check_event_loop(backend, url)
    if deadlock_detection and backend.waiter_registry() is None:
        raise UnsupportedFeature(
            f"{redact(url)} has no place for deadlock detection's records; use lock_all() or "
            "timeouts instead, or a backend that has one (see the multi-lock guide)"
        )
    _check_provided(backend.capabilities, require, url)
    return LockClient(
        backend,
        drift=drift,
        margin=margin,
        connect_timeout=connect_timeout,
        release_timeout=release_timeout,
        deadlock_interval=deadlock_interval if deadlock_detection else None,
        label=label,
    )


def _given(**keywords: float) -> dict[str, float]:
    """Those of ``keywords`` (of :func:`connect`) that its caller gave."""
    return {name: value for name, value in keywords.items() if not isinstance(value, _Default)}


def _check_provided(capabilities: Capabilities, require: Collection[str], url: str) -> None:
    missing = [name for name in require if not getattr(capabilities, name)]
    if missing:
        raise UnsupportedFeature(
            f"{redact(url)} does not provide {', '.join(missing)}; see the backend guide for one "
            "that does (etcd, ZooKeeper and PostgreSQL provide fencing and loss detection)"
        )


def _capability_names(require: Collection[str]) -> tuple[str, ...]:
    if isinstance(require, str):
        require = (require,)  # require="fencing" means the one capability, not its letters
    unknown = set(require) - set(_CAPABILITY_NAMES)
    if unknown:
        raise InvalidArgument(
            f"unknown capabilities in require: {', '.join(sorted(unknown))} "
            f"(known: {', '.join(_CAPABILITY_NAMES)})"
        )
    return tuple(require)
