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
from ._hub import NameWatch, WatchHub
from ._keys import Behind, Keys
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
    """A lock's wait (a reader's and an election's too): it follows the deletes of the keys
    before its own through the client's one watch on the name (``NameWatch``, from the
    revision right after the read that placed it), and holds, without a read of its own,
    once every key it read before its own is deleted and the read had them all (at most
    ``TRACKED``): a hand-over from another client costs one watch event.

    The wait is made (:meth:`begin`) before the read that places it is sent: if the client has
    a watch on the name, it is told every event of the name from then on, so that none is
    lost between the read and the wait; after the read (:meth:`run`) only those of its keys.
    When the key right before ours is this client's own, our release of it wakes us at once
    (``Keys.local``), with the proof its transaction read.
    """

    __slots__ = (
        "_complete",
        "_deletes",
        "_followed",
        "_local",
        "_lost",
        "_older",
        "_placed",
        "_prefix",
        "_stale",
        "_watch",
        "proven",
    )

    def __init__(
        self, wire: Wire, hub: WatchHub, leases: Leases, keys: Keys, prefix: bytes, name: str
    ) -> None:
        super().__init__(wire, hub, leases, keys, b"", 0, _NOWHERE, name)
        self._prefix = prefix
        #: Set by the release of the key before ours when it proved our key the lowest.
        self.proven = False
        self._watch: NameWatch | None = None
        self._local: list[Behind] | None = None
        #: The last delete seen of each key (events before our place was known).
        self._deletes: dict[bytes, int] = {}
        #: The keys before ours still there, with their create revisions; ``_complete``:
        #: they are all of them.
        self._older: dict[bytes, int] = {}
        self._complete = False
        self._followed: tuple[bytes, ...] = ()
        self._placed = self._lost = self._stale = False

    def begin(self) -> None:
        """Before the read: keep every event of the name's watch, if the client has one."""
        watch = self._hub.current_name_watch(self._prefix)
        if watch is not None:
            watch.add_all(self)
            self._watch = watch

    def end(self) -> None:
        """Leave the watch (no await: nothing can interrupt it)."""
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.remove_all(self)
            watch.remove(self, self._followed)
        local, self._local = self._local, None
        if local is not None and self in local:
            local.remove(self)

    def _follow(self, own: bytes, rev: int, place: Standing) -> bool:
        """Our place as read; False if the name's watch does not cover the time since."""
        self.own, self.rev, self._place = own, rev, place
        deletes = self._deletes
        self._older = {key: made for key, made in place.older if deletes.get(key, 0) <= made}
        self._complete = place.complete
        self._lost = deletes.get(own, 0) > rev
        self._placed = True
        watch = self._watch
        if watch is None:
            watch = self._hub.stream().name_watch(self._prefix, place.seen + 1)
            if watch.start > place.seen + 1:
                return False  # made after another read of ours, later than this one
            self._watch = watch
        self._followed = (*self._older, own)
        watch.add(self, self._followed)
        watch.remove_all(self)
        return True

    async def run(self, lease: ClientLease, own: bytes, rev: int, place: Standing) -> bool:
        """Whether our key holds: the release before ours proved it, or every key before it
        was deleted (False: look again)."""
        if not self._follow(own, rev, place):
            return False
        local = self._keys.local.get(place.watch[0])
        if local is not None:
            local.append(self)
            self._local = local
        try:
            if not self._settled():
                await self._arm(1)
                watch, now = self._watch, anyio.current_time()
                near = self._complete and len(self._older) <= 1 and local is None
                polls: list[float] = []
                if near and watch is not None and watch.maybe_unsynced(now):
                    polls = [now + delay for delay in UNSYNCED_POLLS]
                await self._idle(lease, polls, self._gone)
        finally:
            self.end()
        if self.proven or self._turn():
            return True  # whatever failed since: the proof stands (the caller checks the lease)
        await raise_failure(self._wire, self._what, self._failed)
        return False

    def _turn(self) -> bool:
        """Every key before ours is gone, and ours is not."""
        return self._complete and not self._older and not self._lost and not self._stale

    def _settled(self) -> bool:
        """Whether to stop waiting: we hold, or must look again."""
        if self._lost or self._stale or (self._complete and not self._older):
            return True
        if self._local is None:
            return not self._older  # the keys we followed are gone, not all before ours
        # Behind a key of ours: our release of it wakes us, with the proof when ours is next
        # (a read of our own would only come before it); its delete by anyone else, at once.
        predecessor = self._place.watch[0]
        return predecessor not in self._older and predecessor not in self._keys.releasing

    def wake(self, proven: bool, *, gone: bool = True) -> None:
        """Our own client deleted the key before ours (see ``Keys.gone``): we hold if its
        release proved it, or if it was the last key before ours we followed; else we wait on
        (a waiter further back: no read)."""
        self.proven = self.proven or proven
        if gone and self._placed:
            self._older.pop(self._place.watch[0], None)
        if self.proven or not gone or not self._placed or self._settled():
            self._wake()

    # -- told by the watch stream (Subscriber) -------------------------------------------------

    def on_fired(self, events: Sequence[Any]) -> None:
        if not events:  # the watch ended: look again
            self._stale = True
            self._wake()
            return
        for event in events:
            key, revision = bytes(event.kv.key), int(event.kv.mod_revision)
            if not self._placed:
                self._deletes[key] = max(self._deletes.get(key, 0), revision)
                continue
            made = self._older.get(key)
            if made is not None and revision > made:
                del self._older[key]
            elif key == self.own and revision > self.rev:
                self._lost = True
        if self._placed and self._settled():
            self._wake()

    async def _gone(self) -> bool:
        """A poll of :meth:`Wait._idle` (our watch may be late): whether the one key before
        ours, or ours, is gone."""
        (key, made), *_ = self._older.items()
        reply = await self._wire.txn(
            self._what, rpc.TxnRequest(success=[range_op(key), range_op(self.own)])
        )
        before, ours = (response.response_range.kvs for response in reply.responses)
        if not ours or int(ours[0].create_revision) != self.rev:
            self._lost = True
        elif not before or int(before[0].create_revision) != made:
            self._older.pop(key, None)
        return self._settled()


#: The place of a wait not placed yet.
_NOWHERE: Final = Standing(holds=False, watch=(), puts_matter=False, near=False, seen=0)
