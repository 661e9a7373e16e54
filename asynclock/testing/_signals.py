"""Signals to a server's whole process tree: its process group and every descendant."""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import time
from collections.abc import Iterable

__all__ = ("signal_tree",)


def _signal(ids: Iterable[int], sig: signal.Signals) -> None:
    """Send ``sig`` to each process id, or process group for a negative id (as kill(2) does),
    that still exists."""
    for target in ids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(target, sig)


def _descendants(root: int) -> list[int]:
    """Live descendants of ``root``, parents before children (from /proc; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    for entry in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(entry) as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may contain spaces and parentheses.
        fields = stat.rpartition(")")[2].split()
        if len(fields) > 1 and fields[0] not in {"Z", "X"}:
            children.setdefault(int(fields[1]), []).append(int(stat.split(" ", 1)[0]))
    found: list[int] = []
    queue = [root]
    while queue:
        for child in children.get(queue.pop(0), []):
            found.append(child)
            queue.append(child)
    return found


def signal_tree(pid: int, sig: signal.Signals) -> None:
    """Send ``sig`` to the process group of ``pid`` and to every descendant of ``pid``.

    The group alone is not enough: PostgreSQL puts each backend in a session of its own, so
    that a signal to the postmaster's group would leave the backends serving.
    """
    if sig == signal.SIGCONT:
        # Children first, so that a resumed parent finds its children running.
        _signal([*reversed(_descendants(pid)), -pid], sig)
        return
    # Freeze the parent first, so that it forks no child we would miss, and list the children
    # before a SIGKILL reparents them to init.
    _signal([-pid], signal.SIGSTOP)
    descendants = _descendants(pid)
    _signal(descendants, signal.SIGSTOP)
    if sig == signal.SIGSTOP:
        _wait_stopped([pid, *descendants])
        return
    _signal([-pid, *descendants], sig)


def _wait_stopped(pids: Iterable[int], timeout: float = 2.0) -> None:
    """Wait until every thread of ``pids`` has stopped.

    kill() only queues SIGSTOP: the 23 threads of a busy JVM take up to 8 ms to stop, time
    enough to answer a request sent right after pause() returned.
    """
    deadline = time.monotonic() + timeout
    for pid in pids:
        while time.monotonic() < deadline:
            running = False
            for entry in glob.glob(f"/proc/{pid}/task/*/stat"):
                try:
                    with open(entry) as f:
                        state = f.read().rpartition(")")[2].split()[0]
                except (OSError, IndexError):
                    continue
                if state not in {"T", "t", "Z", "X"}:
                    running = True
                    break
            if not running:
                break
            time.sleep(0.0005)
