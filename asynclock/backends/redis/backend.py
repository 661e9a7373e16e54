"""``redis://host:port/db`` and ``rediss://`` (TLS): locks on one Redis server.

Take: one Lua script does ``SET lock owner NX PX ttl`` and ``INCR``s the name's fencing counter,
so the token and the lock come from one atomic step. Renew and release compare the owner id (one
per lease) before they act; one script renews every lock a client holds, in one round trip.

Keys. Per name and kind, five keys, each ``<prefix>[<kind>:]<tag>:{<name>}``: the braces are
a Redis Cluster hash tag, so the five are in one slot (:mod:`._scripts`, :mod:`._queue`): the
exclusive holder (``lock:``), the fencing counter (``token:``, no expiry), the queue by arrival
(``queue:``) and by expiry (``queue-ttl:``), and the other holds (``holds:``: shared holds,
permits, the leader, each with its own expiry, so a crashed holder frees its own only). TAKE,
RELEASE, LEAVE and INSPECT get exactly these five as KEYS and touch no other key. RENEW gets
only lock keys and holds sets, of many names, so on a cluster it must be split per slot (or
per name). Deadlock detection's two keys (``deadlock:waiters``, ``deadlock:expiry``) are whole
keys of their own, touched together only with each other.

Kinds. A shared hold waits behind any exclusive waiter ahead of it (writer preference); a
semaphore's permits are a hold each, its number stored with them while anyone holds or waits
(another number is refused); an election is a semaphore of one whose hold keeps the leader's
value, and whose scripts PUBLISH every change on a channel of the name (``wait_for_change``).

Waiting and the wake-up. A waiter's first TAKE (mode ``wait``) puts it in the queue; its place
expires unless it refreshes it (every third of ``waiter_ttl``, or of its ttl if shorter), so a
dead waiter cannot stall the line for longer than that. Whatever frees the lock (RELEASE, LEAVE,
or a TAKE that finds it free while another waiter is first) *hands it over* in the same script:
it gives the first live waiters their holds (PX: their ttl, cut to what is left of
their place), draws their tokens, takes it out of the queue and ``PUBLISH``es
``"g <owner> <token> <px>"`` on ``<prefix>wake:<client id>``, the channel of the waiter's client
(a Pub/Sub channel, not a key: it has no slot; on a cluster, plain PUBLISH reaches a subscriber
on any node). The waiter wakes holding the lock, without a round trip (unless the message is
older than its last take, read late after a stall: that take found the lease gone and queued it
again, and told it the tokens handed out before; such a wake is dropped). The waiter behind it may
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

import functools
import math
import secrets
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from typing import Any, Final, Self

from .._kit import (
    Backend,
    BackendTimeout,
    BackendUnavailable,
    CallOrder,
    Capabilities,
    HostPort,
    InvalidURL,
    Kind,
    LockInfo,
    LockRequest,
    Options,
    RenewOutcome,
    TaskHost,
    WaiterRegistry,
    finish,
    now,
    parse_host,
    permits_mismatch,
    redact,
    translate,
)
from . import _queue
from . import _scripts as lua
from ._errors import ERRORS, opening_errors
from ._inspect import info_from, wait_for_election_change
from ._lease import Leases, RedisGrant, mode_of, permits_of, value_of
from ._records import RedisWaiters
from ._server import check_server
from ._urls import COMMON_OPTIONS, DEFAULT_PORT, Settings, common_settings, split_url
from ._wakes import WakeChannel, line_of
from ._wire import Lane, Undo

__all__ = ("RedisBackend", "RedisGrant")

_EXAMPLE: Final = "redis://127.0.0.1:6379/0 or rediss://user:password@redis.example:6380/0"
_SCHEMES: Final = ("redis", "rediss")
_DEFAULT_WAITER_TTL: Final = 5.0


class RedisBackend(Backend[RedisGrant]):
    """Locks on one Redis server, with fencing tokens and a fair (FIFO) waiter queue."""

    driver = "redis-py"
    acquire_tries_first = True
    #: Makes the wire: (pool, op_timeout, task host) -> Lane (``redis+cluster://``: by slot).
    _lane_type: Callable[..., Lane] = Lane
    capabilities = Capabilities.every(quorum=False)

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
        self._placing = CallOrder()
        self._closed = False
        self._server_info: dict[str, str] = {}
        self._leases = Leases(
            self._script,
            settings,
            self.describe,
            lambda: self._wakes,
            self._wake_prefix,
            self._client_id,
        )
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
            with translate(opening_errors(self.describe(), self.settings.db), "connecting"):
                # A server slow to answer now (many clients starting at once, a loaded host)
                # is waited for until connect_timeout; a refused connection fails at once.
                lane.connecting = True
                await lane.call("PING")
                run_id, self._server_info = await check_server(
                    lane, self.describe(), durability_warning=self.durability_warning
                )
                # Load the scripts now, so that the first acquire costs one round trip.
                for script in (_queue.TAKE, _queue.RELEASE, _queue.LEAVE, lua.RENEW):
                    await lane.call("SCRIPT", "LOAD", script.text)
                wakes = self._wakes = WakeChannel(
                    pool,
                    self.settings.op_timeout,
                    self.describe(),
                    f"{self._wake_prefix}{self._client_id}",
                    self._leases.report_lost_after_restart,
                )
                wakes.run_id = run_id
                wakes.adopt(await wakes.connect(timeout=math.inf))
                lane.connecting = False
        except BaseException:
            # Not under a shield: the host's task group was entered above, at this level.
            await self.aclose()
            raise
        self._host.start_soon(wakes.run, name=f"asynclock: wake channel of {self.describe()}")

    async def aclose(self) -> None:
        self._closed = True
        self._leases.clear()
        if self._wakes is not None:
            self._wakes.close()
        try:
            await self._host.aclose()  # pending clean-ups still need the lane
        finally:  # so it closes last, also when cancelled before that
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
        self, script: lua.Script, keys: Sequence[str], args: Sequence[lua.Arg], what: str
    ) -> Any:
        lane = self._connected()
        with translate(ERRORS, f"{what} on {self.describe()}"):
            return await lane.script(script, keys, args)

    def _keys(self, name: str, kind: Kind = "lock") -> list[str]:
        return lua.fair_keys(self.settings.prefix, name, kind)

    # -- what it does with the holds it has (:mod:`._lease`, :mod:`._inspect`) ----------------

    async def renew(self, grants: Sequence[RedisGrant]) -> Sequence[RenewOutcome]:
        return await self._leases.renew(grants)

    async def extend(self, grant: RedisGrant, ttl: float) -> RenewOutcome:
        self.check_ttl(ttl)
        return await self._leases.extend(grant, ttl)

    async def release(self, grant: RedisGrant) -> None:
        await self._leases.release(grant)

    async def inspect(self, name: str, kind: Kind = "lock") -> LockInfo:
        what = f"inspecting {kind} {name!r}"
        return info_from(
            name, kind, await self._script(_queue.INSPECT, self._keys(name, kind), [], what)
        )

    async def wait_for_change(self, name: str, kind: Kind, seen: LockInfo, timeout: float) -> None:
        if kind != "election" or self._wakes is None:
            await super().wait_for_change(name, kind, seen, timeout)
            return
        channel = lua.change_channel(self.settings.prefix, name, kind)
        inspect = functools.partial(self.inspect, name, kind)
        await wait_for_election_change(
            self._wakes, channel, inspect, seen, timeout, self.poll_interval
        )

    # -- taking and waiting (:mod:`._queue`) ---------------------------------------------------

    def _args(self, request: LockRequest) -> list[lua.Arg]:
        """ARGV of TAKE and LEAVE (see :mod:`._queue`), without TAKE's ``wait``/``try``."""
        change = ""
        if request.kind == "election":
            change = lua.change_channel(self.settings.prefix, request.name, request.kind)
        return [
            request.owner,
            self._wake_prefix,
            self._place_ms(request),
            lua.ttl_ms(request.ttl),
            self._client_id,
            mode_of(request),
            permits_of(request),
            value_of(request),
            change,
        ]

    def _undo_for(self, request: LockRequest) -> Undo:
        """LEAVE for ``request``, sent as plain EVAL (it must not depend on the script cache)."""
        keys = self._keys(request.name, request.kind)
        return Undo("EVAL", _queue.LEAVE.text, len(keys), *keys, *self._args(request))

    async def _take_once(
        self, request: LockRequest, mode: str, undo: Undo
    ) -> tuple[RedisGrant | None, int, int, float]:
        """One TAKE: (the grant, 0, -1) if the lock is ours, else (None, the script's hint, its
        token floor, -1 after a try); and the time it was sent."""
        lane = self._connected()
        sent_at = now()
        with translate(ERRORS, f"taking lock {request.name!r} on {self.describe()}"):
            reply = await lane.script(
                _queue.TAKE,
                self._keys(request.name, request.kind),
                [*self._args(request), mode],
                undo,
            )
        # {0, hint, floor} when the take left us in line, else two codes (see _queue.TAKE).
        taken, value, *floor = lua.codes(
            reply, 3 if isinstance(reply, list) and len(reply) == 3 else 2
        )
        if taken < 0:
            raise permits_mismatch(request.name, value, request.permits)
        if taken:
            return self._leases.grant(request, value, sent_at, request.ttl), 0, -1, sent_at
        return None, value, floor[0] if floor else -1, sent_at

    def _place_ms(self, request: LockRequest) -> int:
        """How long a waiter's place lasts without a refresh: ``waiter_ttl``, but never longer
        than the lease it waits for, as on etcd and ZooKeeper, where a waiter's key lives as
        long as its lease or session. A waiter whose process stopped then holds up a free lock
        for at most that long (a web handler waiting 0.3 s with ttl 1 s: 1 s, not 5)."""
        return max(1, min(self._waiter_ttl_ms, lua.ttl_ms(request.ttl)))

    async def try_acquire(self, request: LockRequest) -> RedisGrant | None:
        line = line_of(request.kind, request.name)
        if request.kind != "semaphore" and self._wakes is not None and self._wakes.waits_for(line):
            # A task of ours has a place in the line: a try never jumps it (the take would
            # refuse, or hand the free lock to the first in line), so no round trip for that.
            # (A semaphore's try goes anyway: it may ask for other permits, which must raise.)
            return None
        undo = self._undo_for(request)
        try:
            grant, _, _, _ = await self._take_once(request, "try", undo)
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
        waiter = wakes.register(request.owner, line_of(request.kind, request.name))
        placed = False
        try:
            while True:
                waiter.poked = False
                waiter.ahead = math.inf
                # Joins the queue (or refreshes our place) when the lock is not ours yet; the
                # first take in the order acquires asked (one on an idle connection would
                # overtake one still opening its own).
                async with nullcontext() if placed else self._placing.turn(waiter.name):
                    grant, hint_ms, floor, sent_at = await self._take_once(request, "wait", undo)
                placed = True
                if grant is not None:
                    return grant
                if request.answered is not None:
                    request.answered()  # queued: the caller's timeout applies from here
                wakes.in_line(waiter, refresh * 3)
                # A hand-over told before this take's reply may be older than the take (read
                # late, after a stall): the floor tells, and an older one is not ours.
                handed = await waiter.until_due(sent_at, refresh, hint_ms, floor)
                if handed is not None:
                    token, px, valid_from = handed
                    if valid_from + px / 1000 <= now():
                        # Told so late (the process was stopped, the loop stalled) that the
                        # lease is over already: the lock may be another's by now. The next
                        # take says (it finds our own owner id if the key is still ours).
                        continue
                    grant = self._leases.grant(request, token, valid_from, px / 1000)
                    if grant.ttl < 2 * min(1.0, request.ttl / 10):
                        await self._leases.lengthen(grant)
                    return grant
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
            _queue.LEAVE,
            self._keys(request.name, request.kind),
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
