"""``redis://host:port/db`` and ``rediss://`` (TLS): locks on one Redis server.

Take: one Lua script does ``SET lock owner NX PX ttl`` and ``INCR``s the name's fencing counter,
so the token and the lock come from one atomic step. Renew and release compare the owner id (one
per lease) before they act; one script renews every lock a client holds, in one round trip.

Keys. Per lock name, four keys, each ``<prefix><kind>:{<name>}``: the braces are a Redis Cluster
hash tag, so the four are in one slot (:mod:`._scripts`):

- ``lock:{name}``: the holder's owner id, with the lease's PX expiry;
- ``token:{name}``: the fencing counter (no expiry);
- ``queue:{name}``: sorted set of waiters by arrival; a member is
  ``"<client id> <ttl ms> <place ms> <owner id>"``;
- ``queue-ttl:{name}``: the same members, scored by when their place expires (server ms).

TAKE, RELEASE and LEAVE get exactly these four as KEYS, in this order, and touch no other key
(INSPECT reads them too). RENEW gets only lock keys, of many names, so on a cluster it must be
split per slot (or per name). Deadlock detection's two keys (``deadlock:waiters``,
``deadlock:expiry``) are whole keys of their own, touched together only with each other.

Waiting and the wake-up. A waiter's first TAKE (mode ``wait``) puts it in the queue; its place
expires unless it refreshes it (every third of ``waiter_ttl``, or of its ttl if shorter), so a
dead waiter cannot stall the line for longer than that. Whatever frees the lock (RELEASE, LEAVE,
or a TAKE that finds it free while another waiter is first) *hands it over* in the same script:
it sets the lock key to the first live waiter's owner id (PX: its ttl, cut to what is left of
its place), draws its token, takes it out of the queue and ``PUBLISH``es
``"g <owner> <token> <px>"`` on ``<prefix>wake:<client id>``, the channel of the waiter's client
(a Pub/Sub channel, not a key: it has no slot; on a cluster, plain PUBLISH reaches a subscriber
on any node). The waiter wakes holding the lock, without a round trip. The waiter behind it may
be told ``"f <owner> <px>"`` (it is first now; the lease ahead expires in px ms unless renewed),
so that it takes over a holder that dies. Each client holds one connection subscribed to its
channel, however many of its tasks wait (:mod:`._wakes`); its tasks hold no connection while
they wait. Pub/Sub keeps nothing for a connection that is down, so when that connection breaks
or comes back, every waiter of the client takes again: a TAKE that finds the lock key holding
its own owner id returns the lock (handed over meanwhile). A hand-over's lease counts from the
send time of the waiter's last take or of the channel's last answered ``PING`` (sent every 50 ms
while someone waits), whichever is later: both precede the script that set the new expiry.

A holder that dies without releasing is noticed by the first waiter when the key's expiry passes
(it sleeps until then, with jitter). Cancellation of a waiter at any moment, also while the lock
is being handed to it, ends with LEAVE (through ``finish``): it deletes the lock if it is ours and
hands it to the next in line.

Tokens never repeat for a name, also when Redis forgets the counter or brings it back old (a
restart without persistence, an eviction, a snapshot): a token is never below the server's clock
in microseconds, so it is above every token handed out before, as long as that clock does not go
back. Held locks are another matter: :func:`RedisBackend.open` reads the server's persistence and
eviction settings and warns (:class:`RedisDurabilityWarning`) when a restart or eviction could
lose them. The wake channel's connection notices a restart at once (a new run id), and leases
whose keys it took are reported lost then.

Failures: every call is bounded by ``op_timeout``, with the backend's own timer, which lets a
reply that arrived while the process was stalled be read rather than counted as a timeout. A
take interrupted in flight (timeout, cancellation) has its undo written right behind it on the
same connection, so the server runs the two in order whenever it gets to them: a frozen server
that wakes up cannot leave the lock to a caller that has given up.
"""

from __future__ import annotations

import asyncio
import functools
import math
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Self

import anyio

from .._kit import (
    Backend,
    BackendTimeout,
    BackendUnavailable,
    Capabilities,
    Grant,
    HostPort,
    InvalidURL,
    Kind,
    LockInfo,
    LockRequest,
    Lost,
    Options,
    Renewed,
    RenewOutcome,
    TaskHost,
    WaiterRegistry,
    finish,
    now,
    parse_host,
    redact,
    translate,
)
from . import _scripts as lua
from ._lane import Lane, Undo
from ._records import RedisWaiters
from ._server import check_server
from ._settings import COMMON_OPTIONS, DEFAULT_PORT, ERRORS, Settings, common_settings, split_url
from ._wakes import WakeChannel

__all__ = ("RedisBackend", "RedisGrant")

_EXAMPLE: Final = "redis://127.0.0.1:6379/0 or rediss://user:password@redis.example:6380/0"
_SCHEMES: Final = ("redis", "rediss")
_DEFAULT_WAITER_TTL: Final = 5.0


@dataclass(eq=False, slots=True)
class RedisGrant(Grant):
    """A ``redis://`` lease. ``lease_ttl`` is the ttl asked for, which renewals apply: a lock
    handed over while its waiter was in line starts with what was left of the waiter's place
    when that is shorter (``ttl``), so that a waiter that died in line stalls nobody for long."""

    lease_ttl: float


class RedisBackend(Backend[RedisGrant]):
    """Locks on one Redis server, with fencing tokens and a fair (FIFO) waiter queue."""

    driver = "redis-py"
    #: Makes the wire: (pool, op_timeout, task host) -> Lane (``redis+cluster://``: by slot).
    _lane_type: Callable[..., Lane] = Lane
    capabilities = Capabilities(
        fencing=True, fifo=True, loss_detection=True, quorum=False, cross_process=True
    )

    def __init__(
        self,
        address: HostPort,
        settings: Settings,
        *,
        waiter_ttl: float = _DEFAULT_WAITER_TTL,
        durability_warning: bool = True,
    ) -> None:
        self.address = address
        self.settings = settings
        self.waiter_ttl = waiter_ttl
        self.durability_warning = durability_warning
        self._waiter_ttl_ms = max(1, lua.ttl_ms(waiter_ttl))
        self._wake_prefix = lua.wake_prefix(settings.prefix)
        #: This client's id: its waiters' queue entries name it, hand-overs wake its channel.
        self._client_id = secrets.token_hex(8)
        self._lane: Lane | None = None
        self._wakes: WakeChannel | None = None
        self._closed = False
        self._server_info: dict[str, str] = {}
        #: Leases granted and not released, by owner id: told at once when a restart lost them.
        self._held: dict[str, tuple[RedisGrant, Callable[[str], None]]] = {}
        #: The wake channel, the undo replies, the clean-ups that wait for the server.
        self._host = TaskHost(cleanup_timeout=settings.op_timeout)

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_url(cls, url: str, options: Mapping[str, object]) -> Self:
        parts = split_url(url, schemes=_SCHEMES, example=_EXAMPLE)
        if "," in parts.hosts:
            raise InvalidURL(
                f"{redact(url)!r} lists several servers: redis:// is one server; for Redlock "
                "over several independent masters use redlock://h1:6379,h2:6379,h3:6379"
            )
        address = parse_host(
            parts.hosts or "localhost", default_port=DEFAULT_PORT, url=url, example=_EXAMPLE
        )
        source = f"{parts.scheme}://"
        opts = Options(options, source)
        settings = common_settings(opts, source=source, url=parts, tls=parts.scheme == "rediss")
        waiter_ttl = opts.number("waiter_ttl", _DEFAULT_WAITER_TTL, minimum=0.05)
        durability_warning = opts.flag("durability_warning", True)
        opts.finish((*COMMON_OPTIONS, "waiter_ttl", "durability_warning"))
        return cls(address, settings, waiter_ttl=waiter_ttl, durability_warning=durability_warning)

    def describe(self) -> str:
        scheme = "rediss" if self.settings.tls else "redis"
        user = f"{self.settings.username}@" if self.settings.username else ""
        return f"{scheme}://{user}{self.address}/{self.settings.db}"

    def extra_info(self) -> Mapping[str, Any]:
        return {
            "prefix": self.settings.prefix,
            "waiter_ttl": self.waiter_ttl,
            "op_timeout": self.settings.op_timeout,
            **self._server_info,
        }

    # -- keys (public so that tests and tools can find a lock on the server) -----------------

    def lock_key(self, name: str) -> str:
        return lua.lock_key(self.settings.prefix, name)

    def token_key(self, name: str) -> str:
        return lua.token_key(self.settings.prefix, name)

    def queue_key(self, name: str) -> str:
        return lua.queue_key(self.settings.prefix, name)

    def _keys(self, name: str) -> list[str]:
        prefix = self.settings.prefix
        return [
            lua.lock_key(prefix, name),
            lua.token_key(prefix, name),
            lua.queue_key(prefix, name),
            lua.queue_ttl_key(prefix, name),
        ]

    # -- life cycle --------------------------------------------------------------------------

    @property
    def _run_id(self) -> str | None:
        """The server's run id (a new one at every start), if INFO may be read."""
        return self._wakes.run_id if self._wakes is not None else None

    async def open(self) -> None:
        if self._lane is not None or self._closed:
            raise RuntimeError("a RedisBackend can be opened once")
        await self._host.open()
        pool = self.settings.pool(self.address)
        lane = self._lane = self._lane_type(pool, self.settings.op_timeout, self._host)
        try:
            with translate(
                ERRORS,
                f"cannot reach {self.describe()} (is redis-server running there, and are the "
                "host, port, user and password right?)",
            ):
                await lane.call("PING")
                run_id, self._server_info = await check_server(
                    lane, self.describe(), durability_warning=self.durability_warning
                )
                # Load the scripts now, so that the first acquire costs one round trip.
                for script in (lua.TAKE, lua.RELEASE, lua.LEAVE, lua.RENEW):
                    await lane.call("SCRIPT", "LOAD", script.text)
                wakes = self._wakes = WakeChannel(
                    pool,
                    self.settings.op_timeout,
                    self.describe(),
                    f"{self._wake_prefix}{self._client_id}",
                    functools.partial(_report_lost_after_restart, self),
                )
                wakes.run_id = run_id
                conn = await wakes.connect()
        except BaseException:
            # Not under a shield: the host's task group was entered above, at this level.
            await self.aclose()
            raise
        self._host.start_soon(wakes.run, conn, name=f"asynclock: wake channel of {self.describe()}")

    async def aclose(self) -> None:
        self._closed = True
        self._held.clear()
        if self._wakes is not None:
            self._wakes.close()
        # Clean-ups still pending get a moment (they need the lane), then everything stops.
        await self._host.aclose()
        lane, self._lane = self._lane, None
        if lane is not None:
            await lane.aclose()

    # -- the contract ------------------------------------------------------------------------

    def check_ttl(self, ttl: float) -> None:
        lua.check_ttl_ms(ttl, "redis://")

    def waiter_registry(self) -> WaiterRegistry:
        return RedisWaiters(self._script, self.settings.prefix)

    def _connected(self) -> Lane:
        if self._lane is None:
            raise BackendUnavailable(f"{self.describe()} is closed (or was never opened)")
        return self._lane

    async def _script(
        self, script: lua.Script, keys: Sequence[str], args: Sequence[str | int], what: str
    ) -> Any:
        lane = self._connected()
        with translate(ERRORS, f"{what} on {self.describe()}"):
            return await lane.script(script, keys, args)

    async def inspect(self, name: str, kind: Kind = "lock") -> LockInfo:
        holder, ms_left, counter, waiters = await self._script(
            lua.INSPECT, self._keys(name), [], f"inspecting lock {name!r}"
        )
        if not holder:
            return LockInfo(name, held=False, waiters=int(waiters))
        # Every take bumps the counter, so while the key is held it is the holder's token.
        return LockInfo(
            name,
            held=True,
            owner=lua.as_text(holder),
            token=int(counter) if counter is not None else None,
            expires_in=int(ms_left) / 1000 if int(ms_left) >= 0 else None,
            waiters=int(waiters),
        )

    def _args(self, request: LockRequest) -> list[str | int]:
        """ARGV of TAKE and LEAVE (see :mod:`._scripts`), without TAKE's mode."""
        return [
            request.owner,
            self._wake_prefix,
            self._place_ms(request),
            lua.ttl_ms(request.ttl),
            self._client_id,
        ]

    def _undo_for(self, request: LockRequest) -> Undo:
        """LEAVE for ``request``, sent as plain EVAL (it must not depend on the script cache)."""
        return Undo("EVAL", lua.LEAVE.text, 4, *self._keys(request.name), *self._args(request))

    async def _take_once(
        self, request: LockRequest, mode: str, undo: Undo
    ) -> tuple[RedisGrant | None, int, float]:
        """One TAKE: (the grant, 0) if the lock is ours, else (None, the script's hint); and
        the time it was sent."""
        lane = self._connected()
        sent_at = now()
        with translate(ERRORS, f"taking lock {request.name!r} on {self.describe()}"):
            reply = await lane.script(
                lua.TAKE, self._keys(request.name), [*self._args(request), mode], undo
            )
        taken, value = lua.codes(reply, 2)
        if taken:
            return self._granted(request, value, sent_at, request.ttl), 0, sent_at
        return None, value, sent_at

    def _granted(
        self, request: LockRequest, token: int, valid_from: float, ttl: float
    ) -> RedisGrant:
        grant = RedisGrant(request.name, request.owner, token, valid_from, ttl, request.ttl)
        self._held[grant.owner] = (grant, request.on_lost)
        return grant

    def _place_ms(self, request: LockRequest) -> int:
        """How long a waiter's place lasts without a refresh: ``waiter_ttl``, but never longer
        than the lease it waits for, as on etcd and ZooKeeper, where a waiter's key lives as
        long as its lease or session. A waiter whose process stopped then holds up a free lock
        for at most that long (a web handler waiting 0.3 s with ttl 1 s: 1 s, not 5)."""
        return max(1, min(self._waiter_ttl_ms, lua.ttl_ms(request.ttl)))

    async def try_acquire(self, request: LockRequest) -> RedisGrant | None:
        if self._wakes is not None and self._wakes.waits_for(request.name):
            # A task of ours has a place in the line: a try never jumps it (the take would
            # refuse, or hand the free lock to the first in line), so no round trip for that.
            return None
        undo = self._undo_for(request)
        try:
            grant, _, _ = await self._take_once(request, "try", undo)
        except BaseException as exc:
            # Cancelled or failed with the take in flight: it may have run. Undo it.
            await self._clean_up(request, undo, exc)
            raise
        return grant

    async def acquire(self, request: LockRequest) -> RedisGrant:
        self._connected()
        wakes = self._wakes
        assert wakes is not None
        undo = self._undo_for(request)
        refresh = self._place_ms(request) / 3000.0
        # Registered before the first take, so that no hand-over can come before we listen.
        waiter = wakes.register(request.owner, request.name)
        try:
            while True:
                waiter.poked = False
                waiter.ahead = math.inf
                # Joins the queue (or refreshes our place) when the lock is not ours yet.
                grant, hint_ms, sent_at = await self._take_once(request, "wait", undo)
                if grant is not None:
                    return grant
                wakes.in_line(waiter, refresh * 3)
                handed = await waiter.until_due(sent_at, refresh, hint_ms)
                if handed is not None:
                    token, px, valid_from = handed
                    return self._granted(request, token, valid_from, px / 1000)
        except BaseException as exc:
            await self._clean_up(request, undo, exc)
            raise
        finally:
            wakes.unregister(waiter)

    async def _clean_up(self, request: LockRequest, undo: Undo, error: BaseException) -> None:
        """Leave nothing behind after an interrupted or failed acquire.

        A take interrupted in flight has its undo queued behind it on its own connection
        already (the server runs the two in order, whenever it gets to them): nothing to do.
        Otherwise (interrupted while waiting, or the connection failed), LEAVE is sent now,
        surviving any cancellation, or, when the server does not answer, in the background
        until it does; it never holds the caller for longer than one ``op_timeout``.
        """
        if not undo.sent or undo.queued:
            return
        if isinstance(error, BackendTimeout | TimeoutError):
            # The server did not answer in time: do not wait for it a second time.
            self._leave_later(request)
            return
        await finish(
            functools.partial(self._leave, request),
            timeout=self.settings.op_timeout,
            what=f"cleaning up after an acquire of {request.name!r} on {self.describe()}",
            unfinished=functools.partial(self._leave_later, request),
        )

    async def _leave(self, request: LockRequest) -> None:
        try:
            await self._leave_once(request)
        except Exception:
            self._leave_later(request)

    async def _leave_once(self, request: LockRequest) -> None:
        await self._script(
            lua.LEAVE,
            self._keys(request.name),
            self._args(request),
            f"cleaning up after an acquire of {request.name!r}",
        )

    def _leave_later(self, request: LockRequest) -> None:
        """LEAVE in the background until the server answers (or the backend closes; the
        server then drops what is left when its ttl and ``waiter_ttl`` run out)."""
        if not self._closed:
            self._host.deferred.retry(
                functools.partial(self._leave_once, request),
                f"cleaning up after an interrupted acquire of {request.name!r} on "
                f"{self.describe()}",
            )

    async def renew(self, grants: Sequence[RedisGrant]) -> Sequence[RenewOutcome]:
        if not grants:
            return []
        keys = [self.lock_key(grant.name) for grant in grants]
        args: list[str | int] = [grant.owner for grant in grants]
        args += [lua.ttl_ms(grant.lease_ttl) for grant in grants]
        sent_at = anyio.current_time()
        reply = await self._script(lua.RENEW, keys, args, f"renewing {len(grants)} lock(s)")
        codes = lua.codes(reply, len(grants))
        return [
            _outcome(grant, code, sent_at, self.describe())
            for grant, code in zip(grants, codes, strict=True)
        ]

    async def release(self, grant: RedisGrant) -> None:
        self._held.pop(grant.owner, None)
        sent_at = now()
        try:
            reply = await self._script(
                lua.RELEASE,
                self._keys(grant.name),
                [grant.owner, self._wake_prefix, self._client_id],
                f"releasing lock {grant.name!r}",
            )
        except BaseException:
            # The reply may have been the only word of a hand-over to a waiter of ours.
            self._poke(grant.name)
            raise
        if isinstance(reply, list):
            # Handed to a task of this client: it learns from this reply (no message), and
            # runs before the releasing task goes on, as the next holder should.
            heir, token, px = reply
            if self._wakes is not None and self._wakes.hand(
                lua.as_text(heir), int(token), int(px), sent_at
            ):
                await asyncio.sleep(0)
        elif reply == 0:
            self._poke(grant.name)  # or a retry after a lost reply, which may have handed it

    def _poke(self, name: str) -> None:
        if self._wakes is not None:
            self._wakes.poke(name)


def _outcome(grant: RedisGrant, code: int, sent_at: float, describe: str) -> RenewOutcome:
    """What RENEW's code for ``grant`` means."""
    if code == 1:
        return Renewed(sent_at, grant.lease_ttl)
    if code == 0:
        return Lost(
            f"the key of lock {grant.name!r} is gone from {describe} (expired, deleted or evicted)"
        )
    return Lost(f"lock {grant.name!r} is held by another owner on {describe}")


async def _report_lost_after_restart(backend: RedisBackend) -> None:
    """After a restart: every held lease whose key is gone (or another's) is lost, now."""
    held = list(backend._held.values())
    if not held:
        return
    # RENEW with ttls of 0 only tells which keys are still ours.
    reply = await backend._script(
        lua.RENEW,
        [backend.lock_key(grant.name) for grant, _ in held],
        [*(grant.owner for grant, _ in held), *(0 for _ in held)],
        f"checking {len(held)} lock(s) after a restart",
    )
    for (grant, on_lost), code in zip(held, lua.codes(reply, len(held)), strict=True):
        if code == 1 or grant.owner not in backend._held:
            continue  # kept (the server has persistence), or released meanwhile
        what = "is gone" if code == 0 else "is held by another owner"
        on_lost(
            f"{backend.describe()} restarted and the key of lock {grant.name!r} {what} "
            "(a restart without persistence forgets every lock)"
        )
