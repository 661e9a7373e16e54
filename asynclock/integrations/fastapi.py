"""FastAPI endpoints that hold a lock: ``@locked("orders/{order_id}", client=...)``.

.. code-block:: python

    @app.post("/orders/{order_id}/pay")
    @locked("orders/{order_id}", client=lambda: app.state.locks)
    async def pay(order_id: int) -> Receipt: ...

The lock is held while the endpoint runs. When someone else holds it the request gets
423 Locked at once (or after waiting up to ``timeout``); when the lease is lost while the endpoint
runs, the endpoint is cancelled and the request gets 503, so nothing it does after the loss is
reported as a success.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, ParamSpec, TypeVar

from .. import _validate
from .._decorator import ClientSource, lock_name_for, resolve_client
from .._errors import (
    AcquireTimeout,
    InvalidArgument,
    LeaseLost,
    MissingDependency,
    UnsupportedFeature,
)
from .._lease import Lease
from . import template_fields

try:
    from fastapi import Depends, HTTPException, Request
except ImportError as exc:  # pragma: no cover - FastAPI is installed in the test environment
    raise MissingDependency(
        "asynclock.integrations.fastapi needs FastAPI: pip install 'asynclock[fastapi]'"
    ) from exc

__all__ = ("lock_dependency", "locked")

P = ParamSpec("P")
R = TypeVar("R")


def locked(
    template: str,
    *,
    client: ClientSource,
    ttl: float = 30.0,
    timeout: float | None = 0,
    busy_status: int = 423,
    lost_status: int = 503,
) -> Callable[[Callable[P, Awaitable[R]]], Callable[P, Awaitable[R]]]:
    """Hold the lock named by ``template`` while the decorated endpoint runs.

    Put it *below* the route decorator. ``template`` is formatted with the endpoint's parameters
    by name (path and query parameters, bodies, dependencies: ``"orders/{order.id}"`` works);
    the endpoint's signature is kept, so FastAPI sees the same parameters and documents them.

    ``client`` is an open :class:`asynclock.LockClient`, or a function returning one (the usual
    choice: a client opened in the app's lifespan). ``timeout=0`` answers ``busy_status`` (423
    Locked) at once when the lock is held; a number waits up to that many seconds first, ``None``
    waits as long as it takes. If the lease is lost while the endpoint runs, the endpoint is
    cancelled and the request is answered with ``lost_status`` (503). Both answers are
    :class:`fastapi.HTTPException` with a JSON ``detail``: ``{"error": "lock_busy" or
    "lease_lost", "lock": name, "message": ...}``, so the app's exception handlers see them.

    The lock covers the endpoint function, not the sending of its response: a
    ``StreamingResponse`` returned by the endpoint streams after the lock is released.
    """
    template_names = template_fields(template)
    ttl = _validate.positive_seconds(ttl, "ttl")
    timeout = _validate.timeout(timeout)

    def decorate(func: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
        if not inspect.iscoroutinefunction(func):
            raise TypeError(
                f"@locked needs an `async def` endpoint, got {func!r}: a sync endpoint runs in a "
                "thread, which cannot be cancelled when the lease is lost"
            )
        signature = inspect.signature(func)
        unknown = template_names - set(signature.parameters)
        if unknown:
            raise InvalidArgument(
                f"lock name template {template!r} uses {', '.join(sorted(unknown))}, which "
                f"{'is not a parameter' if len(unknown) == 1 else 'are not parameters'} of "
                f"{func.__qualname__} (parameters: {', '.join(signature.parameters) or 'none'})"
            )

        @functools.wraps(func)
        async def endpoint(*args: P.args, **kwargs: P.kwargs) -> R:
            name = lock_name_for(template, signature, args, kwargs)
            try:
                _validate.lock_name(name)
            except InvalidArgument as exc:
                # The name is made of request data, so a bad one is the request's fault.
                raise HTTPException(
                    400, detail={"error": "invalid_lock_name", "message": str(exc)}
                ) from None
            lease: Lease | None = None
            try:
                async with resolve_client(client).lock(name, ttl=ttl, timeout=timeout) as lease:
                    return await func(*args, **kwargs)
            except AcquireTimeout as exc:
                if lease is not None:
                    raise  # from a lock the endpoint itself took
                raise _busy(busy_status, name) from exc
            except LeaseLost as exc:
                if lease is None or not lease.lost:
                    raise  # from a lock the endpoint itself took
                raise _lost(lost_status, name, exc) from exc

        return endpoint

    return decorate


def lock_dependency(
    template: str,
    *,
    client: ClientSource,
    ttl: float = 30.0,
    timeout: float | None = 0,
    busy_status: int = 423,
    lost_status: int = 503,
) -> Any:
    """The dependency form of :func:`locked`, for ``lease: Annotated[Lease, lock_dependency(...)]``.

    Returns a ``Depends(..., scope="function")``: the lock is taken before the endpoint runs and
    released when it returns, before the response is sent, so the lease's cancel scope encloses
    exactly the endpoint. The endpoint receives the :class:`asynclock.Lease`. Busy and lost
    answer as :func:`locked` does.

    ``template`` is formatted with the request's *raw* path parameters, then its query
    parameters, as strings (``/orders/007`` gives ``orders/007``, where :func:`locked` formats
    the parsed ``order_id: int`` as ``orders/7``). A request missing a name gets 400. The
    endpoint must be ``async def``: a sync endpoint runs in a thread that cannot be cancelled.
    Needs FastAPI's dependency scopes (``Depends(scope=...)``, FastAPI >= 0.121; tested with
    0.165, where a cancel scope opened in a dependency may enclose the endpoint).
    """
    template_fields(template)
    ttl = _validate.positive_seconds(ttl, "ttl")
    timeout = _validate.timeout(timeout)
    if "scope" not in inspect.signature(Depends).parameters:
        raise UnsupportedFeature(
            "lock_dependency needs FastAPI's dependency scopes (FastAPI >= 0.121); upgrade "
            "FastAPI or use the @locked decorator"
        )

    async def hold_lock(request: Request) -> AsyncIterator[Lease]:
        endpoint = request.scope.get("endpoint")
        if endpoint is not None and not inspect.iscoroutinefunction(endpoint):
            raise TypeError(
                f"lock_dependency needs an `async def` endpoint, got {endpoint!r}: a sync "
                "endpoint runs in a thread, which cannot be cancelled when the lease is lost"
            )
        try:
            name = _validate.lock_name(template.format_map(_RequestFields(request)))
        except KeyError as exc:
            raise HTTPException(
                400,
                detail={
                    "error": "missing_lock_name_part",
                    "message": f"the lock name {template!r} needs {exc.args[0]!r} from the "
                    "path or the query string",
                },
            ) from None
        except InvalidArgument as exc:
            raise HTTPException(
                400, detail={"error": "invalid_lock_name", "message": str(exc)}
            ) from None
        lease: Lease | None = None
        try:
            async with resolve_client(client).lock(name, ttl=ttl, timeout=timeout) as lease:
                yield lease
        except AcquireTimeout as exc:
            if lease is not None:
                raise
            raise _busy(busy_status, name) from exc
        except LeaseLost as exc:
            if lease is None or not lease.lost:
                raise
            raise _lost(lost_status, name, exc) from exc

    return Depends(hold_lock, scope="function")


class _RequestFields:
    """What a dependency's template is formatted with: path parameters, then the query string."""

    __slots__ = ("_request",)

    def __init__(self, request: Request) -> None:
        self._request = request

    def __getitem__(self, key: str) -> str:
        if key in self._request.path_params:
            return str(self._request.path_params[key])
        value = self._request.query_params.get(key)
        if value is None:
            raise KeyError(key)
        return value


def _busy(status: int, name: str) -> HTTPException:
    return HTTPException(
        status,
        detail={
            "error": "lock_busy",
            "lock": name,
            "message": f"{name!r} is held by another request; try again later",
        },
    )


def _lost(status: int, name: str, exc: LeaseLost) -> HTTPException:
    return HTTPException(
        status,
        detail={
            "error": "lease_lost",
            "lock": name,
            "message": f"the lock {name!r} was lost while the request ran, so it was stopped "
            f"({exc.reason}); its effects may be partial, retry it",
        },
    )
