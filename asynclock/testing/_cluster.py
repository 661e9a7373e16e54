"""Several server processes that form one replicated service (etcd, ZooKeeper)."""

from __future__ import annotations

import abc
import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Generic, Self, TypeVar

from ._host import ServerError, retry_on_port_clash
from ._lifecycle import StartStop
from ._process import Server

M = TypeVar("M", bound=Server)


class Cluster(StartStop, Generic[M]):
    """Several members of one replicated service, started together.

    Every member is a :class:`Server` with its own pause/resume/kill/restart. A member's
    :meth:`Server.restart` waits until that member serves, which needs a quorum; to bring back
    a whole cluster use :meth:`restart`.
    """

    def __init__(self, size: int, *, start_timeout: float, stop_timeout: float) -> None:
        if size < 1:
            raise ValueError("a cluster needs at least one member")
        self.size = size
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self._members: list[M] = self._make_members()
        self._started = False

    @abc.abstractmethod
    def _make_members(self) -> list[M]:
        """Create (not start) the members, each configured with all members' ports."""

    @abc.abstractmethod
    def _is_leader(self, member: M, timeout: float) -> bool:
        """Whether ``member`` is the leader right now; may raise OSError."""

    @property
    def url(self) -> str:
        """The asynclock URL listing every member."""
        return self._members[0].url_format.format(address=self.address)

    @property
    def members(self) -> list[M]:
        """The members, in a new list; fault-inject them one by one."""
        return list(self._members)

    @property
    def address(self) -> str:
        """``host:port,host:port,...`` of all members."""
        return ",".join(member.address for member in self._members)

    def start(self) -> Self:
        """Start every member and wait until each serves."""
        if self._started:
            return self

        def undo() -> None:
            for member in self._members:
                member.stop()

        def new_ports() -> None:
            self._members = self._make_members()

        retry_on_port_clash(lambda: _start_together(self._members, self._members), undo, new_ports)
        self._started = True
        return self

    def stop(self) -> None:
        """Stop every member and delete its data; idempotent."""
        errors = []
        for member in self._shutdown_order():
            try:
                member.stop()
            except Exception as exc:  # one member's failure must not leak the others
                errors.append(exc)
        if errors:
            raise errors[0]

    def restart(self) -> None:
        """Stop every running member, then start all of them together on the same ports with the
        same data; returns once each serves."""
        for member in self._shutdown_order():
            member._terminate()
        _start_together(self._members, [])

    def _shutdown_order(self) -> Iterator[M]:
        """Members one at a time, each time the current leader first if there is one.

        A stopping etcd leader hands leadership to a peer it believes alive and waits up to six
        seconds for it; stopping leaders first means that peer is alive. Stopping members in
        parallel or followers first makes the last leader wait the full six seconds.
        """
        remaining = list(self._members)
        while remaining:
            chosen = remaining[0]
            for member in remaining:
                if member.is_running and not member.is_paused:
                    with contextlib.suppress(OSError, ValueError):
                        if self._is_leader(member, 0.5):
                            chosen = member
                            break
            remaining.remove(chosen)
            yield chosen

    def leader(self, timeout: float = 10.0) -> M:
        """The current leader, waiting up to ``timeout`` seconds for an election to finish."""
        deadline = time.monotonic() + timeout
        while True:
            for member in self._members:
                if not member.is_running or member.is_paused:
                    continue
                with contextlib.suppress(OSError, ValueError):
                    if self._is_leader(member, 1.0):
                        return member
            if time.monotonic() >= deadline:
                raise ServerError(f"{type(self).__name__} has no leader after {timeout:g} s")
            time.sleep(0.05)

    def kill_leader(self, timeout: float = 10.0) -> M:
        """SIGKILL the current leader and return it (restart it with ``member.restart()``)."""
        member = self.leader(timeout)
        member.kill()
        return member

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.address}>"


def _start_together(members: Sequence[Server], fresh: Sequence[Server]) -> None:
    """Launch all members before waiting for any: a member only serves once a quorum runs."""
    for member in members:
        if member in fresh:
            member._begin_start()
        else:
            member._launch()
    for member in members:
        member._finish_start()
