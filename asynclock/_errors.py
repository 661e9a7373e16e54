"""One exception hierarchy for every backend (the kit's ``translate`` maps driver errors to it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


def _restore(cls: type[LockError], args: tuple[Any, ...]) -> LockError:
    """Unpickle an exception without calling its ``__init__`` (see ``LockError.__reduce__``)."""
    exc = cls.__new__(cls, *args)
    # OSError.__new__ leaves ``args`` to ``__init__`` in subclasses that define one
    # (AcquireTimeout is a TimeoutError).
    exc.args = args
    return exc


class LockError(Exception):
    """Base class of every error asynclock raises.

    Every one pickles (job queues store and return them, multiprocessing sends them back): the
    default pickling of an exception calls ``cls(*self.args)``, that is ``cls(message)``, which
    fails for those whose ``__init__`` takes other arguments (``LeaseLost(name, reason)``). Here
    the instance is re-created without ``__init__``, with the same ``args`` (so the same message)
    and the same attributes (``name``, ``reason``, ``timeout``, ``cycle``, notes, ...).
    """

    def __reduce__(self) -> tuple[Any, ...]:
        return _restore, (type(self), self.args), self.__dict__ or None


class LeaseLost(LockError):
    """The lease of a held lock ended before it was released.

    Raised by ``async with locks.lock(...)`` after its body was cancelled because the lease was
    lost (the server proved it, or the local deadline passed without a successful renewal).
    Anything the body did after ``lost_at`` may have overlapped with another holder: a resource
    that must stay correct checks the fencing token.
    """

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"lease on lock {name!r} was lost: {reason}")
        self.name = name
        self.reason = reason


class AcquireTimeout(LockError, TimeoutError):
    """The lock could not be taken within the requested ``timeout``."""

    def __init__(self, name: str, timeout: float) -> None:
        super().__init__(f"lock {name!r} was not acquired within {timeout:g} s")
        self.name = name
        self.timeout = timeout


class NotHeld(LockError, LookupError):
    """An operation needed a held lock and there is none (for example ``current_token()``)."""


class WrongEventLoop(LockError, RuntimeError):
    """A lock client was used from another event loop than the one it was opened on (a
    session-scoped client in a test whose loop is the function's, say): a programming error,
    not an outage. Open one client per event loop."""


class BackendUnavailable(LockError, ConnectionError):
    """The lock server could not be reached or did not answer in time."""


class BackendTimeout(BackendUnavailable, TimeoutError):
    """A call to the lock server did not complete within its time bound."""


class UnsupportedFeature(LockError):
    """The backend cannot provide what was asked of it (for example fencing tokens on Redlock)."""


class InvalidArgument(LockError, ValueError):
    """A lock name, ttl, timeout, option or URL is not acceptable; the message says which."""


class InvalidURL(InvalidArgument):
    """The connection URL is malformed or names an unknown backend."""


class MissingDependency(LockError, ImportError):
    """The driver a backend needs is not installed; the message names the extra to install."""


@dataclass(frozen=True)
class Waiter:
    """One task waiting for a lock, as deadlock detection sees it."""

    #: Who it is: ``label/host/pid/task name#task id``, readable in errors and logs.
    actor: str
    #: The locks it holds (in its context, inherited ones included).
    holds: tuple[str, ...]
    #: The lock it waits for.
    waits: str
    #: When it started waiting, on the wall clock of its host (for choosing the youngest).
    since: float


class DeadlockDetected(LockError):
    """Waiting for the lock would never end: the waiters form a cycle, and this one was chosen
    (the youngest in the cycle) to give up so that the others can go on.

    ``cycle`` lists the waiters in order; each waits for a lock the next one holds.
    """

    def __init__(self, name: str, cycle: Sequence[Waiter]) -> None:
        steps = "; ".join(
            f"{step.actor} holds {', '.join(map(repr, step.holds))} and waits for {step.waits!r}"
            for step in cycle
        )
        super().__init__(f"deadlock while waiting for {name!r}: {steps}")
        self.name = name
        self.cycle = tuple(cycle)


class StaleToken(LockError):
    """A fencing guard refused an access whose token is older than one it has already seen."""

    def __init__(self, resource: str, token: int, highest: int) -> None:
        super().__init__(
            f"fencing token {token} for {resource!r} is stale: the resource has already "
            f"seen token {highest}"
        )
        self.resource = resource
        self.token = token
        self.highest = highest


class RedisDurabilityWarning(UserWarning):
    """The Redis server may lose held locks (eviction, or no AOF).

    A restart without the append-only file forgets every held lock (their holders are told at
    once, but another client may take the lock first), and an eviction policy other than
    ``noeviction`` (with ``maxmemory`` set) may drop locks that are still held. Tokens stay safe
    either way: no token is below the server's clock in microseconds. Silence it with the option
    ``durability_warning=false`` once you have decided that this is acceptable.
    """
