"""redis-py's errors into asynclock's: one translator for every Redis backend, and the one of a
backend's opening, which says what to check."""

from __future__ import annotations

from typing import Final

import redis.exceptions

from .._kit import BackendTimeout, BackendUnavailable, InvalidArgument, LockError, Translator

#: Driver errors, most specific first (the first match wins). The builtin ``TimeoutError``
#: comes from our own ``anyio.fail_after`` bounds.
_CAUSES: Final[dict[type[BaseException], type[LockError]]] = {
    TimeoutError: BackendTimeout,
    redis.exceptions.TimeoutError: BackendTimeout,
    redis.exceptions.RedisError: BackendUnavailable,
    OSError: BackendUnavailable,
}
ERRORS: Final[Translator] = _CAUSES


def opening_errors(describe: str, db: int) -> Translator:
    """The translator of a backend's opening: each error with what to check."""

    def translated(error: Exception, context: str) -> LockError | None:
        text = str(error)
        if isinstance(error, redis.exceptions.ResponseError) and "DB index" in text:
            return InvalidArgument(
                f"{describe} has no database {db} ({text}): the URL's path is the database "
                "number, below the server's 'databases' setting (16 by default)"
            )
        if isinstance(error, redis.exceptions.ConnectionError) and "closed by server" in text:
            return BackendUnavailable(
                f"cannot reach {describe}: it closed the connection while it was being set up "
                f"({text}); is it a Redis server (not another service on that port), and does "
                "it take this client (TLS: rediss://)?"
            )
        for source, target in _CAUSES.items():
            if isinstance(error, source):
                return target(
                    f"cannot reach {describe} (is redis-server running there, and are the "
                    f"host, port, user and password right?): {type(error).__name__}: {text}"
                )
        return None

    return translated
