"""An in-memory fenced store, for tests and for single-process resources."""

from __future__ import annotations

from typing import Any

import anyio.lowlevel

from .._errors import StaleToken
from ._token import accepts, resolve


class MemoryGuard:
    """Fences accesses to named resources held in this process.

    ``check`` records the token; ``read`` and ``write`` check it and touch the value in the same
    step (there is no await between the two), so a stale holder can neither write nor read a value
    that a newer holder may already have replaced.
    """

    def __init__(self, *, strict: bool = False) -> None:
        self.strict = strict
        self._highest: dict[str, int] = {}
        self._values: dict[str, Any] = {}
        #: Accesses refused, for tests and safety runs.
        self.rejected = 0

    def highest(self, resource: str) -> int | None:
        """The highest token this guard has accepted for ``resource``."""
        return self._highest.get(resource)

    async def check(
        self, resource: str, token: int | None = None, *, lock: str | None = None
    ) -> int:
        """Accept ``token`` (default: the current lock's) for ``resource`` or raise StaleToken."""
        await anyio.lowlevel.checkpoint()
        return self._check(resource, resolve(token, lock))

    def _check(self, resource: str, token: int) -> int:
        highest = self._highest.get(resource)
        if not accepts(token, highest, strict=self.strict):
            self.rejected += 1
            assert highest is not None
            raise StaleToken(resource, token, highest)
        self._highest[resource] = token
        return token

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
