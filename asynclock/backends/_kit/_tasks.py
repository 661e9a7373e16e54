"""Background tasks of a backend, owned from ``open()`` to ``aclose()`` (structured concurrency).

The client runs a backend's ``open()`` and ``aclose()`` in one task of its own, at the same
nesting level, so a backend can enter a task group in one and leave it in the other. This is
that task group, with the two things every backend needs from it: start a task that lives until
the backend closes, and run a piece of work with a time bound after which it is abandoned.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import anyio
from anyio.abc import TaskGroup

from ..._errors import BackendUnavailable
from ..._shield import Deferred

__all__ = ("TaskHost",)

logger = logging.getLogger("asynclock")
T = TypeVar("T")


class TaskHost:
    """A backend's task group. ``await host.open()`` in ``Backend.open()``, ``await
    host.aclose()`` in ``Backend.aclose()`` (idempotent; it cancels what still runs).

    Call ``aclose()`` at the nesting level of ``open()``, never inside a cancel scope of your
    own (``with CancelScope(shield=True): await host.aclose()`` breaks the group's nesting and
    anyio raises): the client already runs ``Backend.aclose()`` where nothing cancels it."""

    def __init__(self, *, cleanup_timeout: float = 5.0) -> None:
        self._group: TaskGroup | None = None
        #: Deletes after a cancelled acquire that the server did not answer in time, retried
        #: here until it does (see :class:`asynclock._shield.Deferred`).
        self.deferred = Deferred(attempt_timeout=cleanup_timeout)
        self._cleanup_timeout = cleanup_timeout

    @property
    def running(self) -> bool:
        return self._group is not None

    async def open(self) -> None:
        if self._group is not None:
            return
        group = anyio.create_task_group()
        await group.__aenter__()
        self._group = group
        self.deferred.bind(group)

    def start_soon(
        self, func: Callable[..., Coroutine[Any, Any, Any]], *args: object, name: str
    ) -> None:
        """Run ``func(*args)`` until it returns or the backend closes. Refused with
        ``BackendUnavailable`` once the backend closes (or before it opened): the caller's
        operation fails as any other on a closed backend does."""
        if self._group is None:
            raise BackendUnavailable(f"the backend is closed: it starts no {name!r}")
        self._group.start_soon(func, *args, name=name)

    @staticmethod
    async def within(timeout: float, func: Callable[[], Awaitable[T]], what: str) -> T | None:
        """``await func()``, abandoned (cancelled) after ``timeout`` seconds: then None."""
        with anyio.move_on_after(timeout) as scope:
            return await func()
        if scope.cancelled_caught:
            logger.info("asynclock: %s did not finish within %g s; abandoned", what, timeout)
        return None

    async def aclose(self) -> None:
        group, self._group = self._group, None
        if group is None:
            return
        await self.deferred.aclose(self._cleanup_timeout)
        group.cancel_scope.cancel()
        # No shield around this: a scope entered here would break the nesting of the group
        # (entered in open()); the group's own cancel is all that runs inside it now.
        await group.__aexit__(None, None, None)
