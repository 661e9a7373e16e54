"""Deadlock detection across processes: a wait-for graph kept in the lock store itself.

While a task waits for a lock (and the client opted in), it publishes a record in the backend's
:class:`~asynclock.abc.WaiterRegistry`: who it is, which locks it holds (every lease in its
context, inherited ones included, since a parent waiting for its child holds them just the same)
and which lock it waits for. Records expire unless refreshed, so a dead waiter's edge vanishes.

Only waiting tasks can be part of a deadlock, so the graph needs nothing else: waiter A points to
waiter B when A waits for a lock that B holds. Every waiter in a cycle runs the same check on the
same records and picks the same victim, the youngest waiter (ties broken by actor id); only the
victim acts, failing its own wait with :class:`~asynclock.DeadlockDetected`. Its caller's
``async with`` then releases what it held, which breaks the cycle. A waiter that sees the cycle in
a different snapshot than the others only delays the choice to the next look, it never picks a
second victim in the same cycle, because the victim is a function of the cycle alone.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict

import anyio
from anyio.abc import TaskStatus

from . import _fencing
from ._errors import Waiter
from ._shield import finish
from .abc import Backend, Grant, LockRequest, WaiterRegistry

logger = logging.getLogger("asynclock")

_PROCESS = uuid.uuid4().hex[:6]


def _new_process_tag() -> None:
    # A forked child (gunicorn --preload, a fork server) is another process: with the parent's
    # tag, a reused pid would give it a dead process's actor ids.
    global _PROCESS
    _PROCESS = uuid.uuid4().hex[:6]


os.register_at_fork(after_in_child=_new_process_tag)


def actor_id(label: str | None) -> str:
    """``label/host/pid/task name#task id``: unique, and readable in an error message."""
    task = anyio.get_current_task()
    host = label or socket.gethostname()
    return f"{host}/{os.getpid()}.{_PROCESS}/{task.name}#{task.id}"


def find_cycle(me: str, waiters: Sequence[Waiter]) -> list[Waiter] | None:
    """The cycle of waiters that ``me`` is part of, starting with ``me``, or ``None``."""
    by_actor = {waiter.actor: waiter for waiter in waiters}
    holders: dict[str, list[str]] = {}
    for waiter in waiters:
        for name in waiter.holds:
            holders.setdefault(name, []).append(waiter.actor)
    if me not in by_actor:
        return None
    # Depth-first search from me along "waits for a lock held by"; a path back to me is a cycle.
    path: list[str] = [me]
    on_path = {me}
    visited: set[str] = set()

    def walk(actor: str) -> bool:
        for holder in holders.get(by_actor[actor].waits, ()):
            if holder == me:
                return True
            if holder in on_path or holder in visited or holder not in by_actor:
                continue
            path.append(holder)
            on_path.add(holder)
            if walk(holder):
                return True
            on_path.discard(path.pop())
            visited.add(holder)
        return False

    if walk(me):
        return [by_actor[actor] for actor in path]
    return None


def victim(cycle: Sequence[Waiter]) -> str:
    """The youngest waiter of the cycle: the one whose work is least likely to be wasted."""
    return max(cycle, key=lambda waiter: (waiter.since, waiter.actor)).actor


def waiter_for(name: str, label: str | None) -> Waiter:
    """This task, waiting for ``name``; call it in the waiting task itself."""
    return Waiter(
        actor=actor_id(label),
        holds=tuple(lease.name for lease in _fencing.held_leases() if lease.held),
        waits=name,
        since=time.time(),
    )


async def watch_for_deadlock(
    registry: WaiterRegistry,
    me: Waiter,
    *,
    interval: float,
    found: list[list[Waiter]],
    give_up: anyio.CancelScope,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Publish ``me`` and look for a cycle every ``interval``; as the victim, record the cycle
    in ``found`` and cancel ``give_up`` (the wait).

    Nothing is published during the first ``interval``: most waits end before then, and cost
    nothing. A store that fails to answer only delays detection; it never fails the wait.
    """
    record = json.dumps(asdict(me))
    # Three missed refreshes before the record expires: a slow store does not drop live edges.
    ttl = interval * 3
    task_status.started()
    published = False
    try:
        await anyio.sleep(interval)
        while True:
            try:
                await registry.publish(me.actor, record, ttl)
                published = True
                await anyio.sleep(interval)
                values = await registry.scan()
            except Exception as exc:
                logger.info("asynclock: deadlock detection skipped a round: %r", exc)
                await anyio.sleep(interval)
                continue
            waiters = [waiter for waiter in map(_load, values) if waiter is not None]
            cycle = find_cycle(me.actor, waiters)
            if cycle is not None and victim(cycle) == me.actor:
                found.append(cycle)
                give_up.cancel()
                return
    finally:
        if published:
            with anyio.CancelScope(shield=True), anyio.move_on_after(interval * 2):
                try:
                    await registry.withdraw(me.actor)
                except Exception as exc:
                    logger.info("asynclock: withdrawing a wait record failed: %r", exc)


def _load(value: str) -> Waiter | None:
    try:
        data = json.loads(value)
        return Waiter(
            actor=str(data["actor"]),
            holds=tuple(str(name) for name in data["holds"]),
            waits=str(data["waits"]),
            since=float(data["since"]),
        )
    except (ValueError, KeyError, TypeError):
        return None  # a record from another version, or damaged: no edge rather than a crash


async def wait_watching_deadlocks(
    backend: Backend[Grant],
    request: LockRequest,
    registry: WaiterRegistry,
    me: Waiter,
    *,
    interval: float,
    found: list[list[Waiter]],
    release_timeout: float,
) -> Grant | None:
    """``backend.acquire(request)`` while this waiter's record is published and cycles are
    looked for; None (and the cycle in ``found``) if this waiter is a cycle's victim."""
    grant: Grant | None = None
    try:
        async with anyio.create_task_group() as task_group:
            await task_group.start(
                functools.partial(
                    watch_for_deadlock,
                    registry,
                    me,
                    interval=interval,
                    found=found,
                    give_up=task_group.cancel_scope,
                )
            )
            grant = await backend.acquire(request)
            task_group.cancel_scope.cancel()
    except BaseException:
        # Cancelled while the watcher stopped: the grant exists on the server and must not be
        # stranded there.
        if grant is not None:
            await finish(
                functools.partial(backend.release, grant),
                timeout=release_timeout,
                what=f"releasing {request.name!r} after a cancelled acquire",
            )
        raise
    return grant
