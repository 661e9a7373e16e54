"""Lease: one held lock, its fencing token, its local deadline and the lost/released states."""

from __future__ import annotations

import enum
import hashlib
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Literal, Protocol

import anyio

from ._clock import now
from ._errors import UnsupportedFeature
from ._events import LossKind
from ._renewal import RENEWAL
from .abc import Grant, Kind

logger = logging.getLogger("asynclock")

OnLost = Literal["cancel", "flag"]


class BodyScope(Protocol):
    """What a lease needs of the body it guards (``asynclock._scope.BodyScope``); a protocol,
    so that this module does not import the one above it."""

    def cancel(self) -> None:
        """Cancel the body."""


class _OwnerSecrets:
    """Random owner ids (128 bits each, as ``secrets.token_hex(16)``), cut from one read of the
    OS's random source per 256 ids: one ``os.urandom`` per acquire cost a tenth of an
    uncontended cycle on memory://. A forked child starts from a fresh read, so parent and child
    never hand out the same id."""

    __slots__ = ("_at", "_pool")

    _SIZE = 16
    _BATCH = 256

    def __init__(self) -> None:
        self._pool = b""
        self._at = 0

    def reset(self) -> None:
        self._pool = b""
        self._at = 0

    def next(self) -> str:
        at = self._at
        if at >= len(self._pool):
            self._pool = os.urandom(self._SIZE * self._BATCH)
            at = 0
        self._at = at + self._SIZE
        return self._pool[at : at + self._SIZE].hex()


_owner_secrets = _OwnerSecrets()
os.register_at_fork(after_in_child=_owner_secrets.reset)


def new_owner() -> str:
    """A fresh owner secret for one lease: what renew and release present to the server."""
    return _owner_secrets.next()


def public_owner(secret: str) -> str:
    """The id shown for an owner secret: a hash, from which the secret cannot be recovered.

    Release and renew compare the secret on the server; showing it (in ``inspect()``) would let
    any client free another client's lock.
    """
    return hashlib.blake2b(secret.encode(), digest_size=8, person=b"asynclock").hexdigest()


class LeaseState(enum.Enum):
    HELD = "held"
    LOST = "lost"
    RELEASED = "released"


class Lease:
    """A held lock. Made by ``LockClient.acquire`` / ``lock``; never constructed by users.

    The lease ends in one of two ways: released by its holder, or lost. It is lost when the
    backend proves it (the key is gone, the session expired) or when the local deadline passes
    without a successful renewal. The local deadline is always earlier than the earliest moment
    the server could expire the lock: it starts when the request was *sent*, shrinks the ttl by
    the clock drift allowance, and keeps a safety margin for cancelling the body.
    """

    __slots__ = (
        "_asked_ttl",
        "_deadline",
        "_drift",
        "_extender",
        "_fencing",
        "_grant",
        "_hold",
        "_idle",
        "_lost_event",
        "_lost_reason",
        "_margin",
        "_on_loss",
        "_releaser",
        "_scopes",
        "_state",
        "busy",
        "holder",
        "next_renewal",
        "on_lost",
    )

    def __init__(
        self,
        grant: Grant,
        *,
        on_lost: OnLost,
        drift: float,
        margin: float,
        fencing: bool,
        releaser: Callable[[Lease], Awaitable[None]],
        on_loss: Callable[[Lease, LossKind, str], None] | None = None,
        hold: tuple[Kind, bool, bytes] | None = None,
        extender: Callable[[Lease, float], Awaitable[None]] | None = None,
        asked_ttl: float | None = None,
    ) -> None:
        self._grant = grant
        #: The ttl asked for: a lock handed over may start with less of it (``grant.ttl``).
        self._asked_ttl = grant.ttl if asked_ttl is None else asked_ttl
        #: (kind, shared, value) of any hold but a plain exclusive lock. Not the request: its
        #: on_lost refers back to this lease, and that cycle left every lease to the garbage
        #: collector (3 us more per cycle on memory://).
        self._hold = hold
        self._extender = extender
        #: A renewal or an extend() of this lease is in flight: no other may start, since
        #: two in flight could reach the server in either order and leave it with the ttl of
        #: the one the local deadline did not follow.
        self.busy = False
        self._idle: anyio.Event | None = None  # made when an extend() waits for the renewal
        self._on_loss = on_loss
        self.on_lost: OnLost = on_lost
        self._drift = drift
        self._margin = margin
        self._fencing = fencing
        self._releaser = releaser
        self._state = LeaseState.HELD
        self._lost_reason: str | None = None
        self._lost_event: anyio.Event | None = None  # made when someone waits
        self._scopes: list[BodyScope] = []
        self._deadline = self._deadline_for(grant.valid_from, grant.ttl)
        self.next_renewal = RENEWAL.next_after(grant.valid_from, grant.ttl)
        #: (client, task id) of an exclusive or shared lock's holder, for the check that a task
        #: does not wait for a lock it holds itself (``LockClient``); None for other kinds.
        self.holder: tuple[object, int] | None = None

    # -- what users read ---------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The lock's name, as given to ``lock()`` / ``acquire()``."""
        return self._grant.name

    @property
    def token(self) -> int:
        """The fencing token of this acquisition: larger than every earlier token for this name.

        Raises :class:`asynclock.UnsupportedFeature` on backends that cannot issue sound tokens
        (Redlock): a token that is not strictly increasing would make a guard accept stale writes.
        """
        token = self._grant.token
        if not self._fencing or token is None:
            raise UnsupportedFeature(
                f"lock {self.name!r} has no fencing token: this backend cannot issue tokens that "
                "strictly increase (Redlock's independent masters have no shared counter). Use it "
                "for efficiency locks only, or choose etcd, ZooKeeper, PostgreSQL or Redis."
            )
        return token

    @property
    def kind(self) -> Kind:
        """What was taken: ``"lock"``, ``"semaphore"`` (a permit) or ``"election"`` (a term)."""
        return "lock" if self._hold is None else self._hold[0]

    @property
    def shared(self) -> bool:
        """A shared (read) hold: ``locks.lock(name, shared=True)``."""
        return self._hold is not None and self._hold[1]

    @property
    def value(self) -> bytes:
        """The value an election's candidate campaigned with (``b""`` for other kinds)."""
        return b"" if self._hold is None else self._hold[2]

    @property
    def ttl(self) -> float:
        """The lease length the server applies, in seconds (it may differ from the requested one)."""
        return self._grant.ttl

    @property
    def owner(self) -> str:
        """A public id of this lease: what ``inspect()`` and ``asynclock status`` show as the
        holder. The secret that renew and release present to the server is never shown."""
        return public_owner(self._grant.owner)

    @property
    def deadline(self) -> float:
        """The local deadline on the ``anyio.current_time()`` clock; moves with each renewal."""
        return self._deadline

    @property
    def remaining(self) -> float:
        """Seconds until the local deadline; 0 once the lease is lost or released."""
        if self._state is not LeaseState.HELD:
            return 0.0
        return max(0.0, self._deadline - now())

    @property
    def lost(self) -> bool:
        """True once the lease is lost (proven by the server, or its deadline passed).

        It stays true after ``release()``: the lease was lost while it was meant to be held.
        """
        self._check_deadline()
        return self._lost_reason is not None

    @property
    def lost_reason(self) -> str | None:
        """Why the lease was lost, or None while it is not."""
        self._check_deadline()
        return self._lost_reason

    @property
    def released(self) -> bool:
        """True once ``release()`` ran (or the client closed)."""
        return self._state is LeaseState.RELEASED

    async def wait_lost(self) -> str:
        """Wait until the lease is lost and return the reason.

        Never returns for a lease that is released first: use it inside a task group that the
        critical section cancels, or with a timeout.
        """
        while True:
            self._check_deadline()
            if self._lost_reason is not None:
                return self._lost_reason
            if self._state is LeaseState.RELEASED:
                await anyio.sleep_forever()
            # The deadline moves with every renewal, so sleep only up to the current one and
            # look again.
            if self._lost_event is None:
                self._lost_event = anyio.Event()
            with anyio.move_on_at(self._deadline):
                await self._lost_event.wait()

    async def release(self) -> None:
        """Release the lock. Idempotent, shielded from cancellation, never raises for I/O.

        It never frees a lock someone else holds now: the backend compares the owner id. If the
        server cannot be reached, the lock is freed by its ttl and a warning is logged.
        """
        if self._state is LeaseState.RELEASED:
            return
        await self._releaser(self)

    async def extend(self, ttl: float) -> None:
        """Renew the lease now, with a new ttl (longer or shorter), and move the local deadline
        by the same rule as a background renewal: from the moment the request was sent, less
        the drift allowance and the margin. Later renewals keep the new ttl.

        Raises :class:`asynclock.LeaseLost` if the lease is already lost (or the server says so
        now), :class:`asynclock.NotHeld` if it was released, :class:`asynclock.UnsupportedFeature` for another ttl on a backend
        that fixes it (``capabilities.ttl_change``: ZooKeeper's sessions, PostgreSQL's), and
        ``BackendUnavailable`` / ``BackendTimeout`` if the server did not answer, with the
        deadline as it was (or earlier, for a shorter ttl the server may have applied).
        """
        if self._extender is None:
            raise RuntimeError("this lease was not made by a lock client")
        await self._extender(self, ttl)

    def __repr__(self) -> str:
        token = self._grant.token if self._fencing else None
        kind = " shared" if self.shared else "" if self.kind == "lock" else f" {self.kind}"
        return (
            f"<Lease name={self.name!r}{kind} token={token} state={self._state.value} "
            f"remaining={self.remaining:.3f}>"
        )

    # -- what the core does ------------------------------------------------------------------

    @property
    def grant(self) -> Grant:
        return self._grant

    @property
    def held(self) -> bool:
        return self._state is LeaseState.HELD

    def _check_deadline(self) -> None:
        if self._state is LeaseState.HELD and now() >= self._deadline:
            ttl = f"ttl {self._asked_ttl:g} s"
            if self.ttl < self._asked_ttl:
                ttl += f", handed over with {self.ttl:g} s of it left"
            self._mark_lost(
                f"no successful renewal before the local deadline ({ttl}); the server may "
                "already have expired it",
                "deadline",
            )

    def _extend(self, valid_from: float, ttl: float) -> None:
        # A lost lease stays lost: a late renewal reply must not revive a body already cancelled.
        self._check_deadline()
        if self._state is not LeaseState.HELD:
            return
        self._grant.valid_from = valid_from
        self._grant.ttl = ttl
        # Replies can come back out of order; the deadline only ever moves forward.
        self._deadline = max(self._deadline, self._deadline_for(valid_from, ttl))
        self.next_renewal = RENEWAL.next_after(valid_from, ttl)

    def _set_ttl(self, valid_from: float, ttl: float, margin: float) -> None:
        """An ``extend()`` answered: the server keeps the lease ``ttl`` from ``valid_from``.
        Unlike a renewal, the deadline may move earlier (a shorter ttl)."""
        self._check_deadline()
        if self._state is not LeaseState.HELD:
            return
        self._grant.valid_from = valid_from
        self._grant.ttl = self._asked_ttl = ttl
        self._margin = margin
        self._deadline = self._deadline_for(valid_from, ttl)
        self.next_renewal = RENEWAL.next_after(valid_from, ttl)

    def _cap_deadline(self, valid_from: float, ttl: float, margin: float) -> None:
        """An unanswered ``extend()`` to a shorter ttl: the server may have applied it."""
        self._deadline = min(self._deadline, valid_from + ttl * (1.0 - self._drift) - margin)

    async def _wait_idle(self) -> None:
        while self.busy:
            if self._idle is None:
                self._idle = anyio.Event()
            await self._idle.wait()

    def _set_idle(self) -> None:
        self.busy = False
        if self._idle is not None:
            self._idle.set()
            self._idle = None

    def _deadline_for(self, valid_from: float, ttl: float) -> float:
        return valid_from + ttl * (1.0 - self._drift) - self._margin

    def _mark_lost(self, reason: str, kind: LossKind = "server") -> None:
        if self._state is not LeaseState.HELD:
            return
        self._state = LeaseState.LOST
        self._lost_reason = reason
        if self._lost_event is not None:
            self._lost_event.set()
        logger.warning("asynclock: lease on %r lost: %s", self.name, reason)
        if self._on_loss is not None:
            self._on_loss(self, kind, reason)
        for body in self._scopes:
            body.cancel()

    def _mark_released(self) -> None:
        self._state = LeaseState.RELEASED
        # Wake wait_lost() callers so they re-check; they keep waiting only on held leases.
        if self._lost_event is not None:
            self._lost_event.set()

    def _attach_scope(self, body: BodyScope) -> None:
        """Cancel ``body`` on loss (its deadline is watched by the client's ``Deadlines``)."""
        self._scopes.append(body)
        self._check_deadline()
        if self._state is LeaseState.LOST:
            body.cancel()

    def _detach_scope(self, body: BodyScope) -> None:
        self._scopes.remove(body)
