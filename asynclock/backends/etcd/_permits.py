"""What only a semaphore does, for the one queue of :mod:`._queue`: its permit count, its grant
marks, and its wait on the keys before its own. One key per hold under the semaphore's name,
each on its holder's lease (so a crashed holder frees exactly its own permits, when its lease
expires).

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

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
from aetcd import rpc

from .._kit import BackendUnavailable
from ._hub import delete_watch
from ._lease import ClientLease
from ._names import permit_value, permit_values
from ._order import Rule, check_permits, may_try, read_limit
from ._proto import create_is, mod_below, put_op, range_op, values_within
from ._watch import UNSYNCED_POLLS, Wait, raise_failure
from ._wire import Wire

__all__ = ("PermitWait", "enqueue_op", "entered", "free_guard", "grant_request")


async def free_guard(wire: Wire, name: str, rule: Rule) -> Any | None:
    """For a try: read the semaphore, and return a compare that holds while nothing changed
    since (still fewer keys than permits, all granted, all with our number), or None if no
    permit is free. (etcd cannot compare a count: hence the read.)"""
    seen = await wire.txn(
        f"reading semaphore {name!r}",
        rpc.TxnRequest(success=[range_op(rule.low, rule.high, values=True, limit=rule.permits)]),
    )
    found = seen.responses[0].response_range
    values = [bytes(kv.value) for kv in found.kvs]
    if values:
        check_permits(name, rule.permits, values[0])
    if not may_try(rule, int(found.count), values):
        return None
    return mod_below(rule.low, int(seen.header.revision) + 1, rule.high)


def enqueue_op(rule: Rule, own: bytes, lease_id: int) -> Any:
    """Create our key ``own``, waiting, if every key of the name has our number of permits (or
    there is none), and read it and the keys before it (see :func:`entered`)."""
    then = [
        put_op(own, permit_value(rule.permits, waiting=True), lease_id),
        range_op(
            rule.low, rule.high, values=True, first="newest", limit=read_limit(rule, enqueue=True)
        ),
    ]
    if_empty = rpc.TxnRequest(
        compare=[create_is(rule.low, 0, range_end=rule.high)],
        success=then,
        # One key, with its value: the number it was created with.
        failure=[range_op(rule.low, rule.high, values=True, limit=1)],
    )
    same = rpc.TxnRequest(
        compare=values_within(rule.low, *permit_values(rule.permits), rule.high),
        success=then,
        failure=[rpc.RequestOp(request_txn=if_empty)],
    )
    return rpc.RequestOp(request_txn=same)


def entered(name: str, rule: Rule, reply: Any) -> Sequence[Any]:
    """The keys that :func:`enqueue_op`'s transaction (answered ``reply``) read, ours first;
    raise ``permits_mismatch`` if it created nothing."""
    if not reply.succeeded:
        reply = reply.responses[0].response_txn
        if not reply.succeeded:
            found = reply.responses[0].response_range.kvs
            check_permits(name, rule.permits, bytes(found[0].value) if found else b"")
            raise BackendUnavailable(  # pragma: no cover - the compares say otherwise
                f"queueing for semaphore {name!r}: etcd refused the permit count"
            )
    kvs: Sequence[Any] = reply.responses[1].response_range.kvs
    return kvs


def grant_request(rule: Rule, own: bytes, rev: int, lease_id: int) -> Any:
    """Mark our key granted (so the keys behind may be granted too); it fails if the key is
    gone. Idempotent: a put guarded on the key's create revision."""
    return rpc.TxnRequest(
        compare=[create_is(own, rev)],
        success=[put_op(own, permit_value(rule.permits, waiting=False), lease_id)],
    )


class PermitWait(Wait):
    """One wait for a permit: returns when one of the (up to N) keys just before ours, or ours,
    is deleted (or, once ours may hold, an older one is marked granted), or to look again;
    raises what went wrong. Its watches ride on the client's stream.

    Watching the N keys just before ours is enough: ours may hold once fewer than N keys are
    older, so at least one of those N must go first (the keys before them are too few to make
    up the difference). So a release wakes at most N waiters, not the whole queue."""

    __slots__ = ()
    noun = "semaphore"

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
        place = self._place
        start = place.seen + 1
        requests = [delete_watch(self.own, start)]
        for key in place.watch:
            # An older key marked granted matters only when ours may hold already.
            if place.puts_matter:
                requests.append(rpc.WatchCreateRequest(key=key, start_revision=start))
            else:
                requests.append(delete_watch(key, start))
        stream.add(self, requests)
        try:
            await self._arm(len(requests))
            now = anyio.current_time()
            unsynced = look is not None and max(self._armed, default=0) > place.seen
            await self._idle(
                lease, [now + delay for delay in UNSYNCED_POLLS] if unsynced else [], look
            )
        finally:
            stream.drop(self)  # no await: nothing can interrupt it
        await raise_failure(self._wire, self._what, self._failed)
