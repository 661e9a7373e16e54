"""FastAPI endpoints that hold a lock: ``@locked("orders/{order_id}", client=...)``.

.. code-block:: python

    @app.post("/orders/{order_id}/pay")
    @locked("orders/{order_id}", client=lambda: app.state.locks)
    async def pay(order_id: int) -> Receipt: ...

The lock is held while the endpoint runs. Every error of that lock has a documented answer,
never a 500: busy 423 (``Retry-After``), lost while the endpoint ran 503 ``lease_lost`` (the
endpoint was cancelled), lock server unavailable 503 ``lock_unavailable`` (``Retry-After``),
deadlock victim 409. An endpoint that ran to completion keeps its response; if its lease turned
out lost afterwards, the response carries ``Asynclock-Lease-Lost: <reason>``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, ParamSpec, TypeVar, Unpack

from .._decorator import ClientSource, lock_name_for, resolve_client
from .._errors import InvalidArgument, UnsupportedFeature
from .._lease import Lease
from . import _web, requires, with_keyword
from ._web import LEASE_LOST_HEADER, LockOptions

with requires("fastapi", "FastAPI"):
    from fastapi import Depends, HTTPException, Request, Response
    from starlette.routing import BaseRoute
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ("LEASE_LOST_HEADER", "LeaseLossHeaders", "LockOptions", "lock_dependency", "locked")

P = ParamSpec("P")
R = TypeVar("R")

# The parameter @locked adds to the endpoint's signature when it has no Response parameter of
# its own: FastAPI then passes the response whose headers it merges into the answer.
_RESPONSE = "asynclock_response"
# Where lock_dependency leaves a completed body's loss for LeaseLossHeaders (the ASGI scope is
# the only thing it shares with the code that sends the response).
_SCOPE_KEY = "asynclock.lease_lost"


def locked(
    template: str, *, client: ClientSource, **options: Unpack[LockOptions]
) -> Callable[[Callable[P, Awaitable[R]]], Callable[P, Awaitable[R]]]:
    """Hold the lock named by ``template`` while the decorated endpoint runs.

    Put it *below* the route decorator; above it, the route would call the undecorated function,
    so this raises :class:`asynclock.InvalidArgument` when the module is imported. ``template``
    is formatted with the endpoint's parameters by name (path and query parameters, bodies,
    dependencies: ``"orders/{order.id}"`` works); the endpoint's signature is kept, so FastAPI
    sees the same parameters and documents them.

    ``client`` is an open :class:`asynclock.LockClient`, or a function returning one (the usual
    choice: a client opened in the app's lifespan). Options (:class:`LockOptions`): ``ttl=30``;
    ``timeout=0`` answers ``busy_status`` (423) at once when the lock is held, a number waits up
    to that many seconds first, ``None`` waits as long as it takes; ``lost_status=503``;
    ``retry_after=1`` (seconds, in ``Retry-After``). Answers are :class:`fastapi.HTTPException`
    with a JSON ``detail``: ``{"error": ..., "lock": name, "message": ...}``, so the app's
    exception handlers see them (the table is in docs/integrations.md).

    An endpoint that returned keeps its response even if its lease turns out lost afterwards
    (its work is done): the response then carries ``Asynclock-Lease-Lost: <reason>``. The lock
    covers the endpoint function, not the sending of its response: a ``StreamingResponse``
    streams after the lock is released.
    """
    settings = _web.Settings.make(template, options)

    def decorate(func: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
        if not inspect.iscoroutinefunction(func):
            raise TypeError(
                f"@locked needs an `async def` endpoint, got {func!r}: a sync endpoint runs in a "
                "thread, which cannot be cancelled when the lease is lost"
            )
        _web.refuse_if_registered(func, _route_of, "FastAPI")
        signature = inspect.signature(func)
        unknown = settings.fields - set(signature.parameters)
        if unknown:
            raise InvalidArgument(
                f"lock name template {template!r} uses {', '.join(sorted(unknown))}, which "
                f"{'is not a parameter' if len(unknown) == 1 else 'are not parameters'} of "
                f"{func.__qualname__} (parameters: {', '.join(signature.parameters) or 'none'})"
            )
        own_response = _response_parameter(func)

        @functools.wraps(func)
        async def endpoint(*args: P.args, **kwargs: P.kwargs) -> R:
            if own_response is None:
                response = kwargs.pop(_RESPONSE, None)
            else:
                response = kwargs.get(own_response)
            try:
                name = _web.checked_name(lock_name_for(template, signature, args, kwargs))
                async with _web.holding(resolve_client(client), name, settings) as lease:
                    result = await func(*args, **kwargs)
            except _web.Refusal as refusal:
                raise _http_error(refusal) from refusal.__cause__
            header = _web.loss_header(lease)
            if header is not None:
                # FastAPI sends a returned Response as it is, and merges the injected one's
                # headers into the response it builds from any other return value.
                target = result if isinstance(result, Response) else response
                if isinstance(target, Response):
                    target.headers[header[0]] = header[1]
            return result

        if own_response is None:
            endpoint.__signature__ = with_keyword(  # type: ignore[attr-defined]
                signature, _RESPONSE, annotation=Response
            )
        return endpoint

    return decorate


def lock_dependency(template: str, *, client: ClientSource, **options: Unpack[LockOptions]) -> Any:
    """The dependency form of :func:`locked`, for ``lease: Annotated[Lease, lock_dependency(...)]``.

    Returns a ``Depends(..., scope="function")``: the lock is taken before the endpoint runs and
    released when it returns, before the response is sent, so the lease's cancel scope encloses
    exactly the endpoint. The endpoint receives the :class:`asynclock.Lease`. The options and
    answers are those of :func:`locked`.

    ``template`` is formatted with the request's *raw* path parameters, then its query
    parameters, as strings (``/orders/007`` gives ``orders/007``, where :func:`locked` formats
    the parsed ``order_id: int`` as ``orders/7``). A request missing a name gets 400. The
    endpoint must be ``async def``: a sync endpoint runs in a thread that cannot be cancelled.
    FastAPI builds the response before a function-scoped dependency exits, so a loss learned
    at that exit reaches the response header only through :class:`LeaseLossHeaders`. Needs
    FastAPI's dependency scopes (``Depends(scope=...)``, FastAPI >= 0.121; tested with 0.165).
    """
    settings = _web.Settings.make(template, options)
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
            name = _web.lock_name(settings, request.path_params, request.query_params)
            async with _web.holding(resolve_client(client), name, settings) as lease:
                yield lease
        except _web.Refusal as refusal:
            raise _http_error(refusal) from refusal.__cause__
        header = _web.loss_header(lease)
        if header is not None:
            request.scope[_SCOPE_KEY] = header[1]

    return Depends(hold_lock, scope="function")


class LeaseLossHeaders:
    """ASGI middleware: adds ``Asynclock-Lease-Lost`` for :func:`lock_dependency` endpoints.

    ``app.add_middleware(LeaseLossHeaders)``. FastAPI has built the response by the time a
    function-scoped dependency learns (at its exit) that the lease was lost after the endpoint
    returned; the dependency leaves the reason in the ASGI scope, and this adds it to the
    response's headers as they are sent. Not needed for :func:`locked`, which sets it itself.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Message) -> None:
            reason = scope.get(_SCOPE_KEY)
            if message["type"] == "http.response.start" and reason is not None:
                headers = [*message.get("headers", ()), (b"asynclock-lease-lost", reason.encode())]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_header)


def _http_error(refusal: _web.Refusal) -> HTTPException:
    return HTTPException(refusal.status, detail=refusal.body(), headers=refusal.headers or None)


def _route_of(owner: object, func: object) -> str | None:
    if isinstance(owner, BaseRoute) and getattr(owner, "endpoint", None) is func:
        methods = ",".join(sorted(getattr(owner, "methods", None) or ()))
        return f"{methods} {getattr(owner, 'path', '?')}".strip()
    return None


def _response_parameter(func: Callable[..., object]) -> str | None:
    """The name of the endpoint's own ``Response`` parameter, if it has one."""
    try:
        signature = inspect.signature(func, eval_str=True)
    except NameError:  # an annotation only a type checker can resolve: FastAPI will say so
        signature = inspect.signature(func)
    for parameter in signature.parameters.values():
        annotation = parameter.annotation
        if isinstance(annotation, type) and issubclass(annotation, Response):
            return parameter.name
    return None
