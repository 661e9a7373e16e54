"""``redlock://h1:6379,h2:6379,h3:6379/0``: Redlock over several independent Redis masters.

The algorithm as antirez describes it (and Kleppmann analyses it): send the take to every
master at once, with a per-request time bound small against the ttl; the lock is ours when a
majority said yes and time is left, the validity being ``ttl - elapsed - drift``. Otherwise
release on every master that may have said yes and retry after a jittered, capped delay.
Renew extends the key on every master and holds on a majority; release deletes on all. Every
time is read from the monotonic clock, and the validity starts before the first request of the
round was sent.

Redlock has no sound fencing token: the masters share no counter, so nothing orders two
acquisitions. ``capabilities.fencing`` is False, grants carry no token, and ``lease.token`` /
``asynclock.current_token()`` raise :class:`asynclock.UnsupportedFeature`. Use it for efficiency
locks (work done twice costs time, not correctness); its safety rests on bounded network
delays, process pauses and clock drift, which real systems do not guarantee.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Self, TypeVar

import anyio

from .._errors import BackendUnavailable, InvalidArgument, InvalidURL
from .._registry import redact
from .._validate import Options
from ..abc import Backend, Capabilities, Grant, LockRequest, Lost, Renewed, RenewOutcome, Unknown
from . import _redis_scripts as lua

__all__ = ("RedlockBackend", "RedlockGrant")

logger = logging.getLogger("asynclock")

T = TypeVar("T")

_EXAMPLE = "redlock://127.0.0.1:6379,127.0.0.1:6380,127.0.0.1:6381/0"
_DEFAULT_DRIFT = 0.01
#: Fixed part of the drift allowance (antirez: "plus 2 milliseconds").
_DRIFT_FLOOR = 0.002
_DEFAULT_MAX_RETRY_DELAY = 0.1
_FIRST_RETRY_DELAY = 0.002
#: Per-master request bound in a round, as a share of the ttl (and never above op_timeout).
_REQUEST_SHARE = 0.1
#: Least time the slower masters get once a round is decided, before they are given up on.
_GRACE = 0.01


@dataclass(eq=False, slots=True)
class RedlockGrant(Grant):
    """A Redlock grant: ``ttl`` is the validity (requested ttl less the drift allowance);
    ``ttl_ms`` the expiry set on each master."""

    ttl_ms: int = 0


@dataclass(slots=True)
class _Master:
    address: lua.Address
    lane: lua.Lane


class _Failed:
    """A master that did not answer (or answered with an error) in time."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __repr__(self) -> str:
        return f"<failed: {self.error!r}>"


class RedlockBackend(Backend[RedlockGrant]):
    """Redlock across independent Redis masters: efficiency locks that survive a minority of
    masters being down, paused or partitioned away."""

    schemes = ("redlock",)
    driver = "redis-py"
    capabilities = Capabilities(
        fencing=False, fifo=False, loss_detection=True, quorum=True, cross_process=True
    )

    def __init__(
        self,
        addresses: Sequence[lua.Address],
        settings: lua.Settings,
        *,
        drift: float = _DEFAULT_DRIFT,
        max_retry_delay: float = _DEFAULT_MAX_RETRY_DELAY,
    ) -> None:
        if not addresses:
            raise InvalidArgument("Redlock needs at least one master")
        self.addresses = tuple(addresses)
        self.settings = settings
        self.drift = drift
        self.max_retry_delay = max_retry_delay
        self.quorum = len(self.addresses) // 2 + 1
        self._masters: list[_Master] = []
        self._closed = False

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_url(cls, url: str, options: Mapping[str, object]) -> Self:
        shown = redact(url)
        scheme, sep, rest = url.partition("://")
        if not sep or scheme.lower() != "redlock":
            raise InvalidURL(f"{shown!r} is not a redlock:// URL; e.g. {_EXAMPLE}")
        if "#" in rest:
            raise InvalidURL(f"{shown!r}: a Redlock URL has no #fragment; e.g. {_EXAMPLE}")
        netloc, slash, path = rest.partition("/")
        username, password, hosts = lua.split_userinfo(netloc)
        if not hosts:
            raise InvalidURL(f"{shown!r} names no masters; e.g. {_EXAMPLE}")
        addresses = [lua.parse_address(host, shown, _EXAMPLE) for host in hosts.split(",")]
        if len(set(addresses)) != len(addresses):
            raise InvalidURL(
                f"{shown!r} names a master twice; Redlock needs independent masters, e.g. "
                f"{_EXAMPLE}"
            )
        db = lua.parse_db(slash + path, shown, _EXAMPLE)
        opts = Options(options, "redlock://")
        tls = opts.flag("tls", False)
        settings = lua.common_settings(
            opts, source="redlock://", db=db, username=username, password=password, tls=tls
        )
        drift = opts.number("drift", _DEFAULT_DRIFT)
        if drift >= 0.5:
            raise InvalidArgument(
                f"option 'drift' of redlock:// is a share of the ttl below 0.5, got {drift!r}"
            )
        max_retry_delay = opts.number("max_retry_delay", _DEFAULT_MAX_RETRY_DELAY, minimum=0.001)
        opts.finish((*lua.COMMON_OPTIONS, "tls", "drift", "max_retry_delay"))
        return cls(addresses, settings, drift=drift, max_retry_delay=max_retry_delay)

    def describe(self) -> str:
        user = f"{self.settings.username}@" if self.settings.username else ""
        hosts = ",".join(str(address) for address in self.addresses)
        return f"redlock://{user}{hosts}/{self.settings.db}"

    def extra_info(self) -> Mapping[str, Any]:
        return {
            "masters": len(self.addresses),
            "quorum": self.quorum,
            "prefix": self.settings.prefix,
            "drift": self.drift,
        }

    def lock_key(self, name: str) -> str:
        return lua.lock_key(self.settings.prefix, name)

    # -- life cycle --------------------------------------------------------------------------

    async def open(self) -> None:
        if self._masters or self._closed:
            raise RuntimeError("a RedlockBackend can be opened once")
        for address in self.addresses:
            lane = lua.Lane(self.settings.pool(address), self.settings.op_timeout)
            self._masters.append(_Master(address, lane))
        try:
            await self._check_masters()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.aclose()
            raise

    async def _check_masters(self) -> None:
        async def check(master: _Master) -> bool:
            await master.lane.call("PING")
            for script in (lua.REDLOCK_TAKE, lua.RENEW, lua.COMPARE_AND_DELETE):
                await master.lane.call("SCRIPT", "LOAD", script.text)
            return True

        results = await self._on_all(check, self.settings.op_timeout, lambda _: False)
        down = [
            f"{master.address} ({_reason(result)})"
            for master, result in zip(self._masters, results, strict=True)
            if isinstance(result, _Failed)
        ]
        if len(self._masters) - len(down) < self.quorum:
            raise BackendUnavailable(
                f"cannot reach a majority of {self.describe()}: {len(down)} of "
                f"{len(self._masters)} masters did not answer ({'; '.join(down)}); check "
                "that redis-server runs on each and that the hosts, ports and password are "
                "right"
            )
        if down:
            logger.warning(
                "asynclock: %s: %d of %d masters did not answer (%s); locking goes on with "
                "the majority",
                self.describe(),
                len(down),
                len(self._masters),
                "; ".join(down),
            )

    async def aclose(self) -> None:
        self._closed = True
        masters, self._masters = self._masters, []
        with anyio.CancelScope(shield=True), anyio.move_on_after(self.settings.op_timeout):
            for master in masters:
                await master.lane.aclose()

    # -- running one call on every master ----------------------------------------------------

    async def _on_all(
        self,
        call: Callable[[_Master], Awaitable[T]],
        timeout: float,
        decided: Callable[[list[T | _Failed | None]], bool],
    ) -> list[T | _Failed]:
        """Run ``call`` on every master at once, each bounded by ``timeout``.

        Once ``decided(results so far)`` is true (``None`` marks a master still out), the others
        get a short grace (twice as long as the decision took, at least 10 ms), then the calls
        still out are cancelled and count as failed. The grace matters: a cancelled call costs
        its connection (redis-py drops it), and on a healthy set of masters the last answer
        comes a few microseconds after the deciding one.
        """
        if not self._masters:
            raise BackendUnavailable(f"{self.describe()} is closed (or was never opened)")
        results: list[T | _Failed | None] = [None] * len(self._masters)
        started = anyio.current_time()
        settled = False

        async def one(index: int, master: _Master, scope: anyio.CancelScope) -> None:
            nonlocal settled
            try:
                with anyio.fail_after(timeout):
                    results[index] = await call(master)
            except Exception as exc:
                results[index] = _Failed(exc)
            if not settled and decided(results):
                settled = True
                now = anyio.current_time()
                scope.deadline = min(scope.deadline, now + max(_GRACE, 2 * (now - started)))

        async with anyio.create_task_group() as group:
            for index, master in enumerate(self._masters):
                group.start_soon(one, index, master, group.cancel_scope)
        return [
            _Failed(TimeoutError("no answer before the round was decided"))
            if result is None
            else result
            for result in results
        ]

    def _request_timeout(self, ttl: float) -> float:
        return min(self.settings.op_timeout, max(0.005, ttl * _REQUEST_SHARE))

    def _drift_allowance(self, ttl: float) -> float:
        return ttl * self.drift + _DRIFT_FLOOR

    # -- the contract ------------------------------------------------------------------------

    def check_ttl(self, ttl: float) -> None:
        lua.check_ttl_ms(ttl, "redlock://", minimum_ms=10)
        if self._drift_allowance(ttl) >= ttl / 2:
            raise InvalidArgument(
                f"a {ttl:g} s ttl leaves no validity after Redlock's drift allowance "
                f"({self._drift_allowance(ttl) * 1000:.1f} ms); use a longer ttl"
            )

    async def _round(self, request: LockRequest) -> tuple[RedlockGrant | None, int, int]:
        """One Redlock round: (grant or None, masters that answered, largest holder pttl)."""
        key = self.lock_key(request.name)
        ms = lua.ttl_ms(request.ttl)
        ttl = ms / 1000
        count = len(self._masters)

        def decided(results: list[list[int] | _Failed | None]) -> bool:
            yes = sum(1 for r in results if isinstance(r, list) and r[0] == 1)
            no = sum(1 for r in results if r is not None and not (isinstance(r, list) and r[0]))
            return yes >= self.quorum or count - no < self.quorum

        async def take(master: _Master) -> list[int]:
            reply = await master.lane.script(lua.REDLOCK_TAKE, [key], [request.owner, ms])
            return lua.codes(reply, 2)

        sent_at = anyio.current_time()
        try:
            results = await self._on_all(take, self._request_timeout(ttl), decided)
        except BaseException:
            await self._release_all(request.name, request.owner, ttl)
            raise
        validity = ttl - (anyio.current_time() - sent_at) - self._drift_allowance(ttl)
        yes = sum(1 for r in results if isinstance(r, list) and r[0] == 1)
        if yes >= self.quorum and validity > 0:
            return (
                RedlockGrant(
                    request.name,
                    request.owner,
                    None,
                    sent_at,
                    ttl - self._drift_allowance(ttl),
                    ttl_ms=ms,
                ),
                count,
                0,
            )
        if yes or any(isinstance(r, _Failed) for r in results):
            # Any master that said yes, or might have (no answer), may hold our key.
            await self._release_all(request.name, request.owner, ttl)
        answered = sum(1 for r in results if isinstance(r, list))
        pttl = max((r[1] for r in results if isinstance(r, list) and not r[0]), default=0)
        return None, answered, pttl

    async def try_acquire(self, request: LockRequest) -> RedlockGrant | None:
        grant, answered, _ = await self._round(request)
        if grant is None and answered < self.quorum:
            raise BackendUnavailable(
                f"only {answered} of {len(self._masters)} masters of {self.describe()} "
                f"answered; Redlock needs {self.quorum} to decide whether {request.name!r} is "
                "free"
            )
        return grant

    async def acquire(self, request: LockRequest) -> RedlockGrant:
        delay = _FIRST_RETRY_DELAY
        warned = False
        while True:
            grant, answered, pttl = await self._round(request)
            if grant is not None:
                return grant
            if answered < self.quorum and not warned:
                warned = True
                logger.warning(
                    "asynclock: only %d of %d masters of %s answer; acquiring %r keeps "
                    "retrying until a majority is back or the caller's timeout",
                    answered,
                    len(self._masters),
                    self.describe(),
                    request.name,
                )
            wait = lua.jittered(delay)
            if 0 < pttl / 1000 < wait:
                wait = pttl / 1000 + random.uniform(0.0005, 0.002)
            await anyio.sleep(wait)
            delay = min(delay * 2, self.max_retry_delay)

    async def renew(self, grants: Sequence[RedlockGrant]) -> Sequence[RenewOutcome]:
        if not grants:
            return []
        keys = [self.lock_key(grant.name) for grant in grants]
        args: list[str | int] = [grant.owner for grant in grants]
        args += [grant.ttl_ms for grant in grants]
        count = len(self._masters)

        def decided(results: list[list[int] | _Failed | None]) -> bool:
            for index in range(len(grants)):
                ok = sum(1 for r in results if isinstance(r, list) and r[index] == 1)
                no = sum(1 for r in results if isinstance(r, list) and r[index] != 1)
                if ok < self.quorum and count - no >= self.quorum:
                    return False
            return True

        async def renew(master: _Master) -> list[int]:
            return lua.codes(await master.lane.script(lua.RENEW, keys, args), len(grants))

        sent_at = anyio.current_time()
        shortest = min(grant.ttl_ms for grant in grants) / 1000
        results = await self._on_all(renew, self._request_timeout(shortest), decided)
        elapsed = anyio.current_time() - sent_at
        failures = [r for r in results if isinstance(r, _Failed)]
        outcomes: list[RenewOutcome] = []
        for index, grant in enumerate(grants):
            ttl = grant.ttl_ms / 1000
            ok = sum(1 for r in results if isinstance(r, list) and r[index] == 1)
            no = sum(1 for r in results if isinstance(r, list) and r[index] != 1)
            if ok >= self.quorum and ttl - elapsed - self._drift_allowance(ttl) > 0:
                outcomes.append(Renewed(sent_at, ttl - self._drift_allowance(ttl)))
            elif count - no < self.quorum:
                outcomes.append(
                    Lost(
                        f"{no} of {count} masters of {self.describe()} no longer hold lock "
                        f"{grant.name!r}, so no majority can"
                    )
                )
            else:
                error = failures[0].error if failures else TimeoutError("renewal took too long")
                outcomes.append(
                    Unknown(
                        BackendUnavailable(
                            f"only {ok} of {count} masters of {self.describe()} renewed lock "
                            f"{grant.name!r} in time (first error: {error!r})"
                        )
                    )
                )
        return outcomes

    async def release(self, grant: RedlockGrant) -> None:
        answered = await self._release_all(grant.name, grant.owner, grant.ttl_ms / 1000)
        if answered < self.quorum:
            raise BackendUnavailable(
                f"releasing {grant.name!r}: only {answered} of {len(self.addresses)} masters of "
                f"{self.describe()} answered; the others free it when its ttl runs out"
            )

    async def _release_all(self, name: str, owner: str, ttl: float) -> int:
        """Delete our key on every master; return how many answered. Shielded and never raises:
        a master that does not answer within the request bound keeps the key until its ttl
        runs out."""
        key = self.lock_key(name)

        async def release(master: _Master) -> int:
            return int(await master.lane.script(lua.COMPARE_AND_DELETE, [key], [owner]))

        with anyio.CancelScope(shield=True):
            try:
                # Wait for every master (each call bounded): a release decided at a quorum
                # would leave the key on the slowest master until its ttl runs out.
                results = await self._on_all(
                    release,
                    max(self._request_timeout(ttl), 0.05),
                    lambda results: all(r is not None for r in results),
                )
            except Exception as exc:  # closed backend: nothing left to release on
                logger.debug("asynclock: release of %r skipped: %r", name, exc)
                return 0
        return sum(1 for r in results if not isinstance(r, _Failed))


def _reason(result: object) -> str:
    if isinstance(result, _Failed):
        error = result.error
        text = str(error) or type(error).__name__
        return text if len(text) < 120 else text[:117] + "..."
    return "ok"
