"""A semaphore's permits: one key per hold under the semaphore's name, each on its holder's
lease (so a crashed holder frees exactly its own permits, when its lease expires).

A key holds a permit while fewer than ``permits`` keys of the name are older (FIFO: the first
``permits`` keys by create revision hold). Every key's value is the number of permits, and a
key is only created while every key of the name has the same value (or there is none), in the
transaction that creates it: a request with another number is refused before it leaves
anything behind (:func:`permits_mismatch`).

A waiter cannot wait for one key, as a lock's does: any of the keys before its own may be the
one whose delete lets it in. It watches the deletes of the whole name, from the revision of the
read that placed it (so it misses none), and looks again only after the delete of a key older
than its own (etcd sends the deleted key's create revision with ``prev_kv``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import anyio
from aetcd import rpc

from .._kit import (
    RENEWAL,
    BackendTimeout,
    BackendUnavailable,
    LockRequest,
    ProvenGone,
    RetryPolicy,
    permits_mismatch,
)
from ._errors import transient
from ._hub import WatchHub
from ._keys import Keys
from ._lease import ClientLease, Leases, lease_gone
from ._proto import create_is, mod_below, range_op, value_is
from ._queue import Attempt, Queue
from ._watch import raise_failure
from ._wire import Wire

__all__ = ("Permits",)

#: Pauses of a wait between failed tries (a broken connection, no leader).
_FAILURES = RetryPolicy(first=0.02, cap=1.0)
#: A try reads the semaphore, then takes a permit if nothing changed since: this many times
#: when something did (another holder came or left meanwhile).
_TRIES: Final = 8
#: A waiter reads its place again this often even without a watch event.
_RECHECK_EVERY: Final = 30.0

#: Whether our key holds a permit, and the revision of the read that said so (None: our key
#: is gone).
Spot = tuple[bool, int] | None


def _check_permits(request: LockRequest, value: bytes) -> None:
    try:
        held = int(value)
    except ValueError:
        held = 0
    if held != request.permits:
        raise permits_mismatch(request.name, held, request.permits)


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
        """Create our key only if fewer than ``permits`` keys of the name exist."""
        request = attempt.request
        wire = self._wire
        for _ in range(_TRIES):
            seen = await wire.call(
                f"reading semaphore {request.name!r}",
                lambda md, timeout: wire.kv.Range(
                    rpc.RangeRequest(key=attempt.prefix, range_end=attempt.end, limit=1),
                    timeout=timeout,
                    metadata=md,
                ),
            )
            if seen.kvs:
                _check_permits(request, bytes(seen.kvs[0].value))
            if int(seen.count) >= request.permits:
                return False
            lease = await self._leases.lease_for(attempt.bucket)
            key = self._queue.place(attempt, lease)
            try:
                reply = await wire.txn(
                    f"taking a permit of semaphore {request.name!r}",
                    rpc.TxnRequest(
                        # Nothing created or changed since the read: still fewer keys than
                        # permits, all with our number.
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
                holds, seen = spot
                if holds:
                    if lease.fresh(anyio.current_time()):
                        return
                    if not await self._leases.refresh(lease):
                        self._queue.requeue(attempt)
                    continue
                wait = PermitWait(self._wire, self._hub, self._leases, self._keys, attempt, seen)
                await wait.run(lease)
            except ProvenGone:
                if attempt.lease is not None:
                    self._leases.died(attempt.lease, lease_gone(attempt.lease.id))
                self._queue.requeue(attempt)
            except BackendUnavailable as exc:
                if self._wire.channel is None or not transient(exc):
                    raise
                await failures.pause(exc)

    async def _enqueue(self, attempt: Attempt) -> Spot:
        """Create our key if every key of the name has our number of permits (or there is
        none), and read whether it holds one; raise ``permits_mismatch`` if not."""
        request, key = attempt.request, attempt.own()
        permits = request.permits
        # Ours and the ``permits`` keys before it, if there are that many.
        then = [attempt.put(), attempt.newest(permits + 1)]
        if_empty = rpc.TxnRequest(
            compare=[create_is(attempt.prefix, 0, range_end=attempt.end)],
            success=then,
            # One key, with its value: the number it was created with.
            failure=[
                rpc.RequestOp(
                    request_range=rpc.RangeRequest(
                        key=attempt.prefix, range_end=attempt.end, limit=1
                    )
                )
            ],
        )
        same = rpc.TxnRequest(
            compare=[value_is(attempt.prefix, str(permits).encode("ascii"), attempt.end)],
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
        return len(inner.responses[1].response_range.kvs) <= permits, attempt.rev

    async def _check(self, attempt: Attempt) -> Spot:
        """One linearizable read: ``None`` if our key is gone, else whether it holds."""
        permits = attempt.request.permits
        reply = await self._wire.txn(
            f"checking our place for semaphore {attempt.request.name!r}",
            rpc.TxnRequest(
                success=[
                    range_op(attempt.own()),
                    range_op(
                        attempt.prefix,
                        attempt.end,
                        max_create_revision=attempt.rev - 1,
                        limit=permits,
                    ),
                ]
            ),
        )
        own = reply.responses[0].response_range.kvs
        if not own or int(own[0].create_revision) != attempt.rev:
            return None
        older = len(reply.responses[1].response_range.kvs)
        return older < permits, int(reply.header.revision)


class PermitWait:
    """One wait for a permit: returns when a key older than ours (or ours) was deleted, or to
    look again; raises what went wrong. Its watch rides on the client's stream."""

    __slots__ = (
        "_changed",
        "_created",
        "_end",
        "_failed",
        "_hub",
        "_keys",
        "_leases",
        "_prefix",
        "_rev",
        "_seen",
        "_what",
        "_wire",
        "_woke",
    )  # fmt: skip

    def __init__(
        self, wire: Wire, hub: WatchHub, leases: Leases, keys: Keys, attempt: Attempt, seen: int
    ) -> None:
        self._wire, self._hub, self._leases, self._keys = wire, hub, leases, keys
        self._prefix, self._end = attempt.prefix, attempt.end
        self._rev, self._seen = attempt.rev, seen
        self._what = f"waiting for semaphore {attempt.request.name!r}"
        self._changed = anyio.Event()
        self._created = False
        self._woke = False
        self._failed: list[BaseException] = []

    async def run(self, lease: ClientLease) -> None:
        stream = self._hub.stream()
        request = rpc.WatchCreateRequest(
            key=self._prefix,
            range_end=self._end,
            # From just after the read that placed us: no delete since is missed.
            start_revision=self._seen + 1,
            filters=[rpc.WatchCreateRequest.NOPUT],
            prev_kv=True,
        )
        stream.add(self, [request])
        try:
            await self._idle(lease)
        finally:
            stream.drop(self)  # no await: nothing can interrupt it
        await raise_failure(self._wire, self._what, self._failed)

    async def _idle(self, lease: ClientLease) -> None:
        op_timeout = self._wire.settings.op_timeout
        with anyio.move_on_after(op_timeout):
            await self._changed.wait()
        if not (self._created or self._woke or self._failed):
            self._failed.append(
                BackendTimeout(
                    f"{self._what} on {self._wire.describe}: etcd did not create the watch "
                    f"within {op_timeout:g} s (op_timeout)"
                )
            )
            return
        recheck_at = anyio.current_time() + _RECHECK_EVERY
        while not self._woke and not self._failed and not lease.dead:
            now = anyio.current_time()
            # Another waiter's keepalive is in flight: look again when a retry would be due.
            due = RENEWAL.retry_at(now, lease.ttl) if lease.refreshing else lease.refresh_due()
            self._changed = anyio.Event()
            with anyio.move_on_at(min(due, recheck_at)):
                await self._changed.wait()
            if self._woke or self._failed or anyio.current_time() >= recheck_at:
                return
            # Our key rides on the lease: keep it alive while we wait.
            if await self._leases.refresh_if_due(lease) and self._keys.orphans:
                await self._keys.sweep()

    def _wake(self) -> None:
        self._woke = True
        self._changed.set()

    # -- told by the watch stream (Subscriber) -------------------------------------------------

    def on_created(self, revision: int) -> None:
        self._created = True
        self._changed.set()

    def on_fired(self, events: Sequence[Any]) -> None:
        # Only a key as old as ours (or ours) changes our place; a newer one's delete, not.
        if not events or any(
            not event.HasField("prev_kv") or int(event.prev_kv.create_revision) <= self._rev
            for event in events
        ):
            self._wake()

    def on_failed(self, error: BaseException) -> None:
        self._failed.append(error)
        self._wake()
