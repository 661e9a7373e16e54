"""``asynclock run NAME -- CMD ARGS...``: hold a lock while a guarded command runs."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import anyio
import anyio.abc

from .. import _registry
from .._connect import connect
from .._errors import LeaseLost, UnsupportedFeature
from .._lease import Lease
from ._codes import EXIT_LEASE_LOST, EXIT_NOT_EXECUTABLE, EXIT_NOT_FOUND
from ._groups import group_exists

#: How ``run`` starts the guard: with this same asynclock, whatever the current directory is
#: (-P keeps it off sys.path).
_GUARD = (
    sys.executable,
    "-P",
    "-c",
    "import sys; p = sys.argv.pop(1); p in sys.path or sys.path.append(p); "
    "from asynclock._cli._guard import guard; sys.exit(guard(sys.argv[1:]))",
    str(Path(__file__).resolve().parents[2]),
)


async def _ended(process: anyio.abc.Process, wait: float) -> bool:
    """Whether the guard exited and nothing is left in its process group, within ``wait`` s."""
    with anyio.move_on_after(wait):
        await process.wait()
        while group_exists(process.pid):  # noqa: ASYNC110 (nothing to wait on but polling)
            await anyio.sleep(0.02)
        return True
    return False


async def _terminate(process: anyio.abc.Process, grace: float) -> None:
    """SIGTERM the command's process group, then SIGKILL it after ``grace`` seconds.

    The guard is the group's leader; it ends what the command leaves behind itself, so once it
    has exited there is normally nothing left, unless it was killed.
    """
    with anyio.CancelScope(shield=True):
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            if process.returncode is not None and not group_exists(process.pid):
                return
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, sig)
            if await _ended(process, wait):
                return


async def _forward_signals(process: anyio.abc.Process) -> None:
    # The command runs in its own session (so that a lost lease can kill all of it), which also
    # takes it out of the terminal's process group: pass on what the terminal sends us.
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
        async for sig in signals:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, sig)


def unrunnable(program: str) -> tuple[int, str] | None:
    """Why ``program`` cannot be executed, as the shell says it (exit code, message), or None.

    Checked before the lock is taken, so that a typo does not wait for the lock first; the guard
    reports the same if the program disappears in the meantime.
    """
    if not program:
        return EXIT_NOT_FOUND, "command not found: ''"
    if os.sep in program:
        candidates = [program]
    else:
        path = os.environ.get("PATH", os.defpath)
        candidates = [os.path.join(d or ".", program) for d in path.split(os.pathsep)]
    denied = False
    for candidate in candidates:
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return None
        denied = denied or os.path.exists(candidate)
    if denied:
        return EXIT_NOT_EXECUTABLE, f"command not executable: {program} (permission denied)"
    return EXIT_NOT_FOUND, f"command not found: {program}"


async def _start_guarded(
    command: Sequence[str], env: dict[str, str], grace: float, kill_after: float
) -> tuple[anyio.abc.Process, int]:
    """Start the guard (see ``_guard.guard``) with ``command``; return it and the pipe's write end.

    The write end stays open for as long as this process lives: when it dies, however it dies,
    the guard sees end-of-file and ends the command. Through it the guard also learns the
    lease's deadline (``_report_deadline``), and when we take over ending the command ("stop").
    """
    watch, alive = os.pipe()  # both ends non-inheritable: only the guard gets ``watch``
    os.set_blocking(alive, False)
    try:
        guard = [*_GUARD, str(watch), repr(grace), repr(kill_after), "--", *command]
        process = await anyio.open_process(
            guard,
            env=env,
            start_new_session=True,
            pass_fds=(watch,),
            stdin=None,
            stdout=None,
            stderr=None,
        )
    except BaseException:
        os.close(alive)
        raise
    finally:
        os.close(watch)
    return process, alive


def _tell(alive: int, message: str) -> None:
    """A line for the guard; never blocks (the guard reads all the time), never raises."""
    with contextlib.suppress(OSError):  # BlockingIOError, BrokenPipeError: the guard is gone
        os.write(alive, message.encode() + b"\n")


async def _report_deadline(lease: Lease, alive: int) -> None:
    """Tell the guard each new deadline of the lease, on the CLOCK_MONOTONIC it shares with us.

    If this process stops (SIGSTOP, a hung event loop) the deadline passes without news, and
    the guard ends the command on its own: it must not run on past the lease.
    """
    reported = None
    while True:
        if lease.deadline != reported:
            reported = lease.deadline
            _tell(alive, repr(time.monotonic() - anyio.current_time() + reported))
        await anyio.sleep(min(lease.ttl / 10, 1.0))


async def run_locked(
    url: str, name: str, ttl: float, timeout: float | None, grace: float, command: Sequence[str]
) -> int:
    async with connect(url) as locks:
        try:
            async with locks.lock(name, ttl=ttl, timeout=timeout) as lease:
                env = {**os.environ, "ASYNCLOCK_NAME": name, "ASYNCLOCK_URL": _registry.redact(url)}
                with contextlib.suppress(UnsupportedFeature):
                    env["ASYNCLOCK_TOKEN"] = str(lease.token)
                # Renewals run every ttl / 3, so when this process dies the lease has about
                # 2 ttl / 3 left: the command is dead well before anyone else can get the lock.
                process, alive = await _start_guarded(command, env, grace, min(grace, ttl / 3))
                try:
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(_forward_signals, process)
                        tg.start_soon(_report_deadline, lease, alive)
                        await process.wait()
                        tg.cancel_scope.cancel()
                finally:
                    _tell(alive, "stop")  # from here on, we end the command ourselves
                    await _terminate(process, grace)
                    os.close(alive)
        except LeaseLost as exc:
            print(f"asynclock run: {exc}; the command was terminated", file=sys.stderr)
            return EXIT_LEASE_LOST
        code = process.returncode
        assert code is not None
        if code < 0:  # the guard passes on the command's death by a signal as 128 + N
            print(
                f"asynclock run: the command's guard process was killed by signal {-code}; "
                "the command's process group was killed",
                file=sys.stderr,
            )
            return 128 - code
        return code
