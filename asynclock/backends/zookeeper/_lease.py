"""Leases on a session: the lock nodes it holds, watched for loss, and the leftovers of
cancelled or failed calls, deleted once connected again.

The lease *is* the session: the server deletes a session's ephemeral nodes when it has not
heard from it for the session timeout, and every lease of a session is lost when it dies.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import anyio
from aiozk import exc as zk_exc
from aiozk import protocol as zk

from .._kit import Grant
from . import _proto
from ._errors import SERVER_ERRORS, ConnectionLoss, SessionGone
from ._names import EXCLUSIVE
from ._session import Context, Session
from ._wire import RETRY

__all__ = ("RELEASED", "LockSession", "ZooKeeperGrant")

#: The data a holder's release writes into its node, in the transaction that deletes it. Only
#: that release ever writes a lock node's data (an election candidate's value is written when
#: the node is created), so the *data changed* event it fires proves the release.
RELEASED: Final = b"released"

logger = logging.getLogger("asynclock.zookeeper")


@dataclass(eq=False, slots=True)
class ZooKeeperGrant(Grant):
    """A held lock, permit or term: its znode, the session that owns it, and the node's kind
    (``lock``, ``read`` for a shared hold, ``sem<N>`` for a semaphore's permit)."""

    path: str = ""
    kind: str = EXCLUSIVE
    session: LockSession | None = field(default=None, repr=False)
    #: The release writes the node's data before deleting it (``LockSession.release``): an
    #: exclusive hold that waited, so its release hands the lock over to a waiter.
    marks_release: bool = False


@dataclass(slots=True)
class _Held:
    on_lost: Callable[[str], None]
    callback: Callable[[int], None]


class LockSession(Session):
    """A session that holds lock nodes. ``touch_parent(parent)`` is told of every delete
    under a lock's parent node (the backend deletes parents unused for a while)."""

    def __init__(
        self, context: Context, timeout_ms: int, touch_parent: Callable[[str], None]
    ) -> None:
        super().__init__(context, timeout_ms)
        self._touch_parent = touch_parent
        self._held: dict[str, _Held] = {}
        self._to_arm: set[str] = set()
        self._orphans: dict[tuple[str, str], None] = {}
        self._work = anyio.Event()

    # -- the session's hooks -----------------------------------------------------------------

    def _on_connected(self) -> None:
        self._to_arm = set(self._held)
        if self._to_arm or self._orphans:
            self._work.set()

    def _on_death(self, reason: str) -> None:
        held, self._held = self._held, {}
        self._to_arm.clear()
        self._orphans.clear()
        if held:
            logger.warning(
                "asynclock: ZooKeeper session 0x%x is gone (%s); %d lease(s) lost",
                self.session_id,
                reason,
                len(held),
            )
        for entry in held.values():
            entry.on_lost(reason)

    def _busy(self) -> bool:
        return bool(self._held or self._orphans)

    async def _maintain(self) -> None:
        """Arm watches on our own nodes and delete what cancelled or failed calls left."""
        backoff = RETRY.backoff()
        while True:
            await self._work.wait()
            self._work = anyio.Event()
            try:
                await self._arm_watches()
                await self._clean_orphans()
            except ConnectionLoss:
                await backoff.pause()
                self._work.set()
            except SessionGone:
                return
            else:
                backoff.reset()

    async def _arm_watches(self) -> None:
        paths = [path for path in self._to_arm if path in self._held]
        self._to_arm.clear()
        if not paths:
            return
        for path in paths:
            self.add_watch(path, self._held[path].callback)
        replies = await self.call(*(_proto.get_data(path, watch=True) for path in paths))
        for path, reply in zip(paths, replies, strict=True):
            if path not in self._held:
                continue
            if isinstance(reply, zk_exc.NoNode):
                self._lose(path, f"its znode {path} was deleted (by an operator or another client)")
            elif not isinstance(reply, Exception) and reply.stat.ephemeral_owner != self.session_id:
                self._lose(path, f"its znode {path} belongs to another session")

    async def _clean_orphans(self) -> None:
        while self._orphans:
            parent, prefix = next(iter(self._orphans))
            try:
                await self.delete_matching(parent, prefix)
            except SERVER_ERRORS as exc:  # refused (ACL): retrying cannot help
                logger.warning("asynclock: cannot delete %s/%s*: %r", parent, prefix, exc)
            self._orphans.pop((parent, prefix), None)

    def _on_own_event(self, path: str, event_type: int) -> None:
        if path not in self._held:
            return
        if event_type == zk.WatchEvent.DELETED:
            self._lose(path, f"its znode {path} was deleted (by an operator or another client)")
        elif event_type == zk.WatchEvent.DATA_CHANGED:
            # Only a release writes a lock node's data (``RELEASED``), and the waiter behind
            # takes the lock on that event: written by anyone else, the hold is over too.
            self._lose(path, f"its znode {path} was written (by an operator or another client)")
        else:
            self._to_arm.add(path)
            self._work.set()

    def _lose(self, path: str, reason: str) -> None:
        entry = self._held.pop(path, None)
        if entry is not None:
            self.drop_watch(path, entry.callback)
            entry.on_lost(reason)

    # -- what the backend uses ---------------------------------------------------------------

    def hold(self, path: str, on_lost: Callable[[str], None]) -> None:
        """Report loss of the node at ``path`` through ``on_lost`` (watch, session death)."""

        def callback(event_type: int) -> None:
            self._on_own_event(path, event_type)

        self._held[path] = _Held(on_lost, callback)
        self._to_arm.add(path)
        self._work.set()

    def unhold(self, path: str) -> None:
        entry = self._held.pop(path, None)
        self._to_arm.discard(path)
        if entry is not None:
            self.drop_watch(path, entry.callback)

    def add_orphan(self, parent: str, prefix: str) -> None:
        """Delete the children of ``parent`` starting with ``prefix`` once connected again."""
        if self.usable:
            self._orphans[(parent, prefix)] = None
            self._work.set()

    async def delete_matching(self, parent: str, prefix: str) -> None:
        """Delete our nodes under ``parent`` whose names start with ``prefix``."""
        (children,) = await self.call_retrying(_proto.get_children(parent))
        if isinstance(children, Exception):
            return
        mine = [f"{parent}/{child}" for child in children.children if child.startswith(prefix)]
        await self.delete(mine, parent)

    async def delete(self, paths: Sequence[str], parent: str) -> None:
        """Delete ``paths`` (children of ``parent``); gone already is fine. An error reply is
        raised (an aiozk exception).

        The parent is left for a moment (the next acquisition reuses it) and deleted by the
        backend's janitor once it has been unused for a while.
        """
        if paths:
            replies = await self.call_retrying(*(_proto.delete(path) for path in paths))
            for reply in replies:
                if isinstance(reply, Exception) and not isinstance(reply, zk_exc.NoNode):
                    raise reply
        self._touch_parent(parent)

    async def release(self, path: str, parent: str, *, mark: bool) -> None:
        """Delete the held node ``path`` (gone already is fine; an error reply is raised).

        With ``mark`` (an exclusive hold that waited: a lock's or an election's), the node's data is
        written in the transaction that deletes it (``multi``): the waiter that watches the
        node gets a *data changed* event instead of *deleted*, which tells it that the node
        went with its holder's release, hence that nothing ahead of it is left: it takes the
        lock on that one event, without a round trip (``_queue.Attempt._wait_for_lock``). A
        node that goes any other way (a cancelled waiter, an expired session, an operator's
        delete) fires *deleted*, and the waiter lists the queue.
        """
        if not mark:
            await self.delete([path], parent)
            return
        (reply,) = await self.call_retrying(_proto.release(path, RELEASED))
        marked, deleted = _proto.checked(reply)
        if isinstance(deleted, Exception) and not isinstance(marked, zk_exc.NoNode):
            # Refused as a whole, and not because the node is gone already (a retry after a
            # lost reply, a revoke): the plain delete raises what it refuses.
            await self.delete([path], parent)
            return
        self._touch_parent(parent)

    def info(self) -> dict[str, Any]:
        return {
            "session_id": f"0x{self.session_id:x}",
            "timeout": self.timeout,
            "state": self.state,
            "reconnects": self.reconnects,
            "held": len(self._held),
            "waiting_calls": len(self._pending),
            "watches": len(self._watches),
            "listeners": len(self._listeners),
            "orphans": len(self._orphans),
        }
