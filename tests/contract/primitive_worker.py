"""The process-level contract of semaphores and elections: a client process, and its resource.

:class:`ResourceServer` runs in the test's process, on 127.0.0.1: the resource every worker
process uses, fenced by a :class:`asynclock.fencing.MemoryGuard` (of the semaphore's permits, or
of one for an election's terms). It counts the bodies inside at once (``enter`` / ``exit`` by
holder and token), accepts or refuses writes by token, and keeps every event in arrival order,
so the test reads one history for all processes.

A worker (``python -m tests.contract.primitive_worker '<json config>'``) runs candidate tasks:

- ``mode="semaphore"``: ``tasks`` tasks each take one permit once (``async with sem.lock()``),
  enter, write with its token every ``every`` seconds for ``hold`` seconds, exit (a long
  ``hold``: a holder that keeps writing until its lease is lost);
- ``mode="campaign"``: ``tasks`` candidates campaign over and over until ``seconds`` pass, each
  term writing with its token for up to ``hold`` seconds, then resigning.

Every worker stops early once the test sets ``ResourceServer.stopping`` (a reply says so).

A body whose lease is lost reports ``lost`` and then tries one more write with its old token,
which the guard must refuse (the paused-process case: the write it was about to send).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import anyio
import anyio.abc
from anyio.abc import SocketAttribute
from anyio.streams.buffered import BufferedByteReceiveStream

import asynclock
from asynclock.fencing import MemoryGuard, StaleToken

RESOURCE = "resource"


class ResourceServer:
    """The shared resource, served to the worker processes over loopback TCP."""

    def __init__(self, permits: int | None) -> None:
        self.guard = MemoryGuard(permits=permits or 1)
        #: The bodies inside now, by (who, token).
        self.bodies: set[tuple[str, int]] = set()
        self.most_inside = 0
        #: Every event, in the order the resource saw it (the history the test checks).
        self.events: list[dict[str, Any]] = []
        self.port = 0
        #: Set by the test when it has seen enough: every reply then tells the workers to stop.
        self.stopping = False
        self._changed = anyio.Event()

    async def serve(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
        self.port = listener.extra(SocketAttribute.local_port)
        async with listener:
            task_status.started()
            await listener.serve(self._connection)

    async def _connection(self, stream: anyio.abc.SocketStream) -> None:
        async with stream:
            reader = BufferedByteReceiveStream(stream)
            while True:
                try:
                    line = await reader.receive_until(b"\n", 65536)
                except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError):
                    return
                reply = self.handle(json.loads(line))
                try:
                    await stream.send(json.dumps(reply).encode() + b"\n")
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    return

    def handle(self, message: dict[str, Any]) -> dict[str, Any]:
        """One request, with no await in it: the check and the access are one step."""
        event = {**message, "t": time.monotonic()}
        op = message["op"]
        if op == "enter":
            self.bodies.add((message["who"], message["token"]))
            self.most_inside = max(self.most_inside, len(self.bodies))
            event["inside"] = len(self.bodies)
        elif op == "exit":
            # Only a body whose enter was counted: one cancelled before its enter reached the
            # resource still sends its exit, which must not count another body out.
            self.bodies.discard((message["who"], message["token"]))
        elif op == "write":
            try:
                self.guard._check(RESOURCE, message["token"])
                event["ok"] = True
            except StaleToken:
                event["ok"] = False
        elif op == "leave":
            self.guard._leave(RESOURCE, message["token"])
        if op == "poll":
            return {"ok": True, "stop": self.stopping}
        self.events.append(event)
        self._changed.set()
        self._changed = anyio.Event()
        return {"ok": event.get("ok", True), "stop": self.stopping}

    def of(self, op: str, **match: Any) -> list[dict[str, Any]]:
        """The events ``op`` (whose fields equal ``match``), in order."""
        return [
            event
            for event in self.events
            if event["op"] == op and all(event.get(key) == value for key, value in match.items())
        ]

    async def wait_for(self, condition: Callable[[], object], timeout: float) -> None:
        """Until ``condition()`` is true, re-checked at each event; fails after ``timeout``."""
        try:
            with anyio.fail_after(timeout):
                while not condition():
                    await self._changed.wait()
        except TimeoutError:
            print(f"--- the resource's last events, of {len(self.events)}:")
            for event in self.events[-20:]:
                print(event)
            raise


#: Set in a worker when the resource says the test is done (see ``ResourceServer.stopping``).
_STOP: anyio.Event | None = None


class _Client:
    """A worker's connection to the resource (one per task: requests never interleave)."""

    def __init__(self, port: int, who: str) -> None:
        self._port = port
        self.who = who
        self._stream: anyio.abc.SocketStream | None = None
        self._reader: BufferedByteReceiveStream | None = None

    async def send(self, op: str, **fields: Any) -> bool:
        if self._stream is None:
            self._stream = await anyio.connect_tcp("127.0.0.1", self._port)
            self._reader = BufferedByteReceiveStream(self._stream)
        assert self._reader is not None
        message = {"op": op, "who": self.who, "pid": os.getpid(), **fields}
        try:
            await self._stream.send(json.dumps(message).encode() + b"\n")
            reply = json.loads(await self._reader.receive_until(b"\n", 65536))
        except BaseException:
            # Cancelled mid-request: the reply may still come; never read it as another's.
            await self.aclose()
            raise
        if reply.get("stop") and _STOP is not None:
            _STOP.set()
        return bool(reply["ok"])

    async def aclose(self) -> None:
        if self._stream is not None:
            stream, self._stream = self._stream, None
            await stream.aclose()


async def _fenced_body(
    client: _Client, token: int, hold: float, every: float, *, leave: bool
) -> None:
    """Enter, write with ``token`` every ``every`` s for ``hold`` s, exit (also if cancelled:
    the enter may have reached the resource even if its reply never came back)."""
    try:
        await client.send("enter", token=token)
        end = time.monotonic() + hold
        while True:
            await client.send("write", token=token)
            if time.monotonic() >= end or (_STOP is not None and _STOP.is_set()):
                break
            await anyio.sleep(min(every, max(0.0, end - time.monotonic())))
    finally:
        with anyio.CancelScope(shield=True):
            await _Client(client._port, client.who).send("exit", token=token)
            if leave:
                await _Client(client._port, client.who).send("leave", token=token)


async def _after_loss(client: _Client, token: int, reason: str) -> None:
    # The paused-process case: the write it was about to send goes out with the old token.
    late = _Client(client._port, client.who)
    await late.send("lost", token=token, reason=reason[:200])
    await late.send("write", token=token, late=True)
    await late.aclose()


async def _semaphore_task(locks: asynclock.LockClient, config: dict[str, Any], who: str) -> None:
    client = _Client(config["port"], who)
    sem = locks.semaphore(config["name"], permits=config["permits"])
    token: int | None = None
    try:
        async with sem.lock(ttl=config["ttl"], timeout=config["timeout"]) as lease:
            token = lease.token
            await _fenced_body(client, lease.token, config["hold"], config["every"], leave=True)
    except asynclock.LeaseLost as exc:
        assert token is not None
        await _after_loss(client, token, exc.reason)
    finally:
        await client.aclose()


async def _campaign_task(
    locks: asynclock.LockClient, config: dict[str, Any], who: str, end: float
) -> None:
    client = _Client(config["port"], who)
    election = locks.election(config["name"])
    try:
        while time.monotonic() < end and not (_STOP is not None and _STOP.is_set()):
            token: int | None = None
            with anyio.move_on_after(max(0.0, end - time.monotonic())):
                try:
                    async with election.campaign(value=who.encode(), ttl=config["ttl"]) as term:
                        token = term.token
                        await _fenced_body(
                            client, term.token, config["hold"], config["every"], leave=False
                        )
                except asynclock.LeaseLost as exc:
                    assert token is not None
                    await _after_loss(client, token, exc.reason)
            # Let another candidate in before campaigning again.
            await anyio.sleep(config.get("pause_between", 0.02))
    finally:
        await client.aclose()


async def _poll_for_stop(port: int, cancel: anyio.CancelScope) -> None:
    assert _STOP is not None
    client = _Client(port, "poll")
    try:
        while not _STOP.is_set():
            await client.send("poll")
            with anyio.move_on_after(0.1):
                await _STOP.wait()
    finally:
        await client.aclose()
    # Candidates still waiting to lead have nothing left to do.
    cancel.cancel()


async def main(config: dict[str, Any]) -> None:
    global _STOP
    _STOP = anyio.Event()
    worker = config["worker"]
    end = time.monotonic() + config.get("seconds", 30.0)
    async with asynclock.connect(config["url"], **config["options"]) as locks:
        ready = _Client(config["port"], f"{worker}")
        await ready.send("ready")
        await ready.aclose()
        async with anyio.create_task_group() as outer:
            work = anyio.CancelScope()
            outer.start_soon(_poll_for_stop, config["port"], work)
            with work:
                async with anyio.create_task_group() as tg:
                    for index in range(config.get("tasks", 1)):
                        who = f"{worker}/{index}"
                        if config["mode"] == "campaign":
                            tg.start_soon(_campaign_task, locks, config, who, end)
                        else:
                            tg.start_soon(_semaphore_task, locks, config, who)
            outer.cancel_scope.cancel()
    done = _Client(config["port"], f"{worker}")
    await done.send("done")
    await done.aclose()


if __name__ == "__main__":
    anyio.run(main, json.loads(sys.argv[1]))
