"""The etcd backend: the contract's calls on the wire, the leases, the keys and the queue."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Self

import anyio
from aetcd import rpc

from .._kit import (
    Backend,
    BackendUnavailable,
    Capabilities,
    Kind,
    LockError,
    LockInfo,
    LockRequest,
    Lost,
    Renewed,
    RenewOutcome,
    TaskHost,
    Unknown,
)
from ._hub import WatchHub
from ._inspect import Inspector
from ._keys import Keys
from ._lease import ClientLease, EtcdGrant, Leases, lease_gone
from ._names import key_base
from ._proto import create_is, move_op, range_op, to_compare, to_request_op
from ._queue import Queue
from ._urls import Settings, bucket, check_ttl, read_settings
from ._wire import Wire

__all__ = ("EtcdBackend",)

#: Key reads per renewal transaction; below etcd's default ``--max-txn-ops`` (128).
_KEYS_PER_TXN = 64


class EtcdBackend(Backend[EtcdGrant]):
    """Locks in etcd v3. Made by ``asynclock.connect("etcd://...")``; see docs/backends/etcd.md."""

    driver = "gRPC (grpc.aio, through aetcd)"
    capabilities = Capabilities.every()
    acquire_tries_first = True

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        #: The servers, as (host, port) pairs; the URL's other parts are read from settings.
        self.endpoints = tuple((host.host, host.port) for host in settings.hosts)
        self.prefix, self.op_timeout = settings.prefix, settings.op_timeout
        self.user, self.tls = settings.user, settings.tls
        self._host = TaskHost(cleanup_timeout=settings.op_timeout)
        self._wire = Wire(settings, self._host)
        self._leases = Leases(self._wire, self._host)
        self._keys = Keys(self._wire)
        self._hub = WatchHub(self._wire, self._host)
        prefix = settings.prefix.encode()
        self._queue = Queue(self._wire, self._leases, self._keys, self._host, self._hub, prefix)
        self._inspector = Inspector(self._wire, self._hub, prefix)
        self._opened = False
        self._closed = False

    @classmethod
    def from_url(cls, url: str, options: Mapping[str, object]) -> Self:
        return cls(read_settings(url, options))

    def describe(self) -> str:
        return self._wire.describe

    def extra_info(self) -> Mapping[str, Any]:
        return {
            "endpoints": [str(host) for host in self._settings.hosts],
            "prefix": self.prefix,
            "op_timeout": self.op_timeout,
            "tls": self.tls,
            "server_version": self._wire.server_version,
            "watches": self._hub.watches,
            "leases": {
                bucket: f"{lease.id:016x}" for bucket, lease in self._leases.current.items()
            },
        }

    def check_ttl(self, ttl: float) -> None:
        check_ttl(ttl)

    # -- open and close ----------------------------------------------------------------------

    async def open(self) -> None:
        if self._opened:
            raise RuntimeError("an EtcdBackend is opened once")
        self._opened = True
        await self._host.open()
        try:
            await self._wire.open()
            self._host.start_soon(self._leases.keep, name="asynclock: etcd idle leases")
        except BaseException:
            # Not in a shield scope: the task host's group, entered above, is left in there
            # (the steps of aclose() that must finish are shielded one by one).
            await self.aclose()
            raise

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            with anyio.CancelScope(shield=True):
                if self._wire.channel is not None:
                    # Revoking the leases deletes every key still on them, orphans included.
                    await self._leases.revoke_all()
                # Ends the watch stream's tasks, and wakes every waiter still on it.
                await self._hub.aclose()
            self._leases.stream.close()  # its tasks end with the call
            # Deferred deletes still pending find their keys gone with the leases.
            await self._host.aclose()
        finally:
            with anyio.CancelScope(shield=True):
                await self._wire.close()

    # -- the contract ------------------------------------------------------------------------

    async def try_acquire(self, request: LockRequest) -> EtcdGrant | None:
        attempt = self._queue.attempt(request)
        if self._keys.orphans:
            # A key of ours left behind (a delete that failed) may be the one in the way.
            await self._keys.sweep()
        if self._queue.known_busy(attempt):
            return None
        try:
            taken = await self._queue.take_if_free(attempt)
        except BaseException:
            await self._queue.abandon(attempt)
            raise
        return self._queue.hand_over(attempt) if taken else None

    async def acquire(self, request: LockRequest) -> EtcdGrant:
        attempt = self._queue.attempt(request)
        if self._keys.orphans:
            await self._keys.sweep()
        try:
            await self._queue.wait_for(attempt)
        except BaseException:
            await self._queue.abandon(attempt)
            raise
        # No await between the final check and handing the grant over.
        return self._queue.hand_over(attempt)

    async def renew(self, grants: Sequence[EtcdGrant]) -> Sequence[RenewOutcome]:
        leases: dict[int, ClientLease] = {}
        for grant in grants:
            lease = self._leases.by_id.get(grant.lease_id)
            if lease is not None and not lease.dead:
                leases[lease.id] = lease
        live = [grant for grant in grants if grant.lease_id in leases]
        refreshed, present, checked = await self._renew_round(leases, live)
        outcomes: list[RenewOutcome] = []
        for grant in grants:
            # No lease (gone before this round), or its keepalive found it gone.
            lease = leases.get(grant.lease_id)
            result = refreshed.get(grant.lease_id, True)
            if lease is None or not result:
                outcomes.append(Lost(lease_gone(grant.lease_id)))
            elif isinstance(result, BaseException):
                outcomes.append(Unknown(result))
            elif grant.key in checked and present.get(grant.key) != grant.token:
                outcomes.append(Lost(_key_deleted(grant.key)))
            else:
                outcomes.append(Renewed(lease.valid_from, float(lease.ttl)))
        return outcomes

    async def _renew_round(
        self, leases: Mapping[int, ClientLease], live: Sequence[EtcdGrant]
    ) -> tuple[dict[int, bool | BaseException], dict[bytes, int], set[bytes]]:
        """One keepalive per lease that needs one, and a read of every key, concurrently."""
        refreshed: dict[int, bool | BaseException] = {}
        present: dict[bytes, int] = {}
        checked: set[bytes] = set()
        now = anyio.current_time()
        known = {
            lease_id: min(grant.valid_from for grant in live if grant.lease_id == lease_id)
            for lease_id in leases
        }

        async def keepalive(lease: ClientLease) -> None:
            try:
                refreshed[lease.id] = await self._leases.refresh(lease)
            except LockError as exc:
                refreshed[lease.id] = exc

        async def check(chunk: Sequence[EtcdGrant]) -> None:
            # A read of each key: an operator's delete proves loss even while the lease lives.
            try:
                reply = await self._wire.txn(
                    f"checking {len(chunk)} lock key(s)",
                    rpc.TxnRequest(success=[range_op(grant.key) for grant in chunk]),
                )
            except LockError:
                return
            for grant, response in zip(chunk, reply.responses, strict=True):
                checked.add(grant.key)
                for kv in response.response_range.kvs:
                    present[bytes(kv.key)] = int(kv.create_revision)

        async with anyio.create_task_group() as tg:
            for lease in leases.values():
                # One schedule per lease: a waiter's keepalive since the last renewal counts.
                if not lease.renewed_since(known[lease.id], now):
                    tg.start_soon(keepalive, lease)
            for start in range(0, len(live), _KEYS_PER_TXN):
                tg.start_soon(check, live[start : start + _KEYS_PER_TXN])
            if self._keys.orphans:
                tg.start_soon(self._keys.sweep)
        return refreshed, present, checked

    async def release(self, grant: EtcdGrant) -> None:
        if grant.released:
            return  # run again (after a native cancellation): done already
        lease = self._leases.by_id.get(grant.lease_id)
        if lease is not None:
            lease.held.discard(grant)
        token = grant.token or 0
        # Idempotent (a guarded delete of a key unique to this grant): the core may run it
        # again from the start after a native cancellation, or retry it in the background.
        try:
            await self._queue.release(
                grant.key,
                token,
                f"releasing {grant.space} {grant.name!r}",
                handover=grant.space != "semaphore",
            )
        except BaseException as exc:
            # Interrupted or failed: whoever comes next (a renewal, a wait, the next acquire,
            # or this release run again) deletes it.
            self._keys.orphans[grant.key] = token
            if isinstance(exc, BackendUnavailable):
                raise type(exc)(
                    f"{exc}. The key is deleted on a later renewal or acquire, or with its "
                    "lease when the client closes"
                ) from exc
            raise
        # No await from the answer to here: a run again returns above.
        grant.released = True
        self._keys.orphans.pop(grant.key, None)
        if grant.space == "lock" and lease is not None and not lease.dead:
            self._keys.reusable(key_base(grant.key), grant.key)

    async def inspect(self, name: str, kind: Kind = "lock") -> LockInfo:
        return await self._inspector.inspect(name, kind)

    async def wait_for_change(self, name: str, kind: Kind, seen: LockInfo, timeout: float) -> None:
        await self._inspector.wait_for_change(name, kind, seen, timeout)

    async def extend(self, grant: EtcdGrant, ttl: float) -> RenewOutcome:
        """Renew now with another ttl: the key moves to this client's lease of the new ttl
        (a put that keeps its value and create revision, so its token and its place in the
        queue), and later renewals keep that lease alive."""
        check_ttl(ttl)
        old = self._leases.by_id.get(grant.lease_id)
        if old is None or old.dead:
            return Lost(lease_gone(grant.lease_id))
        if bucket(ttl) == old.bucket:
            return (await self.renew([grant]))[0]
        try:
            lease = await self._leases.lease_for(bucket(ttl))
            # A full ttl from now, not from the new lease's last keepalive.
            if not await self._leases.refresh(lease):
                return Unknown(BackendUnavailable(lease_gone(lease.id)))
            reply = await self._wire.txn(
                f"extending {grant.space} {grant.name!r} to {ttl:g} s",
                rpc.TxnRequest(
                    compare=[create_is(grant.key, grant.token or 0)],
                    success=[move_op(grant.key, lease.id)],
                ),
            )
        except LockError as exc:
            # The key may be on either lease now: a renewal reads it (and finds it gone, if
            # it rode on a lease that expires).
            return Unknown(exc)
        if not reply.succeeded:
            return Lost(_key_deleted(grant.key))
        old.held.discard(grant)
        lease.held.add(grant)
        grant.lease_id, grant.ttl = lease.id, float(lease.ttl)
        grant.valid_from = lease.valid_from
        return Renewed(lease.valid_from, float(lease.ttl))

    # -- fencing inside etcd -----------------------------------------------------------------

    async def fenced_txn(
        self,
        grant: EtcdGrant,
        *,
        compare: Iterable[Any] = (),
        success: Iterable[Any] = (),
        failure: Iterable[Any] = (),
    ) -> tuple[bool, list[Any]] | None:
        """Run a transaction that commits only while ``grant``'s key has its create revision:
        ``(succeeded, responses)`` of the caller's transaction, or None if the key is no longer
        ours (nothing was applied). :func:`asynclock.fencing.fenced_txn` is the public form."""
        inner = rpc.TxnRequest(
            compare=[to_compare(item) for item in compare],
            success=[to_request_op(item) for item in success],
            failure=[to_request_op(item) for item in failure],
        )
        reply = await self._wire.txn(
            f"running a transaction fenced by lock {grant.name!r}",
            rpc.TxnRequest(
                compare=[create_is(grant.key, grant.token or 0)],
                success=[rpc.RequestOp(request_txn=inner)],
            ),
            # The caller's operations need not be safe to repeat: sent once.
            retry=False,
        )
        if not reply.succeeded:
            return None
        result = reply.responses[0].response_txn
        return bool(result.succeeded), list(result.responses)


def _key_deleted(key: bytes) -> str:
    return (
        f"the lock key {key!r} was deleted on the server (by an operator or another client); "
        "someone else may hold the lock now"
    )
