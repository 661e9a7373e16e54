"""Where a guard's token comes from, and the one comparison every guard makes."""

from __future__ import annotations

from .._errors import InvalidArgument
from .._fencing import current_token

#: Tokens travel as signed 64-bit integers (a PostgreSQL bigint, an HTTP header a peer parses).
MAX_TOKEN = 2**63 - 1


def resolve(token: int | None, lock: str | None) -> int:
    """The explicit token, or the one of the lock held in this context (innermost or ``lock``)."""
    if token is None:
        token = current_token(lock)
    if isinstance(token, bool) or not isinstance(token, int):
        raise InvalidArgument(f"a fencing token is an int, not {type(token).__name__}")
    if not 0 <= token <= MAX_TOKEN:
        raise InvalidArgument(f"a fencing token is between 0 and 2**63-1, got {token}")
    return token


def accepts(token: int, highest: int | None, *, strict: bool) -> bool:
    """``strict``: every token is used for one access only (``>``); else the holder of the newest
    token may access as often as it likes (``>=``)."""
    if highest is None:
        return True
    return token > highest if strict else token >= highest
