"""The client's host: the task group that runs the backend, the renewal loop and background
releases, opened in ``__aenter__`` (or ``start()``) and closed in ``aclose()``.

The backend is opened and closed in one task of this group, at the same nesting level, so a
backend may own a task group from ``open()`` to ``aclose()``. Closing finishes whatever cancels
the caller (anyio's or asyncio's native cancellation alike).

A task group must be left by the task that entered it. ``async with`` does both in the caller's
task. ``start()`` is for frameworks whose start-up and shutdown hooks run in different tasks
(arq, saq, taskiq, ASGI lifespans split in two, test fixtures): the group is then entered and left
by a task of the host's own, which ``aclose()`` stops and waits for, so it is owned and joined,
never left running.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import math
import sys
from collections.abc import Callable, Coroutine
from typing import Any, Literal

import anyio
from anyio.abc import TaskGroup, TaskStatus

from . import _fencing
from ._clock import now
from ._errors import BackendTimeout, UnsupportedFeature
from ._events import Events, Source
from ._lease import Lease
from ._scope import Deadlines, release_all
from ._shield import Deferred, finish, on_asyncio
from ._state import StateTracker
from ._supervisor import Supervisor
from ._validate import redact
from .abc import Backend, Grant

logger = logging.getLogger("asynclock")

#: How long releasing an already lost lease may keep the caller: the server may be hanging (often
#: the reason for the loss), and the rest of the release goes on in the background.
_LOST_RELEASE_WAIT = 0.25
#: How long closing the client waits for releases still retried in the background.
_CLOSE_GRACE = 1.0

State = Literal["new", "opening", "open", "closing", "closed"]


class InFlight:
    """The client's acquires in flight. Closing the client ends them first, while the backend
    is still open: each is cancelled as a cancelled acquire is, and undoes what it began (a
    place in a queue, a wait on a connection) before its caller gets BackendUnavailable.
    Closed under them instead, waiters left their places behind on the server (Redis, SQLite)
    until those expired, and some ended with the wrong error or only on a timeout."""

    def __init__(self) -> None:
        self.scopes: set[anyio.CancelScope] = set()
        self._ended: anyio.Event | None = None
        #: The client's close has cancelled them (an acquire's scope that ends cancelled
        #: without it reached its deadline).
        self.closing = False

    def done(self, scope: anyio.CancelScope) -> None:
        self.scopes.discard(scope)
        if not self.scopes and self._ended is not None:
            self._ended.set()

    async def end(self, timeout: float) -> None:
        """Cancel every acquire in flight and wait (up to ``timeout``) until each has ended."""
        self.closing = True
        if not self.scopes:
            return
        self._ended = anyio.Event()
        for scope in list(self.scopes):
            scope.cancel()
        with anyio.move_on_after(timeout):
            await self._ended.wait()


class BackendHost:
    """Runs one backend for one client: open, renew, retry late releases, close."""

    def __init__(
        self,
        backend: Backend[Grant],
        *,
        connect_timeout: float,
        release_timeout: float,
    ) -> None:
        self._backend = backend
        self._connect_timeout, self._release_timeout = connect_timeout, release_timeout
        described = backend.describe()
        #: What happens to the client's locks, for observers; and its connection state.
        self.events = Events(Source(backend=described.split(":", 1)[0], address=described))
        self.connection = StateTracker(self.events)
        self.supervisor = Supervisor(backend, self.events, self.connection)
        #: Cancels bodies whose leases reach their local deadline.
        self.deadlines = Deadlines()
        self._task_group: TaskGroup | None = None
        # Made in open(): anyio primitives need a running event loop, and a client may be
        # made at import time. The renewal task has its own scope so that closing the client
        # stops it without cancelling the caller's code, which runs inside the group's scope.
        self._renewal_scope: anyio.CancelScope
        self._close_requested: anyio.Event
        self._backend_closed: anyio.Event
        #: Releases that did not finish in time and go on in the background.
        self.deferred = Deferred(attempt_timeout=release_timeout)
        self.in_flight = InFlight()
        self.state: State = "new"
        #: With start(): the host's own task, told to stop by ``_stop`` and done at ``_own_done``.
        self._own_task: Any = None
        self._stop: anyio.Event | None = None
        #: The event loop the client runs on (None under trio, which has one per run).
        self.loop: asyncio.AbstractEventLoop | None = None
        self._own_done: anyio.Event | None = None
        self._own_failure: BaseException | None = None

    async def open(self) -> None:
        if self.state != "new":
            raise RuntimeError("a LockClient can be entered once; call asynclock.connect() again")
        check_event_loop(self._backend, self._backend.describe())
        self.state = "opening"
        self._renewal_scope = anyio.CancelScope()
        self._close_requested = anyio.Event()
        self._backend_closed = anyio.Event()
        task_group = anyio.create_task_group()
        await task_group.__aenter__()
        try:
            await task_group.start(self._host_backend, name="asynclock backend")
        except BaseException:
            self.state = "closed"
            # Nothing else runs in the group yet; close it without handing it the error, which
            # would come back wrapped in an ExceptionGroup. (No shield here: a scope entered
            # between the group's enter and exit would break their nesting.)
            await task_group.__aexit__(None, None, None)
            raise
        task_group.start_soon(self._renew, name="asynclock renewal")
        self._task_group = task_group
        self.deferred.bind(task_group)
        self.state = "open"

    async def _host_backend(self, *, task_status: TaskStatus[None]) -> None:
        """Open, hold and close the backend in one task of the client's task group.

        The backend may enter a task group in ``open()`` and leave it in ``aclose()``: both run
        here, and the connect timeout's scope stays open (disarmed) in between, so everything
        the backend starts nests inside it properly.
        """
        opened = False
        try:
            with anyio.CancelScope(
                deadline=anyio.current_time() + self._connect_timeout
            ) as connect_scope:
                await self._backend.open()
                opened = True
                connect_scope.deadline = math.inf
                task_status.started()
                try:
                    await self._close_requested.wait()
                finally:
                    # Called at the nesting level of open(), so that a task group the backend
                    # entered there can be left here. Also when the wait is cancelled: a
                    # start() cancelled as the backend finished opening left it open.
                    await self._backend.aclose()
        except BaseException:
            if not opened:
                with anyio.CancelScope(shield=True):
                    await self._backend.aclose()
            raise
        finally:
            self._backend_closed.set()
        if not opened:
            with anyio.CancelScope(shield=True):
                await self._backend.aclose()
            raise BackendTimeout(
                f"{self._backend.describe()} did not answer within {self._connect_timeout:g} s; "
                "check that the server runs and the URL's host and port are right, or raise "
                "connect_timeout"
            )

    async def start(self) -> None:
        """Open in a task of the host's own, so that :meth:`aclose` may come from any task."""
        if self.state != "new" or self._own_task is not None:
            raise RuntimeError(
                "a LockClient is opened once (async with, or start()); call asynclock.connect() again"
            )
        check_event_loop(self._backend, self._backend.describe())
        self.loop = asyncio.get_running_loop() if on_asyncio() else None
        opened = anyio.Event()
        stop = self._stop = anyio.Event()
        done = self._own_done = anyio.Event()

        opening = anyio.CancelScope()

        async def own() -> None:
            try:
                # Encloses the task group's whole life (entered in open(), left in leave()),
                # so that cancelling it is a proper way to give up an opening.
                with opening:
                    try:
                        await self.open()
                    finally:
                        opened.set()
                    try:
                        await stop.wait()
                    finally:
                        # Also when the event loop shuts down with the client still open.
                        try:
                            await self._close_if_open()
                        finally:
                            await self.leave()
            except BaseException as exc:
                # Nobody awaits this task but through ``done``: the failure is handed to
                # start() (opening) or aclose() (a crash of the renewal task), not lost.
                self._own_failure = exc
            finally:
                done.set()

        self._own_task = _spawn(own, f"asynclock client of {redact(self._backend.describe())}")
        try:
            await opened.wait()
        except BaseException:
            # Cancelled while opening: give the opening up (open() closes what it opened).
            opening.cancel()
            stop.set()
            await finish(done.wait, timeout=self._close_timeout, what="stopping the client")
            raise
        failure, self._own_failure = self._own_failure, None
        if failure is not None:
            raise failure

    @property
    def _close_timeout(self) -> float:
        return self._release_timeout + self._connect_timeout

    async def aclose(self) -> None:
        """Release every lease still held and close the backend. Idempotent; it finishes
        (within ``release_timeout + connect_timeout``) whatever cancels the caller."""
        try:
            await self._close_if_open()
        finally:
            # Also when the caller is cancelled: the own task must not outlive the client.
            if self._stop is not None and self._own_done is not None:
                self._stop.set()
                await finish(
                    self._own_done.wait, timeout=_CLOSE_GRACE, what="stopping the client's task"
                )
        failure, self._own_failure = self._own_failure, None
        if failure is not None:
            raise failure

    async def _close_if_open(self) -> None:
        if self.state != "open":
            return
        self.state = "closing"
        closed = await finish(
            self._close,
            timeout=self._close_timeout,
            what=f"closing the lock client of {self._backend.describe()}",
        )
        if not closed and self._task_group is not None:
            # The backend did not close in time: stop its host task rather than hang the exit.
            self._task_group.cancel_scope.cancel()
        self.state = "closed"
        self.connection.closed()

    async def leave(self) -> None:
        """Leave the task group (after :meth:`aclose`), in the task that opened it."""
        task_group, self._task_group = self._task_group, None
        if task_group is not None:
            # The renewal task is stopped by now. The caller's exception is not the task
            # group's business: handing it over would wrap it in an ExceptionGroup. Only a
            # crash of the renewal task itself surfaces from here (as a group).
            await task_group.__aexit__(None, None, None)

    async def _close(self) -> None:
        await self.in_flight.end(self._release_timeout)
        await release_all(self.supervisor.leases)
        # Releases still retried in the background get a little longer (a server that hung
        # may be back), then stop: the server frees what they held when its lease expires
        # (etcd and ZooKeeper at once, since closing the backend ends its lease or session).
        await self.deferred.aclose(min(self._release_timeout, _CLOSE_GRACE))
        self._renewal_scope.cancel()
        self._close_requested.set()
        await self._backend_closed.wait()

    async def release(self, lease: Lease) -> None:
        """Release ``lease``: at once if the server answers in time, else in the background."""
        if lease.released:
            return
        lease._check_deadline()
        lost = lease._lost_reason is not None
        lease._mark_released()
        self.supervisor.discard(lease)
        _fencing.discard(lease)
        grant = lease.grant
        # A lost lease is released only so that nothing stays behind: the caller need not wait
        # for a server that may be hanging (that is often why the lease was lost).
        wait = min(self._release_timeout, _LOST_RELEASE_WAIT) if lost else self._release_timeout
        if self.events.active:
            held = now() - grant.valid_from
            self.events.emit("released", grant.name, held, lost)
        try:
            released = await finish(
                functools.partial(self._backend.release, grant),
                timeout=wait,
                what=f"releasing {grant.name!r}",
                unfinished=functools.partial(self._defer_release, grant, None, wait),
            )
        except Exception as exc:
            self.connection.reached(False, exc)
            self._defer_release(grant, exc, wait)
        else:
            self.connection.reached(released, None if released else TimeoutError(wait))

    def _defer_release(self, grant: Grant, error: BaseException | None, waited: float) -> None:
        """Go on releasing ``grant`` in the host's task group until the server answers."""
        what = f"in {waited:g} s" if error is None else f"({error!r})"
        retried = self.deferred.retry(
            functools.partial(self._backend.release, grant), f"releasing {grant.name!r}"
        )
        logger.warning(
            "asynclock: releasing %r on %s did not complete %s; %s",
            grant.name,
            self._backend.describe(),
            what,
            "retrying in the background until the server answers or the client closes"
            if retried
            else "the client is closed, so the server frees it when its lease expires",
        )

    async def _renew(self) -> None:
        with self._renewal_scope:
            async with anyio.create_task_group() as watchers:
                watchers.start_soon(self.deadlines.run, name="asynclock deadlines")
                watchers.start_soon(self.supervisor.watch, name="asynclock renewal watch")
                await self.supervisor.run()


def check_event_loop(backend: Backend[Grant], url: str) -> None:
    """Refuse, by name, a backend whose driver cannot run on the event loop in use (trio)."""
    if on_asyncio() or "trio" in backend.event_loops:
        return
    trio = sys.modules.get("trio")  # a running trio has been imported
    if trio is None:
        return
    try:
        trio.lowlevel.current_task()
    except RuntimeError:
        return  # no event loop at all (a client made at import time)
    raise UnsupportedFeature(
        f"{redact(url)} needs asyncio: its driver ({backend.driver}) does not run under trio. "
        "Under trio use memory:// or sqlite://, or run this client on asyncio"
    )


def _spawn(func: Callable[[], Coroutine[Any, Any, None]], name: str) -> Any:
    """Run ``func`` in a task of its own, outside every cancel scope of the caller.

    Its owner keeps the returned handle and waits for the task to end: this is how a client
    outlives the task that started it, not a task left to run on its own.
    """
    if on_asyncio():
        # A fresh context: the caller's (a held lease's fencing token, say) is not the host's.
        return asyncio.get_running_loop().create_task(
            func(),
            name=name,
            context=contextvars.Context(),
        )
    import trio

    return trio.lowlevel.spawn_system_task(func, name=name)
