"""The queue's rules, as pure functions: which keys a hold waits for, and what one read of
them says about its place. No I/O here; :mod:`._queue` does the reads.

A lock, a reader and an election are a semaphore of one permit over the keys they wait for,
without grant marks: a key may hold while fewer than ``permits`` keys of its range are older
than it (a writer's range is every key of the name, a reader's only the writers: see
:mod:`._names`). A semaphore's keys also carry a mark (``b"N;w"``: waiting, ``b"N;"``:
granted, see :mod:`._permits`), and a key may hold only once every older key is granted.

A waiter watches the ``permits`` keys just older than its own: it may hold once fewer than
``permits`` keys are older, so one of those must go first (the keys before them are too few to
make up the difference). A release therefore wakes at most ``permits`` waiters, as
ZooKeeper's (``zookeeper/_order.py``) does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, NamedTuple

from .._kit import Kind, permits_mismatch
from ._names import permits_of, waiting_permit, writers

#: How many of the keys older than its own a lock's waiter reads and follows through the name's
#: watch: when every one it read is gone and there were no more, it holds without a read.
TRACKED: Final = 8

__all__ = (
    "TRACKED",
    "Rule",
    "Standing",
    "check_permits",
    "may_try",
    "read_limit",
    "rule",
    "standing",
)


class Rule(NamedTuple):
    """What one kind of hold waits for."""

    #: The range of the keys that keep ours from holding when they are older.
    low: bytes
    high: bytes
    #: How many keys may hold at once (1 except for semaphores).
    permits: int
    #: Keys are created waiting and marked granted in order (semaphores).
    marked: bool
    #: Whether our own key lies in [low, high) (not a reader's: it is no writer).
    own_in_range: bool


class Standing(NamedTuple):
    """Where our key stands, as one read saw it."""

    #: It may hold now (marked: it may mark itself granted).
    holds: bool
    #: The (up to ``permits``) newest keys older than ours, newest first: one of them must go
    #: before ours may hold, so a wait watches them (a lock's: the key just before ours).
    watch: tuple[bytes, ...]
    #: Marked, with fewer older keys than permits: an older key's grant mark may free ours,
    #: so a wait watches their puts too, not only their deletes.
    puts_matter: bool
    #: At most ``permits`` keys are older: a watch that may be unsynced is helped by polls.
    near: bool
    #: The revision of the read.
    seen: int
    #: The keys older than ours that keep it from holding, as read (newest first), with their
    #: create revisions; ``complete``: every such key (the read returned fewer than its limit).
    older: tuple[tuple[bytes, int], ...] = ()
    complete: bool = False


def rule(prefix: bytes, end: bytes, kind: Kind, shared: bool, permits: int) -> Rule:
    """The rule of a hold of ``kind`` on the name whose keys are [prefix, end)."""
    if kind == "semaphore":
        return Rule(prefix, end, permits, marked=True, own_in_range=True)
    if shared:
        low, high = writers(prefix)
        return Rule(low, high, 1, marked=False, own_in_range=False)
    return Rule(prefix, end, 1, marked=False, own_in_range=True)


def read_limit(rule: Rule, *, enqueue: bool) -> int:
    """How many of the newest keys of the range a read must return: ``permits + 1`` older
    than ours (to tell "near" from further back; an unmarked rule's: ``TRACKED + 1``, see
    ``TurnWait``), and ours too when the read comes right after our key was created in the
    range (then it is the newest)."""
    older = rule.permits + 1 if rule.marked else TRACKED + 1
    return older + (1 if enqueue and rule.own_in_range else 0)


def standing(rule: Rule, older: Sequence[tuple[bytes, bytes, int]], seen: int) -> Standing:
    """Our place, from the newest ``(key, value, create revision)`` of the keys older than ours
    (newest first, at most ``read_limit(rule, enqueue=False)``), read at revision ``seen``. An
    unmarked rule's values are not read (and an election's value may end like a mark): they
    are not looked at."""
    waiting = rule.marked and any(waiting_permit(value) for _, value, _ in older)
    return Standing(
        holds=len(older) < rule.permits and not waiting,
        watch=tuple(key for key, _, _ in older[: rule.permits]),
        puts_matter=rule.marked and len(older) < rule.permits,
        near=len(older) <= rule.permits,
        seen=seen,
        older=tuple((key, rev) for key, _, rev in older[:TRACKED]),
        complete=len(older) <= TRACKED,
    )


def may_try(rule: Rule, count: int, values: Sequence[bytes]) -> bool:
    """Whether a semaphore read with ``count`` keys, the first of them with ``values``, has a
    permit free for a try: fewer keys than permits, and none waiting for its grant mark (a try
    must not overtake it)."""
    return count < rule.permits and not any(map(waiting_permit, values))


def check_permits(name: str, permits: int, value: bytes) -> None:
    """Refuse a semaphore request whose number of permits is not the one the name's key
    ``value`` was created with."""
    held = permits_of(value)
    if held != permits:
        raise permits_mismatch(name, held, permits)
