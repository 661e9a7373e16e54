"""Checks of user input, each naming the problem and the fix."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from urllib.parse import urlsplit

from ._errors import InvalidArgument

#: Longest lock name, in UTF-8 bytes. Every backend can store this as one key or znode name
#: (with its prefix), and it is far beyond any name a person would read.
MAX_NAME_BYTES = 512
#: The ttl of an acquire that names none (the default of ``LockClient.lock()``, ``acquire()`` and
#: the others, spelt out there for the docs): a backend may get ready for it when it opens.
DEFAULT_TTL = 30.0

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


#: What a lock name may not contain: C0 control characters and DEL (searched in C, not in a
#: Python loop over the name: this runs on every acquire).
_CONTROL = re.compile("[\x00-\x1f\x7f]")


def lock_name(name: object) -> str:
    if not isinstance(name, str):
        raise InvalidArgument(f"lock name must be a str, not {type(name).__name__}")
    if not name:
        raise InvalidArgument("lock name must not be empty")
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise InvalidArgument(
            f"lock name {name[:40]!r} is not valid Unicode text (lone surrogate at {exc.start})"
        ) from None
    if size > MAX_NAME_BYTES:
        raise InvalidArgument(
            f"lock name is {size} bytes long in UTF-8; the limit is {MAX_NAME_BYTES}. Hash long "
            "identifiers (for example with hashlib.sha256) and use the digest as the name"
        )
    control = _CONTROL.search(name)
    if control is not None:
        raise InvalidArgument(
            f"lock name {name[:40]!r} contains the control character {control.group()!r} at "
            f"index {control.start()}; names may contain any printable text, '/' and non-ASCII "
            "included"
        )
    return name


def positive_seconds(value: object, what: str) -> float:
    seconds = _number(value, what)
    if not seconds > 0:
        raise InvalidArgument(f"{what} must be > 0 seconds, got {value!r}")
    return seconds


def timeout(value: object) -> float | None:
    """``None`` waits forever, 0 tries once, a positive number bounds the wait."""
    if value is None:
        return None
    seconds = _number(value, "timeout")
    if seconds < 0:
        raise InvalidArgument(
            f"timeout must be >= 0 seconds (0 tries once) or None (wait forever), got {value!r}"
        )
    return seconds


def _number(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgument(f"{what} must be a number of seconds, not {type(value).__name__}")
    seconds = float(value)
    if not math.isfinite(seconds):
        raise InvalidArgument(f"{what} must be a finite number of seconds, got {value!r}")
    return seconds


class Options:
    """Backend options from the URL query string and keyword arguments, consumed one by one.

    ``finish()`` rejects whatever nobody consumed, so a misspelt option is an error and not a
    silently ignored setting.
    """

    def __init__(self, options: Mapping[str, object], source: str) -> None:
        self._options = dict(options)
        self._source = source

    def __contains__(self, key: str) -> bool:
        return key in self._options

    def text(self, key: str, default: str) -> str:
        value = self._options.pop(key, default)
        if not isinstance(value, str):
            raise InvalidArgument(f"option {key!r} of {self._source} must be a string")
        return value

    def optional_text(self, key: str) -> str | None:
        value = self._options.pop(key, None)
        if value is not None and not isinstance(value, str):
            raise InvalidArgument(f"option {key!r} of {self._source} must be a string")
        return value

    def number(self, key: str, default: float, *, minimum: float = 0.0) -> float:
        value = self._options.pop(key, default)
        try:
            number = float(value if isinstance(value, int | float) else str(value))
        except (TypeError, ValueError):
            raise InvalidArgument(
                f"option {key!r} of {self._source} must be a number, got {value!r}"
            ) from None
        if not math.isfinite(number) or number < minimum:
            raise InvalidArgument(
                f"option {key!r} of {self._source} must be a finite number >= {minimum:g}, "
                f"got {value!r}"
            )
        return number

    def whole(self, key: str, default: int, *, minimum: int = 0) -> int:
        value = self._options.pop(key, default)
        try:
            number = int(value if isinstance(value, int) else str(value))
        except (TypeError, ValueError):
            raise InvalidArgument(
                f"option {key!r} of {self._source} must be a whole number, got {value!r}"
            ) from None
        if number < minimum:
            raise InvalidArgument(
                f"option {key!r} of {self._source} must be >= {minimum}, got {value!r}"
            )
        return number

    def flag(self, key: str, default: bool) -> bool:
        value = self._options.pop(key, default)
        if isinstance(value, bool):
            return value
        text = str(value).lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise InvalidArgument(
            f"option {key!r} of {self._source} must be true or false, got {value!r}"
        )

    def pop_raw(self, key: str) -> object:
        return self._options.pop(key, None)

    def finish(self, known: Iterable[str] = ()) -> None:
        if self._options:
            unknown = ", ".join(sorted(self._options))
            hint = f" (known: {', '.join(sorted(known))})" if known else ""
            raise InvalidArgument(f"unknown option(s) for {self._source}: {unknown}{hint}")


def redact(url: str) -> str:
    """The URL without its password, for error messages and logs."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return url.split("@")[-1]
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    return parts._replace(netloc=netloc).geturl()
