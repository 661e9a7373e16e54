"""LockClient: locks on one backend: lock(), acquire(), try_acquire(), lock_all(), inspect()."""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Iterable
from typing import Self

from . import _validate
from ._acquiring import ClientCore, acquire_all, canonical
from ._errors import AcquireTimeout, InvalidArgument
from ._events import ConnectionState, StateChange
from ._lease import Lease, OnLost
from ._primitives import Election, Semaphore
from ._scope import AsyncOnly, LockContext, MultiLockContext
from .abc import Capabilities, Kind, LockInfo

logger = logging.getLogger("asynclock")


class LockClient(ClientCore, AsyncOnly):
    """Locks on one backend. Made by :func:`connect`; enter it (``async with``) or
    ``await client.start()`` it before use.

    Leaving the ``async with`` (or :meth:`aclose`) releases every lease still held and closes the
    backend, also when the block is cancelled.
    """

    _misuse = "a lock client is opened with `async with asynclock.connect(url) as locks:`"

    # -- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        # In a task of the client's own (start()), not in the caller's: a pytest-asyncio
        # fixture, or a framework's lifespan, enters in one task and exits in another, and a
        # task group entered in the first cannot be left from the second.
        await self._host.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        # The caller's exception is not ours to handle: closing is the same either way.
        await self._host.aclose()

    async def start(self) -> Self:
        """Open the client without ``async with``; close it with :meth:`aclose`, from any task.

        What ``async with`` does, for frameworks whose start-up and shutdown hooks are two
        calls (arq's ``on_startup``/``on_shutdown``, saq, taskiq). The client keeps a task of
        its own for its background work, which :meth:`aclose` stops and waits for. Raises as
        ``async with`` does when the backend cannot be reached.
        """
        await self._host.start()
        return self

    async def aclose(self) -> None:
        """Release every lease still held and close the backend. Idempotent, and it finishes
        (within ``release_timeout + connect_timeout``) whatever cancels the caller, anyio's or
        asyncio's native cancellation alike. After :meth:`start`, any task may call it."""
        await self._host.aclose()

    # -- locks -------------------------------------------------------------------------------

    @property
    def capabilities(self) -> Capabilities:
        """What the backend guarantees."""
        return self._backend.capabilities

    @property
    def state(self) -> ConnectionState:
        """How this client sees its server, from its own calls (see :class:`ConnectionState`)."""
        return self._state.state

    def state_changes(self) -> AsyncIterator[StateChange]:
        """``async for change in locks.state_changes():`` every change of :attr:`state` from
        now on; the iteration ends when the client closes."""
        return self._state.changes()

    @property
    def held(self) -> frozenset[Lease]:
        """Every lease this client holds now."""
        return self._supervisor.leases

    @property
    def renew_calls(self) -> int:
        """How many renewal round trips the client has made (batched over all held leases)."""
        return self._supervisor.renew_calls

    def lock(
        self,
        name: str,
        *,
        ttl: float = 30.0,
        timeout: float | None = None,
        on_lost: OnLost = "cancel",
        shared: bool = False,
    ) -> LockContext:
        """Hold the lock ``name`` for the body of an ``async with``; yields the :class:`Lease`.

        ``timeout=None`` waits forever, ``timeout=0`` tries once; past it,
        :class:`AcquireTimeout` is raised. The lease is renewed in the background. If it is lost,
        the body is cancelled (``on_lost="cancel"``, the default) and the ``async with`` raises
        :class:`LeaseLost`; with ``on_lost="flag"`` the body runs on, ``lease.lost`` becomes true
        and ``lease.wait_lost()`` returns.

        ``shared=True`` takes a shared (read) hold: held together with other shared holds of
        the name, never with an exclusive one. A waiting exclusive request blocks the shared
        requests that come after it, so a stream of readers cannot starve a writer. Every hold,
        shared or not, gets a token larger than all before it (``capabilities.shared_locks``).
        """
        self._check_on_lost(on_lost)
        name, ttl, timeout = self._check(name, ttl, timeout)
        if shared:
            self._check_shared()
            acquire = functools.partial(
                self._acquire, name, ttl, timeout, on_lost, track_context=False, shared=True
            )
        else:
            # A partial, not a closure: one coroutine fewer between the body and the backend.
            acquire = functools.partial(
                self._acquire, name, ttl, timeout, on_lost, track_context=False
            )
        return LockContext(acquire, on_lost, self._events, self._host.deadlines)

    def lock_all(
        self,
        names: Iterable[str],
        *,
        ttl: float = 30.0,
        timeout: float | None = None,
        on_lost: OnLost = "cancel",
    ) -> MultiLockContext:
        """Hold every lock in ``names`` for the body, all or nothing; yields a tuple of leases.

        The locks are taken in one canonical order (sorted by name, duplicates dropped), so two
        callers asking for ``{a, b}`` and ``{b, a}`` cannot deadlock each other. ``timeout``
        bounds the whole set. On timeout, cancellation or error, the locks already taken are
        released before the error propagates. The body is cancelled if any lease is lost, and
        ``current_token(name)`` gives each lock's token. The tuple is in canonical order.
        """
        self._check_on_lost(on_lost)
        unique = sorted({_validate.lock_name(name) for name in names}, key=canonical)
        if not unique:
            raise InvalidArgument("lock_all needs at least one lock name")
        _, ttl, timeout = self._check(unique[0], ttl, timeout)

        acquire = functools.partial(acquire_all, self._acquire, unique, ttl, timeout, on_lost)
        return MultiLockContext(acquire, on_lost, self._events, self._host.deadlines)

    async def acquire(
        self,
        name: str,
        *,
        ttl: float = 30.0,
        timeout: float | None = None,
        on_lost: OnLost = "flag",
        shared: bool = False,
    ) -> Lease:
        """Take the lock and return its :class:`Lease`; release it with ``await lease.release()``.

        There is no body to cancel here, so loss is only flagged (``lease.lost``,
        ``lease.wait_lost()``). ``current_token()`` sees the lease in this task until released.
        ``shared`` as for :meth:`lock`.
        """
        self._check_on_lost(on_lost)
        name, ttl, timeout = self._check(name, ttl, timeout)
        if shared:
            self._check_shared()
        return await self._acquire(
            name, ttl, timeout, on_lost, track_context=True, shared=bool(shared)
        )

    async def try_acquire(
        self, name: str, *, ttl: float = 30.0, shared: bool = False
    ) -> Lease | None:
        """Take the lock if it is free right now; ``None`` if someone else holds it (for a
        shared hold: if a writer holds it or waits for it)."""
        name, ttl, _ = self._check(name, ttl, 0)
        if shared:
            self._check_shared()
        try:
            return await self._acquire(
                name, ttl, 0, "flag", track_context=True, shared=bool(shared)
            )
        except AcquireTimeout:
            return None

    def semaphore(self, name: str, *, permits: int) -> Semaphore:
        """A semaphore of ``permits`` holds of ``name``, each its own lease (see
        :class:`Semaphore`). Semaphores are a namespace of their own: the lock ``"a"`` and the
        semaphore ``"a"`` are unrelated."""
        return Semaphore(self, name, permits)

    def election(self, name: str) -> Election:
        """The leader election ``name`` (see :class:`Election`), a namespace of its own."""
        return Election(self, name)

    async def inspect(self, name: str, kind: Kind = "lock") -> LockInfo:
        """What the server says about ``name`` now: held or not, by which lease, with which
        token, how long until it would expire, how many wait (``None`` where it cannot tell).
        ``holders`` lists every hold (readers, a semaphore's permits); ``kind`` picks the
        namespace (``"lock"``, ``"semaphore"``, ``"election"``).

        Redlock answers with what a majority of its masters say (no token, no waiters).
        """
        name = _validate.lock_name(name)
        if kind not in ("lock", "semaphore", "election"):
            raise InvalidArgument(f"kind must be 'lock', 'semaphore' or 'election', got {kind!r}")
        return await self._inspect(name, kind)

    def _check_shared(self) -> None:
        self._require("shared_locks", "shared (read) locks")
