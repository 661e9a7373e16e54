"""Where a guard's token comes from, and the lock rule (a guard of ``permits=1``)."""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass
class HighestToken:
    """The lock rule on one resource (pure), as :class:`PermitSlots` states the permit rule.

    ``strict``: every token is used for one access only (``>``); else the holder of the newest
    token may access as often as it likes (``>=``). The Redis script and the PostgreSQL upsert
    state the same rule in their store's language.
    """

    strict: bool
    highest: int | None = None

    @property
    def admitted(self) -> list[int]:
        return [] if self.highest is None else [self.highest]

    def admit(self, token: int) -> int | None:
        """Accept ``token``, or return the token it is refused in favour of (``None``: accepted)."""
        if self.highest is not None and (
            token <= self.highest if self.strict else token < self.highest
        ):
            return self.highest
        self.highest = token
        return None

    def leave(self, token: int) -> None:
        """Nothing to do, in every store. With one permit, leaving could only let in a token
        *older* than the leaver (the permit rule would: leave 5, then 3 is admitted), and that
        token's permit ended before 5's began, so refusing it is right. What ``leave`` is for,
        a long holder not evicted by short ones beside it, cannot arise with one permit. The
        leaver's own token stays accepted until a newer one arrives, as it always has."""
