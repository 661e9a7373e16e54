"""The order of a queue of lock nodes, read from one listing of the parent: who holds, who
waits for whom.

* A lock (``lock`` and ``read`` nodes): a reader waits for the writers before it, a writer for
  everyone before it.
* A semaphore of N permits (``sem<N>`` nodes): a node holds when fewer than N nodes are ahead
  of it. A waiter watches the N nodes just ahead of it: its place can only change when one of
  them goes (a node further ahead leaving moves it up, but leaves those N ahead of it), so a
  release wakes at most N waiters, not every one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from .._kit import permits_mismatch
from ._names import EXCLUSIVE, PROTECTED, SHARED, permits_of

__all__ = ("Queued", "blockers", "permit_blockers", "queue", "sequence")


class Queued(NamedTuple):
    """A lock node in the queue. A tuple, so that a listing of 1,000 nodes is read and sorted
    in C (sequence numbers are unique: the order is theirs)."""

    sequence: int
    child: str
    #: The encoded owner id (``encode_name(request.owner)``).
    owner: str
    kind: str


def sequence(child: str) -> int:
    suffix = child.rpartition("-")[2]
    return int(suffix) if suffix.isdigit() else -1


def _known_kind(kind: str) -> bool:
    return kind in (EXCLUSIVE, SHARED) or permits_of(kind) is not None


def queue(children: Sequence[str]) -> list[Queued]:
    """Our lock nodes among ``children`` (``_c_<owner>-<kind>-<sequence>``), in queue order;
    anything else takes no part in the order."""
    found: list[Queued] = []
    for child in children:
        head, _, suffix = child.rpartition("-")
        owner_part, _, child_kind = head.rpartition("-")
        owner = owner_part.removeprefix(PROTECTED)
        if (
            not child.startswith(PROTECTED)
            or not suffix.isdigit()
            or not _known_kind(child_kind)
            or not owner
        ):
            continue
        found.append(Queued(int(suffix), child, owner, child_kind))
    found.sort()
    return found


def blockers(children: Sequence[str], node: str, kind: str) -> tuple[int, str] | None:
    """How many nodes ahead of the lock node ``node`` keep it from the lock, and the nearest of
    them (``(0, "")``: it holds the lock); None if ``node`` is not among ``children``.

    The same order as :func:`queue`, read in one pass that looks closer only at the nodes
    ahead, and keeps only the nearest: every waiter reads a listing (a name per node of the
    queue) when it queues, so at 1,000 waiters this runs on 1,000 names per waiter.
    """
    mine = sequence(node)
    found = False
    count = 0
    nearest, nearest_number = "", -1
    for child in children:
        head, _, suffix = child.rpartition("-")
        if not suffix.isdigit():
            continue
        number = int(suffix)
        if number >= mine:
            found = found or child == node
            continue
        owner, _, child_kind = head.rpartition("-")
        if (
            (child_kind == EXCLUSIVE or (child_kind == SHARED and kind == EXCLUSIVE))
            and len(owner) > len(PROTECTED)
            and owner.startswith(PROTECTED)
        ):
            count += 1
            if number > nearest_number:
                nearest, nearest_number = child, number
    if not found:
        return None
    return count, nearest


def permit_blockers(
    children: Sequence[str], node: str, name: str, permits: int
) -> list[str] | None:
    """The nodes the semaphore node ``node`` waits for (empty: it holds a permit); None if
    ``node`` is not among ``children``.

    Raises ``permits_mismatch`` when the first node of the queue (the oldest holder) has
    another number of permits: the number is the name's while anyone holds or waits. A node
    with another number further ahead is one that is about to find out and leave (it saw an
    older node with ours): it is waited for, never counted as one of ours.
    """
    entries = queue(children)
    index = next((i for i, entry in enumerate(entries) if entry.child == node), None)
    if index is None:
        return None
    ahead = entries[:index]
    if ahead:
        held = permits_of(ahead[0].kind)
        if held is not None and held != permits:
            raise permits_mismatch(name, held, permits)
    if len(ahead) < permits and all(permits_of(entry.kind) == permits for entry in ahead):
        return []
    return [entry.child for entry in ahead[-permits:]]
