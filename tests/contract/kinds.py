"""The lock contract run again through a semaphore of one permit and through an election.

A contract test that takes the ``kind`` fixture runs once per kind of hold the backend has
(``lock``, ``semaphore``, ``election``; see tests/contract/conftest.py) and takes its holds
through ``holds(locks, kind)``: the same calls, ``lock()``, ``acquire()``, ``try_acquire()``,
mapped onto ``locks.semaphore(name, permits=1)`` or ``locks.election(name)``. A permit and a
term are leases of the same core as a lock's, so what a lock must survive (cancellation at any
moment, a closing client, renewal) each of them must survive too: one test, every primitive,
as DistributedLock runs its mutex suite again on its semaphores.
"""

from __future__ import annotations

from typing import Literal, Protocol

import asynclock
from asynclock._scope import LockContext
from asynclock.abc import Kind

OnLost = Literal["cancel", "flag"]

#: Each kind of hold, and the capability a backend needs for it (None: every backend).
KINDS: dict[Kind, str | None] = {"lock": None, "semaphore": "semaphores", "election": "elections"}


class Holds(Protocol):
    """What a contract test asks of a kind of hold: the lock API, by name."""

    def lock(
        self, name: str, *, ttl: float, timeout: float | None = None, on_lost: OnLost = "cancel"
    ) -> LockContext: ...

    async def acquire(
        self, name: str, *, ttl: float, timeout: float | None = None, on_lost: OnLost = "flag"
    ) -> asynclock.Lease: ...

    async def try_acquire(self, name: str, *, ttl: float) -> asynclock.Lease | None: ...


class _Permits:
    """A semaphore of one permit per name."""

    def __init__(self, locks: asynclock.LockClient) -> None:
        self._locks = locks

    def lock(
        self, name: str, *, ttl: float, timeout: float | None = None, on_lost: OnLost = "cancel"
    ) -> LockContext:
        return self._locks.semaphore(name, permits=1).lock(
            ttl=ttl, timeout=timeout, on_lost=on_lost
        )

    async def acquire(
        self, name: str, *, ttl: float, timeout: float | None = None, on_lost: OnLost = "flag"
    ) -> asynclock.Lease:
        return await self._locks.semaphore(name, permits=1).acquire(
            ttl=ttl, timeout=timeout, on_lost=on_lost
        )

    async def try_acquire(self, name: str, *, ttl: float) -> asynclock.Lease | None:
        return await self._locks.semaphore(name, permits=1).try_acquire(ttl=ttl)


class _Terms:
    """An election per name; a term is the hold."""

    def __init__(self, locks: asynclock.LockClient) -> None:
        self._locks = locks

    def lock(
        self, name: str, *, ttl: float, timeout: float | None = None, on_lost: OnLost = "cancel"
    ) -> LockContext:
        return self._locks.election(name).campaign(ttl=ttl, timeout=timeout, on_lost=on_lost)

    async def acquire(
        self, name: str, *, ttl: float, timeout: float | None = None, on_lost: OnLost = "flag"
    ) -> asynclock.Lease:
        # Elections have only campaign()'s `async with`: a term without a body is taken the
        # way campaign() takes it (the client's own acquire, kind "election").
        self._locks.election(name)  # checks the capability, as campaign() does
        return await self._locks._acquire(
            name, ttl, timeout, on_lost, track_context=True, kind="election"
        )

    async def try_acquire(self, name: str, *, ttl: float) -> asynclock.Lease | None:
        try:
            return await self.acquire(name, ttl=ttl, timeout=0)
        except asynclock.AcquireTimeout:
            return None


def holds(locks: asynclock.LockClient, kind: Kind) -> Holds:
    """The holds of ``kind`` on ``locks``, through the lock API."""
    if kind == "semaphore":
        return _Permits(locks)
    if kind == "election":
        return _Terms(locks)
    return locks
