"""Lock keys whose delete failed ("orphans"), deleted again by whoever comes next; and the
keys of this client in the queues, so that a waiter behind one of them is woken by our own
delete at once instead of by its watch."""

from __future__ import annotations

from typing import Protocol

from aetcd import rpc

from ._names import name_of
from ._proto import create_is, delete_op
from ._wire import Wire

__all__ = ("Behind", "Keys")

#: How many of our deleted keys are remembered (see ``Keys.deleted``).
_RECENT = 64
#: Key names kept for reuse (see ``Keys.reuse``): per lock name and lease, and lock names.
_POOL_KEYS = 16
_POOL_NAMES = 256


class Behind(Protocol):
    """A local waiter right behind one of our keys: its own key and create revision."""

    own: bytes
    rev: int

    def wake(self, proven: bool, *, gone: bool = True) -> None:
        """The key before ours is gone; ``proven``: the same etcd transaction that deleted
        it found our key the lowest (we hold the lock). ``gone=False``: its delete failed or
        was interrupted (it may still be there): look again."""


class Keys:
    """Deletes of our lock keys. A key whose delete failed is kept here, with its create
    revision (0: delete whatever is there, the key name is unique to one acquisition), and
    deleted by the next acquire, renewal or wait; it dies with its lease in any case."""

    def __init__(self, wire: Wire) -> None:
        self._wire = wire
        self.orphans: dict[bytes, int] = {}
        #: Our keys that may exist on the server, each with the local waiters right behind it.
        self.local: dict[bytes, list[Behind]] = {}
        #: Keys whose release is in flight: its answer, not the watch, wakes the waiter behind.
        self.releasing: set[bytes] = set()
        #: Keys of ours that a release's transaction found the lowest under their name (so
        #: they hold the lock), with the create revision it saw.
        self.lowest: dict[bytes, int] = {}
        #: Our keys whose place in the queue is not known yet (their queueing request was not
        #: sent or not answered), and how many of them each lock name has.
        self._unsettled: set[bytes] = set()
        self.unsettled: dict[bytes, int] = {}
        #: The last keys of ours that we know are gone (oldest first).
        self._recent: dict[bytes, None] = {}
        #: The same keys by lock name (the prefix of its keys).
        #: (Lists: most names have one key, and a list of one is a third of a set's size.)
        self.by_name: dict[bytes, list[bytes]] = {}
        #: Names of keys released cleanly, by the part of their name before the owner (lock
        #: name, kind mark, lease): the next acquisition there takes one (see ``reuse``).
        self._pool: dict[bytes, list[bytes]] = {}

    def reuse(self, base: bytes) -> bytes | None:
        """The name of a key of ours whose last life ended cleanly, to create again.

        etcd keeps a deleted key in its index until the cluster is compacted, and every read
        of a lock's queue walks every key its range ever had: with a new name per acquisition,
        one lock name taken 20,000 times without compaction made an uncontended acquire 5 times
        slower (Go's ``concurrency.Mutex`` reuses one key per session for the same reason).
        A name is reused only after its release's guarded delete was answered (so no request
        of its last life can still land: no orphan, none in flight, the grant ``released``);
        the create revision tells its lives apart everywhere (deletes, renewals, watches)."""
        keys = self._pool.get(base)
        return keys.pop() if keys else None

    def reusable(self, base: bytes, key: bytes) -> None:
        """``key`` (a lock's) was released cleanly: its name may be created again."""
        if key in self.local or key in self.orphans:
            return
        keys = self._pool.pop(base, None)
        if keys is None:
            keys = []
            if len(self._pool) >= _POOL_NAMES:
                del self._pool[next(iter(self._pool))]
        self._pool[base] = keys  # the newest last
        if len(keys) < _POOL_KEYS:
            keys.append(key)

    def placed(self, key: bytes) -> None:
        """``key`` is about to be created by us."""
        self._recent.pop(key, None)
        if key not in self.local:
            self.local[key] = []
            name = name_of(key)
            self.by_name.setdefault(name, []).append(key)
            self._unsettled.add(key)
            self.unsettled[name] = self.unsettled.get(name, 0) + 1

    def settled(self, key: bytes) -> None:
        """We know where ``key`` stands in its queue."""
        if key in self._unsettled:
            self._unsettled.discard(key)
            name = name_of(key)
            if self.unsettled[name] == 1:
                del self.unsettled[name]
            else:
                self.unsettled[name] -= 1

    def deleted(self, key: bytes) -> bool:
        """Whether ``key`` is one of ours that we know is gone (so a waiter behind it need not
        watch it: its release's answer came before the waiter's own)."""
        return key in self._recent and key not in self.orphans

    def holds(self, key: bytes, rev: int) -> bool:
        """Whether a release found our ``key``, created at ``rev``, the lowest of its name."""
        return self.lowest.get(key) == rev

    def gone(self, key: bytes, lowest: tuple[bytes, int] | None = None) -> None:
        """``key`` is deleted (or was never created): wake the local waiters behind it.
        ``lowest``: the lowest key of the name just after the delete, and its create revision,
        read in the delete's transaction."""
        if lowest is not None and lowest[0] in self.local:
            self.lowest[lowest[0]] = lowest[1]
        self.lowest.pop(key, None)
        self.settled(key)
        if key in self.local:
            self._recent[key] = None
            if len(self._recent) > _RECENT:
                del self._recent[next(iter(self._recent))]
        name = name_of(key)
        keys = self.by_name.get(name)
        if keys is not None and key in keys:
            keys.remove(key)
            if not keys:
                del self.by_name[name]
        for waiter in self.local.pop(key, ()):
            waiter.wake(self.holds(waiter.own, waiter.rev))

    async def delete(self, key: bytes, rev: int, what: str) -> None:
        if rev:
            await self._wire.txn(
                what, rpc.TxnRequest(compare=[create_is(key, rev)], success=[delete_op(key)])
            )
        else:
            await self._wire.unary(what, self._wire.kv.DeleteRange, rpc.DeleteRangeRequest(key=key))
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
