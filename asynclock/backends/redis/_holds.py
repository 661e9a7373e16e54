"""What ``redis://`` needs to know about the kinds of holds beyond the scripts: a request's
mode, what ``inspect()`` makes of INSPECT's reply, and what a renewal's code means."""

from __future__ import annotations

import asyncio
from abc import abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from .._kit import (
    Backend,
    Grant,
    HolderInfo,
    Kind,
    LockInfo,
    LockRequest,
    Lost,
    Renewed,
    RenewOutcome,
    now,
)
from . import _fair
from . import _scripts as lua
from ._scripts import as_text
from ._urls import Settings
from ._wakes import WakeChannel


def mode_of(request: LockRequest) -> str:
    """The scripts' mode (see :mod:`._fair`): ``x`` exclusive, ``s`` shared, ``p`` a permit
    (a semaphore's, or an election's: a semaphore of one, whose hold keeps the value)."""
    if request.kind == "lock":
        return "s" if request.shared else "x"
    return "p"


def permits_of(request: LockRequest) -> int:
    return request.permits if request.kind == "semaphore" else 1


def value_of(request: LockRequest) -> bytes:
    return request.value if request.kind == "election" else b""


def line_of(kind: Kind, name: str) -> str:
    """The wake channel's name for the queue of ``name`` of ``kind`` (kinds are namespaces)."""
    return f"{kind} {name}"


def _seconds(ms: int) -> float | None:
    return ms / 1000 if ms >= 0 else None


def info_from(name: str, kind: Kind, reply: Any) -> LockInfo:
    """``inspect()``'s answer from INSPECT's reply (see :data:`._fair.INSPECT`)."""
    holder, ms_left, counter, waiters, members, server_ms = reply
    now = int(server_ms)
    holds: list[HolderInfo] = []
    permits: int | None = None
    if holder:
        # Nobody takes while an exclusive holder holds: the counter is its token.
        token = int(counter) if counter is not None else None
        holds.append(HolderInfo(as_text(holder), token, _seconds(int(ms_left))))
    for member, score in zip(members[::2], members[1::2], strict=True):
        if member.startswith(b"#"):
            permits = int(member[1:])
            continue
        token_text, owner, value = member.split(b" ", 2)
        holds.append(
            HolderInfo(
                as_text(owner),
                int(token_text),
                (int(float(score)) - now) / 1000,
                shared=kind == "lock",
                value=value if kind == "election" else None,
            )
        )
    return LockInfo.of(name, kind, holds, waiters=int(waiters), permits=permits)


def differs(now: LockInfo, seen: LockInfo) -> bool:
    """Whether the holds of ``now`` are not those of ``seen`` (who, with which token, value)."""

    def key(info: LockInfo) -> tuple[Any, ...]:
        return (info.held, info.owner, info.token, info.value)

    return key(now) != key(seen)


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
    #: The scripts' mode (see :mod:`._fair`), permits and value of the request.
    mode: str = "x"
    permits: int = 1
    value: bytes = b""

    @property
    def renew_id(self) -> str | bytes:
        """What RENEW and RELEASE present: the owner id, or the hold's member."""
        if self.mode == "x":
            return self.owner
        return lua.hold_member(self.token or 0, self.owner, self.value)


class HoldingBackend(Backend[RedisGrant]):
    """What :class:`~.backend.RedisBackend` does with the holds it has, of every kind: renew,
    extend, release, inspect, wait for a change, and check them after a restart. (Taking and
    waiting, with their clean-up, are the backend's own.)"""

    settings: Settings
    _wakes: WakeChannel | None
    #: Leases granted and not released, by owner id: told at once when a restart lost them.
    _held: dict[str, tuple[RedisGrant, Callable[[str], None]]]

    _wake_prefix: str
    _client_id: str

    @abstractmethod
    async def _script(
        self, script: lua.Script, keys: Sequence[str], args: Sequence[lua.Arg], what: str
    ) -> Any:
        """Run ``script`` on the server, its errors translated (``what`` names the call)."""

    def _keys(self, name: str, kind: Kind = "lock") -> list[str]:
        return lua.fair_keys(self.settings.prefix, name, kind)

    def _renew_key(self, grant: RedisGrant) -> str:
        if grant.mode == "x":
            return lua.lock_key(self.settings.prefix, grant.name)
        return lua.holds_key(self.settings.prefix, grant.name, grant.kind)

    async def inspect(self, name: str, kind: Kind = "lock") -> LockInfo:
        reply = await self._script(
            _fair.INSPECT, self._keys(name, kind), [], f"inspecting {kind} {name!r}"
        )
        return info_from(name, kind, reply)

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
        self.check_ttl(ttl)
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

    async def wait_for_change(self, name: str, kind: Kind, seen: LockInfo, timeout: float) -> None:
        wakes = self._wakes
        if kind != "election" or wakes is None:
            await super().wait_for_change(name, kind, seen, timeout)
            return
        # An expiry runs no script and tells nobody: look again when the leader's would come.
        if seen.held and seen.expires_in is not None:
            timeout = min(timeout, seen.expires_in + 0.005)
        channel = lua.change_channel(self.settings.prefix, name, kind)
        with anyio.move_on_after(timeout), wakes.watch(channel) as watch:
            if not await watch.ready():
                # No subscribed connection now: poll.
                await anyio.sleep(min(timeout, self.poll_interval))
                return
            # Subscribed: whatever changes from now on is told; compare with what was seen.
            if differs(await self.inspect(name, kind), seen):
                return
            await watch.changed()

    async def _report_lost_after_restart(self) -> None:
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
                _fair.RELEASE,
                self._keys(grant.name, grant.kind),
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
            for heir, token, px in zip(reply[::3], reply[1::3], reply[2::3], strict=True):
                if self._wakes is not None and self._wakes.hand(
                    lua.as_text(heir), int(token), int(px), sent_at
                ):
                    handed = True
            if handed:
                await asyncio.sleep(0)
        elif reply == 0:
            self._poke(line)  # or a retry after a lost reply, which may have handed it

    def _poke(self, line: str) -> None:
        if self._wakes is not None:
            self._wakes.poke(line)
