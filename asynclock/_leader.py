"""A job that runs on exactly one replica at a time: campaign, run while leading, cancel when the
term is lost, campaign again; stop cleanly on shutdown (:class:`LeaderTask`).

This is the loop every service writes around an election (ShedLock's purpose, client-go's
``leaderelection``), written once: the term is an election's lease with ``on_lost="cancel"``,
so a lost term cancels the job before the server can hand the term to another replica; the job
gets the term's lease, whose token fences what it writes.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Self

import anyio
import anyio.lowlevel

from . import _validate
from ._errors import BackendUnavailable, InvalidArgument, LeaseLost
from ._host import _spawn
from ._lease import Lease
from ._shield import finish

if TYPE_CHECKING:
    from ._client import LockClient

logger = logging.getLogger("asynclock")

#: How long stopping waits for the job to end and the term to be resigned, at most.
_STOP_TIMEOUT = 10.0


class LeaderTask:
    """Run ``job(term)`` on one replica at a time, for as long as this object runs.

    ::

        async def refresh_caches(term: asynclock.Lease) -> None:
            await rebuild(fence=term.token)

        async with asynclock.LeaderTask(locks, "cache-refresher", refresh_caches, every=60):
            ...  # the service runs; one replica refreshes every 60 s

    It campaigns in the election ``name`` (``value`` is what ``leader()`` shows, for example the
    host); once it leads it calls ``job`` with the term's :class:`Lease`: once and for the whole
    term, or with ``every``, again ``every`` seconds after each run ends, for as long as the term
    lasts. A term that is lost cancels the job (``on_lost="cancel"``) before the term can pass to
    another replica (the lease logs a warning), and the task campaigns again after
    ``retry_after`` seconds; so does a lock server that is unavailable while campaigning
    (logged as a warning). A job that returns (without ``every``)
    resigns the term, and the task campaigns again after ``retry_after``. A job that raises is
    logged with its traceback (ERROR), resigns, and the task campaigns again after
    ``retry_after``: a bug in one run does not stop the job on every replica for good.

    ``async with`` runs it for the block; ``start()`` and ``aclose()`` are for start-up and
    shutdown hooks that run in different tasks (aiohttp's ``on_startup``/``on_cleanup``,
    job workers' hooks). Stopping cancels the job, resigns the term and waits for both.
    """

    def __init__(
        self,
        client: LockClient,
        name: str,
        job: Callable[[Lease], Awaitable[object]],
        *,
        value: bytes = b"",
        ttl: float = 30.0,
        every: float | None = None,
        retry_after: float = 1.0,
    ) -> None:
        if not callable(job):
            raise InvalidArgument(f"job must be an async function of the term's lease, got {job!r}")
        self._election = client.election(name)  # checks the name and the capability
        # The name, the ttl against the backend's shortest: refused here, not in every
        # campaign of a loop that would log the same mistake for ever.
        _, self._ttl, _ = client._check(name, ttl, None)
        self._job = job
        self._value = value
        self._every = None if every is None else _validate.positive_seconds(every, "every")
        self._retry_after = _validate.positive_seconds(retry_after, "retry_after")
        #: The term's lease while this replica leads, else None.
        self.term: Lease | None = None
        #: How many terms this replica has led.
        self.terms = 0
        self._task: Any = None
        #: Entered by the task, cancelled by ``aclose()`` (from any task, even before it runs).
        self._stop: anyio.CancelScope | None = None
        self._done: anyio.Event | None = None
        self._failure: Exception | None = None

    @property
    def name(self) -> str:
        return self._election.name

    @property
    def leading(self) -> bool:
        """Whether this replica leads now (its job runs, or waits for its next run)."""
        return self.term is not None

    async def start(self) -> None:
        """Start campaigning in a task of its own; :meth:`aclose` stops it (from any task)."""
        if self._task is not None:
            raise RuntimeError(f"LeaderTask {self.name!r} runs already; make a new one")
        self._stop, self._done = anyio.CancelScope(), anyio.Event()
        self._task = _spawn(self._own, f"asynclock leader task {self.name!r}")

    async def aclose(self) -> None:
        """Stop: cancel the job, resign the term, and wait for both (idempotent)."""
        if self._stop is None or self._done is None:
            return
        self._stop.cancel()
        await finish(self._done.wait, timeout=_STOP_TIMEOUT, what=f"stopping {self.name!r}")
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def _own(self) -> None:
        assert self._stop is not None and self._done is not None
        try:
            with self._stop:
                await self._campaign_for_ever()
        except Exception as exc:  # not the job's (those are logged): aclose() raises it
            self._failure = exc
        finally:
            self.term = None
            self._done.set()

    async def _campaign_for_ever(self) -> None:
        while True:
            try:
                async with self._election.campaign(self._value, ttl=self._ttl) as term:
                    self.term = term
                    self.terms += 1
                    try:
                        await self._lead(term)
                    finally:
                        self.term = None
            except LeaseLost as exc:
                # The lease has logged the loss (WARNING) already.
                logger.info(
                    "asynclock: %r lost its term (%s); its job was cancelled, campaigning again",
                    self.name,
                    exc.reason,
                )
            except BackendUnavailable as exc:
                logger.warning(
                    "asynclock: %r cannot campaign (%s); trying again in %g s",
                    self.name,
                    exc,
                    self._retry_after,
                )
            except Exception:
                logger.exception(
                    "asynclock: the job of %r failed; resigned, campaigning again in %g s",
                    self.name,
                    self._retry_after,
                )
            await anyio.sleep(self._retry_after)

    async def _lead(self, term: Lease) -> None:
        while True:
            # A run never starts on a term whose deadline has passed: after a pause of the whole
            # process (SIGSTOP, a blocked loop) the pause between runs and the deadline are both
            # overdue, and the former may wake us first. Reading ``lost`` marks the loss, which
            # cancels this body at the checkpoint.
            if term.lost:
                await anyio.lowlevel.checkpoint()
            await self._job(term)
            if self._every is None:
                return
            await anyio.sleep(self._every)

    def __repr__(self) -> str:
        return f"<LeaderTask {self.name!r} leading={self.leading} terms={self.terms}>"
