"""What the store says about a name of any kind (``inspect``), and the wait for a change of
it (``wait_for_change``, through the client's watch stream)."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import takewhile
from typing import Any, Final

import anyio
from aetcd import rpc

from .._kit import HolderInfo, Kind, LockError, LockInfo
from ._hub import WatchHub
from ._names import is_shared, lease_of, name_prefix, owner_of, permits_of, waiting_permit
from ._proto import prefix_end, range_op
from ._wire import Wire

__all__ = ("Inspector",)

#: After the watch stream failed, how long ``wait_for_change`` waits before the caller looks
#: again (the next call opens a new stream).
_FAILED_PAUSE: Final = 0.1


def _holding(kvs: Sequence[Any], kind: Kind) -> tuple[Sequence[Any], int | None]:
    """The keys that hold (oldest first), and a semaphore's number of permits."""
    if kind == "semaphore":
        permits = max(1, permits_of(bytes(kvs[0].value)))
        # Among the first N, a key still marked waiting is about to be granted (or its
        # holder died and its lease is running out): not a holder yet.
        first = kvs[:permits]
        return [kv for kv in first if not waiting_permit(bytes(kv.value))], permits
    if kind == "lock" and is_shared(bytes(kvs[0].key)):
        # Readers hold up to the oldest writer (which waits for them, as do all after it).
        return list(takewhile(lambda kv: is_shared(bytes(kv.key)), kvs)), None
    return kvs[:1], None


def _changed(now: LockInfo, seen: LockInfo) -> bool:
    if now.held != seen.held or now.token != seen.token:
        return True
    return bool(seen.holders) and [h.token for h in now.holders] != [h.token for h in seen.holders]


class Inspector:
    """``inspect`` and ``wait_for_change`` for one client."""

    def __init__(self, wire: Wire, hub: WatchHub, prefix: bytes) -> None:
        self._wire = wire
        self._hub = hub
        self._prefix = prefix

    async def inspect(self, name: str, kind: Kind) -> LockInfo:
        prefix = name_prefix(self._prefix, name, kind)
        wire = self._wire
        end = prefix_end(prefix)

        # Every key, oldest first; values only where they say something: a semaphore's
        # permits and waiting marks (a few bytes each), and only the leader's of an election
        # (a candidate's may be 64 KiB). A lock's values are its owners (its key's name may be
        # an earlier acquisition's: see Keys.reuse).
        reads = [range_op(prefix, end, values=kind != "election", first="oldest")]
        if kind == "election":
            reads.append(range_op(prefix, end, values=True, first="oldest", limit=1))
        reply = await wire.txn(f"inspecting {kind} {name!r}", rpc.TxnRequest(success=reads))
        ranges = [response.response_range for response in reply.responses]
        kvs = list(ranges[0].kvs)
        if kind == "election" and kvs:
            kvs[0] = ranges[1].kvs[0]  # the leader, with its value (read in the same txn)
        holding, permits = _holding(kvs, kind) if kvs else ((), None)
        if not holding:
            return LockInfo.of(name, kind, (), waiters=len(kvs), permits=permits)
        # The lease the key rides on now (extend() moves a key off the lease its name says).
        expires = await self._expiries({int(kv.lease) or lease_of(bytes(kv.key)) for kv in holding})
        holders = tuple(
            HolderInfo(
                owner=bytes(kv.value).decode() if kind == "lock" else owner_of(bytes(kv.key)),
                token=int(kv.create_revision),
                expires_in=expires.get(int(kv.lease) or lease_of(bytes(kv.key))),
                shared=is_shared(bytes(kv.key)),
                value=bytes(kv.value) if kind == "election" else None,
            )
            for kv in holding
        )
        return LockInfo.of(name, kind, holders, waiters=len(kvs) - len(holding), permits=permits)

    async def _expiries(self, lease_ids: set[int]) -> dict[int, float | None]:
        """The remaining ttl of each lease (None: expired, or unknown)."""
        wire = self._wire
        found: dict[int, float | None] = {}

        async def one(lease_id: int) -> None:
            reply = await wire.unary(
                f"reading lease {lease_id:016x}",
                wire.lease.LeaseTimeToLive,
                rpc.LeaseTimeToLiveRequest(ID=lease_id),
            )
            found[lease_id] = float(reply.TTL) if int(reply.TTL) >= 0 else None

        async with anyio.create_task_group() as tg:
            for lease_id in lease_ids:
                tg.start_soon(one, lease_id)
        return found

    async def wait_for_change(self, name: str, kind: Kind, seen: LockInfo, timeout: float) -> None:
        """Watch the name's keys first, then compare what the store holds with ``seen``;
        return on a change (or an event that may be one), or after ``timeout``."""
        prefix = name_prefix(self._prefix, name, kind)
        # Who leads an election changes only when a key is deleted, or created while nobody
        # led (a new candidate queues; a key moved to another lease by extend() is no change).
        puts_matter = kind != "election" or not seen.held
        watch = _ChangeWatch(puts_matter)
        stream = self._hub.stream()
        stream.add(watch, [rpc.WatchCreateRequest(key=prefix, range_end=prefix_end(prefix))])
        try:
            with anyio.move_on_after(timeout):
                await watch.changed.wait()
                if watch.failed:
                    # No push to wait for: the caller looks again after a poll's pause.
                    await anyio.sleep(_FAILED_PAUSE)
                    return
                if watch.fired:
                    return
                try:
                    if _changed(await self.inspect(name, kind), seen):
                        return
                except LockError:
                    return  # the caller's inspect() reports it
                watch.changed = anyio.Event()
                if not (watch.fired or watch.failed):
                    await watch.changed.wait()
        finally:
            stream.drop(watch)  # no await: nothing can interrupt it


class _ChangeWatch:
    """A watch on a name's keys (a ``Subscriber`` of the stream)."""

    __slots__ = ("_puts_matter", "changed", "failed", "fired")

    def __init__(self, puts_matter: bool) -> None:
        self._puts_matter = puts_matter
        self.changed = anyio.Event()
        self.fired = False
        self.failed = False

    def on_created(self, revision: int) -> None:
        self.changed.set()

    def on_fired(self, events: Sequence[Any]) -> None:
        if (
            not events
            or self._puts_matter
            or any(event.type == rpc.Event.DELETE for event in events)
        ):
            self.fired = True
            self.changed.set()

    def on_failed(self, error: BaseException) -> None:
        self.failed = True
        self.changed.set()
