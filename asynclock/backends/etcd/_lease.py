"""The client's etcd leases (one per ttl bucket), their grants, keepalives and revocation.

Renewal is decided in one place, :data:`RENEWAL`: a lease is kept alive ``RENEWAL.next_after``
its last proof of life, whether locks are held on it (the client's supervisor calls
``renew``), only waiters' keys ride on it (the waiters keep it alive, one at a time), or
nothing does but an acquire of its ttl came within :data:`KEEP_IDLE` (``Leases.keep``, as
etcd's Go session keeps its lease: the next acquire then puts its key at once, where it first
waited for a keepalive, or for a grant once the lease had lapsed). Any keepalive moves
``valid_from``, and the others then have nothing to send.
"""

from __future__ import annotations

import logging
import math
import secrets
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import grpc
from aetcd import rpc

from .._kit import RENEWAL, BackendUnavailable, Grant, LockError, ProvenGone, TaskHost
from ._errors import Superseded
from ._hub import BidiStream
from ._wire import Metadata, Wire

__all__ = ("ClientLease", "EtcdGrant", "KeepaliveStream", "Leases", "lease_gone")

logger = logging.getLogger("asynclock")

#: How long after the last acquire of its ttl a lease with nothing on it is still kept alive
#: (``Leases.keep``); then it lapses, and the next acquire of that ttl grants a new one.
KEEP_IDLE = 300.0


@dataclass(eq=False, slots=True)
class EtcdGrant(Grant):
    """A lock held in etcd. ``token`` is the create revision of ``key``, our key on lease
    ``lease_id``; a transaction that compares ``create_revision(key) == token`` commits only
    while we hold the lock (see :func:`asynclock.fencing.fence_compare` and
    :func:`asynclock.fencing.fenced_txn`)."""

    key: bytes
    lease_id: int
    on_lost: Callable[[str], None] = field(repr=False)
    #: Its release's delete was answered: the release, run again, does nothing (its key's
    #: name may be another acquisition's by then, see ``Keys.reusable``).
    released: bool = field(default=False, repr=False)


class ClientLease:
    """One etcd lease of this client; every key of one ttl bucket rides on it."""

    __slots__ = ("bucket", "dead", "held", "id", "pending", "retry_at", "ttl", "valid_from")

    def __init__(self, lease_id: int, bucket: int, ttl: int, valid_from: float) -> None:
        self.id = lease_id
        self.bucket = bucket
        #: As granted by the server (at least the bucket).
        self.ttl = ttl
        #: When the last grant or keepalive that etcd answered with a ttl was sent: the lease
        #: lives at least until ``valid_from + ttl``.
        self.valid_from = valid_from
        self.dead = False
        self.held: set[EtcdGrant] = set()
        #: Set when the keepalive in flight (at most one per lease) is answered.
        self.pending: anyio.Event | None = None
        #: After a keepalive that proved nothing, the next one no earlier than this.
        self.retry_at = 0.0

    @property
    def refreshing(self) -> bool:
        return self.pending is not None

    def fresh(self, now: float) -> bool:
        """Refreshed within the last half of its ttl: good for a new grant (the supervisor
        renews it at once), and no keepalive of its own when locks are taken back to back."""
        return not self.dead and now < self.valid_from + self.ttl / 2.0

    def refresh_due(self) -> float:
        """When this lease is kept alive next (:data:`RENEWAL`'s schedule)."""
        return max(RENEWAL.next_after(self.valid_from, self.ttl), self.retry_at)

    def renewed_since(self, valid_from: float, now: float) -> bool:
        """Whether a keepalive after ``valid_from`` proved it alive, recently enough that the
        next one is not due yet."""
        return not self.dead and self.valid_from > valid_from and now < self.refresh_due()


def lease_gone(lease_id: int) -> str:
    return f"etcd lease {lease_id:016x} expired or was revoked: its lock keys are gone"


class _Asked:
    """A keepalive sent on the stream, until its answer (or the stream's end) comes."""

    __slots__ = ("done", "error", "reply")

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.reply: Any = None
        self.error: BaseException | None = None


class _Keepalives(BidiStream):
    """One LeaseKeepAlive call. etcd answers its requests one at a time, in order: each
    answer is that of the oldest keepalive outstanding."""

    kind = "keepalive"

    def __init__(self, call: Any, describe: str) -> None:
        super().__init__(call, describe)
        self.asked: deque[_Asked] = deque()

    def _received(self, response: Any) -> None:
        if not self.asked:  # an answer matched to nobody: the order is lost
            self.end(BackendUnavailable(f"{self._describe}: an unasked keepalive answer"))
            return
        answered = self.asked.popleft()
        answered.reply = response
        answered.done.set()

    def _ended(self, error: BaseException) -> None:
        for left in self.asked:
            left.error = error
            left.done.set()
        self.asked.clear()


class KeepaliveStream:
    """The client's one LeaseKeepAlive stream, opened for the first keepalive and again after
    it ends. A stream per keepalive (gRPC's call set-up, a task and a task group each) cost
    0.65-0.90 ms of CPU a keepalive, this 0.29-0.32. Each answer is that of the oldest
    keepalive outstanding, which etcd got before it renewed (so its send time is a safe start
    for the lease's new ttl). A keepalive not answered in time ends the stream, for every
    keepalive on it."""

    def __init__(self, wire: Wire, host: TaskHost) -> None:
        self._wire = wire
        self._host = host
        self._stream: _Keepalives | None = None
        self._metadata: Metadata = ()

    async def keepalive(self, lease_id: int, metadata: Metadata, timeout: float | None) -> int:
        """The ttl etcd answered (0: the lease is gone). Like a unary call, it is given up,
        to be sent again, when it is slow and etcd has elected a new leader since it was sent."""
        stream = self._stream
        if stream is None or stream.dead or self._metadata != metadata:
            self.close()  # a new token (re-authenticated) goes on a new stream
            stream = self._open(metadata)
        asked = _Asked()
        stream.asked.append(asked)
        stream.send(rpc.LeaseKeepAliveRequest(ID=lease_id))
        term = self._wire.term
        superseded = False
        with anyio.move_on_after(timeout):
            superseded = await self._wire.superseded(asked.done, term)
        if not asked.done.is_set():
            # Its answer would come late, matched to nobody: the stream goes with it.
            stream.end(BackendUnavailable(f"{self._wire.describe} did not answer a keepalive"))
            if superseded:
                raise Superseded
        if asked.error is not None:
            raise asked.error
        return int(asked.reply.TTL)

    def _open(self, metadata: Metadata) -> _Keepalives:
        stream = _Keepalives(
            self._wire.lease.LeaseKeepAlive(metadata=metadata), self._wire.describe
        )
        try:
            self._host.start_soon(stream.run, name="asynclock: keepalives")
        except BackendUnavailable as exc:  # the backend is closing: it takes no more tasks
            stream.end(exc)
            raise
        self._stream, self._metadata = stream, metadata
        return stream

    def close(self) -> None:
        """End the stream (its keepalives outstanding fail); the next keepalive opens one.
        Idempotent."""
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.end(BackendUnavailable(f"{self._wire.describe} closed the keepalive stream"))


class Leases:
    """The leases of one client."""

    def __init__(self, wire: Wire, host: TaskHost) -> None:
        self._wire = wire
        self.stream = KeepaliveStream(wire, host)
        #: The lease new acquisitions of each ttl bucket (whole seconds) go on.
        self.current: dict[int, ClientLease] = {}
        #: Every lease of ours not known to be gone, by id.
        self.by_id: dict[int, ClientLease] = {}
        #: Lease ids that may exist on the server: revoked in ``aclose``. Includes grants whose
        #: answer never came (we choose the id, so a lost answer leaks nothing).
        self._granted: set[int] = set()
        self._granting: dict[int, anyio.Lock] = {}
        #: When an acquire last asked for each bucket's lease (``keep``).
        self._used: dict[int, float] = {}
        self._wake = anyio.Event()

    async def lease_for(self, bucket: int) -> ClientLease:
        """A live lease for ``bucket``, refreshed within the last half of its ttl."""
        now = self._used[bucket] = anyio.current_time()
        lease = self.current.get(bucket)
        if lease is not None and lease.fresh(now):
            return lease
        # A bucket unused for KEEP_IDLE is back in use: ``keep`` looks at it again (a grant
        # below would wake it too, a lease that outlived KEEP_IDLE would not).
        self._wake.set()
        async with self._granting.setdefault(bucket, anyio.Lock()):
            lease = self.current.get(bucket)
            if lease is not None and lease.fresh(anyio.current_time()):
                return lease
            # Not renewed lately (nothing held on it): ask whether it still lives. A lease
            # past its known expiry is most likely gone, but a keepalive whose answer was lost
            # may have kept it: this way none is left behind.
            if lease is not None and not lease.dead and await self.refresh(lease):
                return lease
            return await self._grant(bucket)

    async def _grant(self, bucket: int) -> ClientLease:
        for _ in range(3):
            # We choose the id, so a grant whose answer is lost is still revoked in aclose.
            lease_id = secrets.randbits(62) + 1
            self._granted.add(lease_id)
            sent_at = anyio.current_time()
            try:
                reply = await self._wire.unary(
                    f"granting a {bucket} s lease",
                    self._wire.lease.LeaseGrant,
                    rpc.LeaseGrantRequest(TTL=bucket, ID=lease_id),
                )
            except BackendUnavailable as exc:
                cause = exc.__cause__
                if isinstance(cause, grpc.aio.AioRpcError) and "lease already exists" in str(
                    cause.details()
                ):
                    # Almost surely our own grant, sent again after an answer that was lost
                    # (two random 62-bit ids colliding is not worth a thought): adopt it.
                    lease = ClientLease(lease_id, bucket, bucket, sent_at)
                    if await self.refresh(lease):
                        return self._adopt(lease)
                    continue
                raise
            if reply.error:
                self._granted.discard(lease_id)
                raise BackendUnavailable(
                    f"granting a lease on {self._wire.describe} failed: {reply.error}"
                )
            return self._adopt(ClientLease(int(reply.ID), bucket, int(reply.TTL), sent_at))
        raise BackendUnavailable(f"{self._wire.describe} refused three random lease ids")

    def _adopt(self, lease: ClientLease) -> ClientLease:
        self.by_id[lease.id] = lease
        self.current[lease.bucket] = lease
        self._wake.set()  # ``keep`` learns of it
        return lease

    async def keep(self) -> None:
        """Keep alive, on :data:`RENEWAL`'s schedule, the leases with nothing held on them whose
        ttl an acquire asked for within :data:`KEEP_IDLE` (the supervisor renews the others), so
        that they stay fresh for the next acquire. Runs in the backend's task host until it
        closes; a keepalive that fails is tried again later (``refresh_if_due``), quietly."""
        while True:
            # Before the look: a lease granted while a keepalive below is awaited wakes it.
            self._wake = wake = anyio.Event()
            now = anyio.current_time()
            wake_at = math.inf
            for bucket, lease in list(self.current.items()):
                if lease.dead or now - self._used.get(bucket, -math.inf) > KEEP_IDLE:
                    continue
                if lease.held or lease.refreshing:
                    # Kept alive by another, for now: looked at again well within its
                    # freshness (half its ttl), as its last lock may be released at any time.
                    wake_at = min(wake_at, now + lease.ttl / 8.0)
                    continue
                if lease.refresh_due() <= now:
                    try:
                        await self.refresh_if_due(lease)
                    except Exception as exc:  # never end the task host for a keepalive
                        logger.debug("asynclock: keeping lease %016x alive: %r", lease.id, exc)
                        lease.retry_at = RENEWAL.retry_at(anyio.current_time(), lease.ttl)
                wake_at = min(wake_at, lease.refresh_due())
            with anyio.move_on_at(wake_at):
                await wake.wait()

    async def refresh(self, lease: ClientLease) -> bool:
        """One keepalive: True if etcd extended the lease, False if it is gone. While one is in
        flight (a waiter's, or the supervisor's), its answer serves every caller."""
        before = lease.valid_from
        while lease.pending is not None:
            await lease.pending.wait()
            if lease.dead:
                return False
            if lease.valid_from > before:
                return True
        lease.pending = pending = anyio.Event()
        try:
            return await self._refresh(lease)
        finally:
            lease.pending = None
            pending.set()

    async def _refresh(self, lease: ClientLease) -> bool:
        sent_at = anyio.current_time()
        ttl: int = await self._wire.call(
            f"renewing lease {lease.id:016x}",
            lambda md, timeout: self.stream.keepalive(lease.id, md, timeout),
        )
        if ttl <= 0:
            self.died(lease, lease_gone(lease.id))
            return False
        if not lease.dead:
            lease.valid_from = max(lease.valid_from, sent_at)
            lease.ttl = ttl
            lease.retry_at = 0.0
        return True

    async def refresh_if_due(self, lease: ClientLease) -> bool:
        """A waiter's keepalive of the lease its key rides on, when :data:`RENEWAL` says it is
        due and no other waiter is sending one; whether it sent one."""
        now = anyio.current_time()
        if lease.refreshing or lease.dead or now < lease.refresh_due():
            return False
        try:
            await self.refresh(lease)
        except LockError:
            lease.retry_at = RENEWAL.retry_at(anyio.current_time(), lease.ttl)
        return True

    def died(self, lease: ClientLease, reason: str) -> None:
        if lease.dead:
            return
        lease.dead = True
        if self.current.get(lease.bucket) is lease:
            del self.current[lease.bucket]
        self.by_id.pop(lease.id, None)
        self._granted.discard(lease.id)
        for grant in list(lease.held):
            grant.on_lost(reason)
        lease.held.clear()

    async def revoke_all(self) -> None:
        """Revoke every lease that may exist (deleting every key still on it), within
        ``op_timeout``; quiet: a lease left behind expires by itself."""
        with anyio.move_on_after(self._wire.settings.op_timeout):
            async with anyio.create_task_group() as tg:
                for lease_id in list(self._granted):
                    tg.start_soon(self._revoke, lease_id)

    async def _revoke(self, lease_id: int) -> None:
        try:
            await self._wire.unary(
                f"revoking lease {lease_id:016x}",
                self._wire.lease.LeaseRevoke,
                rpc.LeaseRevokeRequest(ID=lease_id),
            )
        except ProvenGone:
            pass
        except Exception:  # quiet: it expires by itself; nothing else may stop aclose()
            return
        self._granted.discard(lease_id)
