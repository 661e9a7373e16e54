"""The ZooKeeper backend: sessions per ttl, the contract's calls, and the lock parents' janitor."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Self

import anyio
from aiozk import exc as zk_exc

from .._kit import (
    Backend,
    BackendTimeout,
    BackendUnavailable,
    Capabilities,
    InvalidArgument,
    Kind,
    LockInfo,
    LockRequest,
    Lost,
    ProvenGone,
    Renewed,
    RenewOutcome,
    TaskHost,
    Unknown,
    finish,
    now,
    translate,
)
from . import _inspect, _proto
from ._errors import SessionGone, zk_errors
from ._lease import LockSession, ZooKeeperGrant
from ._queue import Attempt
from ._session import ATTEMPTS, Context, Session
from ._tree import Tree
from ._urls import Settings, describe, parse_url

__all__ = ("ZooKeeperBackend",)

logger = logging.getLogger("asynclock.zookeeper")

#: A lock's parent node that nobody of this client used for this long is deleted (if empty).
#: Keeping it for a moment saves a create and a delete per acquisition of a busy lock.
_PARENT_LINGER = 2.0


class ZooKeeperBackend(Backend[ZooKeeperGrant]):
    """Locks on ZooKeeper (``zookeeper://[user:password@]host:port[,host:port...][/chroot]``).

    Options: ``op_timeout`` (seconds, default 5) bounds every server call, including the wait
    for a connection; ``session_timeout`` (seconds, default 10) is the session opened at connect
    (locks whose ttl equals it share it; every other ttl opens its own session on first use).
    """

    driver = "aiozk"
    # acquire's first round trip (create and list, pipelined) takes a free lock or queues.
    acquire_tries_first = True
    # ttl_change stays False: a lease's ttl is its session's timeout, fixed when the session
    # was made (``extend`` renews with the same ttl, the contract's default).
    capabilities = Capabilities.every(ttl_change=False)

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._sessions: dict[int, LockSession] = {}
        self._tree = Tree(settings, describe(settings))
        # Made in open(): from_url() may run outside of an event loop.
        self._session_lock: anyio.Lock | None = None
        self._host = TaskHost(cleanup_timeout=settings.op_timeout)
        self._context = Context(settings, self._host, describe(settings), self._forget_session)
        self._min_ms: int | None = None
        self._max_ms: int | None = None
        self._state: Literal["new", "open", "closed"] = "new"

    @classmethod
    def from_url(cls, url: str, options: Mapping[str, object]) -> Self:
        return cls(parse_url(url, options))

    def describe(self) -> str:
        return describe(self._settings)

    def extra_info(self) -> Mapping[str, Any]:
        return {
            "chroot": self._settings.chroot,
            "op_timeout": self._settings.op_timeout,
            "session_timeout_bounds": (self._min_ms, self._max_ms),
            "known_parents": len(self._tree.parents),
            "sessions": {ms: session.info() for ms, session in self._sessions.items()},
        }

    # -- lifecycle -------------------------------------------------------------------------

    async def open(self) -> None:
        if self._state != "new":
            raise RuntimeError("a ZooKeeperBackend can be opened once")
        self._state = "open"
        self._session_lock = anyio.Lock()
        await self._host.open()
        try:
            # A server slow to answer now (many clients starting at once, a loaded host) is
            # waited for until connect_timeout; servers that all refuse still fail at once.
            session = await self._new_session(_ms(self._settings.session_timeout), connecting=True)
            session.default = True
            self._sessions[round(session.timeout * 1000)] = session
            await self._tree.ensure_chroot(session)
        except BaseException:
            # Not in a shield scope: the task host's group, entered above, is left in there
            # (the steps of aclose() that must finish are shielded one by one).
            await self.aclose()
            raise
        self._host.start_soon(self._parent_janitor, name="asynclock zookeeper parents")

    async def aclose(self) -> None:
        if self._state == "closed":
            return
        self._state = "closed"
        # A session that is reconnecting (a connection reset just before) will do: the delete
        # waits for it, within the bound; skipped, the parents would stay until the server's
        # container check, a minute later.
        session = self._connected() or next((s for s in self._sessions.values() if s.usable), None)
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(min(self._settings.op_timeout, 2.0)):
                await self._tree.delete_parents(session, list(self._tree.parents))
        sessions, self._sessions = list(self._sessions.values()), {}
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as tg:
                for session in sessions:
                    tg.start_soon(session.aclose)
        await self._host.aclose()

    def _connected(self) -> LockSession | None:
        return next((s for s in self._sessions.values() if s.state == "connected"), None)

    async def _new_session(self, timeout_ms: int, *, connecting: bool = False) -> LockSession:
        session = LockSession(self._context, timeout_ms, self._tree.touch)
        with translate(zk_errors, "opening a ZooKeeper session"):
            await session.start(connecting=connecting)
        negotiated = round(session.timeout * 1000)
        if negotiated > timeout_ms:
            self._min_ms = negotiated
        elif negotiated < timeout_ms:
            self._max_ms = negotiated
        return session

    async def _parent_janitor(self) -> None:
        while True:
            await self._tree.wait_for_parents()
            await anyio.sleep(_PARENT_LINGER / 2)
            stale = self._tree.stale(_PARENT_LINGER)
            if stale:
                await self._tree.delete_parents(self._connected(), stale)

    def _forget_session(self, session: Session) -> None:
        for ms, known in list(self._sessions.items()):
            if known is session:
                del self._sessions[ms]

    async def _session_for(self, ttl: float) -> LockSession:
        ms = _ms(ttl)
        session = self._sessions.get(ms)
        lock = self._session_lock
        # While a session is being made, later calls queue behind the ones waiting for it:
        # skipping ahead once it exists would reorder their creates, hence their places in
        # the queue (the server numbers nodes in the order the creates arrive).
        if session is not None and session.usable and lock is not None and not lock.locked():
            return session
        if self._state != "open":
            raise BackendUnavailable(f"the lock client for {self.describe()} is closed")
        assert lock is not None
        async with lock:
            session = self._sessions.get(ms)
            if session is not None and session.usable:
                return session
            self.check_ttl(ttl)
            session = await self._new_session(ms)
            if round(session.timeout * 1000) != ms:
                # Closed whatever cancels us (a native cancel goes through an anyio shield and
                # would leave the session and its connection open until the client closes).
                await finish(
                    session.aclose,
                    timeout=self._settings.op_timeout + 1.0,
                    what="closing a ZooKeeper session with a refused timeout",
                )
                self.check_ttl(ttl)  # the bounds just learned explain the refusal
                raise InvalidArgument(
                    f"ZooKeeper at {self.describe()} negotiated a session timeout of "
                    f"{session.timeout:g} s for a lock ttl of {ttl:g} s; use a ttl the "
                    "server allows"
                )
            self._sessions[ms] = session
            return session

    def check_ttl(self, ttl: float) -> None:
        ms = _ms(ttl)
        if ms <= 0 or ms > 0x7FFFFFFF:
            raise InvalidArgument(f"ttl {ttl:g} s is out of range for a ZooKeeper session")
        low, high = self._min_ms, self._max_ms
        if (low is not None and ms < low) or (high is not None and ms > high):
            raise InvalidArgument(_ttl_refusal(ttl, self.describe(), low, high))

    # -- the contract ----------------------------------------------------------------------

    async def inspect(self, name: str, kind: Kind = "lock") -> LockInfo:
        session = await self._session_for(self._settings.session_timeout)
        with translate(zk_errors, f"inspecting {kind} {name!r} on {self.describe()}"):
            return await _inspect.inspect(session, self._tree, name, kind)

    async def wait_for_change(self, name: str, kind: Kind, seen: LockInfo, timeout: float) -> None:
        session = await self._session_for(self._settings.session_timeout)
        with translate(zk_errors, f"watching {kind} {name!r} on {self.describe()}"):
            try:
                await _inspect.wait_for_change(session, self._tree, name, kind, seen, timeout)
            except SessionGone:
                # aclose() ended the session under the watch: a change feed ends with its
                # client (the caller sees it closed), it does not fail.
                if self._state != "closed":
                    raise

    async def try_acquire(self, request: LockRequest) -> ZooKeeperGrant | None:
        return await self._acquire(request, wait=False)

    async def acquire(self, request: LockRequest) -> ZooKeeperGrant:
        grant = await self._acquire(request, wait=True)
        assert grant is not None
        return grant

    async def _acquire(self, request: LockRequest, *, wait: bool) -> ZooKeeperGrant | None:
        what = f"acquiring {request.kind} {request.name!r} on {self.describe()}"
        if request.kind == "semaphore" and request.permits < 1:
            raise InvalidArgument(f"{what}: permits must be at least 1, not {request.permits}")
        # Told once, by the first attempt that queues (an attempt clears its ``answered`` when
        # it tells it; one whose session died before that hands it on to the next).
        answered: Callable[[], None] | None = request.answered if wait else None
        with translate(zk_errors, what):
            for _ in range(ATTEMPTS):
                session = await self._session_for(request.ttl)
                attempt = Attempt(self._tree, session, request, self._settings.op_timeout, answered)
                try:
                    return await attempt.run(wait)
                except SessionGone as exc:
                    answered = attempt.answered
                    logger.info("asynclock: %s: session gone (%s); starting again", what, exc)
        raise BackendUnavailable(f"{what}: the ZooKeeper session kept expiring")

    async def renew(self, grants: Sequence[ZooKeeperGrant]) -> Sequence[RenewOutcome]:
        outcomes: list[RenewOutcome] = [Unknown(RuntimeError())] * len(grants)
        by_session: dict[LockSession, list[int]] = {}
        for index, grant in enumerate(grants):
            assert grant.session is not None
            by_session.setdefault(grant.session, []).append(index)

        async def renew_session(session: LockSession, indexes: list[int]) -> None:
            for index, outcome in zip(
                indexes, await self._renew_session(session, grants, indexes), strict=True
            ):
                outcomes[index] = outcome

        async with anyio.create_task_group() as tg:
            for session, indexes in by_session.items():
                tg.start_soon(renew_session, session, indexes)
        return outcomes

    async def _renew_session(
        self, session: LockSession, grants: Sequence[ZooKeeperGrant], indexes: list[int]
    ) -> list[RenewOutcome]:
        """Whether each node still exists and is owned by the session: one round trip."""
        if session.state == "dead":
            return [Lost(f"its ZooKeeper session is gone: {session.dead_reason}")] * len(indexes)
        if session.state != "connected":
            error = BackendUnavailable(
                f"{self.describe()}: disconnected from ZooKeeper, reconnecting (session "
                f"0x{session.session_id:x})"
            )
            return [Unknown(error)] * len(indexes)
        sent_at = now()
        try:
            with translate(zk_errors, f"renewing on {self.describe()}"):
                replies = await session.call(
                    *(_proto.exists(grants[index].path, watch=False) for index in indexes)
                )
        except ProvenGone:
            return [Lost(f"its ZooKeeper session is gone: {session.dead_reason}")] * len(indexes)
        except BackendUnavailable as exc:
            return [Unknown(exc)] * len(indexes)
        outcomes: list[RenewOutcome] = []
        for index, reply in zip(indexes, replies, strict=True):
            path = grants[index].path
            if isinstance(reply, zk_exc.NoNode):
                outcomes.append(
                    Lost(
                        f"its znode {path} is gone (deleted by an operator or another client, "
                        "or the session expired)"
                    )
                )
            elif isinstance(reply, Exception):
                outcomes.append(
                    Unknown(zk_errors(reply, f"renewing on {self.describe()}") or reply)
                )
            elif reply.stat.ephemeral_owner != session.session_id:
                outcomes.append(Lost(f"its znode {path} belongs to another session now"))
            else:
                outcomes.append(Renewed(sent_at, session.timeout))
        return outcomes

    async def release(self, grant: ZooKeeperGrant) -> None:
        session = grant.session
        assert session is not None
        session.unhold(grant.path)
        if not session.usable:
            return  # the node went, or goes, with its session
        parent, _, node = grant.path.rpartition("/")
        if session.state != "connected":
            session.add_orphan(parent, node)
            return
        try:
            with translate(zk_errors, f"releasing {grant.name!r} on {self.describe()}"):
                await session.release(grant.path, parent, mark=grant.marks_release)
        except ProvenGone:
            return  # the node went with its session
        except BackendTimeout as exc:
            # Deleted in the background once connected again; until then the node holds the
            # lock, so it must not be forgotten while the session lives.
            session.add_orphan(parent, node)
            raise type(exc)(f"{exc}; it is deleted once the connection is back") from exc.__cause__


def _ttl_refusal(ttl: float, where: str, low: int | None, high: int | None) -> str:
    """Why ``ttl`` cannot be honoured, given the session timeout bounds learned so far (ms;
    None: not known, the server never had to clamp a request that way), and what to do."""
    if low is not None and high is not None:
        allowed = f"from {low / 1000:g} to {high / 1000:g} s"
    elif high is not None:
        allowed = f"of at most {high / 1000:g} s"
    else:
        assert low is not None
        allowed = f"of at least {low / 1000:g} s"
    if high is not None and _ms(ttl) > high:
        fix = (
            f"pass ttl={high / 1000:g} or less (locks.lock(name, ttl={high / 1000:g})), or raise "
            f"the server's maxSessionTimeout to at least {_ms(ttl)} ms (zoo.cfg; by default it "
            "is 20 times tickTime)"
        )
    else:
        assert low is not None
        fix = (
            f"pass ttl={low / 1000:g} or more, or lower the server's minSessionTimeout to at "
            f"most {_ms(ttl)} ms (zoo.cfg; by default it is 2 times tickTime)"
        )
    return (
        f"ttl {ttl:g} s cannot be honoured by ZooKeeper at {where}: a lock's ttl is the timeout "
        f"of its ZooKeeper session, and this server allows session timeouts {allowed}; {fix}"
    )


def _ms(seconds: float) -> int:
    if not math.isfinite(seconds):
        return -1
    return round(seconds * 1000)
