"""A semaphore's permits: one key per hold under the semaphore's name, each on its holder's
lease (so a crashed holder frees exactly its own permits, when its lease expires).

A key may hold a permit while fewer than ``permits`` keys of the name are older (FIFO: the first
``permits`` keys by create revision). Permits are also *granted* in that order, across clients:
a key is created "waiting" (value ``b"N;w"``) and its holder marks it granted (``b"N;"``, a put
guarded on its create revision) before it reports the permit, and only once every older key is
marked granted. Without that, two waiters let in by the same releases would each report its
permit in whatever order their reads came back: later waiters (and higher tokens) first. A try
creates its key granted, and only when no key waits. A key created holding costs that one more
put; a key whose waiter died while marked waiting holds the ones behind it until its lease ends.

Every key's value starts with the number of permits, and a key is only created while every key
of the name has the same number (or there is none), in the transaction that creates it: a request
with another number is refused before it leaves anything behind (:func:`permits_mismatch`).

A waiter cannot wait for one key, as a lock's does: any of the keys before its own may be the
one whose delete lets it in. It watches the ``permits`` keys just before its own (one of them
must go before it may hold) and its own, from the revision of the read that placed it (so it
misses nothing), and looks again when one is deleted or, once it may hold, when an older one is
marked granted (see :class:`PermitWait`). A release wakes at most ``permits`` waiters.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import anyio
from aetcd import rpc

from .._kit import (
    RENEWAL,
    BackendTimeout,
    BackendUnavailable,
    LockError,
    LockRequest,
    ProvenGone,
    RetryPolicy,
    permits_mismatch,
)
from ._errors import transient
from ._hub import WatchHub, delete_watch
from ._keys import Keys
from ._lease import ClientLease, Leases, lease_gone
from ._names import permit_value, permit_values, permits_of, waiting_permit
from ._proto import create_is, mod_below, put_op, range_op, values_within
from ._queue import Attempt, Queue
from ._watch import UNSYNCED_POLLS, raise_failure
from ._wire import Wire

__all__ = ("Permits",)

#: Pauses of a wait between failed tries (a broken connection, no leader).
_FAILURES = RetryPolicy(first=0.02, cap=1.0)
#: A try reads the semaphore, then takes a permit if nothing changed since: this many times
#: when something did (another holder came or left meanwhile).
_TRIES: Final = 8
#: A waiter reads its place again this often even without a watch event.
_RECHECK_EVERY: Final = 30.0


@dataclass(frozen=True, slots=True)
class Spot:
    """Where our key stands, as one read saw it."""

    #: How many keys are older than ours (counted up to ``permits + 1``).
    older: int
    #: Whether every older key is marked granted.
    ready: bool
    #: The revision of the read.
    seen: int
    #: The (up to ``permits``) newest keys older than ours: one of them goes before ours may
    #: hold, so the wait watches them.
    before: tuple[bytes, ...] = ()


def _check_permits(request: LockRequest, value: bytes) -> None:
    held = permits_of(value)
    if held != request.permits:
        raise permits_mismatch(request.name, held, request.permits)


def _values(kvs: Sequence[Any]) -> list[bytes]:
    return [bytes(kv.value) for kv in kvs]


def _read(key: bytes, end: bytes, **fields: Any) -> Any:
    """A read of keys with their values (``range_op`` reads keys only)."""
    return rpc.RequestOp(request_range=rpc.RangeRequest(key=key, range_end=end, **fields))


def _spot(older: Sequence[Any], attempt: Attempt, seen: int = 0) -> Spot:
    """Our place, from the newest keys older than ours (newest first, up to ``permits + 1``)."""
    values = _values(older)
    return Spot(
        len(older),
        not any(map(waiting_permit, values)),
        seen or attempt.rev,
        tuple(bytes(kv.key) for kv in older[: attempt.request.permits]),
    )


class Permits:
    """Taking and waiting for a semaphore's permits, for one client (leaving is the lock
    queue's: the key of an acquisition is deleted the same way)."""

    def __init__(self, wire: Wire, leases: Leases, keys: Keys, hub: WatchHub, queue: Queue) -> None:
        self._wire = wire
        self._leases = leases
        self._keys = keys
        self._hub = hub
        self._queue = queue

    async def take_if_free(self, attempt: Attempt) -> bool:
        """Create our key, granted, only if fewer than ``permits`` keys of the name exist and
        none of them waits."""
        request = attempt.request
        wire = self._wire
        for _ in range(_TRIES):
            seen = await wire.txn(
                f"reading semaphore {request.name!r}",
                rpc.TxnRequest(success=[_read(attempt.prefix, attempt.end, limit=request.permits)]),
            )
            found = seen.responses[0].response_range
            values = _values(found.kvs)
            if values:
                _check_permits(request, values[0])
            if int(found.count) >= request.permits or any(map(waiting_permit, values)):
                return False
            lease = await self._leases.lease_for(attempt.bucket)
            key = self._queue.place(attempt, lease)
            try:
                reply = await wire.txn(
                    f"taking a permit of semaphore {request.name!r}",
                    rpc.TxnRequest(
                        # Nothing created or changed since the read: still fewer keys than
                        # permits, all granted, all with our number.
                        compare=[
                            mod_below(attempt.prefix, int(seen.header.revision) + 1, attempt.end)
                        ],
                        success=[attempt.put()],
                        failure=[range_op(key)],
                    ),
                    keep=attempt,
                )
            except ProvenGone:
                self._keys.gone(key)
                attempt.key = None
                self._leases.died(lease, lease_gone(lease.id))
                continue
            own = reply.responses[0].response_range.kvs if not reply.succeeded else ()
            if reply.succeeded or own:
                # Ours (by this send, or by an earlier one whose answer was lost, which found
                # the same room).
                attempt.rev = int(own[0].create_revision) if own else int(reply.header.revision)
                self._keys.settled(key)
                return True
            if attempt.ambiguous:
                self._keys.orphans[key] = 0
            else:
                self._keys.gone(key)
            attempt.key = None
        return False

    async def wait_for(self, attempt: Attempt) -> None:
        """Queue (or find our place again) and wait until our key holds a permit."""
        failures = _FAILURES.backoff(window=2.0 * self._wire.settings.op_timeout)
        permits = attempt.request.permits
        while True:
            try:
                if attempt.rev == 0:
                    if attempt.key is None or attempt.lease is None:
                        self._queue.place(attempt, await self._leases.lease_for(attempt.bucket))
                    spot = await self._enqueue(attempt)
                else:
                    spot = await self._check(attempt)
                lease = attempt.lease
                assert lease is not None
                if spot is None:
                    self._queue.requeue(attempt)  # at the back
                    continue
                self._keys.settled(attempt.own())
                failures.reset()
                if spot.older < permits and spot.ready:
                    if not await self._grant(attempt):
                        self._queue.requeue(attempt)
                    elif lease.fresh(anyio.current_time()):
                        return
                    elif not await self._leases.refresh(lease):
                        self._queue.requeue(attempt)
                    continue
                wait = PermitWait(self._wire, self._hub, self._leases, self._keys, attempt, spot)
                # Close to a permit: the watch may be slow to tell (see PermitWait.run).
                near = spot.older <= permits
                await wait.run(lease, functools.partial(self._moved, attempt) if near else None)
            except ProvenGone:
                if attempt.lease is not None:
                    self._leases.died(attempt.lease, lease_gone(attempt.lease.id))
                self._queue.requeue(attempt)
            except BackendUnavailable as exc:
                if self._wire.channel is None or not transient(exc):
                    raise
                await failures.pause(exc)

    async def _enqueue(self, attempt: Attempt) -> Spot | None:
        """Create our key, waiting, if every key of the name has our number of permits (or
        there is none), and read the keys before it; raise ``permits_mismatch`` if not."""
        request, key, lease = attempt.request, attempt.own(), attempt.lease
        assert lease is not None
        permits = request.permits
        # Ours and the ``permits + 1`` keys before it, if there are that many.
        then = [
            put_op(key, permit_value(permits, waiting=True), lease.id),
            _read(
                attempt.prefix,
                attempt.end,
                sort_target=rpc.RangeRequest.CREATE,
                sort_order=rpc.RangeRequest.DESCEND,
                limit=permits + 2,
            ),
        ]
        if_empty = rpc.TxnRequest(
            compare=[create_is(attempt.prefix, 0, range_end=attempt.end)],
            success=then,
            # One key, with its value: the number it was created with.
            failure=[_read(attempt.prefix, attempt.end, limit=1)],
        )
        same = rpc.TxnRequest(
            compare=values_within(attempt.prefix, *permit_values(permits), attempt.end),
            success=then,
            failure=[rpc.RequestOp(request_txn=if_empty)],
        )
        reply = await self._wire.txn(
            f"queueing for semaphore {request.name!r}",
            rpc.TxnRequest(
                compare=[create_is(key, 0)],
                success=[rpc.RequestOp(request_txn=same)],
                failure=[range_op(key)],
            ),
            keep=attempt,
        )
        if not reply.succeeded:
            own = reply.responses[0].response_range.kvs
            if not own:  # pragma: no cover - the compare saw it, the read in the txn must too
                raise BackendUnavailable(f"etcd lost key {key!r} within one transaction")
            # Created by an earlier try whose answer was lost: keep its place.
            attempt.rev = int(own[0].create_revision)
            return await self._check(attempt)
        inner = reply.responses[0].response_txn
        if not inner.succeeded:
            inner = inner.responses[0].response_txn
            if not inner.succeeded:
                # Nothing was created: forget the key before the caller withdraws it.
                self._keys.gone(key)
                attempt.key = None
                found = inner.responses[0].response_range.kvs
                _check_permits(request, bytes(found[0].value) if found else b"")
                raise BackendUnavailable(  # pragma: no cover - the compares say otherwise
                    f"queueing for semaphore {request.name!r}: etcd refused the permit count"
                )
        attempt.rev = int(reply.header.revision)
        return _spot(inner.responses[1].response_range.kvs[1:], attempt)

    async def _check(self, attempt: Attempt) -> Spot | None:
        """One linearizable read: ``None`` if our key is gone, else our place."""
        permits = attempt.request.permits
        reply = await self._wire.txn(
            f"checking our place for semaphore {attempt.request.name!r}",
            rpc.TxnRequest(
                success=[
                    range_op(attempt.own()),
                    _read(
                        attempt.prefix,
                        attempt.end,
                        max_create_revision=attempt.rev - 1,
                        sort_target=rpc.RangeRequest.CREATE,
                        sort_order=rpc.RangeRequest.DESCEND,
                        limit=permits + 1,
                    ),
                ]
            ),
        )
        own = reply.responses[0].response_range.kvs
        if not own or int(own[0].create_revision) != attempt.rev:
            return None
        return _spot(reply.responses[1].response_range.kvs, attempt, int(reply.header.revision))

    async def _grant(self, attempt: Attempt) -> bool:
        """Mark our key granted (so the keys behind may be granted too); False if it is gone.
        Idempotent: a put guarded on the key's create revision."""
        lease = attempt.lease
        assert lease is not None
        value = permit_value(attempt.request.permits, waiting=False)
        reply = await self._wire.txn(
            f"taking a permit of semaphore {attempt.request.name!r}",
            rpc.TxnRequest(
                compare=[create_is(attempt.own(), attempt.rev)],
                success=[put_op(attempt.own(), value, lease.id)],
            ),
        )
        return bool(reply.succeeded)

    async def _moved(self, attempt: Attempt) -> bool:
        """Whether our key may be granted now, or is gone."""
        spot = await self._check(attempt)
        return spot is None or (spot.older < attempt.request.permits and spot.ready)


class PermitWait:
    """One wait for a permit: returns when one of the (up to N) keys just before ours, or ours,
    is deleted (or, once ours may hold, an older one is marked granted), or to look again;
    raises what went wrong. Its watches ride on the client's stream.

    Watching the N keys just before ours is enough: ours may hold once fewer than N keys are
    older, so at least one of those N must go first (the keys before them are too few to make
    up the difference). So a release wakes at most N waiters, not the whole queue."""

    __slots__ = (
        "_armed",
        "_before",
        "_changed",
        "_failed",
        "_hub",
        "_keys",
        "_leases",
        "_own",
        "_puts_matter",
        "_seen",
        "_what",
        "_wire",
        "_woke",
    )  # fmt: skip

    def __init__(
        self, wire: Wire, hub: WatchHub, leases: Leases, keys: Keys, attempt: Attempt, spot: Spot
    ) -> None:
        self._wire, self._hub, self._leases, self._keys = wire, hub, leases, keys
        self._own, self._before, self._seen = attempt.own(), spot.before, spot.seen
        #: An older key marked granted matters only when ours may hold already.
        self._puts_matter = spot.older < attempt.request.permits
        self._what = f"waiting for semaphore {attempt.request.name!r}"
        self._changed = anyio.Event()
        #: The revisions at which etcd created our watches.
        self._armed: list[int] = []
        self._woke = False
        self._failed: list[BaseException] = []

    async def run(self, lease: ClientLease, look: Callable[[], Awaitable[bool]] | None) -> None:
        """Wait; ``look`` (when we are close to a permit) reads whether our place changed, for
        the polls below.

        The watches start in the past (just after our read), and when anything was written
        since, etcd makes them "unsynced" and delivers their events from a loop that runs
        every 100 ms: then ``look`` is called a few times in that window (as a lock's next
        waiter does, see ``TurnWait._after_watch``), so that a permit freed just after our
        read is taken at once, in queue order, rather than up to 100 ms later."""
        stream = self._hub.stream()
        # From just after the read that placed us: no change since is missed.
        start = self._seen + 1
        requests = [delete_watch(self._own, start)]
        for key in self._before:
            if self._puts_matter:
                requests.append(rpc.WatchCreateRequest(key=key, start_revision=start))
            else:
                requests.append(delete_watch(key, start))
        stream.add(self, requests)
        try:
            await self._idle(lease, look, len(requests))
        finally:
            stream.drop(self)  # no await: nothing can interrupt it
        await raise_failure(self._wire, self._what, self._failed)

    async def _idle(
        self, lease: ClientLease, look: Callable[[], Awaitable[bool]] | None, watches: int
    ) -> None:
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
            return
        now = anyio.current_time()
        recheck_at = now + _RECHECK_EVERY
        unsynced = look is not None and max(self._armed, default=0) > self._seen
        polls = [now + delay for delay in UNSYNCED_POLLS] if unsynced else []
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

    def _wake(self) -> None:
        self._woke = True
        self._changed.set()

    # -- told by the watch stream (Subscriber) -------------------------------------------------

    def on_created(self, revision: int) -> None:
        self._armed.append(revision)
        self._changed.set()

    def on_fired(self, events: Sequence[Any]) -> None:
        # Every event of our watches matters (their filters leave out the rest).
        self._wake()

    def on_failed(self, error: BaseException) -> None:
        self._failed.append(error)
        self._wake()
