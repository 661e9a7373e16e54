"""Lock keys whose delete failed ("orphans"), deleted again by whoever comes next; and the
keys of this client in the queues, so that a waiter behind one of them is woken by our own
delete at once instead of by its watch."""

from __future__ import annotations

from collections.abc import Callable

from aetcd import rpc

from ._proto import create_is, delete_op
from ._wire import Wire

__all__ = ("Keys",)


class Keys:
    """Deletes of our lock keys. A key whose delete failed is kept here, with its create
    revision (0: delete whatever is there, the key name is unique to one acquisition), and
    deleted by the next acquire, renewal or wait; it dies with its lease in any case."""

    def __init__(self, wire: Wire) -> None:
        self._wire = wire
        self.orphans: dict[bytes, int] = {}
        #: Our keys that may exist on the server, each with the wake-ups of the local waiters
        #: right behind it.
        self.local: dict[bytes, list[Callable[[], None]]] = {}

    def placed(self, key: bytes) -> None:
        """``key`` is about to be created by us."""
        self.local.setdefault(key, [])

    def gone(self, key: bytes) -> None:
        """``key`` is deleted (or was never created): wake the local waiters behind it."""
        for wake in self.local.pop(key, ()):
            wake()

    async def delete(self, key: bytes, rev: int, what: str) -> None:
        if rev:
            await self._wire.txn(
                what, rpc.TxnRequest(compare=[create_is(key, rev)], success=[delete_op(key)])
            )
        else:
            await self._wire.call(
                what,
                lambda md, timeout: self._wire.kv.DeleteRange(
                    rpc.DeleteRangeRequest(key=key), timeout=timeout, metadata=md
                ),
            )
        # Gone (or, guarded on a create revision, no longer the key that was ours).
        self.gone(key)

    async def sweep(self) -> None:
        for key, rev in list(self.orphans.items()):
            try:
                await self.delete(key, rev, "deleting a lock key left by a failed release")
            except Exception:  # quiet: tried again on the next renewal or wait
                return
            if self.orphans.get(key) == rev:
                del self.orphans[key]

    async def delete_orphan(self, key: bytes, rev: int) -> None:
        """One orphan, deleted (a :class:`Deferred` cleanup: raises until it is done)."""
        if self.orphans.get(key) != rev:
            return
        await self.delete(key, rev, "deleting the lock key of a cancelled acquire")
        if self.orphans.get(key) == rev:
            del self.orphans[key]
