"""aiohttp handlers that hold a lock: ``@locked("orders/{order_id}", client=...)``.

.. code-block:: python

    @routes.post("/orders/{order_id}/pay")
    @locked("orders/{order_id}", client=lambda: app[LOCKS])
    async def pay(request: web.Request) -> web.Response: ...

The lock is held while the handler runs. Every error of that lock has a documented answer, never
a 500: busy 423 (``Retry-After``), lost while the handler ran 503 ``lease_lost`` (the handler was
cancelled), lock server unavailable 503 ``lock_unavailable`` (``Retry-After``), deadlock victim
409. A handler that ran to completion keeps its response; if its lease turned out lost
afterwards, the response carries ``Asynclock-Lease-Lost: <reason>``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable
from typing import ParamSpec, Unpack

from .._decorator import ClientSource, resolve_client
from . import _web, requires
from ._web import LEASE_LOST_HEADER, LockOptions

with requires("aiohttp"):
    from aiohttp import web

__all__ = ("FENCING_RESOURCE", "FENCING_TOKEN", "LEASE_LOST_HEADER", "LockOptions", "locked")

#: Where :func:`asynclock.fencing.aiohttp_fencing_middleware` puts the accepted fencing token
#: (``None`` when the request carried none): ``request[FENCING_TOKEN]``.
FENCING_TOKEN = web.RequestKey[int | None]("fencing_token")
#: ... and the resource it was checked for: ``request[FENCING_RESOURCE]``.
FENCING_RESOURCE = web.RequestKey[str | None]("fencing_resource")

P = ParamSpec("P")
Handler = Callable[P, Awaitable[web.StreamResponse]]


def _request_of(args: tuple[object, ...]) -> web.BaseRequest:
    # handler(request), a method handler(self, request), or a web.View method (self.request).
    last = args[-1] if args else None
    if isinstance(last, web.BaseRequest):
        return last
    if isinstance(last, web.View):
        return last.request
    raise TypeError(f"@locked wraps aiohttp handlers, called with the request last; got {last!r}")


def locked(
    template: str, *, client: ClientSource, **options: Unpack[LockOptions]
) -> Callable[[Handler[P]], Handler[P]]:
    """Hold the lock named by ``template`` while the decorated aiohttp handler runs.

    ``template`` is formatted with the route's ``request.match_info`` by name, then with the
    query string; a request missing a name gets 400. ``client`` is an open
    :class:`asynclock.LockClient` or a function returning one (for a client opened in
    ``app.cleanup_ctx``). Options (:class:`LockOptions`): ``ttl=30``; ``timeout=0`` answers
    ``busy_status`` (423) at once when the lock is held, a number waits up to that many seconds
    first, ``None`` waits as long as it takes; ``lost_status=503``; ``retry_after=1`` (seconds,
    in ``Retry-After``). Answers are JSON, ``{"error": ..., "lock": name, "message": ...}``
    (the table is in docs/integrations.md). Apply it to the handler *before* registering it: a
    handler already registered (``@routes.post`` above it, ``app.router.add_post`` earlier)
    raises :class:`asynclock.InvalidArgument`, since the route would call it without the lock.

    A handler that returned keeps its response even if its lease turns out lost afterwards (its
    work is done): a response not yet sent then carries ``Asynclock-Lease-Lost: <reason>``.
    A handler that has already started sending a streamed response (``StreamResponse``,
    WebSocket) when the lease is lost cannot be answered with 503 any more: then
    :class:`asynclock.LeaseLost` propagates and aiohttp drops the connection, so the client sees
    a failed request, not a complete one.
    """
    settings = _web.Settings.make(template, options)

    def decorate(handler: Handler[P]) -> Handler[P]:
        if not inspect.iscoroutinefunction(handler):
            raise TypeError(f"@locked needs an `async def` handler, got {handler!r}")
        _web.refuse_if_registered(handler, _route_of, "aiohttp")

        @functools.wraps(handler)
        async def locked_handler(*args: P.args, **kwargs: P.kwargs) -> web.StreamResponse:
            request = _request_of(args)
            try:
                name = _web.lock_name(settings, getattr(request, "match_info", {}), request.query)
                async with _web.holding(resolve_client(client), name, settings) as lease:
                    response = await handler(*args, **kwargs)
            except _web.Refusal as refusal:
                if request.writer.output_size > 0 and refusal.__cause__ is not None:
                    raise refusal.__cause__ from None  # a response is already on its way
                return web.json_response(
                    refusal.body(), status=refusal.status, headers=refusal.headers
                )
            header = _web.loss_header(lease)
            if header is not None and not response.prepared:
                response.headers[header[0]] = header[1]
            return response

        return locked_handler

    return decorate


def _route_of(owner: object, func: object) -> str | None:
    if isinstance(owner, web.RouteDef) and owner.handler is func:
        return f"{owner.method} {owner.path}"
    if isinstance(owner, web.AbstractRoute) and owner.handler is func:
        resource = owner.resource.canonical if owner.resource is not None else "?"
        return f"{owner.method} {resource}"
    return None
