"""One worker process of a safety run: take the lock, read-modify-write the shared resource.

Run by :func:`asynclock.testing.run_safety`; it writes one JSON object a line to its history file:

- ``{"op": "acquire", "t", "token", "expires"}``: holds from ``t``; ``expires`` is the earliest
  moment the server could expire this lease (``valid_from + ttl``), on CLOCK_MONOTONIC, which every
  process on the host shares;
- ``{"op": "write", "t", "ok", "token", "value"}``: the resource accepted (``ok``) or refused the
  write of ``value``;
- ``{"op": "end", "t"}``: the body finished or was cancelled;
- ``{"op": "release", "t"}`` or ``{"op": "lost", "t", "reason"}``: how the hold ended.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import time
from pathlib import Path
from typing import IO, Any, Literal

import anyio

import asynclock
from asynclock._errors import StaleToken
from asynclock._scope import LockContext
from asynclock.testing._safety import open_resource
from asynclock.testing._safety_permits import open_permits


class _History:
    def __init__(self, file: IO[str]) -> None:
        self._file = file

    def log(self, op: str, **fields: Any) -> None:
        # One write per line and a flush: a worker killed mid-run leaves whole lines behind.
        self._file.write(json.dumps({"op": op, "t": time.monotonic(), **fields}) + "\n")
        self._file.flush()


def _held(locks: asynclock.LockClient, args: argparse.Namespace) -> LockContext:
    on_lost: Literal["cancel", "flag"] = "cancel" if args.cancel_on_loss else "flag"
    options = {"ttl": args.ttl, "timeout": args.acquire_timeout, "on_lost": on_lost}
    if args.primitive == "semaphore":
        return locks.semaphore(args.lock, permits=args.permits).lock(**options)
    if args.primitive == "election":
        return locks.election(args.lock).campaign(f"worker {os.getpid()}".encode(), **options)
    return locks.lock(args.lock, **options)


def _pause(args: argparse.Namespace) -> None:
    # The fault lands after the last await before the write, where no check the client makes
    # can help: the write is sent the moment the process runs again.
    if args.random.random() < args.pause_probability:
        if args.pause_kind == "stop":
            # The GC-pause case: the whole process stops; the runner resumes it.
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            # An event loop blocked by synchronous work: no renewal runs either.
            time.sleep(args.pause)  # the fault itself: a blocking call in async code


async def _body(resource: Any, history: _History, args: argparse.Namespace, lease: Any) -> None:
    # Redlock has no sound token (lease.token raises): only a backend that has one logs it.
    known = lease.token if args.fencing_known else None
    token = known if args.fencing else None
    history.log("acquire", token=known, expires=lease.grant.valid_from + lease.ttl)
    try:
        if args.primitive == "semaphore":
            # A permit: enter, work, (pause), exit; at most `permits` holders inside.
            await resource.access("enter", token, known)
            await anyio.sleep(args.hold)
            _pause(args)
            await resource.access("exit", token, known)
            history.log("write", ok=True, token=known, value=None)
        else:
            value = await resource.read(token)
            await anyio.sleep(args.hold)
            _pause(args)
            await resource.write(value + 1, token, known)
            history.log("write", ok=True, token=known, value=value + 1)
    except StaleToken as exc:
        history.log("write", ok=False, token=exc.token, value=None)
    finally:
        # The hold ends here, as the body sees it (also when it is being cancelled); the
        # release that follows is not part of it.
        history.log("end")
        if token is not None and args.primitive == "semaphore":
            with anyio.CancelScope(shield=True):
                await resource.leave(token)


async def _hold_once(
    locks: asynclock.LockClient,
    resource: Any,
    history: _History,
    args: argparse.Namespace,
) -> None:
    async with _held(locks, args) as lease:
        await _body(resource, history, args, lease)
    if lease.lost:
        # on_lost="flag": the body ran to its end on a lost lease; record it as a loss.
        raise asynclock.LeaseLost(args.lock, lease.lost_reason or "lost")


async def _start_together(history: str) -> None:
    """Say this worker is connected, and wait for the runner's go: every worker contends for the
    whole duration, however long each took to start (on a loaded host, seconds)."""
    # Tiny local files, polled: the runner is another process, with nothing to wait on instead.
    Path(f"{history}.ready").touch()  # noqa: ASYNC240
    go = Path(history).with_name("go")
    while not go.exists():  # noqa: ASYNC110
        await anyio.sleep(0.005)


async def _main(args: argparse.Namespace) -> None:
    with open(args.history, "a", encoding="utf-8") as file:  # noqa: ASYNC230 - tiny, local
        history = _History(file)
        opened = (
            open_permits(args.resource, args.permits)
            if args.primitive == "semaphore"
            else open_resource(args.resource)
        )
        async with asynclock.connect(args.url) as locks, opened as resource:
            args.fencing_known = locks.capabilities.fencing
            await _start_together(args.history)
            # The runner ends the run (see run_safety): at the duration, or later if the faults
            # the run is asked for have not all happened yet.
            stop = Path(args.history).with_name("stop")
            while not stop.exists():
                try:
                    await _hold_once(locks, resource, history, args)
                    history.log("release")
                except asynclock.LeaseLost as exc:
                    history.log("lost", reason=exc.reason)
                except asynclock.AcquireTimeout:
                    continue
                except asynclock.BackendUnavailable as exc:
                    # A server fault of the nemesis: wait for it to pass.
                    history.log("error", reason=str(exc)[:200])
                    await anyio.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--lock", required=True)
    parser.add_argument("--resource", required=True)
    parser.add_argument("--history", required=True)
    parser.add_argument("--fencing", action="store_true")
    parser.add_argument("--ttl", type=float, required=True)
    parser.add_argument("--hold", type=float, default=0.005)
    parser.add_argument("--acquire-timeout", type=float, default=2.0)
    parser.add_argument("--pause-probability", type=float, default=0.0)
    parser.add_argument("--pause-kind", choices=("stop", "block"), default="stop")
    parser.add_argument("--pause", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-cancel", dest="cancel_on_loss", action="store_false")
    parser.add_argument("--primitive", choices=("lock", "semaphore", "election"), default="lock")
    parser.add_argument("--permits", type=int, default=3)
    args = parser.parse_args()
    # The worker's own generator: which holds pause must not depend on what else (a retry's
    # jitter in the library) draws from the module's.
    args.random = random.Random(args.seed)
    anyio.run(_main, args)


if __name__ == "__main__":
    main()
