"""Fencing for semaphores: at most ``permits`` holders' accesses accepted at a time, by token.

A semaphore's permits carry tokens from one counter per name, so a newer permit always has a
larger token. A guard cannot know which permits are still live (a paused holder's lease expired
on the server, but the guard never hears of it), so it keeps the rule a lock's guard keeps, widened
to N: it admits the tokens of at most ``permits`` holders at once, and when a token newer than all
of them arrives while every slot is taken, the *oldest* admitted token is evicted and refused from
then on. A stale holder whose permit went to someone else is therefore refused as soon as the
newer holders use the resource, exactly as a stale lock holder is.

A holder that tells the guard it is done (:meth:`MemorySemaphoreGuard.leave`) frees its slot at
once, so a long-running holder is not evicted by short ones that came and went after it; a
token that left is never admitted again.

The invariant the safety runs check: a token admitted at two moments was admitted throughout
(an evicted or departed token never comes back), so at every moment at most ``permits`` tokens
can have accesses accepted around it.
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio.lowlevel

from .._errors import InvalidArgument, StaleToken
from ._token import resolve

#: Departed tokens remembered per resource (above ``floor``); past this, the oldest are folded
#: into ``floor``, which only ever refuses more: memory stays bounded at no cost to safety.
_REMEMBERED = 4096


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


class MemorySemaphoreGuard:
    """Fences accesses to resources that a semaphore of ``permits`` protects, in this process.

    ``check``, ``read`` and ``write`` admit the token (default: the current lease's) or raise
    :class:`asynclock.StaleToken`, with no await between the check and the access. Call
    :meth:`leave` when a holder is done with the resource (``async with guard.entered(...)``
    does), so that its slot is free for the next one; a holder that never does (it crashed,
    or was paused past its ttl) is evicted when a newer token needs its slot.

    Use the same ``permits`` as the semaphore: fewer refuses live holders, more lets stale
    ones in.
    """

    def __init__(self, permits: int) -> None:
        if isinstance(permits, bool) or not isinstance(permits, int) or permits < 1:
            raise InvalidArgument(f"permits must be a positive int, got {permits!r}")
        self.permits = permits
        self._slots: dict[str, PermitSlots] = {}
        self._values: dict[str, Any] = {}
        #: Accesses refused, for tests and safety runs.
        self.rejected = 0

    def admitted(self, resource: str) -> tuple[int, ...]:
        """The tokens whose accesses ``resource`` accepts now, oldest first."""
        slots = self._slots.get(resource)
        return tuple(slots.admitted) if slots else ()

    async def check(
        self, resource: str, token: int | None = None, *, lock: str | None = None
    ) -> int:
        """Admit ``token`` (default: the current lease's) for ``resource`` or raise StaleToken."""
        await anyio.lowlevel.checkpoint()
        return self._check(resource, resolve(token, lock))

    def _check(self, resource: str, token: int) -> int:
        slots = self._slots.setdefault(resource, PermitSlots(self.permits))
        newer = slots.admit(token)
        if newer is not None:
            self.rejected += 1
            raise StaleToken(resource, token, newer)
        return token

    async def leave(
        self, resource: str, token: int | None = None, *, lock: str | None = None
    ) -> None:
        """The holder of ``token`` is done with ``resource``: free its slot (idempotent)."""
        await anyio.lowlevel.checkpoint()
        self._slots.setdefault(resource, PermitSlots(self.permits)).leave(resolve(token, lock))

    @contextlib.asynccontextmanager
    async def entered(
        self, resource: str, token: int | None = None, *, lock: str | None = None
    ) -> AsyncIterator[int]:
        """Admit the token for the block and leave on the way out (also when it fails)."""
        token = await self.check(resource, token, lock=lock)
        try:
            yield token
        finally:
            # No await: a cancelled block still frees its slot.
            self._slots[resource].leave(token)

    async def write(
        self, resource: str, value: Any, *, token: int | None = None, lock: str | None = None
    ) -> None:
        await anyio.lowlevel.checkpoint()
        self._check(resource, resolve(token, lock))
        self._values[resource] = value

    async def read(
        self,
        resource: str,
        default: Any = None,
        *,
        token: int | None = None,
        lock: str | None = None,
    ) -> Any:
        await anyio.lowlevel.checkpoint()
        self._check(resource, resolve(token, lock))
        return self._values.get(resource, default)
