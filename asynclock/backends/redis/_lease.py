"""A ``redis://`` lease: :class:`RedisGrant`, and the :class:`Leases` a client holds, which it
renews, extends, releases, and checks after the server restarted."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import anyio

from .._kit import Grant, Kind, LockRequest, Lost, Renewed, RenewOutcome, now
from . import _queue
from . import _scripts as lua
from ._urls import Settings
from ._wakes import WakeChannel, line_of


def mode_of(request: LockRequest) -> str:
    """The scripts' mode (see :mod:`._queue`): ``x`` exclusive, ``s`` shared, ``p`` a permit
    (a semaphore's, or an election's: a semaphore of one, whose hold keeps the value)."""
    if request.kind == "lock":
        return "s" if request.shared else "x"
    return "p"


def permits_of(request: LockRequest) -> int:
    return request.permits if request.kind == "semaphore" else 1


def value_of(request: LockRequest) -> bytes:
    return request.value if request.kind == "election" else b""


def outcome(name: str, code: int, sent_at: float, ttl: float, describe: str) -> RenewOutcome:
    """What RENEW's code for a hold of ``name`` means."""
    if code == 1:
        return Renewed(sent_at, ttl)
    if code == 0:
        return Lost(f"the hold of {name!r} is gone from {describe} (expired, deleted or evicted)")
    return Lost(f"lock {name!r} is held by another owner on {describe}")


@dataclass(eq=False, slots=True)
class RedisGrant(Grant):
    """A ``redis://`` lease. ``lease_ttl`` is the ttl asked for, which renewals apply: a lock
    handed over while its waiter was in line starts with what was left of the waiter's place
    when that is shorter (``ttl``), so that a waiter that died in line stalls nobody for long."""

    lease_ttl: float
    kind: Kind = "lock"
    #: The scripts' mode (see :mod:`._queue`), permits and value of the request.
    mode: str = "x"
    permits: int = 1
    value: bytes = b""

    @property
    def renew_id(self) -> str | bytes:
        """What RENEW and RELEASE present: the owner id, or the hold's member."""
        if self.mode == "x":
            return self.owner
        return lua.hold_member(self.token or 0, self.owner, self.value)


@dataclass(eq=False)
class Leases:
    """The leases a client was granted and has not released: renewed, extended and released
    here, and reported lost at once when a restart of the server lost them."""

    _script: lua.Run
    settings: Settings
    describe: Callable[[], str]
    #: The client's wake channel, once it has one (a release hands the lock to its waiters).
    _wakes: Callable[[], WakeChannel | None]
    _wake_prefix: str
    _client_id: str
    #: By owner id, with what to call when it is lost.
    _held: dict[str, tuple[RedisGrant, Callable[[str], None]]] = field(default_factory=dict)

    def grant(self, request: LockRequest, token: int, valid_from: float, ttl: float) -> RedisGrant:
        """The lease ``request`` was granted (its ``token``, valid ``ttl`` s from ``valid_from``),
        held from now on."""
        grant = RedisGrant(
            request.name,
            request.owner,
            token,
            valid_from,
            ttl,
            request.ttl,
            request.kind,
            mode_of(request),
            permits_of(request),
            value_of(request),
        )
        self._held[grant.owner] = (grant, request.on_lost)
        return grant

    async def lengthen(self, grant: RedisGrant) -> None:
        """Renew a lock handed over with a short rest of its waiter's place at once: the core
        keeps a safety margin (by default ``min(1 s, ttl / 10)`` of the ttl asked for) from a
        lease's first deadline, which a place shorter than that (a ``waiter_ttl`` under a
        second or so, with a longer ttl) would have passed already: lost when it was granted."""
        (result,) = await self.renew([grant])
        if isinstance(result, Renewed):
            grant.valid_from, grant.ttl = result.valid_from, result.ttl
        # Lost: the core's first renewal will say so.

    def clear(self) -> None:
        self._held.clear()

    def _renew_key(self, grant: RedisGrant) -> str:
        if grant.mode == "x":
            return lua.lock_key(self.settings.prefix, grant.name)
        return lua.holds_key(self.settings.prefix, grant.name, grant.kind)

    async def renew(self, grants: Sequence[RedisGrant]) -> Sequence[RenewOutcome]:
        if not grants:
            return []
        keys = [self._renew_key(grant) for grant in grants]
        args: list[lua.Arg] = [grant.renew_id for grant in grants]
        args += [lua.ttl_ms(grant.lease_ttl) for grant in grants]
        sent_at = anyio.current_time()
        reply = await self._script(lua.RENEW, keys, args, f"renewing {len(grants)} lock(s)")
        codes = lua.codes(reply, len(grants))
        return [
            outcome(grant.name, code, sent_at, grant.lease_ttl, self.describe())
            for grant, code in zip(grants, codes, strict=True)
        ]

    async def extend(self, grant: RedisGrant, ttl: float) -> RenewOutcome:
        # The new ttl applies to this one lease from now on: renewals send lease_ttl.
        sent_at = anyio.current_time()
        reply = await self._script(
            lua.RENEW,
            [self._renew_key(grant)],
            [grant.renew_id, lua.ttl_ms(ttl)],
            f"extending {grant.kind} {grant.name!r}",
        )
        (code,) = lua.codes(reply, 1)
        result = outcome(grant.name, code, sent_at, ttl, self.describe())
        if isinstance(result, Renewed):
            grant.lease_ttl = ttl
        return result

    async def report_lost_after_restart(self) -> None:
        """After a restart: every held lease whose key is gone (or another's) is lost, now."""
        held = list(self._held.values())
        if not held:
            return
        # RENEW with ttls of 0 only tells which holds are still ours.
        reply = await self._script(
            lua.RENEW,
            [self._renew_key(grant) for grant, _ in held],
            [*(grant.renew_id for grant, _ in held), *(0 for _ in held)],
            f"checking {len(held)} lock(s) after a restart",
        )
        for (grant, on_lost), code in zip(held, lua.codes(reply, len(held)), strict=True):
            if code == 1 or grant.owner not in self._held:
                continue  # kept (the server has persistence), or released meanwhile
            what = "is gone" if code == 0 else "is held by another owner"
            on_lost(
                f"{self.describe()} restarted and the key of {grant.kind} {grant.name!r} {what} "
                "(a restart without persistence forgets every lock)"
            )

    async def release(self, grant: RedisGrant) -> None:
        self._held.pop(grant.owner, None)
        sent_at = now()
        line = line_of(grant.kind, grant.name)
        args: list[lua.Arg] = [
            grant.owner,
            self._wake_prefix,
            0,
            0,
            self._client_id,
            grant.mode,
            grant.permits,
            grant.value,
            lua.change_channel(self.settings.prefix, grant.name, grant.kind)
            if grant.kind == "election"
            else "",
            grant.token or 0,
        ]
        try:
            reply = await self._script(
                _queue.RELEASE,
                lua.fair_keys(self.settings.prefix, grant.name, grant.kind),
                args,
                f"releasing {grant.kind} {grant.name!r}",
            )
        except BaseException:
            # The reply may have been the only word of a hand-over to a waiter of ours.
            self._poke(line)
            raise
        if isinstance(reply, list):
            # Handed to tasks of this client: they learn from this reply (no message), and
            # run before the releasing task goes on, as the next holders should.
            handed = False
            wakes = self._wakes()
            for heir, token, px in zip(reply[::3], reply[1::3], reply[2::3], strict=True):
                if wakes is not None and wakes.hand(
                    lua.as_text(heir), int(token), int(px), sent_at
                ):
                    handed = True
            if handed:
                await asyncio.sleep(0)
        elif reply == 0:
            self._poke(line)  # or a retry after a lost reply, which may have handed it

    def _poke(self, line: str) -> None:
        wakes = self._wakes()
        if wakes is not None:
            wakes.poke(line)
