"""What the tree says about a name now (``inspect``), and waiting for it to change
(``wait_for_change``, with ZooKeeper watches).

The holders are read from one listing of the parent, as the acquirers read it (``_order``):
the first node of a lock (with the readers right after it, if it is a reader), the first N
nodes of a semaphore of N permits, an election's first node (the leader). Their tokens
(``czxid``) and an election's value come from one pipelined ``getData`` per holder.

Server error replies are raised as aiozk exceptions: the backend translates them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import takewhile
from urllib.parse import unquote

import anyio
from aiozk import exc as zk_exc

from .._kit import HolderInfo, Kind, LockInfo
from . import _proto
from ._names import SHARED, permits_of
from ._order import Queued, queue
from ._session import ATTEMPTS, Session, Wake
from ._tree import Tree

__all__ = ("inspect", "wait_for_change")


def _holding(entries: list[Queued], kind: Kind) -> tuple[list[Queued], int | None]:
    """The entries that hold (queue order) and a semaphore's permits, from the queue."""
    if not entries:
        return [], None
    first = entries[0]
    if kind == "semaphore":
        permits = permits_of(first.kind)
        if permits is None:
            return [], None
        # As a node decides (``_order.permit_blockers``): among the first N, behind no node
        # with another number.
        holding = takewhile(lambda entry: permits_of(entry.kind) == permits, entries[:permits])
        return list(holding), permits
    if kind == "lock" and first.kind == SHARED:  # every reader before the first writer
        return list(takewhile(lambda entry: entry.kind == SHARED, entries)), None
    return entries[:1], None


async def _read(
    session: Session, parent: str, name: str, kind: Kind, children: Sequence[str]
) -> LockInfo | None:
    """The state the listing ``children`` shows; None if a holder went meanwhile (list again)."""
    entries = queue(children)
    holding, permits = _holding(entries, kind)
    if not holding:
        return LockInfo.of(name, kind, (), waiters=len(entries), permits=permits)
    replies = await session.call_retrying(
        *(_proto.get_data(f"{parent}/{entry.child}", watch=False) for entry in holding)
    )
    holders: list[HolderInfo] = []
    for entry, reply in zip(holding, replies, strict=True):
        if isinstance(reply, zk_exc.NoNode):
            return None
        if isinstance(reply, Exception):
            raise reply
        holders.append(
            HolderInfo(
                # The owner part of the node's name is the lease's owner secret, which the
                # core hashes before anyone sees it.
                owner=unquote(entry.owner) or None,
                token=int(reply.stat.created_zxid),
                shared=entry.kind == SHARED,
                value=bytes(reply.data or b"") if kind == "election" else None,
            )
        )
    return LockInfo.of(name, kind, holders, waiters=len(entries) - len(holders), permits=permits)


async def inspect(session: Session, tree: Tree, name: str, kind: Kind) -> LockInfo:
    parent = tree.parent(name, kind)
    for _ in range(ATTEMPTS):
        children = await _children(session, parent, watch=False)
        if children is None:
            return LockInfo(name, held=False, waiters=0, kind=kind)
        info = await _read(session, parent, name, kind, children)
        if info is not None:
            return info
    # The holders kept changing under us: say what is sure.
    return LockInfo(name, held=True, kind=kind)


async def _children(session: Session, parent: str, *, watch: bool) -> list[str] | None:
    """The children of ``parent``; None if it does not exist."""
    (listed,) = await session.call_retrying(_proto.get_children(parent, watch=watch))
    if isinstance(listed, zk_exc.NoNode):
        return None
    children: list[str] = _proto.checked(listed).children
    return children


def _same(info: LockInfo, seen: LockInfo) -> bool:
    """Whether ``info`` shows the holders ``seen`` showed (owners may be hashed in ``seen``:
    the tokens tell the holds apart)."""
    if info.held != seen.held or info.token != seen.token or info.value != seen.value:
        return False
    if seen.holders and [h.token for h in info.holders] != [h.token for h in seen.holders]:
        return False
    return info.waiters == seen.waiters or seen.kind == "election"


async def wait_for_change(
    session: Session, tree: Tree, name: str, kind: Kind, seen: LockInfo, timeout: float
) -> None:
    """Return when the holders of ``name`` may differ from ``seen``, or after ``timeout``.

    The watch is registered first, in the request that reads the state compared with
    ``seen``, so no change falls between the two. An election watches its leader's node only
    (candidates joining or leaving the queue wake nobody), or, with no leader, the parent's
    children; a lock or semaphore watches the parent's children (any hold or waiter coming or
    going). A change of the session's state (a reconnect loses the server's watches) returns
    too: the caller inspects again.
    """
    parent = tree.parent(name, kind)
    wake = Wake()
    watched: list[str] = []

    def watch(path: str) -> None:
        watched.append(path)
        session.add_watch(path, wake)

    session.add_listener(wake)
    try:
        with anyio.move_on_after(timeout):
            if await _changed(session, parent, name, kind, seen, watch):
                return
            await wake.future
    finally:
        session.drop_listener(wake)
        for path in watched:
            session.drop_watch(path, wake)


async def _changed(
    session: Session,
    parent: str,
    name: str,
    kind: Kind,
    seen: LockInfo,
    watch: Callable[[str], None],
) -> bool:
    """Register the watch and say whether the state already differs from ``seen``."""
    if kind == "election":
        (listed,) = await session.call_retrying(_proto.get_children(parent, watch=False))
        entries = [] if isinstance(listed, Exception) else queue(listed.children)
        if entries:
            # The leader changes only when its node goes: nodes are never created ahead of it.
            leader = f"{parent}/{entries[0].child}"
            watch(leader)
            (reply,) = await session.call_retrying(_proto.get_data(leader, watch=True))
            if isinstance(reply, Exception):
                return True  # gone already (or unreadable: let the caller's inspect say)
            return not seen.held or seen.token != int(reply.stat.created_zxid)
    watch(parent)
    children = await _children(session, parent, watch=True)
    if children is None:
        if seen.held:
            return True
        # A child watch is not left on a missing node; an existence watch is (it fires when
        # the parent is made).
        (reply,) = await session.call_retrying(_proto.exists(parent, watch=True))
        return not isinstance(reply, zk_exc.NoNode)
    info = await _read(session, parent, name, kind, children)
    return info is None or not _same(info, seen)
