"""The guard: the command's parent process, which ends the command's whole process group when
``asynclock run`` is gone, stopped or hung past the lease's deadline."""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

from ._codes import EXIT_LEASE_LOST, EXIT_NOT_EXECUTABLE, EXIT_NOT_FOUND
from ._groups import group_members


def _parent_death_signal(sig: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the child sent ``sig`` when its parent dies (Linux), or None.

    Only for a single-threaded parent (the guard): ``preexec_fn`` is unsafe with threads, and the
    signal is tied to the thread that forked.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()
    pr_set_pdeathsig = 1

    def preexec() -> None:
        prctl(pr_set_pdeathsig, sig, 0, 0, 0)
        # The parent may have died between the fork and the prctl: then the signal never comes.
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)

    return preexec


def _end_group(child: subprocess.Popen[bytes] | None, wait: float, *, with_self: bool) -> None:
    """SIGTERM our process group, SIGKILL what is left of it after ``wait`` seconds.

    This process ignores the SIGTERM; ``with_self`` says whether it may die of the SIGKILL (the
    supervisor is gone, nobody reads our exit code), else the rest is killed one by one.
    """
    group = os.getpgid(0)

    def done() -> bool:  # without /proc, only the child is known
        return (child is None or child.poll() is not None) and not group_members(group)

    if done():
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal.SIGTERM)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if done():
            return
        time.sleep(0.02)
    if with_self or group_members(group) is None:
        if with_self:
            os.killpg(group, signal.SIGKILL)
        return
    for _ in range(10):  # what forks while being killed
        if child is not None and child.poll() is None:
            child.kill()
        for pid in group_members(group) or ():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if done():
            return
        time.sleep(0.02)


def guard(argv: Sequence[str]) -> int:
    """The command's parent: ``_guard WATCH_FD GRACE KILL_AFTER -- CMD ARGS...``.

    It leads the command's session and process group (``run`` started it with
    ``start_new_session``), so a signal sent to ``run``'s own group (``kill -9 -PGID``, a shell
    killing a job) does not reach it. It exits with the command's code (128 + N for signal N).
    When ``WATCH_FD`` (``run`` holds its other end) reaches end-of-file, ``run`` is gone: the group
    gets SIGTERM, and SIGKILL after KILL_AFTER seconds. The same when the lease's deadline, which
    ``run`` writes there at each renewal, passes without news (``run`` stopped or hung).
    """
    watch, grace, kill_after = int(argv[0]), float(argv[1]), float(argv[2])
    command = list(argv[4:])
    received = b""
    deadline: float | None = None  # the lease's, as run last reported it

    def read() -> bool:
        """Read what run wrote; False at end-of-file (run is gone)."""
        nonlocal received, deadline
        data = os.read(watch, 4096)
        received += data
        *lines, received = received.split(b"\n")
        for line in lines:
            deadline = None if line == b"stop" else float(line)
        return bool(data)

    # Signals for the command that reach the whole group (forwarded by run, or from the lease
    # loss path) must not end the guard; a caught signal is reset to its default by exec.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: None)
    if select.select([watch], [], [], 0)[0] and not read():
        return EXIT_LEASE_LOST
    try:
        child = subprocess.Popen(command, preexec_fn=_parent_death_signal(signal.SIGKILL))
    except FileNotFoundError:
        print(f"asynclock run: command not found: {command[0]}", file=sys.stderr)
        return EXIT_NOT_FOUND
    except PermissionError:
        print(
            f"asynclock run: command not executable: {command[0]} (permission denied)",
            file=sys.stderr,
        )
        return EXIT_NOT_EXECUTABLE
    except OSError as exc:
        print(f"asynclock run: cannot execute {command[0]}: {exc.strerror}", file=sys.stderr)
        return EXIT_NOT_EXECUTABLE
    try:
        exited: int | None = os.pidfd_open(child.pid)
    except (AttributeError, OSError):
        exited = None
    while child.poll() is None:
        # Woken by run's news, the command's end (its pidfd; without one, a poll every 50 ms),
        # or the lease's local deadline (which precedes the server's expiry by the margin). A run
        # that is not stopped acts at the same moment (the lease is lost without a renewal); its
        # --grace is then cut to KILL_AFTER, on the safe side.
        waits = [] if exited is not None else [0.05]
        if deadline is not None:
            waits.append(max(0.0, deadline - time.monotonic()))
        wait = min(waits, default=None)
        readable, _, _ = select.select([watch] if exited is None else [watch, exited], [], [], wait)
        if watch in readable and not read():
            # run was killed: its lease ends at the latest one ttl after its last renewal.
            _end_group(child, kill_after, with_self=True)
            return EXIT_LEASE_LOST
        if deadline is not None and time.monotonic() >= deadline:
            name = os.environ.get("ASYNCLOCK_NAME", "")
            print(
                f"asynclock run: the lease on lock {name!r} reached its deadline without a "
                "renewal (asynclock run is stopped or hung); the command was terminated",
                file=sys.stderr,
            )
            _end_group(child, kill_after, with_self=False)
            return EXIT_LEASE_LOST
    code = child.returncode
    # What the command left running in its group must not outlive the lock either.
    _end_group(None, grace, with_self=False)
    return 128 - code if code < 0 else code
