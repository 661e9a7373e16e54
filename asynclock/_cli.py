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
lock server could not be used, ``EXIT_USAGE`` (64) for bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

import anyio
import anyio.abc

from . import _registry
from ._client import connect
from ._errors import (
    AcquireTimeout,
    BackendUnavailable,
    InvalidArgument,
    LeaseLost,
    LockError,
    UnsupportedFeature,
)

EXIT_USAGE = 64
EXIT_UNAVAILABLE = 69
EXIT_TIMEOUT = 75
EXIT_LEASE_LOST = 79

#: The URL ``run`` uses when neither --url nor $ASYNCLOCK_URL is given.
DEFAULT_URL = "sqlite:///tmp/asynclock.db"


async def _terminate(process: anyio.abc.Process, grace: float) -> None:
    """SIGTERM the command's process group, then SIGKILL it after ``grace`` seconds."""
    with anyio.CancelScope(shield=True):
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            if process.returncode is not None:
                return
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, sig)
            with anyio.move_on_after(wait):
                await process.wait()


async def _forward_signals(process: anyio.abc.Process) -> None:
    # The command runs in its own session (so that a lost lease can kill all of it), which also
    # takes it out of the terminal's process group: pass on what the terminal sends us.
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
        async for sig in signals:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, sig)


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
                process = await anyio.open_process(
                    list(command),
                    env=env,
                    start_new_session=True,
                    stdin=None,
                    stdout=None,
                    stderr=None,
                )
                try:
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(_forward_signals, process)
                        await process.wait()
                        tg.cancel_scope.cancel()
                finally:
                    await _terminate(process, grace)
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
