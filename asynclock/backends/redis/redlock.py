"""``redlock://h1:6379,h2:6379,h3:6379/0``: Redlock over several independent Redis masters.

The algorithm as antirez describes it (and Kleppmann analyses it): send the take to every
master at once, with a per-request time bound small against the ttl; the lock is ours when a
majority said yes and time is left, the validity being ``ttl - elapsed - drift``. Otherwise
release on every master that may have said yes and retry after a jittered, capped delay.
Renew extends the key on every master and holds on a majority; release deletes on all. Every
time is read from the monotonic clock, and the validity starts before the first request of the
round was sent.

Many waiters, one client: the tasks of one client that wait for the same name queue locally
(first come, first served), and only the first of them runs rounds, with the backoff; a release
by this client wakes it at once. So 1,000 waiting tasks cost the masters what one waiter costs,
and they never split the masters' votes among themselves.

Connections: one per master, pipelined (see :mod:`._wire`), so the release that follows an
abandoned take reaches each master after that take and cannot overtake it.

Redlock has no sound fencing token: the masters share no counter, so nothing orders two
acquisitions. ``capabilities.fencing`` is False, grants carry no token, and ``lease.token`` /
``asynclock.current_token()`` raise :class:`asynclock.UnsupportedFeature`. Use it for efficiency
locks (work done twice costs time, not correctness); its safety rests on bounded network
delays, process pauses and clock drift, which real systems do not guarantee.
"""

from __future__ import annotations

import functools
import logging
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Self

import anyio

from .._kit import (
    Backend,
    BackendUnavailable,
    Capabilities,
    Grant,
    HostPort,
    InvalidArgument,
    InvalidURL,
    Kind,
    LockInfo,
    LockRequest,
    Options,
    Renewed,
    RenewOutcome,
    RetryPolicy,
    TaskHost,
    UnsupportedFeature,
    finish,
    parse_hosts,
    redact,
)
from . import _scripts as lua
from ._pipeline import Failed, Master, gather
from ._quorum import (
    EXAMPLE,
    MIN_MASTERS,
    PEEK,
    RenewVotes,
    Room,
    check_majority,
    check_master_count,
    majority_answered,
    majority_view,
    never,
    round_decided,
    said,
    still_queued,
)
from ._urls import COMMON_OPTIONS, DEFAULT_PORT, Settings, common_settings, split_url
from ._wire import finish_closing

__all__ = ("MIN_MASTERS", "RedlockBackend", "RedlockGrant")

logger = logging.getLogger("asynclock")

_DEFAULT_DRIFT = 0.01
#: Fixed part of the drift allowance (antirez: "plus 2 milliseconds").
_DRIFT_FLOOR = 0.002
_DEFAULT_MAX_RETRY_DELAY = 0.1
_FIRST_RETRY_DELAY = 0.002
#: Per-master request bound in a round, as a share of the ttl (and never above op_timeout).
_REQUEST_SHARE = 0.1
#: Least time a release waits for the masters' answers.
_MIN_RELEASE_WAIT = 0.05
#: How long a release waits for the slower masters once a majority answered.
_RELEASE_GRACE = 0.01
#: How long opening waits for the slower masters once a majority answered.
_OPEN_GRACE = 0.25
#: How long closing the client waits for requests still on their way (releases) to be answered.
_DRAIN_ON_CLOSE = 0.5


@dataclass(eq=False, slots=True)
class RedlockGrant(Grant):
    """A Redlock grant: ``ttl`` is the validity (requested ttl less the drift allowance);
    ``ttl_ms`` the expiry set on each master."""

    ttl_ms: int = 0


def _parse(
    url: str, options: Mapping[str, object]
) -> tuple[tuple[HostPort, ...], Settings, float, float]:
    """``from_url``'s work: the masters, the settings, the drift and the retry cap."""
    parts = split_url(url, schemes=("redlock",), example=EXAMPLE)
    if not parts.hosts:
        raise InvalidURL(f"{redact(url)!r} names no masters; e.g. {EXAMPLE}")
    addresses = tuple(parse_hosts(parts.hosts, default_port=DEFAULT_PORT, url=url, example=EXAMPLE))
    if len(set(addresses)) != len(addresses):
        raise InvalidURL(
            f"{redact(url)!r} names a master twice; Redlock needs independent masters, e.g. "
            f"{EXAMPLE}"
        )
    check_master_count(len(addresses), redact(url))
    opts = Options(options, "redlock://")
    tls = opts.flag("tls", False)
    settings = common_settings(opts, source="redlock://", url=parts, tls=tls)
    drift = opts.number("drift", _DEFAULT_DRIFT)
    if drift >= 0.5:
        raise InvalidArgument(
            f"option 'drift' of redlock:// is a share of the ttl below 0.5, got {drift!r}"
        )
    max_retry_delay = opts.number("max_retry_delay", _DEFAULT_MAX_RETRY_DELAY, minimum=0.001)
    opts.finish((*COMMON_OPTIONS, "tls", "drift", "max_retry_delay"))
    return addresses, settings, drift, max_retry_delay


# -- the backend ------------------------------------------------------------------------------


class RedlockBackend(Backend[RedlockGrant]):
    """Redlock across independent Redis masters: efficiency locks that survive a minority of
    masters being down, paused or partitioned away."""

    driver = "asyncio streams, plus redis-py"
    client_keywords = frozenset({"drift"})
    #: No shared holds, semaphores or elections: without a counter shared by the masters there
    #: is no token to order them, and a semaphore's permits would need a majority's agreement on
    #: a set, which independent masters cannot give atomically. ``extend`` applies a new ttl on
    #: a majority by the renewal's (and the take's) validity rule.
    capabilities = Capabilities.every(
        fencing=False, fifo=False, shared_locks=False, semaphores=False, elections=False
    )

    def __init__(
        self,
        addresses: Sequence[HostPort],
        settings: Settings,
        *,
        drift: float = _DEFAULT_DRIFT,
        max_retry_delay: float = _DEFAULT_MAX_RETRY_DELAY,
    ) -> None:
        check_master_count(len(addresses))
        self.addresses = tuple(addresses)
        self.settings = settings
        self.drift = drift
        self.max_retry_delay = max_retry_delay
        self.quorum = len(self.addresses) // 2 + 1
        self._majority: Callable[[list[Any]], bool] = functools.partial(
            majority_answered, quorum=self.quorum
        )
        self._masters: list[Master] = []
        #: The connections' tasks: connecting, reading replies, watching for a hung master.
        self._host = TaskHost(cleanup_timeout=settings.op_timeout)
        self._retry = RetryPolicy(first=_FIRST_RETRY_DELAY, cap=max_retry_delay, factor=2.0)
        self._rooms: dict[str, Room] = {}
        self._closed = False

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_url(cls, url: str, options: Mapping[str, object]) -> Self:
        addresses, settings, drift, max_retry_delay = _parse(url, options)
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
            "connections_per_master": [master.open_connections for master in self._masters],
        }

    def lock_key(self, name: str) -> str:
        return lua.lock_key(self.settings.prefix, name)

    # -- life cycle --------------------------------------------------------------------------

    async def open(self) -> None:
        if self._masters or self._closed:
            raise RuntimeError("a RedlockBackend can be opened once")
        await self._host.open()
        self._masters = [Master(address, self.settings, self._host) for address in self.addresses]
        try:
            # A hung minority does not hold up the start for op_timeout: a majority and a
            # moment for the others is enough (a connection being set up goes on in its task).
            await check_majority(
                self._masters, self.settings.op_timeout, self.quorum, self.describe(), _OPEN_GRACE
            )
        except BaseException:
            await self.aclose()
            raise

    async def aclose(self) -> None:
        if self._closed:
            return
        masters = self._masters
        # Releases just sent (by the client's close) get a moment to be answered.
        with anyio.CancelScope(shield=True), anyio.move_on_after(_DRAIN_ON_CLOSE):
            while any(master.busy for master in masters):  # noqa: ASYNC110
                await anyio.sleep(0.005)
        self._closed = True
        writers = [writer for master in masters if (writer := master.close()) is not None]
        # Not under a shield: the host's task group was entered in open(), at this level.
        await self._host.aclose()
        await finish_closing(writers, _DRAIN_ON_CLOSE)

    # -- rounds ------------------------------------------------------------------------------

    def _live_masters(self) -> list[Master]:
        if not self._masters or self._closed:
            raise BackendUnavailable(f"{self.describe()} is closed (or was never opened)")
        return self._masters

    def _request_timeout(self, ttl: float) -> float:
        return min(self.settings.op_timeout, max(0.005, ttl * _REQUEST_SHARE))

    def _drift_allowance(self, ttl: float) -> float:
        return ttl * self.drift + _DRIFT_FLOOR

    def check_ttl(self, ttl: float) -> None:
        lua.check_ttl_ms(ttl, "redlock://", minimum_ms=10)
        if self._drift_allowance(ttl) >= ttl / 2:
            raise InvalidArgument(
                f"a {ttl:g} s ttl leaves no validity after Redlock's drift allowance "
                f"({self._drift_allowance(ttl) * 1000:.1f} ms); use a longer ttl"
            )

    async def _round(self, request: LockRequest) -> tuple[RedlockGrant | None, int, int]:
        """One Redlock round: (grant or None, masters that answered, largest holder pttl)."""
        masters = self._live_masters()
        key = self.lock_key(request.name)
        ms = lua.ttl_ms(request.ttl)
        ttl = ms / 1000
        count = len(masters)
        decided = functools.partial(round_decided, count=count, quorum=self.quorum)
        sent_at = anyio.current_time()
        # Sent to every master before the first await: rounds of this client reach every
        # master in the same order, so they cannot split the votes among themselves.
        futures = [
            master.submit(("EVAL", lua.REDLOCK_TAKE.text, 1, key, request.owner, ms))
            for master in masters
        ]
        try:
            results = await gather(futures, self._request_timeout(ttl), decided)
        except BaseException:
            # Cancelled mid-round: any master may hold our key. The deletes are queued on each
            # connection behind the takes before the first await of the cleanup.
            await finish(
                functools.partial(self._release_on, masters, request.name, request.owner, ttl),
                timeout=self._release_wait(ttl) + 0.05,
                what=f"undoing a cancelled Redlock round for {request.name!r}",
                unfinished=functools.partial(still_queued, request.name),
            )
            raise
        yes = sum(1 for r in results if said(r) == 1)
        validity = ttl - (anyio.current_time() - sent_at) - self._drift_allowance(ttl)
        if yes >= self.quorum and validity > 0:
            grant = RedlockGrant(
                request.name,
                request.owner,
                None,
                sent_at,
                ttl - self._drift_allowance(ttl),
                ttl_ms=ms,
            )
            return grant, count, 0
        # Any master that said yes, or might have (no answer), may hold our key; one that
        # said no did not write it.
        # The deletes are waited for only where the take was answered: a master that did not
        # answer within the bound runs the delete right after the take whenever it does, and
        # waiting for it again would double the bound (try_acquire on hung masters).
        maybe = [m for m, r in zip(masters, results, strict=True) if said(r) != 0]
        answered_yes = [m for m, r in zip(masters, results, strict=True) if said(r) == 1]
        if maybe:
            await finish(
                functools.partial(
                    self._release_on,
                    maybe,
                    request.name,
                    request.owner,
                    ttl,
                    wait_for=answered_yes,
                ),
                timeout=self._release_wait(ttl) + 0.05,
                what=f"undoing a failed Redlock round for {request.name!r}",
                unfinished=functools.partial(still_queued, request.name),
            )
        answered = sum(1 for r in results if isinstance(r, list))
        pttl = max((r[1] for r in results if said(r) == 0), default=0)
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
        self._live_masters()
        room = self._rooms.get(request.name)
        if room is None:
            room = self._rooms[request.name] = Room()
        room.users += 1
        try:
            async with room.turn:
                # No await between the grant and the return: the turn passes on at once.
                return await self._contend(request, room)
        finally:
            room.users -= 1
            if room.users == 0 and self._rooms.get(request.name) is room:
                del self._rooms[request.name]

    async def _contend(self, request: LockRequest, room: Room) -> RedlockGrant:
        backoff = self._retry.backoff()
        warned = False
        while True:
            room.kick.clear()
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
            wait = backoff.next_delay()
            if 0 < pttl / 1000 < wait:
                wait = pttl / 1000 + random.uniform(0.0005, 0.002)
            with anyio.move_on_after(wait):
                await room.kick.wait()
            if room.kick.is_set():
                backoff.reset()

    async def renew(self, grants: Sequence[RedlockGrant]) -> Sequence[RenewOutcome]:
        return await self._renew([(grant, grant.ttl_ms) for grant in grants])

    async def extend(self, grant: RedlockGrant, ttl: float) -> RenewOutcome:
        """A renewal with another ttl, by the rule of every renewal: renewed on a majority,
        and ``ttl - elapsed - drift`` left, counted from before the first request was sent.
        Later renewals apply the new ttl once it held; after an outcome that proves nothing
        they keep the old one (the core caps the deadline by a shorter ttl that a master may
        have applied)."""
        self.check_ttl(ttl)
        ms = lua.ttl_ms(ttl)
        (outcome,) = await self._renew([(grant, ms)])
        if not isinstance(outcome, Renewed):
            return outcome
        grant.ttl_ms = ms
        # The same expiry told as the ttl the masters apply, from a start moved earlier by the
        # drift allowance (valid_from + ttl is still a bound no master expires before).
        allowance = ms / 1000 - outcome.ttl
        return Renewed(outcome.valid_from - allowance, ms / 1000)

    async def _renew(self, grants: Sequence[tuple[RedlockGrant, int]]) -> list[RenewOutcome]:
        """RENEW of each grant with its ttl in ms, on every master at once."""
        if not grants:
            return []
        masters = self._live_masters()
        keys = [self.lock_key(grant.name) for grant, _ in grants]
        args: list[str | int] = [grant.owner for grant, _ in grants]
        args += [ms for _, ms in grants]
        votes = RenewVotes(len(masters), self.quorum, len(grants))
        sent_at = anyio.current_time()
        command = ("EVAL", lua.RENEW.text, len(keys), *keys, *args)
        futures = [master.submit(command) for master in masters]
        shortest = min(ms for _, ms in grants) / 1000
        results = await gather(futures, self._request_timeout(shortest), votes.decided)
        elapsed = anyio.current_time() - sent_at
        return votes.outcomes(
            [(grant.name, ms / 1000) for grant, ms in grants],
            results,
            sent_at=sent_at,
            elapsed=elapsed,
            allowance=self._drift_allowance,
            where=self.describe(),
        )

    async def inspect(self, name: str, kind: Kind = "lock") -> LockInfo:
        if kind != "lock":
            raise UnsupportedFeature(f"{self.describe()} has no {kind}s (only exclusive locks)")
        futures = [
            master.submit(("EVAL", PEEK, 1, self.lock_key(name))) for master in self._live_masters()
        ]
        timeout = self.settings.op_timeout
        results = await gather(futures, timeout, self._majority, grace=_RELEASE_GRACE)
        return majority_view(name, results, self.quorum, self.describe())

    async def release(self, grant: RedlockGrant) -> None:
        masters = self._live_masters()
        answered = await self._release_on(
            masters, grant.name, grant.owner, grant.ttl_ms / 1000, wake_waiters=True
        )
        if answered < self.quorum:
            raise BackendUnavailable(
                f"releasing {grant.name!r}: only {answered} of {len(masters)} masters of "
                f"{self.describe()} answered; the others free it when its ttl runs out"
            )

    def _release_wait(self, ttl: float) -> float:
        return max(self._request_timeout(ttl), _MIN_RELEASE_WAIT)

    async def _release_on(
        self,
        masters: Sequence[Master],
        name: str,
        owner: str,
        ttl: float,
        *,
        wake_waiters: bool = False,
        wait_for: Sequence[Master] | None = None,
    ) -> int:
        """Delete our key on ``masters``; return how many of them answered. The deletes are
        queued before the first await (and go out even if nobody waits for them any more), so
        a cancellation cannot stop them; waiting for the answers is bounded by the request
        bound. Idempotent: running it twice deletes nothing of anybody else's.

        ``wake_waiters`` (a release of a grant, not the undo of a round): the task of this
        client whose turn it is to wait for ``name`` looks again at once. ``wait_for``: the
        masters whose answers are waited for (all of them by default; the count is of those)."""
        key = self.lock_key(name)
        futures = {
            master: master.submit(("EVAL", lua.COMPARE_AND_DELETE.text, 1, key, owner), keep=True)
            for master in masters
        }
        # Whoever of this client waits for the name may take it now: its take reaches every
        # master behind these deletes.
        room = self._rooms.get(name) if wake_waiters else None
        if room is not None:
            room.kick.set()
        if wait_for is None:
            waited = list(futures.values())
            # Every master is waited for until a majority answered, then briefly: a delete
            # not answered yet still runs (it is queued behind our take), so a hung minority
            # master costs a release only the grace.
            decided, grace = self._majority, _RELEASE_GRACE
        else:
            waited = [futures[master] for master in wait_for]
            decided, grace = never, 0.0
        if not waited:
            return 0
        results = await gather(waited, self._release_wait(ttl), decided, grace=grace)
        return sum(1 for result in results if not isinstance(result, Failed))
