"""Fencing headers in aiohttp: a client middleware that sends them, a server one that checks them.

aiohttp is imported only when the server middleware is made, so ``asynclock.fencing`` imports
without it; the client middleware needs nothing from aiohttp at run time. Needs aiohttp >= 3.14
(client middlewares came in 3.12, ``web.RequestKey`` in 3.14).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from .._errors import MissingDependency
from ._http import (
    LOCK_HEADER,
    TOKEN_HEADER,
    Door,
    Guard,
    Refusal,
    check_header_name,
    entered,
    fencing_headers,
)

if TYPE_CHECKING:
    from aiohttp import ClientHandlerType, ClientMiddlewareType, ClientRequest, ClientResponse, web
    from aiohttp.typedefs import Handler, Middleware


def aiohttp_client_middleware(
    *, header: str = TOKEN_HEADER, lock_header: str | None = LOCK_HEADER, lock: str | None = None
) -> ClientMiddlewareType:
    """An aiohttp client middleware (aiohttp >= 3.12) that sends the current lock's headers.

    ``aiohttp.ClientSession(middlewares=(asynclock.fencing.aiohttp_client_middleware(),))``.
    It runs in the task that makes the request, so it sees the lock held there; it adds nothing
    when no lock is held, or when the request already carries ``header``.
    """
    check_header_name(header, "header")
    if lock_header is not None:
        check_header_name(lock_header, "lock_header")

    async def fencing_client_middleware(
        request: ClientRequest, handler: ClientHandlerType
    ) -> ClientResponse:
        if header not in request.headers:
            request.headers.update(fencing_headers(lock, header=header, lock_header=lock_header))
        return await handler(request)

    return fencing_client_middleware


def aiohttp_fencing_middleware(
    *,
    guard: Guard | None,
    resource: Callable[[web.Request], str] | None = None,
    header: str = TOKEN_HEADER,
    lock_header: str | None = LOCK_HEADER,
    required: bool = False,
) -> Middleware:
    """An aiohttp server middleware that refuses malformed (400) and stale (409) fencing tokens.

    ``web.Application(middlewares=[asynclock.fencing.aiohttp_fencing_middleware(guard=guard)])``.
    It behaves as :class:`FencingMiddleware` does. The handler finds the token in
    :func:`incoming_token` and in ``request[asynclock.integrations.aiohttp.FENCING_TOKEN]``, the
    resource in ``request[asynclock.integrations.aiohttp.FENCING_RESOURCE]`` (typed request
    keys, as aiohttp >= 3.14 warns about string keys). ``resource(request)`` names the resource;
    the default is the ``Fencing-Lock`` header's lock name, else ``request.path``.
    """
    try:
        from aiohttp import web
    except ImportError as exc:  # pragma: no cover - aiohttp is installed in the test environment
        raise MissingDependency(
            "the aiohttp fencing middleware needs aiohttp: pip install 'asynclock[aiohttp]'"
        ) from exc
    from ..integrations.aiohttp import FENCING_RESOURCE, FENCING_TOKEN

    door: Door[web.Request] = Door(
        guard=guard,
        header=header,
        lock_header=lock_header,
        required=required,
        resource=resource,
        path=lambda request: request.path,
    )

    @web.middleware
    async def fencing_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        checked = await door.check(
            request,
            request.headers.getall(header, []),
            [] if lock_header is None else request.headers.getall(lock_header, []),
        )
        if isinstance(checked, Refusal):
            return web.json_response(checked.body, status=checked.status)
        token, name = checked
        request[FENCING_TOKEN] = token
        request[FENCING_RESOURCE] = name
        with entered(token):
            return await handler(request)

    return fencing_middleware
