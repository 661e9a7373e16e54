"""One retry policy for transient failures: capped exponential backoff with jitter.

Every loop in a backend that waits before trying again (a reconnect, a polled lock, a lost
watch, a deferred delete) takes its pauses from a :class:`Backoff`, so that the constants are
decided here, once, and a thundering herd of clients spreads out the same way on every store.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import anyio

__all__ = ("Backoff", "RetryPolicy")


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    #: The first pause, in seconds.
    first: float = 0.05
    #: The longest pause.
    cap: float = 1.0
    #: Each pause is this many times the one before.
    factor: float = 2.0
    #: Each pause is drawn from ``[pause * (1 - jitter), pause]``.
    jitter: float = 0.5

    def backoff(self, *, window: float | None = None) -> Backoff:
        return Backoff(self, window)


class Backoff:
    """The pauses of one retry loop; :meth:`pause` raises once ``window`` seconds of failures
    have passed (``None``: retry until cancelled)."""

    __slots__ = ("_next", "_policy", "_since", "window")

    def __init__(self, policy: RetryPolicy, window: float | None = None) -> None:
        self._policy = policy
        self.window = window
        self._since: float | None = None
        self._next = policy.first

    def reset(self) -> None:
        """A success: the next failure starts from the first pause again."""
        self._since = None
        self._next = self._policy.first

    def next_delay(self) -> float:
        """The next pause (and move on to the one after it)."""
        policy = self._policy
        delay = self._next * random.uniform(1.0 - policy.jitter, 1.0)
        self._next = min(self._next * policy.factor, policy.cap)
        return delay

    async def pause(self, error: BaseException | None = None) -> None:
        """Sleep before the next try; re-raise ``error`` when the window is spent."""
        now = anyio.current_time()
        if self._since is None:
            self._since = now
        elif self.window is not None and now - self._since >= self.window and error is not None:
            raise error
        await anyio.sleep(self.next_delay())
