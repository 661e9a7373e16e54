"""Fencing inside etcd: transactions that etcd itself refuses once the lock was lost.

The etcd driver (``aetcd``) is imported on first use, so that ``asynclock.fencing`` imports
without it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from .._errors import InvalidArgument, LeaseLost
from .._lease import Lease
from ..abc import Grant

if TYPE_CHECKING:
    from .._client import LockClient
    from ..backends.etcd import EtcdGrant

__all__ = ("fence_compare", "fenced_txn")


def fence_compare(lease: Lease | EtcdGrant) -> Any:
    """An ``aetcd`` comparison that holds only while ``lease`` holds its lock.

    Add it to the ``compare`` list of your own ``aetcd.Client.transaction(...)`` to make etcd
    itself refuse a write from a holder that lost the lock::

        await client.transaction(compare=[fence_compare(lease), ...], success=[...], failure=[])
    """
    from aetcd import transactions

    grant = _etcd_grant(lease, "fence_compare")
    return transactions.Create(grant.key) == grant.token


async def fenced_txn(
    locks: LockClient,
    lease: Lease | EtcdGrant,
    *,
    compare: Iterable[Any] = (),
    success: Iterable[Any] = (),
    failure: Iterable[Any] = (),
) -> tuple[bool, list[Any]]:
    """Run an etcd transaction that commits only while ``lease`` still holds its lock.

    The transaction is nested in one that compares our lock key's create revision with the
    lease's token, so etcd itself refuses it once the lock was lost (and perhaps taken by
    someone else), however late the request arrives. ``compare`` takes ``aetcd`` comparisons
    (``client.transactions.value(key) == b"x"``) or ``aetcd.rpc.Compare`` messages;
    ``success`` and ``failure`` take ``aetcd`` operations (``client.transactions.put(key,
    value)``, ``.get``, ``.delete``, ``.txn``) or ``aetcd.rpc`` request messages. The
    transaction is sent once (your operations need not be safe to repeat).

    Returns ``(succeeded, responses)`` of *your* transaction (``responses`` are
    ``aetcd.rpc.ResponseOp`` messages). Raises :class:`asynclock.LeaseLost` if the lock key is
    no longer ours: nothing was applied.
    """
    from ..backends.etcd import EtcdBackend

    backend = locks._backend
    if not isinstance(backend, EtcdBackend):
        raise InvalidArgument(f"fenced_txn needs an etcd:// lock client, not {backend.describe()}")
    grant = _etcd_grant(lease, "fenced_txn")
    result = await backend.fenced_txn(grant, compare=compare, success=success, failure=failure)
    if result is None:
        raise LeaseLost(
            grant.name,
            f"the lock key no longer has create revision {grant.token} (the lock was lost, "
            "released or taken by someone else); the transaction was not applied",
        )
    return result


def _etcd_grant(lease: Lease | EtcdGrant, what: str) -> EtcdGrant:
    from ..backends.etcd import EtcdGrant

    if isinstance(lease, Lease):
        grant: object = lease.grant
    elif isinstance(lease, Grant):
        grant = lease
    else:
        raise InvalidArgument(f"expected an asynclock Lease, not {type(lease).__name__}")
    if not isinstance(grant, EtcdGrant):
        raise InvalidArgument(f"{what} needs a lease taken on an etcd:// client")
    return grant
