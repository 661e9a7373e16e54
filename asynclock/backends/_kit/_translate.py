"""Driver errors into asynclock's hierarchy, at the backend boundary, in one dialect.

A backend gives either a table (``{DriverTimeout: BackendTimeout, OSError:
BackendUnavailable}``, first match wins, subclasses first) or a function that looks at the
error and returns the exception to raise (``None``: not a driver error, let it through). Two
private outcomes every backend can raise or return, so that the code above it can act on them:

- :class:`MayHaveApplied`: the request was sent and no answer came, so the server may have
  carried it out (a take that may hold the lock now must be undone);
- :class:`ProvenGone`: the server proved that the lease or session is gone (renewal reports
  :class:`asynclock.abc.Lost`, not :class:`asynclock.abc.Unknown`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Literal

from ..._errors import BackendTimeout, BackendUnavailable, LockError

__all__ = ("MayHaveApplied", "ProvenGone", "Translator", "translate")

Translator = (
    Mapping[type[BaseException], type[LockError]] | Callable[[Exception, str], LockError | None]
)


class MayHaveApplied(BackendTimeout):
    """The request was sent and not answered in time: it may have been applied."""


class ProvenGone(BackendUnavailable):
    """The server proved that the lease (or session) is gone."""


class translate:  # lower case: it is used as a function, `with translate(table, "what"):`
    """Raise driver errors inside the block as asynclock errors, ``from`` the original.

    ``context`` says what was being done ("renewing 3 locks on redis://127.0.0.1:6379"), which
    the driver's error rarely says. A class rather than a generator: it wraps every call a
    backend makes, and a generator-based context manager costs several times more.
    """

    __slots__ = ("_context", "_translator")

    def __init__(self, translator: Translator, context: str) -> None:
        self._translator = translator
        self._context = context

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]:
        if exc is None or not isinstance(exc, Exception) or isinstance(exc, LockError):
            return False
        error = _translated(self._translator, exc, self._context)
        if error is None:
            return False
        raise error from exc


def _translated(translator: Translator, exc: Exception, context: str) -> LockError | None:
    if callable(translator) and not isinstance(translator, Mapping):
        return translator(exc, context)
    for source, target in translator.items():
        if isinstance(exc, source):
            return target(f"{context}: {_described(exc)}")
    return None


def _described(exc: Exception) -> str:
    # A timeout of the backend's own (anyio.fail_after, asyncio.timeout) says nothing itself.
    if not str(exc) and isinstance(exc, TimeoutError):
        return "TimeoutError (the server did not answer in time)"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
