"""The client's host: the task group that runs the backend, the renewal loop and background
releases, opened in ``__aenter__`` and closed in ``aclose()``.

The backend is opened and closed in one task of this group, at the same nesting level, so a
backend may own a task group from ``open()`` to ``aclose()``. Closing finishes whatever cancels
the caller (anyio's or asyncio's native cancellation alike).
"""

from __future__ import annotations

import math
import sys
from typing import Literal

import anyio
from anyio.abc import TaskGroup, TaskStatus

from ._errors import BackendTimeout, UnsupportedFeature
from ._scope import release_all
from ._shield import Deferred, finish, on_asyncio
from ._supervisor import Supervisor
from ._validate import redact
from .abc import Backend, Grant

#: How long closing the client waits for releases still retried in the background.
_CLOSE_GRACE = 1.0

State = Literal["new", "opening", "open", "closing", "closed"]


class BackendHost:
    """Runs one backend for one client: open, renew, retry late releases, close."""

    def __init__(
        self,
        backend: Backend[Grant],
        supervisor: Supervisor,
        *,
        connect_timeout: float,
        release_timeout: float,
    ) -> None:
        self._backend = backend
        self._supervisor = supervisor
        self._connect_timeout = connect_timeout
        self._release_timeout = release_timeout
        self._task_group: TaskGroup | None = None
        # Made in open(): anyio primitives need a running event loop, and a client may be
        # made at import time. The renewal task has its own scope so that closing the client
        # stops it without cancelling the caller's code, which runs inside the group's scope.
        self._renewal_scope: anyio.CancelScope
        self._close_requested: anyio.Event
        self._backend_closed: anyio.Event
        #: Releases that did not finish in time and go on in the background.
        self.deferred = Deferred(attempt_timeout=release_timeout)
        self.state: State = "new"

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
                await self._close_requested.wait()
                # Called at the nesting level of open(), so that a task group the backend
                # entered there can be left here.
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

    async def aclose(self) -> None:
        """Release every lease still held and close the backend. Idempotent; it finishes
        (within ``release_timeout + connect_timeout``) whatever cancels the caller."""
        if self.state != "open":
            return
        self.state = "closing"
        closed = await finish(
            self._close,
            timeout=self._release_timeout + self._connect_timeout,
            what=f"closing the lock client of {self._backend.describe()}",
        )
        if not closed and self._task_group is not None:
            # The backend did not close in time: stop its host task rather than hang the exit.
            self._task_group.cancel_scope.cancel()
        self.state = "closed"

    async def leave(self) -> None:
        """Leave the task group (after :meth:`aclose`), in the task that opened it."""
        task_group, self._task_group = self._task_group, None
        if task_group is not None:
            # The renewal task is stopped by now. The caller's exception is not the task
            # group's business: handing it over would wrap it in an ExceptionGroup. Only a
            # crash of the renewal task itself surfaces from here (as a group).
            await task_group.__aexit__(None, None, None)

    async def _close(self) -> None:
        await release_all(self._supervisor.leases)
        # Releases still retried in the background get a little longer (a server that hung
        # may be back), then stop: the server frees what they held when its lease expires
        # (etcd and ZooKeeper at once, since closing the backend ends its lease or session).
        await self.deferred.aclose(min(self._release_timeout, _CLOSE_GRACE))
        self._renewal_scope.cancel()
        self._close_requested.set()
        await self._backend_closed.wait()

    async def _renew(self) -> None:
        with self._renewal_scope:
            await self._supervisor.run()


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
