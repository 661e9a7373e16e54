"""Waiting for a lock, a semaphore's permit or an election: Curator's queue recipe, one
attempt in one session.

The acquirer creates an ephemeral sequential node; the lowest sequence number holds the lock
and every other waiter watches only the node just before its own that blocks it (FIFO, no
herd). A reader waits for the writers before it, a writer for everyone before it; a semaphore's
node holds among the first N and watches the N nodes just ahead of it (``_order``). The
fencing token is the node's ``czxid``, returned by the same ``Create2`` round trip. An
election's node is an exclusive lock node in the election's own parent, and carries the
candidate's value as its data.

Server error replies are raised as aiozk exceptions and the session's private ones as they
are: the backend translates them (``_errors.zk_errors``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

import anyio
from aiozk import exc as zk_exc
from aiozk import protocol as zk

from .._kit import BackendUnavailable, LockRequest, finish, now
from . import _proto
from ._errors import SERVER_ERRORS, ConnectionLoss, NotConnected, SessionGone
from ._lease import LockSession, ZooKeeperGrant
from ._names import EXCLUSIVE, PROTECTED, SHARED, encode_name, semaphore_kind
from ._order import blockers, permit_blockers, queue, sequence
from ._proto import CONTAINER, EPHEMERAL_SEQUENTIAL, checked
from ._session import ATTEMPTS, Wake
from ._tree import Tree

__all__ = ("Attempt", "node_kind")

logger = logging.getLogger("asynclock.zookeeper")


def node_kind(request: LockRequest) -> str:
    """The kind part of the name of the node that ``request`` creates (``_names``)."""
    if request.kind == "semaphore":
        return semaphore_kind(request.permits)
    return SHARED if request.kind == "lock" and request.shared else EXCLUSIVE


@dataclass(eq=False, slots=True)
class Attempt:
    """One pass of the queue recipe in one session; cleans up whatever it does not hand over."""

    tree: Tree
    session: LockSession
    request: LockRequest
    op_timeout: float
    #: The kind part of our node's name (``lock``, ``read``, ``sem3``).
    kind: str = field(init=False)
    parent: str = field(init=False)
    prefix: str = field(init=False)
    #: Our node's name once we know it.
    node: str | None = field(default=None, init=False)
    #: A create was sent whose outcome we do not know.
    unsure: bool = field(default=False, init=False)
    #: Told when our node is queued (``LockRequest.answered``), then cleared: told once, also
    #: over the backend's attempts (it hands an untold one on to the next).
    answered: Callable[[], None] | None = None
    #: Whether any node was ever seen ahead of ours: then its release marks the hand-over.
    waited: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.kind = node_kind(self.request)
        self.parent = self.tree.parent(self.request.name, self.request.kind)
        self.prefix = f"{PROTECTED}{encode_name(self.request.owner)}-{self.kind}-"

    async def run(self, wait: bool) -> ZooKeeperGrant | None:
        session = self.session
        session.users += 1
        try:
            czxid, children, listed_at = await self._enqueue()
            while True:
                assert self.node is not None
                ahead = self._blockers(children)
                # A waiter keeps the nodes it watches, not the listing (a name per node of the
                # queue): its memory stays the same however long the queue.
                del children
                if ahead is None:
                    # Our node is gone (deleted by someone, or its session expired): queue again.
                    if session.dead:
                        raise SessionGone(session.dead_reason)
                    self.node = None
                    czxid, children, listed_at = await self._enqueue()
                    continue
                count, watched = ahead
                if not count:
                    return self._granted(czxid, listed_at)
                self.waited = True
                if not wait:
                    return None
                if self.answered is not None:
                    self.answered()  # queued: the caller's timeout applies from here
                    self.answered = None
                if self.request.kind == "semaphore":
                    # Any of the N nodes ahead going may give us a permit; the listing says.
                    await self._wait_for(*(f"{self.parent}/{node}" for node in watched))
                    del ahead, watched
                else:
                    granted_at = await self._wait_for_lock(watched[-1], alone=count == 1)
                    del ahead, watched
                    if granted_at is not None:
                        return self._granted(czxid, granted_at)
                listed_at = now()
                (reply,) = await session.call_retrying(_proto.get_children(self.parent))
                children = [] if isinstance(reply, zk_exc.NoNode) else checked(reply).children
        finally:
            session.users -= 1
            if self.node is not None or self.unsure:
                # Survives native cancellation too (a second Task.cancel() would go through an
                # anyio shield and leave the node in a live session: stranded until close).
                await finish(
                    self._abandon,
                    timeout=self.op_timeout + 1.0,
                    what=f"deleting the lock node of a cancelled acquire of {self.request.name!r}",
                    unfinished=self._leave_to_janitor,
                )

    def _blockers(self, children: Sequence[str]) -> tuple[int, list[str]] | None:
        """How many nodes ahead keep ours from holding, and the ones to watch (of a lock's:
        the nearest only); None if our node is not among ``children``."""
        assert self.node is not None
        if self.request.kind == "semaphore":
            ahead = permit_blockers(children, self.node, self.request.name, self.request.permits)
            return None if ahead is None else (len(ahead), ahead)
        found = blockers(children, self.node, self.kind)
        return None if found is None else (found[0], [found[1]])

    async def _wait_for_lock(self, watched: str, *, alone: bool) -> float | None:
        """Wait for ``watched`` (the nearest of the nodes that block our lock node; ``alone``:
        the only one) to go.

        Returns when the lock is known to be ours without listing the queue (a valid
        ``valid_from``), or None: list it. Known on the watch's event alone when the node was
        the only one ahead (a node created later always gets a higher sequence number), or
        when it went with its holder's release: the release of an exclusive hold that ever
        waited writes its node's data in the transaction that deletes it
        (:meth:`LockSession.release`), so the event is *data changed*, not *deleted*. It held
        the lock, so nothing ahead of it is left, and nothing is between it and us (it is the
        last node ahead). A holder that never waited releases with a plain delete (one write
        fewer for an uncontended lock): it had no node ahead when it queued, and none is ever
        created ahead of a node, so it is the only one ahead of whoever watches it. A node that
        went any other way (a cancelled waiter, an expired session, an operator, a reader's
        release) fires *deleted*: then the queue is listed. Readers hold together, so one
        leaving proves nothing about the others. A hand-over costs one event whatever the
        queue's length.
        """
        entries = queue([watched])
        exclusive = bool(entries) and entries[0].kind == EXCLUSIVE
        gone = await self._wait_for(f"{self.parent}/{watched}")
        if gone is None:
            return None
        gone_since, released = gone
        if alone or (released and exclusive):
            return gone_since
        return None

    def _granted(self, czxid: int, listed_at: float) -> ZooKeeperGrant:
        path = f"{self.parent}/{self.node}"
        grant = ZooKeeperGrant(
            name=self.request.name,
            owner=self.request.owner,
            token=czxid,
            valid_from=listed_at,
            ttl=self.session.timeout,
            path=path,
            kind=self.kind,
            session=self.session,
            marks_release=self.kind == EXCLUSIVE and self.waited,
            space=self.request.kind,
        )
        self.session.hold(path, self.request.on_lost)
        self.node = None  # handed over: nothing to clean up
        return grant

    def _requests(self) -> list[_proto.Request]:
        # An election's candidate keeps its value in its node: the leader's is read from the
        # first node (``inspect``).
        value = self.request.value if self.request.kind == "election" else b""
        requests = [
            _proto.create(
                f"{self.parent}/{self.prefix}", value, self.tree.acl, EPHEMERAL_SEQUENTIAL
            ),
            _proto.get_children(self.parent),
        ]
        # The parent is a container node: created here when we do not know it exists,
        # deleted by the janitor (or by the server) once empty.
        if self.parent not in self.tree.parents:
            name = self.request.name.encode()
            requests.insert(0, _proto.create(self.parent, name, self.tree.acl, CONTAINER))
        return requests

    async def _enqueue(self) -> tuple[int, list[str], float]:
        """Create our node (reusing it if a lost reply hid it) and list the queue."""
        session = self.session
        tree = self.tree
        for _ in range(ATTEMPTS):
            sent_at = now()
            self.unsure = True
            try:
                *made_parent, created, listed = await session.call(*self._requests())
            except NotConnected:
                self.unsure = False
                raise
            except ConnectionLoss:
                found = await self._find_own()
                if found is not None:
                    return found
                continue
            if made_parent and isinstance(made_parent[0], zk_exc.NoNode):
                # Someone deleted the chroot: make it again.
                self.unsure = False
                await tree.ensure_chroot(session)
                continue
            if isinstance(created, zk_exc.NoNode):
                # The parent is gone (deleted once it was empty): make it again.
                self.unsure = False
                tree.parents.pop(self.parent, None)
                continue
            checked(created)
            self.unsure = False
            self.node = created.path.rpartition("/")[2]
            tree.touch(self.parent)
            return created.stat.created_zxid, checked(listed).children, sent_at
        raise BackendUnavailable(
            f"acquiring {self.request.name!r} on {tree.where}: could not create the "
            f"lock node in {ATTEMPTS} attempts"
        )

    async def _find_own(self) -> tuple[int, list[str], float] | None:
        """After a create whose reply was lost: find the node it made, if it made one."""
        sent_at = now()
        (listed,) = await self.session.call_retrying(_proto.get_children(self.parent))
        if isinstance(listed, zk_exc.NoNode):
            self.unsure = False
            return None
        children = checked(listed).children
        mine = sorted((c for c in children if c.startswith(self.prefix)), key=sequence)
        if not mine:
            self.unsure = False
            return None
        # Keep the first; any later one is a duplicate from another lost reply (until they are
        # deleted, a cancellation cleans up by prefix: every node of this lease).
        self.node = mine[0]
        if mine[1:]:
            await self.session.delete([f"{self.parent}/{extra}" for extra in mine[1:]], self.parent)
            children = [c for c in children if c not in mine[1:]]
        self.unsure = False
        (stat,) = await self.session.call_retrying(_proto.exists(f"{self.parent}/{self.node}"))
        if isinstance(stat, zk_exc.NoNode):
            self.node = None
            return None
        logger.info("asynclock: reusing lock node %s/%s after a lost reply", self.parent, self.node)
        return checked(stat).stat.created_zxid, children, sent_at

    async def _wait_for(self, *paths: str) -> tuple[float, bool] | None:
        """Wait until one of ``paths`` is gone or changed, or the session's state changed.

        Returns, when one is known to be gone, a time before a request the server answered
        after that (a valid ``valid_from``), and whether it went with its holder's release
        (:meth:`LockSession.release`); None when something else woke us.
        """
        wake = Wake()
        session = self.session
        for path in paths:
            session.add_watch(path, wake)
        session.add_listener(wake)
        try:
            sent_at = now()
            replies = await session.call_retrying(
                *(_proto.get_data(path, watch=True) for path in paths)
            )
            if any(isinstance(reply, zk_exc.NoNode) for reply in replies):
                return sent_at, False
            for reply in replies:
                checked(reply)
            await wake.future
            # The event came over a live connection of a live session; the last request the
            # server answered bounds when it last heard from us. A release deletes the node in
            # the transaction that writes its data: gone too.
            if session.state != "connected" or wake.event not in _GONE:
                return None
            return session.heard_sent_at, wake.event == zk.WatchEvent.DATA_CHANGED
        finally:
            for path in paths:
                session.drop_watch(path, wake)
            session.drop_listener(wake)

    def _orphan_prefix(self) -> str:
        # Unsure (a create or a duplicate delete whose outcome is unknown): every node of this
        # lease; otherwise just the one we know.
        if self.unsure or self.node is None:
            return self.prefix
        return self.node

    def _leave_to_janitor(self) -> None:
        self.session.add_orphan(self.parent, self._orphan_prefix())

    async def _abandon(self) -> None:
        """Delete what this attempt created (bounded; left to the session's janitor if not).

        Idempotent: :func:`asynclock.backends._kit.finish` runs it again from the start when a
        native cancellation interrupted it.
        """
        session = self.session
        if not session.usable:
            return
        prefix = self._orphan_prefix()
        if session.state != "connected":
            session.add_orphan(self.parent, prefix)
            return
        try:
            with anyio.fail_after(self.op_timeout):
                if prefix == self.prefix:
                    await session.delete_matching(self.parent, prefix)
                else:
                    await session.delete([f"{self.parent}/{prefix}"], self.parent)
        except (ConnectionLoss, TimeoutError, *SERVER_ERRORS):
            session.add_orphan(self.parent, prefix)
        except SessionGone:
            pass


#: The watch events that say a watched lock node is gone: deleted, or written by its holder's
#: release in the transaction that deletes it (:data:`RELEASED`).
_GONE: Final = (zk.WatchEvent.DELETED, zk.WatchEvent.DATA_CHANGED)
