"""A waiter's wait for its turn: watches on the keys before its own (and on its own), with the
lease its key rides on kept alive meanwhile. :class:`Wait` is what every wait does;
:class:`TurnWait` waits for the one key before a lock's (a semaphore's wait, on the N keys
before it, is ``_permits.PermitWait``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final

import anyio
import grpc
from aetcd import rpc

from .._kit import RENEWAL, BackendTimeout, BackendUnavailable, LockError, translate
from ._errors import token_rejected
from ._hub import NameWatch, WatchHub, delete_watch
from ._keys import Keys
from ._lease import ClientLease, Leases
from ._order import Standing
from ._proto import range_op
from ._wire import Wire

__all__ = ("UNSYNCED_POLLS", "TurnWait", "Wait", "raise_failure")

#: A waiter re-reads the queue this often even without a watch event (a belt to the braces of
#: watch revisions and gRPC keepalive pings).
_RECHECK_EVERY: Final = 30.0
#: When the next waiter's watch may be unsynced (see ``TurnWait._after_watch``), it looks again
#: after these delays (seconds from the watch's start), covering etcd's 100 ms catch-up period.
UNSYNCED_POLLS: Final = (0.002, 0.005, 0.01, 0.02, 0.04, 0.07, 0.11)


async def raise_failure(wire: Wire, what: str, failed: Sequence[BaseException]) -> None:
    """Raise the first failure of a wait's watches, translated (after an auth token that etcd
    dropped: authenticate again, and return so that the waiter looks again)."""
    for error in failed:
        if isinstance(error, grpc.aio.AioRpcError):
            if wire.settings.user is not None and token_rejected(error):
                await wire.authenticate()
                return
            with translate(wire.errors, f"{what} on {wire.describe}"):
                raise error
        if isinstance(error, LockError):
            raise error
        raise BackendUnavailable(f"{what} on {wire.describe}: {error!r}") from error


class Wait:
    """What every wait for a place in a queue has: watches on the client's stream (it is their
    Subscriber), the wait for etcd to create them, and the idle loop that keeps the lease our
    key rides on alive, looks again at times (``polls``) and returns when a watch fires."""

    __slots__ = (
        "_armed",
        "_changed",
        "_failed",
        "_hub",
        "_keys",
        "_leases",
        "_place",
        "_what",
        "_wire",
        "_woke",
        "own",
        "rev",
    )
    #: What the wait is for, in messages.
    noun = "lock"

    def __init__(
        self,
        wire: Wire,
        hub: WatchHub,
        leases: Leases,
        keys: Keys,
        own: bytes,
        rev: int,
        place: Standing,
        name: str,
    ) -> None:
        self._wire, self._hub, self._leases, self._keys = wire, hub, leases, keys
        #: Our key and its create revision.
        self.own, self.rev = own, rev
        #: Where it stood when the wait began.
        self._place = place
        self._what = f"waiting for {self.noun} {name!r}"
        self._changed = anyio.Event()
        #: The revisions at which etcd created our watches.
        self._armed: list[int] = []
        self._woke = False
        self._failed: list[BaseException] = []

    def _wake(self) -> None:
        self._woke = True
        self._changed.set()

    # -- told by the watch stream (Subscriber) -------------------------------------------------

    def on_created(self, revision: int) -> None:
        self._armed.append(revision)
        self._changed.set()

    def on_fired(self, events: Sequence[Any]) -> None:
        self._wake()

    def on_failed(self, error: BaseException) -> None:
        self._failed.append(error)
        self._wake()

    # -- waiting -------------------------------------------------------------------------------

    async def _arm(self, watches: int) -> None:
        """Until etcd created our ``watches`` watches (or one fired or failed), within
        ``op_timeout``."""
        op_timeout = self._wire.settings.op_timeout
        with anyio.move_on_after(op_timeout):
            while len(self._armed) < watches and not (self._woke or self._failed):
                self._changed = anyio.Event()
                await self._changed.wait()
        if len(self._armed) < watches and not (self._woke or self._failed):
            self._failed.append(
                BackendTimeout(
                    f"{self._what} on {self._wire.describe}: etcd did not create the watches "
                    f"within {op_timeout:g} s (op_timeout)"
                )
            )

    async def _idle(
        self, lease: ClientLease, polls: list[float], look: Callable[[], Awaitable[bool]] | None
    ) -> None:
        """Until a watch fires: at ``polls``, return if ``look()`` says our place changed; keep
        the lease alive when due; return every ``_RECHECK_EVERY`` to look again anyway."""
        recheck_at = anyio.current_time() + _RECHECK_EVERY
        while not self._woke and not self._failed and not lease.dead:
            now = anyio.current_time()
            # Another waiter's keepalive is in flight: look again when a retry would be due.
            due = RENEWAL.retry_at(now, lease.ttl) if lease.refreshing else lease.refresh_due()
            self._changed = anyio.Event()
            with anyio.move_on_at(min(due, recheck_at, *polls[:1])):
                await self._changed.wait()
            if self._woke or self._failed or anyio.current_time() >= recheck_at:
                return
            if polls and anyio.current_time() >= polls[0]:
                polls.pop(0)
                assert look is not None
                try:
                    if await look():
                        return
                except LockError as exc:
                    self._failed.append(exc)
            # Our key rides on the lease: keep it alive while we wait.
            elif await self._leases.refresh_if_due(lease) and self._keys.orphans:
                await self._keys.sweep()


class TurnWait(Wait):
    """One wait: :meth:`run` returns when the key before ours, or ours, is deleted (or to look
    again), and raises what went wrong.

    Its watches go on the client's shared stream (:mod:`._hub`). When the key before ours is
    this client's own, our release or withdrawal of it wakes us at once (``Keys.local``), and
    the watches, from the revision after the place was read, only cover a delete by anyone
    else (a lease expiry, an operator): no read and no polls are needed for them.
    """

    __slots__ = ("_local", "_predecessor", "proven")

    async def run(self, lease: ClientLease) -> bool:
        """Whether the release of the key before ours proved that we hold the lock."""
        wire = self._wire
        #: Set by the release of the key before ours when it proved our key the lowest.
        self.proven = False
        self._predecessor = self._place.watch[0]
        #: Woken by our own delete of the key before ours (None: someone else's key).
        self._local = local = self._keys.local.get(self._predecessor)
        stream = self._hub.stream()
        keys = (self._predecessor, self.own)
        shared: NameWatch | None = None
        if local is None:
            stream.add(self, [delete_watch(key) for key in keys])
        else:
            # A local predecessor: the watches start right after the read (they may be
            # "unsynced", see _after_watch, which only delays a fault's wake-up). The
            # name's shared watch, unless it started after that.
            start = self._place.seen + 1
            shared = stream.name_watch(self.own[: self.own.rindex(b"/") + 1], start)
            if shared.start <= start:
                shared.add(self, keys)
            else:
                shared = None
                stream.add(self, [delete_watch(key, start) for key in keys])
            local.append(self)
        try:
            polls = await self._first_look()
            if polls is not None:
                await self._idle(lease, polls, self._gone)
        finally:
            # No await: nothing can interrupt it.
            if shared is not None:
                shared.remove(self, keys)
            else:
                stream.drop(self)
            if local is not None and self in local:
                local.remove(self)
        if self.proven:
            return True  # whatever failed since: the proof stands (the caller checks the lease)
        await raise_failure(wire, self._what, self._failed)
        return False

    def wake(self, proven: bool) -> None:
        """Our own client deleted the key before ours (see ``Keys.gone``)."""
        self.proven = self.proven or proven
        self._wake()

    # -- told by the watch stream (Subscriber) -------------------------------------------------

    def on_created(self, revision: int) -> None:
        self._armed.append(revision)
        if len(self._armed) == 2:
            self._changed.set()

    def on_fired(self, events: Sequence[Any]) -> None:
        predecessor = self._predecessor
        if (
            events
            and predecessor in self._keys.releasing
            and all(bytes(event.kv.key) == predecessor for event in events)
        ):
            return  # our own release of it is in flight: its answer wakes us, with the proof
        self._wake()

    async def _first_look(self) -> list[float] | None:
        """Wait for the watches; the times to look again at (None: no wait is needed)."""
        await self._arm(2)
        armed, place = self._armed, self._place
        if self._local is not None or len(armed) < 2 or self._woke:
            return []
        if max(armed) > place.seen or place.near:
            try:
                return await self._after_watch(max(armed))
            except LockError as exc:  # raised by run(), out of the task group
                self._failed.append(exc)
        return []

    async def _gone(self) -> bool:
        """Whether the key before ours, or ours, is gone (a poll of :meth:`Wait._idle`)."""
        return not (await self._both_exist())[0]

    async def _after_watch(self, start: int) -> list[float] | None:
        """Once the watches exist (from revision ``start``): a read covers what happened since
        the place was read. Returns None if a watched key is already gone, ``[]`` if the
        watches can be trusted alone, else the times at which to look again.

        etcd 3.4 turns a watch "from now" into one from ``Rev() + 1`` before it locks its store;
        a write that commits in between leaves the watch "unsynced", and etcd delivers its
        events from a loop that runs every 100 ms. For the next waiter in line that would delay
        the hand-over by up to 100 ms, so it looks again a few times during that window, unless
        the read proves nothing was written since the watch started (so it is synced).
        """
        exists, revision = await self._both_exist()
        if not exists:
            return None
        if not self._place.near or revision <= start:
            return []
        now = anyio.current_time()
        return [now + delay for delay in UNSYNCED_POLLS]

    async def _both_exist(self) -> tuple[bool, int]:
        reply = await self._wire.txn(
            self._what,
            rpc.TxnRequest(
                success=[
                    range_op(self._predecessor, count_only=True),
                    range_op(self.own, count_only=True),
                ]
            ),
        )
        exists = all(response.response_range.count for response in reply.responses)
        return exists, int(reply.header.revision)
