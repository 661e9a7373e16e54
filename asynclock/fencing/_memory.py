"""An in-memory fenced store, for tests and for single-process resources."""

from __future__ import annotations

import contextlib
from typing import Any

import anyio.lowlevel

from .._errors import StaleToken
from ._permits import PermitSlots, checked_permits, holding
from ._token import HighestToken, resolve


class MemoryGuard:
    """Fences accesses to named resources held in this process.

    ``check`` records the token; ``read`` and ``write`` check it and touch the value in the same
    step (there is no await between the two), so a stale holder can neither write nor read a value
    that a newer holder may already have replaced.

    With ``permits=N`` (the semaphore's N) it admits the tokens of at most N holders at once and
    evicts the oldest for a newer one (:class:`PermitSlots`). Call :meth:`leave` when a holder is
    done (``async with guard.entered(...)`` does), so that its slot is free for the next one; a
    holder that never does (it crashed, or was paused past its ttl) is evicted when a newer token
    needs its slot. Fewer permits than the semaphore's refuses live holders, more lets stale ones
    in. ``strict=True`` (each token for one access only) needs ``permits=1``.
    """

    def __init__(self, *, permits: int = 1, strict: bool = False) -> None:
        self.permits = checked_permits(permits, strict=strict)
        self.strict = strict
        self._rules: dict[str, HighestToken | PermitSlots] = {}
        self._values: dict[str, Any] = {}
        #: Accesses refused, for tests and safety runs.
        self.rejected = 0

    def _rule(self, resource: str) -> HighestToken | PermitSlots:
        rule = self._rules.get(resource)
        if rule is None:
            rule = HighestToken(self.strict) if self.permits == 1 else PermitSlots(self.permits)
            self._rules[resource] = rule
        return rule

    def highest(self, resource: str) -> int | None:
        """The highest token this guard has accepted for ``resource``."""
        rule = self._rules.get(resource)
        return None if rule is None else rule.highest

    def admitted(self, resource: str) -> tuple[int, ...]:
        """The tokens whose accesses ``resource`` accepts now, oldest first."""
        rule = self._rules.get(resource)
        return () if rule is None else tuple(rule.admitted)

    async def check(
        self, resource: str, token: int | None = None, *, lock: str | None = None
    ) -> int:
        """Accept ``token`` (default: the current lock's) for ``resource`` or raise StaleToken."""
        await anyio.lowlevel.checkpoint()
        return self._check(resource, resolve(token, lock))

    def _check(self, resource: str, token: int) -> int:
        newer = self._rule(resource).admit(token)
        if newer is not None:
            self.rejected += 1
            raise StaleToken(resource, token, newer)
        return token

    async def leave(
        self, resource: str, token: int | None = None, *, lock: str | None = None
    ) -> None:
        """The holder of ``token`` is done with ``resource``: free its slot (idempotent; nothing
        to do with one permit)."""
        await anyio.lowlevel.checkpoint()
        self._leave(resource, resolve(token, lock))

    def _leave(self, resource: str, token: int) -> None:
        self._rule(resource).leave(token)

    def entered(
        self, resource: str, token: int | None = None, *, lock: str | None = None
    ) -> contextlib.AbstractAsyncContextManager[int]:
        """Admit the token for the block and leave on the way out (also when it fails)."""

        async def leave(token: int) -> None:
            self._leave(resource, token)  # no await: ends in finish()'s first step

        return holding(resource, lambda: self.check(resource, token, lock=lock), leave)

    async def write(
        self, resource: str, value: Any, *, token: int | None = None, lock: str | None = None
    ) -> None:
        await self.check(resource, token, lock=lock)  # and no await from here: one step
        self._values[resource] = value

    async def read(
        self,
        resource: str,
        default: Any = None,
        *,
        token: int | None = None,
        lock: str | None = None,
    ) -> Any:
        await self.check(resource, token, lock=lock)  # and no await from here: one step
        return self._values.get(resource, default)
