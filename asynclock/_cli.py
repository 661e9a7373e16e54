"""The ``asynclock`` command.

``asynclock run NAME -- CMD ARGS...`` runs a command while holding a lock, like ``flock(1)`` or
``etcdctl lock``, but it exports the fencing token to the command, renews the lease while the
command runs, and when the lease is lost it terminates the command's whole process group
(etcdctl lets the command run on after its lease is gone).

``asynclock status NAME... [--url URL]`` prints who holds each lock, with which token, how long
until its lease would expire and how many wait, as far as the backend can tell.

``asynclock demo`` starts several worker *processes* that contend for one lock on the embedded
backend (or any URL) and print who held it, with which fencing token, so that the cross-process
exclusion and the strictly increasing tokens can be seen with nothing installed.

Exit codes of ``run``: the command's own code (128 + N when it died of signal N), or
``EXIT_TIMEOUT`` (75) when the lock was not acquired within ``--timeout``, ``EXIT_LEASE_LOST``
(79) when the lease was lost and the command was terminated, ``EXIT_UNAVAILABLE`` (69) when the
lock server could not be used, ``EXIT_USAGE`` (64) for bad arguments, ``EXIT_NOT_FOUND`` (127)
when the command does not exist and ``EXIT_NOT_EXECUTABLE`` (126) when it cannot be executed
(the shell's codes).

The command never outlives ``run``: it is started by a small guard process, its parent, in a
session of its own, which watches a pipe from ``run``. When ``run`` dies, even of SIGKILL, the
pipe reaches end-of-file and the guard sends SIGTERM to the command's process group, then SIGKILL
after ``min(--grace, ttl / 3)`` seconds, before the lease can expire (it was renewed at most
ttl / 3 earlier). The same when ``run`` is stopped or hung past the lease's deadline, which it
tells the guard at each renewal. The command itself gets SIGKILL if the guard dies (Linux: the
parent-death signal). What the command leaves running in its group when it exits is ended the same way before
the lock is released.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import itertools
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import anyio
import anyio.abc

from . import _registry
from ._connect import connect
from ._errors import (
    AcquireTimeout,
    BackendUnavailable,
    InvalidArgument,
    LeaseLost,
    LockError,
    UnsupportedFeature,
)
from ._lease import Lease

EXIT_USAGE = 64
EXIT_UNAVAILABLE = 69
EXIT_TIMEOUT = 75
EXIT_LEASE_LOST = 79
EXIT_NOT_EXECUTABLE = 126
EXIT_NOT_FOUND = 127

#: How ``run`` starts the guard: with this same asynclock, whatever the current directory is
#: (-P keeps it off sys.path).
_GUARD = (
    sys.executable,
    "-P",
    "-c",
    "import sys; p = sys.argv.pop(1); p in sys.path or sys.path.append(p); "
    "from asynclock._cli import _guard; sys.exit(_guard(sys.argv[1:]))",
    str(Path(__file__).resolve().parent.parent),
)

#: The URL ``run`` uses when neither --url nor $ASYNCLOCK_URL is given.
DEFAULT_URL = "sqlite:///tmp/asynclock.db"


def _group_exists(pgid: int) -> bool:
    """Whether process group ``pgid`` has live members (zombies an init is slow to reap not)."""
    members = _group_members(pgid)
    if members is not None:
        return bool(members)
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # the number was reused by someone else's group: not ours
        return False
    return True


async def _ended(process: anyio.abc.Process, wait: float) -> bool:
    """Whether the guard exited and nothing is left in its process group, within ``wait`` s."""
    with anyio.move_on_after(wait):
        await process.wait()
        while _group_exists(process.pid):  # noqa: ASYNC110 (nothing to wait on but polling)
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
            if process.returncode is not None and not _group_exists(process.pid):
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


def _unrunnable(program: str) -> tuple[int, str] | None:
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
    """Start the guard (see ``_guard``) with ``command``; return it and the pipe's write end.

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


async def _run_locked(
    url: str, name: str, ttl: float, timeout: float | None, grace: float, command: Sequence[str]
) -> int:
    async with connect(url) as locks:
        lease_lost: LeaseLost | None = None
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
            lease_lost = exc
        if lease_lost is not None:
            print(
                f"asynclock run: {lease_lost}; the command was terminated",
                file=sys.stderr,
            )
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


def _group_members(pgid: int) -> list[int] | None:
    """The live processes of group ``pgid`` other than this one (from /proc; None without it)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    me = os.getpid()
    members: list[int] = []
    for entry in entries:
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as file:
                stat = file.read()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...; comm may contain anything, ")" included.
        fields = stat.rsplit(b")", 1)[-1].split()
        if len(fields) > 2 and fields[0] != b"Z" and int(fields[2]) == pgid:
            members.append(int(entry))
    return members


def _end_group(child: subprocess.Popen[bytes] | None, wait: float, *, with_self: bool) -> None:
    """SIGTERM our process group, SIGKILL what is left of it after ``wait`` seconds.

    This process ignores the SIGTERM; ``with_self`` says whether it may die of the SIGKILL (the
    supervisor is gone, nobody reads our exit code), else the rest is killed one by one.
    """
    group = os.getpgid(0)

    def done() -> bool:  # without /proc, only the child is known
        return (child is None or child.poll() is not None) and not _group_members(group)

    if done():
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal.SIGTERM)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if done():
            return
        time.sleep(0.02)
    if with_self or _group_members(group) is None:
        if with_self:
            os.killpg(group, signal.SIGKILL)
        return
    for _ in range(10):  # what forks while being killed
        if child is not None and child.poll() is None:
            child.kill()
        for pid in _group_members(group) or ():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if done():
            return
        time.sleep(0.02)


def _guard(argv: Sequence[str]) -> int:
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


def _demo_worker(url: str, worker: int, rounds: int, hold: float) -> None:
    async def run() -> None:
        async with connect(url) as locks:
            for _ in range(rounds):
                async with locks.lock("demo", ttl=5, timeout=60) as lease:
                    started = time.monotonic()
                    await anyio.sleep(hold)
                    print(
                        f"worker {worker} (pid {os.getpid()}) held 'demo' with token "
                        f"{lease.token:>4} from {started:.3f} to {time.monotonic():.3f}",
                        flush=True,
                    )
                # Let the others have a turn; the embedded backend is not FIFO across processes.
                await anyio.sleep(hold / 2)

    anyio.run(run)


def _demo(url: str | None, workers: int, rounds: int, hold: float) -> int:
    with tempfile.TemporaryDirectory(prefix="asynclock-demo-") as directory:
        url = url or f"sqlite://{directory}/locks.db"
        print(f"{workers} processes contend for the lock 'demo' on {_registry.redact(url)}")
        command = [sys.executable, "-m", "asynclock", "_demo-worker", url]
        children = [
            subprocess.Popen(
                [*command, str(worker), str(rounds), str(hold)], stdout=subprocess.PIPE, text=True
            )
            for worker in range(1, workers + 1)
        ]
        lines: list[str] = []
        failed = 0
        for child in children:
            out, _ = child.communicate()
            lines.extend(out.splitlines())
            failed += child.returncode != 0
        # Sorted by the start of each hold: CLOCK_MONOTONIC is shared by the processes.
        lines.sort(key=lambda line: float(line.split(" from ")[1].split()[0]))
        tokens: list[int] = []
        overlaps = 0
        previous_end = 0.0
        for line in lines:
            print(line)
            tokens.append(int(line.split("token")[1].split()[0]))
            start, end = (float(part) for part in line.split(" from ")[1].split(" to "))
            overlaps += start < previous_end
            previous_end = end
        increasing = all(a < b for a, b in itertools.pairwise(tokens))
        print(
            f"{len(lines)} holds, {overlaps} overlapping, tokens strictly increasing: "
            f"{'yes' if increasing else 'NO'}"
        )
        return 1 if failed or overlaps or not increasing else 0


async def _status(url: str, names: Sequence[str]) -> int:
    async with connect(url) as locks:
        for name in names:
            info = await locks.inspect(name)
            if not info.held:
                waiting = "" if info.waiters is None else f", {info.waiters} waiting"
                print(f"{name}: free{waiting}")
                continue
            parts = [
                f"held by {info.holder or info.owner or 'an unknown holder'}",
                f"token {info.token}" if info.token is not None else "",
                f"expires in {info.expires_in:.1f} s" if info.expires_in is not None else "",
                f"{info.waiters} waiting" if info.waiters is not None else "",
            ]
            print(f"{name}: " + ", ".join(part for part in parts if part))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="asynclock",
        description="Distributed locks from the command line.",
        epilog=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run a command while holding a lock")
    run.add_argument("name", help="the lock's name")
    run.add_argument("--url", default=os.environ.get("ASYNCLOCK_URL", DEFAULT_URL))
    run.add_argument("--ttl", type=float, default=30.0, help="lease length in seconds")
    run.add_argument("--timeout", type=float, default=None, help="seconds to wait (0: try once)")
    run.add_argument("--grace", type=float, default=5.0, help="SIGTERM to SIGKILL, seconds")
    run.add_argument("cmd", nargs="*", help="the command and its arguments, after --")
    status = commands.add_parser("status", help="who holds a lock, its token, who waits")
    status.add_argument("names", nargs="+", metavar="NAME")
    status.add_argument("--url", default=os.environ.get("ASYNCLOCK_URL", DEFAULT_URL))
    demo = commands.add_parser("demo", help="processes contending for one lock, with tokens")
    demo.add_argument("--url", help="lock URL (default: a temporary SQLite file)")
    demo.add_argument("--workers", type=int, default=2)
    demo.add_argument("--rounds", type=int, default=5)
    demo.add_argument("--hold", type=float, default=0.05, help="seconds each hold lasts")
    commands.add_parser("bench", add_help=False, help="benchmark the backends (bench --help)")
    worker = commands.add_parser("_demo-worker")
    worker.add_argument("url")
    worker.add_argument("worker", type=int)
    worker.add_argument("rounds", type=int)
    worker.add_argument("hold", type=float)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_guard"]:  # the command's parent process (``run`` starts it this way too)
        return _guard(argv[1:])
    if argv[:1] == ["bench"]:  # options parsed by benchmarks/, in a source checkout only
        from benchmarks import main as bench

        return bench(argv[1:])
    # Everything after the first "--" is the command, options that look like ours included.
    command: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, command = argv[:split], argv[split + 1 :]
    args = parser.parse_args(argv)
    try:
        if args.command == "run":
            command = [*args.cmd, *command]
            if not command:
                parser.error("run needs a command: asynclock run NAME -- CMD ARGS...")
            unrunnable = _unrunnable(command[0])
            if unrunnable is not None:
                print(f"asynclock run: {unrunnable[1]}", file=sys.stderr)
                return unrunnable[0]
            return anyio.run(
                _run_locked, args.url, args.name, args.ttl, args.timeout, args.grace, command
            )
        if args.command == "status":
            return anyio.run(_status, args.url, args.names)
        if args.command == "demo":
            return _demo(args.url, args.workers, args.rounds, args.hold)
        _demo_worker(args.url, args.worker, args.rounds, args.hold)
    except AcquireTimeout as exc:
        print(f"asynclock: {exc}", file=sys.stderr)
        return EXIT_TIMEOUT
    except InvalidArgument as exc:
        print(f"asynclock: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (BackendUnavailable, LockError, OSError) as exc:
        print(f"asynclock: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    return 0
