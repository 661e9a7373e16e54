"""Fencing for semaphores: at most ``permits`` holders' accesses accepted at a time, by token.

A semaphore's permits carry tokens from one counter per name, so a newer permit always has a
larger token. A guard cannot know which permits are still live (a paused holder's lease expired
on the server, but the guard never hears of it), so it keeps the rule a lock's guard keeps, widened
to N: it admits the tokens of at most ``permits`` holders at once, and when a token newer than all
of them arrives while every slot is taken, the *oldest* admitted token is evicted and refused from
then on. A stale holder whose permit went to someone else is therefore refused as soon as the
newer holders use the resource, exactly as a stale lock holder is.

A holder that tells the guard it is done (``leave``) frees its slot at once, so a long-running
holder is not evicted by short ones that came and went after it; a token that left is never
admitted again.

The invariant the safety runs check: a token admitted at two moments was admitted throughout
(an evicted or departed token never comes back), so at every moment at most ``permits`` tokens
can have accesses accepted around it.
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from .._errors import InvalidArgument
from .._shield import finish

#: Departed tokens remembered per resource (above ``floor``); past this, the oldest are folded
#: into ``floor``, which only ever refuses more: memory stays bounded at no cost to safety.
_REMEMBERED = 4096

#: How long the way out of a guard's ``entered`` waits for its ``leave``. Past it the slot stays
#: taken until a newer token evicts it, as a crashed holder's does: safe, only slower.
_LEAVE_TIMEOUT = 5.0


def checked_permits(permits: int, *, strict: bool) -> int:
    """``permits`` if a guard can keep it: a positive int, and 1 for a ``strict`` guard."""
    if isinstance(permits, bool) or not isinstance(permits, int) or permits < 1:
        raise InvalidArgument(f"permits must be a positive int, got {permits!r}")
    if strict and permits > 1:
        raise InvalidArgument(
            f"strict=True needs permits=1, got permits={permits}: the permit rule has no "
            "once-per-token form; drop strict=True for a semaphore's guard"
        )
    return permits


@dataclass
class PermitSlots:
    """The admission state of one resource (pure: no I/O, no clock), for guards on any store."""

    permits: int
    #: Admitted tokens, ascending; never more than ``permits``.
    admitted: list[int] = field(default_factory=list)
    #: Every token at or below it is refused, unless admitted now: the highest token evicted
    #: (or the newest of the oldest departed ones, once too many are remembered).
    floor: int | None = None
    #: Tokens above ``floor`` that left (never admitted again).
    departed: set[int] = field(default_factory=set)
    #: The highest token seen, for the message of a refusal.
    highest: int | None = None
    #: How many departed tokens to remember before folding the oldest into ``floor``.
    remembered: int = _REMEMBERED

    def admit(self, token: int) -> int | None:
        """Admit ``token``, or return the token it is refused in favour of (``None``: admitted)."""
        if token in self.admitted:
            return None
        newest = self.highest if self.highest is not None else token
        if token in self.departed or (self.floor is not None and token <= self.floor):
            return max(newest, token)
        if len(self.admitted) >= self.permits:
            if token < self.admitted[0]:
                return self.admitted[0]
            # Full, and newer than the oldest: that one's permit must have ended (the store
            # grants at most `permits` at once), so it is the one refused from now on.
            evicted = self.admitted.pop(0)
            self.floor = evicted if self.floor is None else max(self.floor, evicted)
            self._forget_below_floor()
        bisect.insort(self.admitted, token)
        self.highest = max(newest, token)
        return None

    def leave(self, token: int) -> None:
        """``token``'s holder is done: free its slot, and refuse the token from now on."""
        if token in self.admitted:
            self.admitted.remove(token)
        if self.floor is None or token > self.floor:
            self.departed.add(token)
            if len(self.departed) > self.remembered:
                self._fold()

    def _fold(self) -> None:
        # Raise the floor through the oldest departed tokens. An admitted token below the new
        # floor keeps its slot (admission is checked first): a long-running holder is not
        # evicted however many short ones came and went after it.
        oldest = sorted(self.departed)[max(1, self.remembered // 2) - 1]
        self.floor = oldest if self.floor is None else max(self.floor, oldest)
        self._forget_below_floor()

    def _forget_below_floor(self) -> None:
        floor = self.floor
        assert floor is not None
        self.departed = {token for token in self.departed if token > floor}


@contextlib.asynccontextmanager
async def holding(
    resource: str,
    check: Callable[[], Awaitable[int]],
    leave: Callable[[int], Awaitable[object]],
) -> AsyncIterator[int]:
    """A guard's ``entered``: ``check``, the block, then ``leave`` however the block ends.

    ``leave`` runs shielded (also from a native ``Task.cancel()``, which goes through an anyio
    shield) and time-bounded, so a cancelled block still frees its slot and a store that does
    not answer cannot hold the way out. It must be idempotent: :func:`finish` may run it twice.
    """
    token = await check()
    try:
        yield token
    finally:
        await finish(
            lambda: leave(token), timeout=_LEAVE_TIMEOUT, what=f"leaving the fence of {resource!r}"
        )
