"""The ``asynclock`` command.

``asynclock run NAME -- CMD ARGS...`` runs a command while holding a lock, like ``flock(1)`` or
``etcdctl lock``, but it exports the fencing token to the command, renews the lease while the
command runs, and when the lease is lost it terminates the command's whole process group
(etcdctl lets the command run on after its lease is gone).

``asynclock status NAME... [--url URL] [--kind lock|semaphore|election]`` prints who holds each
lock (every reader, every permit, the leader's value), with which token, how long
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
import os
import sys
from collections.abc import Sequence

import anyio

from .._errors import AcquireTimeout, BackendUnavailable, InvalidArgument, LockError
from ._codes import (
    EXIT_LEASE_LOST,
    EXIT_NOT_EXECUTABLE,
    EXIT_NOT_FOUND,
    EXIT_TIMEOUT,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
)
from ._demo import demo, demo_worker
from ._guard import guard
from ._run import run_locked, unrunnable
from ._status import status

__all__ = (
    "DEFAULT_URL",
    "EXIT_LEASE_LOST",
    "EXIT_NOT_EXECUTABLE",
    "EXIT_NOT_FOUND",
    "EXIT_TIMEOUT",
    "EXIT_UNAVAILABLE",
    "EXIT_USAGE",
    "main",
)

#: The URL ``run`` uses when neither --url nor $ASYNCLOCK_URL is given.
DEFAULT_URL = "sqlite:///tmp/asynclock.db"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asynclock",
        description="Distributed locks from the command line.",
        epilog=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    url = os.environ.get("ASYNCLOCK_URL", DEFAULT_URL)
    commands = parser.add_subparsers(dest="command", required=True)
    run_ = commands.add_parser("run", help="run a command while holding a lock")
    run_.add_argument("name", help="the lock's name")
    run_.add_argument("--url", default=url)
    run_.add_argument("--ttl", type=float, default=30.0, help="lease length in seconds")
    run_.add_argument("--timeout", type=float, default=None, help="seconds to wait (0: try once)")
    run_.add_argument("--grace", type=float, default=5.0, help="SIGTERM to SIGKILL, seconds")
    run_.add_argument("cmd", nargs="*", help="the command and its arguments, after --")
    status_ = commands.add_parser("status", help="who holds a lock, its token, who waits")
    status_.add_argument("names", nargs="+", metavar="NAME")
    status_.add_argument("--url", default=url)
    status_.add_argument(
        "--kind",
        choices=("lock", "semaphore", "election"),
        default="lock",
        help="what NAME is: a lock (with its readers), a semaphore, an election",
    )
    demo_ = commands.add_parser("demo", help="processes contending for one lock, with tokens")
    demo_.add_argument("--url", help="lock URL (default: a temporary SQLite file)")
    demo_.add_argument("--workers", type=int, default=2)
    demo_.add_argument("--rounds", type=int, default=5)
    demo_.add_argument("--hold", type=float, default=0.05, help="seconds each hold lasts")
    commands.add_parser("bench", add_help=False, help="benchmark the backends (bench --help)")
    worker = commands.add_parser("_demo-worker")
    worker.add_argument("url")
    worker.add_argument("worker", type=int)
    worker.add_argument("rounds", type=int)
    worker.add_argument("hold", type=float)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_guard"]:  # the command's parent process (``run`` starts it this way too)
        return guard(argv[1:])
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
            why = unrunnable(command[0])
            if why is not None:
                print(f"asynclock run: {why[1]}", file=sys.stderr)
                return why[0]
            return anyio.run(
                run_locked, args.url, args.name, args.ttl, args.timeout, args.grace, command
            )
        if args.command == "status":
            return anyio.run(status, args.url, args.names, args.kind)
        if args.command == "demo":
            return demo(args.url, args.workers, args.rounds, args.hold)
        demo_worker(args.url, args.worker, args.rounds, args.hold)
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
