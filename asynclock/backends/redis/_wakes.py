"""One ``redis://`` client's watch connection: wakes for its waiters, and server restarts.

A client holds one connection subscribed to its own wake channel (``<prefix>wake:<client
id>``), however many of its tasks wait. The scripts that free a lock hand it to the first
waiter in line and PUBLISH on that waiter's client channel (see :mod:`._scripts`); the reader
here passes each message to the waiting task it names, which then holds the lock without a
round trip of its own. Waiting tasks hold no connection: they wait on a :class:`Waiter`.

Pub/Sub keeps nothing for a connection that is down, so whenever this connection breaks and
whenever it is made again, every waiter is *poked*: it runs its take once more, which finds a
lock handed to it meanwhile (the take returns a lock whose key holds its owner id). The same
connection reads the server's run id first (``INFO``), and after a restart (a new run id)
tells the backend, which reports the leases the restart lost.

Lease arithmetic: a hand-over starts the new holder's expiry when the releasing script runs,
at a moment the waiter does not see. What it knows precedes that moment is the send time of
any request the server answered before it published the wake: the waiter's own last take,
and the last ``PING`` sent on this connection whose reply came before the message (replies and
messages on one connection arrive in the order the server wrote them). The first holds only for
a hand-over that came after that take, which a message read late (the client was stopped, and
its take ran first on resuming) may not be: the take's reply says which tokens came before it,
and a hand-over with one of those is dropped (:meth:`Waiter.hand`). The reader pings every
:data:`PING_EVERY` seconds while anyone waits (more often when a waiter's place is short: a
tenth of the shortest), so that bound is never much older than that.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Final

import anyio
import redis.asyncio
import redis.exceptions
from redis.asyncio.connection import AbstractConnection

from .._kit import RetryPolicy, now
from ._scripts import as_text
from ._server import run_id_of
from ._wire import close_now, pack, write_now

logger = logging.getLogger("asynclock")

#: How often the watch connection pings while some task waits (see the module's docstring).
PING_EVERY: Final = 0.05
#: ... but never more often than this.
_PING_AT_MOST: Final = 0.005
#: Pauses between two attempts to connect again.
_RECONNECT: Final = RetryPolicy(first=0.05, cap=0.5, factor=2.0, jitter=0.2)
_PING: Final = pack(("PING",))


def line_of(kind: str, name: str) -> str:
    """The wake channel's name for the queue of ``name`` of ``kind`` (kinds are namespaces)."""
    return f"{kind} {name}"


@dataclass(eq=False, slots=True)
class Waiter:
    """The mailbox of one waiting acquire: what its client's channel told it."""

    owner: str
    name: str
    #: (token, px, fresh): the lock was handed to us, with this token and expiry (ms),
    #: started after the local time ``fresh``.
    handed: tuple[int, int, float] | None = None
    #: Our last take left us in line, and every hand-over after it has a token above
    #: this: one told with a lower token (read late, after a stall) came before that
    #: take, which found it gone already (else it would have returned the lock).
    floor: int = -1
    #: When to take again: to refresh our place, and (told "f": we are first) just after
    #: the lease ahead of us expires, in case its holder died.
    deadline: float = math.inf
    ahead: float = math.inf
    #: The channel was (re)connected or broke: a wake may have been lost, take again.
    poked: bool = False
    #: When our last take was sent (it precedes any hand-over to us).
    sent_at: float = -math.inf
    #: Our place in the queue was taken (so a try of this name by this client must fail).
    in_line: bool = False
    _future: asyncio.Future[None] | None = None
    _timer: asyncio.TimerHandle | None = None

    @property
    def due(self) -> bool:
        """Time to take again (or the lock is ours)."""
        return self.handed is not None or self.poked or now() >= min(self.deadline, self.ahead)

    def hand(self, token: int, px: int, fresh: float) -> bool:
        """The lock was handed to us (told at ``fresh``); False if that hand-over came before
        our last take (its token is at or below the take's floor): that take did not find
        it, so its lease is gone, and we wait in a new place."""
        if token <= self.floor:
            return False
        self.handed = (token, px, fresh)
        self.notify()
        return True

    def notify(self) -> None:
        future = self._future
        if future is not None and not future.done():
            future.set_result(None)

    def first(self, ms: int) -> None:
        """We are first; the lease ahead expires in ``ms`` unless renewed. The wait's deadline
        moves, without waking the task."""
        self.ahead = min(self.ahead, now() + ms / 1000 + random.uniform(0.001, 0.003))
        if self._timer is not None and self.ahead < self._timer.when():
            self._arm()

    def _arm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        future = self._future
        assert future is not None
        self._timer = future.get_loop().call_at(min(self.deadline, self.ahead), _wake, future)

    async def until_due(
        self, sent_at: float, refresh: float, hint_ms: int, floor: int
    ) -> tuple[int, int, float] | None:
        """After a take that left us in line (sent at ``sent_at``, with the script's hint and
        token floor): wait until the lock is handed to us (token, px, valid from), or it is
        time to take again (our place needs its refresh, the lease ahead of us expired, a
        poke): None."""
        self.sent_at = sent_at
        self.floor = max(self.floor, floor)
        if self.handed is not None and self.handed[0] <= self.floor:
            # Told (late) of a hand-over that came before this take, which did not find it:
            # its lease is gone, and we are in line again. Not ours.
            self.handed = None
        self.deadline = sent_at + refresh * random.uniform(0.8, 1.0)
        if hint_ms >= 0:
            # We are first and the holder's key expires in hint_ms (or the first waiter is
            # silent and its place runs out then): look again just after that.
            self.first(hint_ms)
        while not self.due:
            await self._wait()
        if self.handed is None:
            return None
        token, px, fresh = self.handed
        # The hand-over ran after our last take, and after the ping whose send time is
        # ``fresh``: either is a safe start of the server's new expiry.
        return token, px, max(sent_at, fresh)

    async def _wait(self) -> None:
        # A bare future and timer, not an anyio.Event in a CancelScope: this is the hot path
        # of every hand-over (the backend runs on asyncio only). A cancellation of the task
        # comes through the await as always.
        self._future = asyncio.get_running_loop().create_future()
        self._arm()
        try:
            await self._future
        finally:
            if self._timer is not None:
                self._timer.cancel()
            self._future = self._timer = None


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class Watch:
    """One ``wait_for_change`` listening on a channel of changes (see :meth:`WakeChannel.watch`).

    ``target``: how many SUBSCRIBEs of the channel this connection must have confirmed before
    it listens (None: no connection); ``fired``: a message came (or the connection changed)."""

    __slots__ = ("_acks", "_future", "channel", "fired", "lost", "target")

    def __init__(self, channel: str, acks: Counter[str], target: int | None) -> None:
        self.channel = channel
        self._acks = acks
        self.target = target
        self.fired = False
        self.lost = target is None
        self._future: asyncio.Future[None] | None = None

    def notify(self) -> None:
        if self._future is not None and not self._future.done():
            self._future.set_result(None)

    async def _wait(self) -> None:
        self._future = asyncio.get_running_loop().create_future()
        try:
            await self._future
        finally:
            self._future = None

    async def ready(self) -> bool:
        """Wait until the subscription is confirmed: True; False if there is no connection."""
        while not self.lost and self._acks[self.channel] < (self.target or 0):
            await self._wait()
        return not self.lost

    async def changed(self) -> None:
        """Wait for a message on the channel (or the connection's end)."""
        while not (self.fired or self.lost):
            await self._wait()


class WakeChannel:
    """The watch connection of one client (see the module's docstring). ``run`` lives in the
    backend's task host until it closes."""

    def __init__(
        self,
        pool: redis.asyncio.ConnectionPool,
        op_timeout: float,
        describe: str,
        channel: str,
        on_restart: Callable[[], Awaitable[None]],
    ) -> None:
        self._pool = pool
        self._op_timeout = op_timeout
        self._describe = describe
        self._channel = channel
        self._channel_bytes = channel.encode()
        self._on_restart = on_restart
        self.run_id: str | None = None
        self.waiters: dict[str, Waiter] = {}
        #: How many of those have a place in the queue, by lock name.
        self._lines: Counter[str] = Counter()
        #: The send time of the last request on this connection that the server answered
        #: before the messages read since.
        self._fresh = -math.inf
        self._pings: deque[float] = deque()
        self._conn: AbstractConnection | None = None
        #: The connection the backend's open() made, until run() takes it (close() closes it
        #: if run() never started: a task cancelled before its first step runs no finally).
        self._opened: AbstractConnection | None = None
        self._ping_timer: asyncio.TimerHandle | None = None
        self._ping_every = PING_EVERY
        self._connected_before = False
        #: ``watch``: the listeners by channel; SUBSCRIBEs written and confirmed on this
        #: connection by channel; the channels whose last command written was SUBSCRIBE.
        self._watches: dict[str, set[Watch]] = {}
        self._subs: Counter[str] = Counter()
        self._acks: Counter[str] = Counter()
        self._subscribed: set[str] = set()

    # -- changes (elections' wait_for_change) ------------------------------------------------

    @contextlib.contextmanager
    def watch(self, channel: str) -> Iterator[Watch]:
        """Listen to ``channel`` on this connection while in the block. The subscription is
        written at once (no await); :meth:`Watch.ready` waits for its confirmation, after which
        every message published on it is seen. Leaving unsubscribes the last listener."""
        conn = self._conn
        target: int | None = None
        if conn is not None:
            try:
                if channel not in self._subscribed:
                    write_now(conn, pack(("SUBSCRIBE", channel)))
                    self._subs[channel] += 1
                    self._subscribed.add(channel)
                target = self._subs[channel]
            except redis.exceptions.ConnectionError:
                target = None  # the reader finds out, and connects again
        watch = Watch(channel, self._acks, target)
        self._watches.setdefault(channel, set()).add(watch)
        try:
            yield watch
        finally:
            watches = self._watches.get(channel)
            if watches is not None:
                watches.discard(watch)
                if not watches:
                    del self._watches[channel]
                    self._unsubscribe(channel)

    def _unsubscribe(self, channel: str) -> None:
        if channel in self._subscribed and self._conn is not None:
            self._subscribed.discard(channel)
            with contextlib.suppress(redis.exceptions.ConnectionError):
                write_now(self._conn, pack(("UNSUBSCRIBE", channel)))

    def _changes_lost(self) -> None:
        """The connection ended: its subscriptions with it; every listener looks again."""
        self._subs.clear()
        self._acks.clear()
        self._subscribed.clear()
        for watches in self._watches.values():
            for watch in watches:
                watch.lost = True
                watch.notify()

    def _on_feed(self, kind: bytes, channel: bytes, _data: object) -> None:
        name = channel.decode()
        if kind == b"subscribe":
            self._acks[name] += 1
        for watch in self._watches.get(name, ()):
            if kind == b"message":
                watch.fired = True
            watch.notify()

    # -- waiters -----------------------------------------------------------------------------

    def register(self, owner: str, name: str) -> Waiter:
        waiter = self.waiters[owner] = Waiter(owner, name)
        return waiter

    def in_line(self, waiter: Waiter, place: float) -> None:
        """``waiter`` has a place (lasting ``place`` s unrefreshed) in its queue now (see
        :meth:`waits_for`)."""
        if not waiter.in_line:
            waiter.in_line = True
            self._lines[waiter.name] += 1
            # A hand-over may cut a lease to what is left of the place: its start must then be
            # known to a small share of that.
            self._ping_every = max(_PING_AT_MOST, min(self._ping_every, place / 10))
            self._arm_ping()  # only now: an acquire that takes at once costs no timer

    def unregister(self, waiter: Waiter) -> None:
        if self.waiters.get(waiter.owner) is waiter:
            del self.waiters[waiter.owner]
            if waiter.in_line:
                waiter.in_line = False
                self._lines[waiter.name] -= 1
                if not self._lines[waiter.name]:
                    del self._lines[waiter.name]

    def waits_for(self, name: str) -> bool:
        """Some task of this client has a place in the queue of ``name``."""
        return name in self._lines

    def close(self) -> None:
        """Wake every waiter (their next take finds the backend closed)."""
        opened, self._opened = self._opened, None
        if opened is not None:
            close_now(opened)
        self.poke()

    def hand(self, owner: str, token: int, px: int, fresh: float) -> bool:
        """The lock was handed to our waiter ``owner`` (a RELEASE of this client said so, sent
        at ``fresh``); False if no such waiter waits any more (its clean-up frees the lock),
        or the hand-over came before its last take (see :meth:`Waiter.hand`)."""
        waiter = self.waiters.get(owner)
        return waiter is not None and waiter.hand(token, px, fresh)

    def poke(self, name: str | None = None) -> None:
        """Every waiter of ``name`` (None: every waiter) takes again (a hand-over to one of
        them may be unknown)."""
        for waiter in self.waiters.values():
            if name is None or waiter.name == name:
                waiter.poked = True
                waiter.notify()

    def _dispatch(self, data: bytes) -> None:
        kind, _, rest = data.partition(b" ")
        owner, _, numbers = rest.partition(b" ")
        waiter = self.waiters.get(owner.decode())
        if waiter is None:
            return  # its acquire ended meanwhile (LEAVE or its own take dealt with the lock)
        if kind == b"g":
            token, _, px = numbers.partition(b" ")
            waiter.hand(int(token), int(px), self._fresh)
        elif kind == b"f":
            waiter.first(int(numbers))

    # -- the connection ----------------------------------------------------------------------

    async def connect(self, timeout: float | None = None) -> AbstractConnection:
        """Connect, learn the run id and subscribe, within ``timeout`` (``op_timeout`` by
        default); returns the connection, ready to read."""
        conn: AbstractConnection = self._pool.make_connection()  # type: ignore[no-untyped-call]
        try:
            with anyio.fail_after(self._op_timeout if timeout is None else timeout):
                await conn.connect()  # type: ignore[no-untyped-call]
                write_now(conn, pack(("INFO", "server")))
                try:
                    info = as_text(await conn.read_response(timeout=None))
                except redis.exceptions.ResponseError:
                    info = ""  # INFO refused (ACL): every reconnect is then checked
                subscribed_at = now()
                write_now(conn, pack(("SUBSCRIBE", self._channel)))
                try:
                    await conn.read_response(timeout=None, disconnect_on_error=False)
                except redis.exceptions.ResponseError as exc:
                    raise redis.exceptions.ResponseError(
                        f"{exc} (waiting needs SUBSCRIBE, and releasing PUBLISH, on the "
                        f"client's wake channel {self._channel!r}: with ACLs, grant the user "
                        f"the channels '&{self._channel.rsplit(':', 1)[0]}:*')"
                    ) from exc
        except BaseException:
            close_now(conn)
            raise
        self._fresh = subscribed_at
        self._pings.clear()
        run_id = run_id_of(info)
        restarted = self.run_id is not None and run_id != self.run_id
        self.run_id = run_id
        # Anything published while we were not subscribed is lost: every waiter looks again.
        self.poke()
        if restarted or (run_id is None and self._connected_before):
            try:
                await self._on_restart()
            except BaseException:
                close_now(conn)  # cancelled (the backend closes) or failed: not handed to run()
                raise
        self._connected_before = True
        return conn

    def adopt(self, conn: AbstractConnection) -> None:
        """The connection :meth:`connect` made while the backend opened, for :meth:`run`."""
        self._opened = conn

    async def run(self) -> None:
        """Read messages for ever (on the adopted connection first), reconnecting when the
        connection ends."""
        conn, self._opened = self._opened, None
        backoff = _RECONNECT.backoff()
        while True:
            try:
                if conn is None:
                    conn = await self.connect()
                backoff.reset()
                await self._read(conn)
            except Exception as exc:
                logger.debug("asynclock: wake channel of %s: %r", self._describe, exc)
            finally:
                if conn is not None:
                    close_now(conn)
                    conn = None
            self.poke()  # their next take finds out whether the server is there
            await anyio.sleep(backoff.next_delay())

    async def _read(self, conn: AbstractConnection) -> None:
        self._conn = conn
        self._arm_ping()
        try:
            while True:
                reply = await conn.read_response(timeout=None, disconnect_on_error=False)
                if not isinstance(reply, list) or not reply:
                    continue
                kind = reply[0]
                if kind == b"message" and reply[1] == self._channel_bytes:
                    self._dispatch(reply[2])
                elif kind == b"pong" and self._pings:
                    self._fresh = self._pings.popleft()
                elif kind in (b"message", b"subscribe") and len(reply) == 3:
                    self._on_feed(kind, reply[1], reply[2])
        finally:
            self._conn = None
            self._changes_lost()
            if self._ping_timer is not None:
                self._ping_timer.cancel()
                self._ping_timer = None

    def _arm_ping(self) -> None:
        """Ping every :data:`PING_EVERY` seconds while someone waits (a timer, not a timeout on
        the reads: reading a message then costs no cancel scope)."""
        if self._ping_timer is None and self._conn is not None and self.waiters:
            loop = asyncio.get_running_loop()
            self._ping_timer = loop.call_later(self._ping_every, self._ping)

    def _ping(self) -> None:
        self._ping_timer = None
        conn = self._conn
        if conn is None or not self.waiters:
            self._ping_every = PING_EVERY  # nobody waits: the next ones set it again
            return
        sent = now()
        try:
            write_now(conn, _PING)
        except redis.exceptions.ConnectionError:
            return  # the reader finds out, and connects again
        self._pings.append(sent)
        self._arm_ping()
