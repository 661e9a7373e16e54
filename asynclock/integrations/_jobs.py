"""What the job-queue integrations (arq, saq, taskiq) share: the lock a job holds, and the client a
worker opens at start-up and closes at shutdown.

Each queue module adds only what differs: how the job is called, where the worker keeps the
client, and how a job whose lock is busy, or whose lease was lost while it ran, is run again in
that queue's own way.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Awaitable, Callable
from typing import Any, Final, ParamSpec, TypeVar

from .. import _validate
from .._client import LockClient
from .._connect import connect
from .._decorator import ClientSource, lock_name_for, resolve_client
from .._errors import AcquireTimeout, InvalidArgument, LeaseLost
from . import template_fields

P = ParamSpec("P")
R = TypeVar("R")

#: Where the lifecycle helpers put the worker's client: ``ctx["asynclock"]`` for arq and saq,
#: ``broker.state.asynclock`` for taskiq.
CONTEXT_KEY: Final = "asynclock"


class RunAgain(Exception):
    """The job should run again in ``delay`` seconds: its lock was busy (``error`` is the
    :class:`AcquireTimeout`), or its lease was lost while it ran (a :class:`LeaseLost`).

    Private: it never leaves the queue modules, which turn it into the queue's own retry.
    """

    def __init__(self, error: AcquireTimeout | LeaseLost, delay: float) -> None:
        super().__init__(str(error))
        self.error = error
        self.delay = delay

    @property
    def lost(self) -> bool:
        return isinstance(self.error, LeaseLost)


class JobLock:
    """The lock a job holds, as the decorator's options describe it (checked at import)."""

    def __init__(
        self,
        template: str,
        *,
        client: ClientSource | None,
        ttl: float,
        timeout: float | None,
        defer: float,
        jitter: float,
        queue: str,
        lost_retries: int = 0,
    ) -> None:
        self.template = template
        self.fields = template_fields(template)
        self.client = client
        self.ttl = _validate.positive_seconds(ttl, "ttl")
        self.timeout = _validate.timeout(timeout)
        if isinstance(defer, bool) or not isinstance(defer, int | float) or not 0 <= defer < 1e6:
            raise InvalidArgument(f"defer must be a number of seconds >= 0, got {defer!r}")
        self.defer = float(defer)
        if isinstance(jitter, bool) or not isinstance(jitter, int | float) or not 0 <= jitter <= 1:
            raise InvalidArgument(
                f"jitter is a share of defer between 0 and 1 (0.5 defers by 0.5x to 1.5x), "
                f"got {jitter!r}"
            )
        self.jitter = float(jitter)
        if isinstance(lost_retries, bool) or not isinstance(lost_retries, int) or lost_retries < 0:
            raise InvalidArgument(
                f"lost_retries is how often a job whose lease was lost runs again, an int >= 0, "
                f"got {lost_retries!r}"
            )
        self.lost_retries = lost_retries
        self.queue = queue

    def signature_of(self, func: object, *, skip: int = 0) -> inspect.Signature:
        """The job function's signature, after checking that the template only names its
        parameters (a typo fails at import, not in the first job). ``skip`` leading parameters
        are the queue's own (arq's and saq's ``ctx``) and cannot be formatted into a name."""
        if not inspect.iscoroutinefunction(func):
            # arq.func() keeps the function as .coroutine, taskiq's @broker.task as
            # .original_func: @locked above them would lock nothing the worker calls.
            inner = getattr(func, "original_func", None) or getattr(func, "coroutine", None)
            if inspect.iscoroutinefunction(inner):
                raise InvalidArgument(
                    f"@locked is above the queue's own decorator of {inner.__qualname__!r}, so "
                    f"the worker would run the job without the lock: put @locked directly "
                    f"above `async def`, below @broker.task or inside arq.func(...)"
                )
            raise TypeError(
                f"asynclock.integrations.{self.queue}.locked needs an `async def` job function, "
                f"got {func!r}; put it directly above the function, below the queue's own "
                "decorator"
            )
        signature = inspect.signature(func)
        parameters = list(signature.parameters.values())
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
        named = {p.name for p in parameters[skip:] if p.kind is not inspect.Parameter.VAR_KEYWORD}
        unknown = sorted(self.fields - named)
        if unknown and not takes_any:
            raise InvalidArgument(
                f"lock name template {self.template!r} names {', '.join(unknown)}, which "
                f"{'is' if len(unknown) == 1 else 'are'} not a parameter of "
                f"{getattr(func, '__qualname__', func)!r} (parameters: {', '.join(sorted(named))})"
            )
        return signature

    def client_from(self, found: object, where: str) -> LockClient:
        """The decorator's ``client=`` if given, else the one the lifecycle helper left."""
        if self.client is not None:
            return resolve_client(self.client)
        if isinstance(found, LockClient):
            return found
        raise RuntimeError(
            f"no asynclock client in {where}: open one at worker start-up with "
            f"asynclock.integrations.{self.queue}.WorkerLocks (see docs/jobs/{self.queue}.md), "
            f"or pass client= to @locked"
        )

    def defer_delay(self) -> float:
        """The configured delay with jitter, so deferred jobs of one key do not return together."""
        return self.defer * random.uniform(1.0 - self.jitter, 1.0 + self.jitter)

    async def run(
        self,
        func: Callable[..., Awaitable[R]],
        signature: inspect.Signature,
        args: tuple[object, ...],
        kwargs: dict[str, Any],
        *,
        found: object,
        where: str,
        wait: bool,
        rerun_lost: bool,
    ) -> R:
        """Run ``func(*args, **kwargs)`` holding the lock named from those arguments, on the
        client :meth:`client_from` finds (``found`` in ``where``); :class:`RunAgain` if the lock
        was not free within ``timeout``.

        ``wait`` ignores ``timeout`` and waits as long as it takes (a deferral the queue could
        not honour). An :class:`AcquireTimeout` raised by the job itself (a lock it takes) is
        the job's error and propagates as it is; only this lock's busy answer defers the job.
        A lease lost before the job finished raises :class:`asynclock.LeaseLost`, or
        :class:`RunAgain` if ``rerun_lost``; one found lost only after the job returned keeps
        its result (the core's rule), so a finished job never runs twice.
        """
        name = lock_name_for(self.template, signature, args, kwargs)
        locks = self.client_from(found, where)
        lease = None
        try:
            async with locks.lock(
                name, ttl=self.ttl, timeout=None if wait else self.timeout
            ) as lease:
                return await func(*args, **kwargs)
        except AcquireTimeout as exc:
            if lease is not None:
                raise
            raise RunAgain(exc, self.defer_delay()) from exc
        except LeaseLost as exc:
            # Only this job's own lease: a LeaseLost from a lock the body took is its error.
            if not rerun_lost or lease is None or not lease.lost:
                raise
            raise RunAgain(exc, self.defer_delay()) from exc


class WorkerClient:
    """One lock client per worker process: made and started in the start-up hook, closed in the
    shutdown hook (which may run in another task: :meth:`LockClient.start` allows that).

    It is also a client source: ``@locked(..., client=worker_locks)`` works where a job cannot
    reach the queue's context.
    """

    def __init__(self, url: str, /, **options: Any) -> None:
        # Check the URL and options now, at import, rather than at the first worker start.
        connect(url, **options)
        self._url = url
        self._options = options
        self._client: LockClient | None = None

    def __call__(self) -> LockClient:
        if self._client is None:
            raise RuntimeError(
                "the worker's asynclock client is not open: the queue's start-up hook opens it "
                "(see the integration's WorkerLocks)"
            )
        return self._client

    @property
    def client(self) -> LockClient:
        """The open client (``RuntimeError`` before start-up and after shutdown)."""
        return self()

    async def open(self) -> LockClient:
        if self._client is not None:
            raise RuntimeError("this worker's asynclock client is already open")
        client = connect(self._url, **self._options)
        await client.start()
        self._client = client
        return client

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()
