"""The lanes of one backend (one holding connection per ttl): takes, renewals and releases on
them. What runs on a lane, and why nothing may interrupt it, is in ``_lease.py``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio

from .._kit import (
    BackendTimeout,
    BackendUnavailable,
    LockRequest,
    Lost,
    RenewOutcome,
    Unknown,
    now,
    translate,
)
from ._errors import connection_broken, unmapped
from ._kinds import Mode
from ._lease import RENEWAL, TAKE, Lane, PostgresGrant
from ._renewals import CLOSED, renewed
from ._wire import Wire

logger = logging.getLogger("asynclock")


class Lanes:
    """The lanes of one backend, one per ttl (in milliseconds)."""

    def __init__(self, wire: Wire) -> None:
        self._wire = wire
        # What a lane reads of its owner (``_lease.Owner``).
        self.server = wire.errors.server
        self.sequence = wire.sequence
        self.op_timeout = wire.op_timeout
        self.close = wire.sessions.close
        self.by_ttl: dict[int, Lane] = {}
        self.by_connection: dict[Any, Lane] = {}
        #: The statements every new lane prepares as it connects, before it takes anything
        #: (``Lane._prepare``; the renewal is a simple query, never parsed apart).
        self.statements: tuple[str, ...] = ()

    def lane(self, ttl_ms: int) -> Lane:
        lane = self.by_ttl.get(ttl_ms)
        if lane is None:
            if not self._wire.sessions.open:
                # Closed (a waiter whose turn came as the client closed): a lane made now
                # would never run, and its takes would wait for an answer until op_timeout.
                raise BackendUnavailable(f"the lock client for {self.server} is closed")
            lane = Lane(self, ttl_ms)
            connect = self._wire.sessions.connect_lane
            self._wire.host.start_soon(lane.run, connect, name="asynclock: postgres lane")
            self.by_ttl[ttl_ms] = lane
        return lane

    def forget(self, lane: Lane) -> None:
        if self.by_ttl.get(lane.ttl_ms) is lane:
            del self.by_ttl[lane.ttl_ms]
        self.by_connection.pop(lane.connection, None)

    def closed(self, connection: Any) -> bool:
        """asyncpg closed ``connection``: if it was a lane's, its locks are lost (True)."""
        lane = self.by_connection.get(connection)
        if lane is None:
            return False
        lane.die(BackendUnavailable(f"the connection to {self.server} closed"))
        return True

    async def drain(self, timeout: float) -> None:
        """Let the statements queued on the lanes run (shielded, up to ``timeout``): a waiter's
        place given up just before the client closes would hold the others up until it expired."""
        with anyio.CancelScope(shield=True), anyio.move_on_after(timeout):
            while any(lane.pending for lane in self.by_ttl.values()):  # noqa: ASYNC110
                await anyio.sleep(0.001)

    def close_all(self) -> None:
        for lane in list(self.by_ttl.values()):
            lane.die(BackendUnavailable(f"the lock client for {self.server} is closed"))

    # -- take, renew, release ----------------------------------------------------------------

    def holds_shared(self, ttl_ms: int, key: int, mode: Mode) -> bool:
        """Whether the lane of ``ttl_ms`` holds ``key``, or is taking it, in ``mode`` (shared):
        its unlock is that mode's."""
        lane = self.by_ttl.get(ttl_ms)
        unlock = None if lane is None or key not in lane.keys else lane.unlocks.get(key)
        return unlock is not None and unlock[0] == mode.unlock

    async def take(
        self, request: LockRequest, key: int, ttl_ms: int, mode: Mode, channel: str
    ) -> PostgresGrant | None:
        """One try-lock on the lane of ``ttl_ms``, run by the lane, not by the caller: a caller
        that is cancelled or times out stops waiting, and a take that succeeded behind it is
        undone (``Lane._end``, or here when the cancellation came with the reply). A lane found
        dead (closed by the server or the network) is replaced and the take starts again."""
        for attempt in range(3):
            lane = self.lane(ttl_ms)
            if key in lane.keys:
                return None  # ours already: re-entrant on the server, busy to everyone
            lane.keys.add(key)
            lane.unlocks[key] = (mode.unlock, mode.unlock_args(channel))
            op = lane.submit(
                TAKE, key, mode.lane_take, *mode.take_args(request.owner, request.value, channel)
            )
            try:
                with translate(self._wire.errors, f"taking {request.name!r}"):
                    token = await op.future
            except BaseException as exc:
                future = op.future
                if future.done() and not future.cancelled() and future.exception() is None:
                    if future.result() is not None:
                        lane.unlock_behind(key)  # taken, and the caller is gone
                elif (
                    isinstance(exc, Exception)
                    and lane.dead is not None
                    and lane.connection is not None
                    and attempt < 2
                ):
                    logger.info(
                        "asynclock: the holding connection to %s died while taking %r (%r); "
                        "taking it on another one",
                        self.server,
                        request.name,
                        unmapped(exc),
                    )
                    continue
                raise
            if token is None:
                return None
            grant = PostgresGrant(
                name=request.name,
                owner=request.owner,
                token=int(token),
                valid_from=op.sent_at,
                ttl=lane.ttl,
                key=key,
                pid=lane.pid,
                connection=lane.connection,
                on_lost=request.on_lost,
                space=request.kind,
                lane=lane,
                kept_key=key if mode.kept else None,
            )
            lane.grants[key] = grant
            return grant
        raise AssertionError("unreachable")  # pragma: no cover

    async def renew_all(
        self,
        grants: Sequence[PostgresGrant],
        renew_dedicated: Callable[[PostgresGrant], Awaitable[RenewOutcome]],
    ) -> list[RenewOutcome]:
        """One statement per lane and one per dedicated connection (each connection has its
        own idle timer), all at the same time."""
        outcomes: list[RenewOutcome] = [Unknown(RuntimeError("not renewed"))] * len(grants)
        lanes: dict[Lane, list[int]] = {}
        dedicated: list[int] = []
        for index, grant in enumerate(grants):
            if grant.lane is not None:
                lanes.setdefault(grant.lane, []).append(index)
            else:
                dedicated.append(index)

        async def renew_lane(lane: Lane, indexes: list[int]) -> None:
            renewed = await self.renew(lane, [grants[index] for index in indexes])
            for index, outcome in zip(indexes, renewed, strict=True):
                outcomes[index] = outcome

        async def renew_one(index: int) -> None:
            outcomes[index] = await renew_dedicated(grants[index])

        if len(lanes) == 1 and not dedicated:
            ((lane, indexes),) = lanes.items()
            await renew_lane(lane, indexes)
            return outcomes
        async with anyio.create_task_group() as task_group:
            for lane, indexes in lanes.items():
                task_group.start_soon(renew_lane, lane, indexes)
            for index in dedicated:
                task_group.start_soon(renew_one, index)
        return outcomes

    async def renew(self, lane: Lane, grants: Sequence[PostgresGrant]) -> list[RenewOutcome]:
        """One statement restarts the idle timer of every lock on the lane. It runs on the
        lane and is shared by every renewal that comes while it is queued or in flight:
        a renewal that waited in the network still renews from its send time."""
        op = lane.renewal
        if op is None and lane.dead is None:
            # Detached as well as shielded: when every renewal waiting for it has given up (a
            # partition, a closing client), its error must not be left unretrieved ("Future
            # exception was never retrieved", seen when a partition ended a renewal in flight).
            op = lane.renewal = Lane.detach(lane.submit(RENEWAL))
        error: BaseException | None = lane.dead
        same = False
        if op is not None:
            try:
                # Shared: a caller that stops waiting must not cancel it for the others. The
                # lane's watchdog ends the wait after op_timeout.
                same = await asyncio.shield(op.future)
            except TimeoutError:
                error = BackendTimeout(
                    f"renewing {len(grants)} lock(s) on {self.server}: no answer for "
                    f"{now() - op.queued_at:.3g} s"
                )
            except Exception as exc:
                error = exc
        sent_at = None if op is None else op.sent_at
        return [self._outcome(lane, grant, error, same, sent_at) for grant in grants]

    @staticmethod
    def _outcome(
        lane: Lane,
        grant: PostgresGrant,
        error: BaseException | None,
        same: bool,
        sent_at: float | None,
    ) -> RenewOutcome:
        if grant.released or lane.grants.get(grant.key) is not grant:
            return Lost("the lock was released, or its connection closed")
        if lane.dead is not None:
            return Lost(CLOSED)
        if error is not None or sent_at is None:
            return Unknown(error or RuntimeError("not renewed"))
        return renewed(same, lane.pid, sent_at, lane.ttl)

    async def release(self, grant: PostgresGrant, lane: Lane) -> None:
        """Unlock the key only (the lane holds other locks), run by the lane: a cancelled
        caller stops waiting, the unlock still runs. A lane that is gone took the lock with
        its session. One that does not answer keeps the unlock queued, and it is applied when
        the server answers; a session that ends meanwhile frees the lock anyway."""
        if lane.grants.get(grant.key) is not grant:
            return
        op = lane.unlock_behind(grant.key, awaited=True)
        if op is None:
            return
        try:
            await op.future
        except Exception as exc:
            if lane.dead is not None or connection_broken(lane.connection, exc):
                return  # ended with the session
            logger.warning(
                "asynclock: unlocking %r on %s did not complete (%r); the unlock stays queued "
                "on its holding connection, so the server frees the lock when it answers, at "
                "the latest %g s after the last renewal it received",
                grant.name,
                self.server,
                exc,
                grant.ttl,
            )
