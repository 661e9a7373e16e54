"""Semaphores and leader elections: leases of their own kinds, on the client's core.

Both are thin: a permit and a term are leases like a lock's (renewed by the client's renewal
loop, their body cancelled before the server can expire them, ``LeaseLost``, a fencing token in
contextvars), taken with ``LockRequest.kind`` set, in a namespace of their own on the server.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import AsyncIterator

from . import _validate
from ._acquiring import ClientCore
from ._errors import AcquireTimeout, BackendUnavailable, InvalidArgument
from ._lease import Lease, OnLost, public_owner
from ._scope import LockContext
from .abc import Kind, LockInfo

__all__ = ("Election", "Leader", "Semaphore")

#: The most permits a semaphore may have: every backend keeps one record per hold and per
#: waiter, and a larger number is almost always a unit mistake.
MAX_PERMITS = 10_000
#: The largest value a candidate may campaign with (ZooKeeper's and etcd's values are small).
MAX_VALUE_BYTES = 64 * 1024
#: How long observe() waits for a pushed change before it looks again anyway.
OBSERVE_RECHECK = 1.0


def _context(
    client: ClientCore,
    name: str,
    ttl: float,
    timeout: float | None,
    on_lost: OnLost,
    *,
    kind: Kind,
    permits: int = 1,
    value: bytes = b"",
) -> LockContext:
    """The ``async with`` of one hold of ``kind``, checked as ``locks.lock()`` checks its own."""
    client._check_on_lost(on_lost)
    _, ttl, timeout = client._check(name, ttl, timeout)
    acquire = functools.partial(
        client._acquire,
        name,
        ttl,
        timeout,
        on_lost,
        track_context=False,
        kind=kind,
        permits=permits,
        value=value,
    )
    return LockContext(acquire, on_lost, client._events, client._host.deadlines)


class Semaphore:
    """Up to ``permits`` holders of ``name`` at once, each holding its own lease.

    Made by ``locks.semaphore(name, permits=N)``. Each permit is renewed, lost and released on
    its own, so a crashed holder frees its permit after its ttl without touching anyone
    else's; waiters are served first come, first served where the backend can::

        sem = locks.semaphore("renderers", permits=3)
        async with sem.lock(ttl=10) as permit:
            await render(fence=permit.token)

    ``permits`` is part of the semaphore's state on the server while anyone holds or waits for
    it: a client asking with a different number gets :class:`InvalidArgument`.
    """

    __slots__ = ("_client", "name", "permits")

    def __init__(self, client: ClientCore, name: str, permits: int) -> None:
        self.name = _validate.lock_name(name)
        if isinstance(permits, bool) or not isinstance(permits, int):
            raise InvalidArgument(f"permits must be an int, not {type(permits).__name__}")
        if not 1 <= permits <= MAX_PERMITS:
            raise InvalidArgument(f"permits must be between 1 and {MAX_PERMITS}, got {permits}")
        client._require("semaphores", "semaphores")
        self._client = client
        self.permits = permits

    def lock(
        self, *, ttl: float = 30.0, timeout: float | None = None, on_lost: OnLost = "cancel"
    ) -> LockContext:
        """Hold a permit for the body of an ``async with``; yields its :class:`Lease`.

        ``timeout``, ``on_lost`` and loss as for ``locks.lock()``."""
        return _context(
            self._client, self.name, ttl, timeout, on_lost, kind="semaphore", permits=self.permits
        )

    async def acquire(
        self, *, ttl: float = 30.0, timeout: float | None = None, on_lost: OnLost = "flag"
    ) -> Lease:
        """Take a permit and return its lease; give it back with ``await lease.release()``."""
        client = self._client
        client._check_on_lost(on_lost)
        _, ttl, timeout = client._check(self.name, ttl, timeout)
        return await client._acquire(
            self.name,
            ttl,
            timeout,
            on_lost,
            track_context=True,
            kind="semaphore",
            permits=self.permits,
        )

    async def try_acquire(self, *, ttl: float = 30.0) -> Lease | None:
        """Take a permit if one is free right now (and nobody waits); ``None`` otherwise."""
        try:
            return await self.acquire(ttl=ttl, timeout=0)
        except AcquireTimeout:
            return None

    async def inspect(self) -> LockInfo:
        """The permits held now (``holders``), ``permits``, and how many wait."""
        return await self._client._inspect(self.name, "semaphore")

    def __repr__(self) -> str:
        return f"<Semaphore name={self.name!r} permits={self.permits}>"


@dataclasses.dataclass(frozen=True, slots=True)
class Leader:
    """Who leads an election: the value it campaigned with, its term's token, its public id."""

    value: bytes
    #: The term's fencing token (``None`` on a backend without sound tokens).
    token: int | None
    #: The leader lease's public id (``Lease.owner`` in the leader's process).
    owner: str | None


class Election:
    """A leader election: at most one leader at a time, each term with a rising token.

    Made by ``locks.election(name)``::

        election = locks.election("scheduler")
        async with election.campaign(value=b"host-a", ttl=10) as term:
            await lead(fence=term.token)        # cancelled with LeaseLost if the term ends

    ``campaign()`` waits until this candidate leads (candidates are served in the order they
    came, where the backend can), the body runs while it does, and leaving the ``async with``
    resigns. The term is a lease like a lock's. ``leader()`` says who leads now;
    ``observe()`` follows each change.
    """

    __slots__ = ("_client", "name")

    def __init__(self, client: ClientCore, name: str) -> None:
        self.name = _validate.lock_name(name)
        client._require("elections", "leader elections")
        self._client = client

    def campaign(
        self,
        value: bytes = b"",
        *,
        ttl: float = 30.0,
        timeout: float | None = None,
        on_lost: OnLost = "cancel",
    ) -> LockContext:
        """Wait to lead, then lead for the body of an ``async with``; yields the term's lease.

        ``value`` is what ``leader()`` and ``observe()`` show while this candidate leads (an
        address, a host name: at most 64 KiB). ``timeout`` bounds the wait, as for a lock.
        """
        if not isinstance(value, bytes):
            raise InvalidArgument(
                f"value must be bytes, not {type(value).__name__}: encode text first "
                "(value='host-a'.encode())"
            )
        if len(value) > MAX_VALUE_BYTES:
            raise InvalidArgument(
                f"value is {len(value)} bytes; the limit is {MAX_VALUE_BYTES}: campaign with "
                "a reference (an address, a key) rather than the data"
            )
        return _context(
            self._client, self.name, ttl, timeout, on_lost, kind="election", value=value
        )

    async def leader(self) -> Leader | None:
        """Who leads now, as the server says; ``None`` while nobody does."""
        self._client._check_open()
        return self._leader(await self._client._backend.inspect(self.name, "election"))

    async def observe(self) -> AsyncIterator[Leader | None]:
        """``async for leader in election.observe():`` the leader now (or ``None``), then
        each change, pushed where the backend can (etcd and ZooKeeper watches, Redis Pub/Sub,
        PostgreSQL's NOTIFY), polled elsewhere.

        Leaders come in term order: a term is never reported after a later one (tokens
        rise). A term shorter than one look at the server may be skipped. The iteration ends
        when the client closes; a server that cannot be reached raises as ``inspect()`` does
        (``BackendUnavailable``), and a new ``observe()`` starts again from the leader now.
        """
        client = self._client
        backend = client._backend
        last: Leader | None = None
        started = False
        highest = -math.inf
        try:
            while client._host.state == "open":
                info = await backend.inspect(self.name, "election")
                leader = self._leader(info)
                token = None if leader is None else leader.token
                stale = token is not None and token < highest  # a lagging replica's answer
                if not stale and (not started or leader != last):
                    started = True
                    last = leader
                    if token is not None:
                        highest = token
                    yield leader
                if client._host.state != "open":
                    return
                await backend.wait_for_change(self.name, "election", info, OBSERVE_RECHECK)
        except BackendUnavailable:
            # The client closed its connections under a look (a close does not wait for
            # them): the iteration ends, as it does when the close comes between two looks.
            if client._host.state == "open":
                raise

    def _leader(self, info: LockInfo) -> Leader | None:
        if not info.held:
            return None
        fencing = self._client._backend.capabilities.fencing
        return Leader(
            value=info.value if info.value is not None else b"",
            token=info.token if fencing else None,
            owner=None if info.owner is None else public_owner(info.owner),
        )

    def __repr__(self) -> str:
        return f"<Election name={self.name!r}>"
