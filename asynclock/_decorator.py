"""``@locked("invoice-{invoice_id}", client=...)``: hold a lock for each call of a coroutine function.

For worker coroutines and job functions (plain asyncio workers; arq, saq and taskiq have their own
integrations, which also defer busy jobs): the lock name is formatted from the call's arguments,
the lock is held for the call, and a call whose lease is lost is cancelled and raises
:class:`asynclock.LeaseLost`, so the caller records a failure, not a success. A call that returned
although its lease was lost (the loss came too late to stop it) keeps its result, as ``async with``
does (see the lease-loss guide): its work is done, and raising would only get it done twice.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

from ._client import LockClient
from ._errors import InvalidArgument

P = ParamSpec("P")
R = TypeVar("R")

ClientSource = LockClient | Callable[[], LockClient]


def lock_name_for(
    template: str, signature: inspect.Signature, args: tuple[object, ...], kwargs: dict[str, object]
) -> str:
    """Format ``template`` with the call's arguments by parameter name (defaults included)."""
    bound = signature.bind_partial(*args, **kwargs)
    bound.apply_defaults()
    try:
        return template.format_map(bound.arguments)
    except (KeyError, AttributeError, IndexError) as exc:
        raise InvalidArgument(
            f"lock name template {template!r} uses {exc}, which is not an argument of the call "
            f"(arguments: {', '.join(bound.arguments) or 'none'})"
        ) from None


def resolve_client(client: ClientSource) -> LockClient:
    return client if isinstance(client, LockClient) else client()


def locked(
    template: str,
    *,
    client: ClientSource,
    ttl: float = 30.0,
    timeout: float | None = None,
    shared: bool = False,
) -> Callable[[Callable[P, Awaitable[R]]], Callable[P, Awaitable[R]]]:
    """Hold the lock named by ``template`` around every call of the decorated coroutine function.

    ``client`` is an open :class:`LockClient`, or a function returning one (for clients made
    after import, in an application's start-up). ``timeout`` is as for ``LockClient.lock``:
    ``None`` waits, ``0`` raises :class:`asynclock.AcquireTimeout` at once when the lock is held.
    ``shared=True`` holds it shared with other readers (a read-write lock's read side).
    """

    def decorate(func: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
        if not inspect.iscoroutinefunction(func):
            raise TypeError(f"@locked needs a coroutine function, got {func!r}")
        signature = inspect.signature(func)

        @functools.wraps(func)
        async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            name = lock_name_for(template, signature, args, kwargs)
            async with resolve_client(client).lock(name, ttl=ttl, timeout=timeout, shared=shared):
                return await func(*args, **kwargs)

        return wrapper

    return decorate
