"""The queue of one name, for every kind: taking a hold, queueing and waiting for it, and
leaving the queue. The kinds differ only by their rule (:mod:`._order`); a semaphore's own
steps (its permit count, its grant marks, its wait) are in :mod:`._permits`.

A lock's holder is the key with the lowest create revision under the name. A waiter waits only
for the key just before its own (see :mod:`._watch`). Before it reports success, a linearizable read
must have shown that its own key still exists with its create revision (so it is on a live
lease: etcd#11456 granted locks on dead leases) and that no lower key is left: its own read, or
the transaction of the release that deleted the key before it, when that key was this client's
(:meth:`Queue.release`, ``Keys.lowest``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

import anyio
from aetcd import rpc

from .._kit import (
    BackendUnavailable,
    CallOrder,
    LockError,
    LockRequest,
    ProvenGone,
    RetryPolicy,
    TaskHost,
    finish,
)
from ._errors import transient
from ._hub import WatchHub
from ._keys import Keys
from ._lease import ClientLease, EtcdGrant, Leases, lease_gone
from ._names import SHARED_MARK, blockers, lease_of, name_of, name_prefix, permit_value
from ._order import Rule, Standing, read_limit, rule, standing
from ._permits import PermitWait, enqueue_op, entered, free_guard, grant_request
from ._proto import create_is, delete_op, prefix_end, put_op, range_op
from ._urls import bucket
from ._watch import TurnWait
from ._wire import Wire, ended

__all__ = ("Attempt", "Queue")

#: Pauses of a wait between failed tries (a broken connection, no leader).
_FAILURES = RetryPolicy(first=0.02, cap=1.0)
#: A try whose every lease was gone by its request (ProvenGone) this many times raises.
_LEASE_TRIES: Final = 3
#: A semaphore's try reads, then takes a permit if nothing changed since: this many times when
#: something did (another holder came or left meanwhile), then it answers "busy".
_READ_TRIES: Final = 8


@dataclass(slots=True)
class Attempt:
    """One acquisition's place in the queue."""

    request: LockRequest
    bucket: int
    prefix: bytes
    #: What the hold waits for (see :mod:`._order`).
    rule: Rule
    lease: ClientLease | None = None
    #: Set just before the request that may create it is sent: from then on it may exist.
    key: bytes | None = None
    #: Its create revision once known (0 while unknown).
    rev: int = 0
    #: A request that may create ``key``, still in flight when we were cancelled.
    inflight: Any = None
    #: A request that may have created ``key`` failed or was given up (and sent again).
    ambiguous: bool = False

    def put(self) -> Any:
        assert self.key is not None and self.lease is not None
        request = self.request
        if request.kind == "election":
            value = request.value
        elif request.kind == "semaphore":
            value = permit_value(request.permits, waiting=False)
        else:
            value = request.owner.encode("ascii")
        return put_op(self.key, value, self.lease.id)

    def base(self, lease: ClientLease) -> bytes:
        """Our key's name on ``lease`` up to the owner id (see ``Keys.reuse``)."""
        mark = SHARED_MARK if self.request.shared else b""
        return self.prefix + mark + f"{lease.id:016x}-".encode("ascii")

    def own(self) -> bytes:
        """Our key (placed)."""
        assert self.key is not None
        return self.key

    def what(self, doing: str) -> str:
        """``doing`` a lock (an election's term, a reader) or a semaphore, by name."""
        noun = "semaphore" if self.rule.marked else "lock"
        return f"{doing} {noun} {self.request.name!r}"

    def grant(self) -> EtcdGrant:
        """The grant of our key, which holds (its lease keeps it)."""
        lease, key = self.lease, self.key
        assert lease is not None and key is not None and self.rev > 0
        grant = EtcdGrant(
            name=self.request.name,
            owner=self.request.owner,
            token=self.rev,
            valid_from=lease.valid_from,
            ttl=float(lease.ttl),
            key=key,
            lease_id=lease.id,
            on_lost=self.request.on_lost,
            space=self.request.kind,
        )
        lease.held.add(grant)
        return grant


@dataclass(slots=True)
class Queue:
    """Taking, waiting for and leaving locks, for one client."""

    _wire: Wire
    _leases: Leases
    _keys: Keys
    _host: TaskHost
    _hub: WatchHub
    #: The key prefix of every lock (the ``prefix`` option, encoded).
    _prefix: bytes
    _sending: CallOrder = field(default_factory=CallOrder)

    def attempt(self, request: LockRequest) -> Attempt:
        prefix = name_prefix(self._prefix, request.name, request.kind)
        order = rule(prefix, prefix_end(prefix), request.kind, request.shared, request.permits)
        return Attempt(request, bucket(request.ttl), prefix, order)

    def place(self, attempt: Attempt, lease: ClientLease) -> bytes:
        """Put the attempt's (next) key on ``lease``."""
        attempt.lease = lease
        base = attempt.base(lease)
        key = self._keys.reuse(base) if attempt.request.kind == "lock" else None
        attempt.key = key or base + attempt.request.owner.encode("ascii")
        attempt.rev = 0
        self._keys.placed(attempt.key)
        return attempt.key

    def requeue(self, attempt: Attempt) -> None:
        """Our key is gone (its lease expired or was revoked, or someone deleted it), or was
        never created: forget it."""
        if attempt.key is not None:
            self._keys.gone(attempt.key)
        attempt.key, attempt.rev = None, 0

    def hand_over(self, attempt: Attempt) -> EtcdGrant:
        grant = attempt.grant()
        self._keys.lowest.pop(grant.key, None)
        return grant

    def known_busy(self, attempt: Attempt) -> bool:
        """Whether a key of ours that this hold waits for is on a lease refreshed within half its
        ttl (so it exists, unless an operator deleted it just now): then the lock is not free,
        and a try needs no round trip (nor a write through raft, when a client's tasks take
        turns). Not for a semaphore: a key of ours may leave a permit free."""
        order, now = attempt.rule, anyio.current_time()
        if order.marked:
            return False
        for key in self._keys.by_name.get(attempt.prefix, ()):
            if not order.low <= key < order.high:
                continue  # a reader of ours does not keep another reader out
            lease = self._leases.by_id.get(lease_of(key))
            if lease is not None and lease.fresh(now):
                return True
        return False

    async def take_if_free(self, attempt: Attempt) -> bool:
        """Create our key only if it would hold at once: no key it waits for under the name
        (a semaphore: fewer keys than permits, none waiting)."""
        order, gone, changed = attempt.rule, 0, 0
        while gone < _LEASE_TRIES and changed < _READ_TRIES:
            # The compare under which the key is created (None: busy).
            if order.marked:
                guard = await free_guard(self._wire, attempt.request.name, order)
            else:
                guard = create_is(order.low, 0, range_end=order.high)
            if guard is None:
                return False
            lease = await self._leases.lease_for(attempt.bucket)
            key = self.place(attempt, lease)
            try:
                reply = await self._wire.txn(
                    attempt.what("taking a permit of" if order.marked else "taking"),
                    rpc.TxnRequest(
                        compare=[guard],
                        success=[attempt.put()],
                        # Our own key, in case an earlier try of this request created it.
                        failure=[range_op(key)],
                    ),
                    keep=attempt,
                )
            except ProvenGone:
                self.requeue(attempt)
                self._leases.died(lease, lease_gone(lease.id))
                gone += 1
                continue
            own = () if reply.succeeded else reply.responses[0].response_range.kvs
            if reply.succeeded or own:
                # Ours, by this send or by an earlier one (its answer lost) that found it free.
                attempt.rev = int(own[0].create_revision) if own else int(reply.header.revision)
                self._keys.settled(key)
                return True
            if attempt.ambiguous:
                # An earlier try might still land (it cannot, once etcd answered a later
                # request of ours, but be sure): the next sweep deletes whatever it made.
                self._keys.orphans[key] = 0
            else:
                self._keys.gone(key)
            attempt.key = None
            if not order.marked:
                return False  # the compare saw a key: busy
            changed += 1  # a semaphore changed since it was read: read it again
        if gone < _LEASE_TRIES:
            return False
        raise BackendUnavailable(
            f"{attempt.what('taking')} on {self._wire.describe}: every lease etcd "
            "granted was gone by the next request"
        )

    async def wait_for(self, attempt: Attempt) -> None:
        """Queue (or find our place again) and wait until our key holds. The first round trip
        takes a free lock as a try would (``acquire_tries_first``)."""
        failures = _FAILURES.backoff(window=2.0 * self._wire.settings.op_timeout)
        marked = attempt.rule.marked
        shortcuts = 0
        answered = attempt.request.answered
        while True:
            turn = None
            if not marked:
                # Made before the read, so that no delete after it is missed.
                turn = TurnWait(*self._waits, attempt.prefix, attempt.request.name)
                turn.begin()
            try:
                if attempt.rev == 0:
                    # In call order: etcd applies requests that arrive together in any order.
                    async with self._sending.turn(attempt.prefix):
                        if attempt.key is None or attempt.lease is None:
                            self.place(attempt, await self._leases.lease_for(attempt.bucket))
                        place = await self._enqueue(attempt)
                else:
                    place = await self._check(attempt)
                lease = attempt.lease
                assert lease is not None
                if place is None:
                    self.requeue(attempt)  # at the back
                    continue
                self._keys.settled(attempt.own())
                failures.reset()
                # The proof of a release before ours is a lock's only: a semaphore's key must
                # also wait for the grant marks of the keys before it.
                if place.holds or (not marked and self._keys.holds(attempt.own(), attempt.rev)):
                    if marked and not await self._grant(attempt):
                        self.requeue(attempt)
                    elif lease.fresh(anyio.current_time()):
                        return
                    # Our lease was not refreshed lately: prove it alive, then look again.
                    elif not await self._leases.refresh(lease):
                        self.requeue(attempt)
                    continue
                if not marked and self._keys.deleted(place.watch[0]) and shortcuts < 3:
                    # We deleted the key before ours after this read (our release's answer
                    # came first): read our place again rather than watch a deleted key.
                    shortcuts += 1
                    continue
                if answered is not None:
                    # The first attempt is over (a lock: one round trip; a semaphore's permit
                    # may need its grant mark too): the caller's timeout counts from now.
                    answered()
                    answered = None
                if turn is None:
                    # Close to a permit: the watch may be slow to tell (see PermitWait.run).
                    look = (lambda: self._moved(attempt)) if place.near else None
                    args = (*self._waits, attempt.own(), attempt.rev, place, attempt.request.name)
                    await PermitWait(*args).run(lease, look)
                elif await turn.run(lease, attempt.own(), attempt.rev, place) and lease.fresh(
                    anyio.current_time()
                ):
                    return  # every key before ours is gone, ours is not
            except ProvenGone:
                if attempt.lease is not None:
                    self._leases.died(attempt.lease, lease_gone(attempt.lease.id))
                self.requeue(attempt)
            except BackendUnavailable as exc:
                if self._wire.channel is None or not transient(exc):
                    raise
                await failures.pause(exc)
            finally:
                if turn is not None:
                    turn.end()

    @property
    def _waits(self) -> tuple[Wire, WatchHub, Leases, Keys]:
        return self._wire, self._hub, self._leases, self._keys

    async def _moved(self, attempt: Attempt) -> bool:
        """Whether our key may hold now, or is gone."""
        place = await self._check(attempt)
        return place is None or place.holds

    async def _grant(self, attempt: Attempt) -> bool:
        """Mark our (semaphore's) key granted; False if it is gone."""
        assert attempt.lease is not None
        request = grant_request(attempt.rule, attempt.own(), attempt.rev, attempt.lease.id)
        reply = await self._wire.txn(attempt.what("taking a permit of"), request)
        return bool(reply.succeeded)

    async def release(self, key: bytes, token: int, what: str, *, handover: bool = True) -> None:
        """Delete our key ``key`` (guarded on its create revision ``token``). When keys of
        ours wait under the name, the same transaction reads which key is the lowest after
        the delete: if it is ours, its waiter holds the lock without a round trip of its own
        (``Keys.lowest``). Not for a semaphore's permits (``handover=False``): their waiters
        count the keys before them."""
        keys = self._keys
        prefix = name_of(key)
        behind = list(keys.local.get(key, ()))
        if not token or not handover or not (behind or prefix in keys.unsettled):
            await keys.delete(key, token, what)
            return
        end = prefix_end(prefix)
        if len(behind) == 1:
            # The waiter right behind: is its key still there, with nothing before it that it
            # waits for (any key, or only writers for a reader)?
            # (Not count_only: etcd counts before it applies the create revision filter.)
            waiter = behind[0]
            low, high = blockers(waiter.own)
            reads = [
                range_op(waiter.own),
                range_op(low, high, max_create_revision=waiter.rev - 1, limit=1),
            ]
        else:
            # A key of ours whose place is not known yet (its request is on its way): the
            # lowest key left, whoever's it is. (Only then: etcd reads every key of the name
            # to sort them.)
            reads = [range_op(prefix, end, first="oldest", limit=1)]
        keys.releasing.add(key)
        try:
            reply = await self._wire.txn(
                what,
                rpc.TxnRequest(
                    compare=[create_is(key, token)],
                    # Read after the delete, in one transaction: they see it.
                    success=[delete_op(key), *reads],
                ),
            )
        except BaseException:
            # A waiter behind may have ignored the watch's event while this was in flight.
            for each in behind:
                each.wake(False, gone=False)
            raise
        finally:
            keys.releasing.discard(key)
        lowest: tuple[bytes, int] | None = None
        if reply.succeeded:
            found = reply.responses[1].response_range.kvs
            if len(behind) == 1:
                first = not reply.responses[2].response_range.kvs
                if first and found and int(found[0].create_revision) == behind[0].rev:
                    lowest = (behind[0].own, behind[0].rev)
            elif found:
                lowest = (bytes(found[0].key), int(found[0].create_revision))
        keys.gone(key, lowest)

    async def _enqueue(self, attempt: Attempt) -> Standing | None:
        """Create our key (or find it, after an ambiguous failure) and read the keys before it."""
        key, order, lease = attempt.own(), attempt.rule, attempt.lease
        assert lease is not None
        if order.marked:
            queue = [enqueue_op(order, key, lease.id)]
        else:
            # Our key was created last, so the newest keys are ours (unless it is a reader's),
            # the one before, and whether there is one before that.
            limit = read_limit(order, enqueue=True)
            queue = [attempt.put(), range_op(order.low, order.high, first="newest", limit=limit)]
        reply = await self._wire.txn(
            attempt.what("queueing for"),
            rpc.TxnRequest(compare=[create_is(key, 0)], success=queue, failure=[range_op(key)]),
            keep=attempt,
        )
        if not reply.succeeded:
            kvs = reply.responses[0].response_range.kvs
            if not kvs:  # pragma: no cover - the compare saw it, the read in the txn must too
                raise BackendUnavailable(f"etcd lost key {key!r} within one transaction")
            # Created by an earlier try whose answer was lost: keep its place.
            attempt.rev = int(kvs[0].create_revision)
            return await self._check(attempt)
        if not order.marked:
            kvs = reply.responses[1].response_range.kvs
        else:
            try:
                kvs = entered(attempt.request.name, order, reply.responses[0].response_txn)
            except LockError:
                # Nothing was created: forget the key before the caller withdraws it.
                self.requeue(attempt)
                raise
        attempt.rev = int(reply.header.revision)
        return _standing(order, kvs[1:] if order.own_in_range else kvs, attempt.rev)

    async def _check(self, attempt: Attempt) -> Standing | None:
        """One linearizable read: ``None`` if our key is gone, else our place."""
        order = attempt.rule
        limit = read_limit(order, enqueue=False)
        older = range_op(
            order.low,
            order.high,
            values=order.marked,
            first="newest",
            limit=limit,
            max_create_revision=attempt.rev - 1,
        )
        reply = await self._wire.txn(
            attempt.what("checking our place for"),
            rpc.TxnRequest(success=[range_op(attempt.own()), older]),
        )
        own = reply.responses[0].response_range.kvs
        if not own or int(own[0].create_revision) != attempt.rev:
            return None
        return _standing(order, reply.responses[1].response_range.kvs, int(reply.header.revision))

    async def abandon(self, attempt: Attempt) -> None:
        """Delete the key a failed or cancelled acquisition may have created.

        Runs to its end whatever cancels the caller, a native ``Task.cancel()`` included (see
        :func:`finish`), within twice ``op_timeout``: if its create request was still in
        flight, etcd must be done with it before the delete goes out (the delete travels on
        another stream and could overtake it), then the delete itself. What does not finish
        stays an orphan, deleted in the background (``TaskHost.deferred``) and by the next
        acquire, wait or renewal.
        """
        key, rev, inflight = attempt.key, attempt.rev, attempt.inflight
        attempt.key = None
        attempt.rev = 0
        attempt.inflight = None
        if key is None:
            return
        what = f"withdrawing from lock {attempt.request.name!r}"
        keys, op_timeout = self._keys, self._wire.settings.op_timeout

        async def withdraw() -> None:
            # Idempotent: finish() may run it again, from the start, in a task of its own.
            landed = inflight is None or await ended(inflight, op_timeout)
            try:
                await keys.delete(key, rev, what)
            except BaseException as exc:
                keys.orphans[key] = rev
                if isinstance(exc, LockError):
                    return  # quiet: the caller's own error or cancellation is what matters
                raise
            if landed:
                keys.orphans.pop(key, None)
            else:
                # The create may still land after the delete: look again later.
                keys.orphans[key] = rev

        def unfinished() -> None:
            keys.orphans[key] = rev
            self._host.deferred.retry(lambda: keys.delete_orphan(key, rev), what)

        await finish(withdraw, timeout=2.0 * op_timeout, what=what, unfinished=unfinished)


def _standing(order: Rule, older: Any, seen: int) -> Standing:
    return standing(
        order, [(bytes(kv.key), bytes(kv.value), int(kv.create_revision)) for kv in older], seen
    )
