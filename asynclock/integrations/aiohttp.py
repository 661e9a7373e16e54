"""aiohttp handlers that hold a lock: ``@locked("orders/{order_id}", client=...)``.

.. code-block:: python

    @routes.post("/orders/{order_id}/pay")
    @locked("orders/{order_id}", client=lambda: app[LOCKS])
    async def pay(request: web.Request) -> web.Response: ...

The lock is held while the handler runs. When someone else holds it the request gets 423 Locked
at once (or after waiting up to ``timeout``); when the lease is lost while the handler runs, the
handler is cancelled and the request gets 503.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable
from typing import ParamSpec

from .. import _validate
from .._decorator import ClientSource, resolve_client
from .._errors import AcquireTimeout, InvalidArgument, LeaseLost, MissingDependency
from .._lease import Lease
from . import template_fields

try:
    from aiohttp import web
except ImportError as exc:  # pragma: no cover - aiohttp is installed in the test environment
    raise MissingDependency(
        "asynclock.integrations.aiohttp needs aiohttp: pip install 'asynclock[aiohttp]'"
    ) from exc

__all__ = ("FENCING_RESOURCE", "FENCING_TOKEN", "locked")

#: Where :func:`asynclock.fencing.aiohttp_fencing_middleware` puts the accepted fencing token
#: (``None`` when the request carried none): ``request[FENCING_TOKEN]``.
FENCING_TOKEN = web.RequestKey[int | None]("fencing_token")
#: ... and the resource it was checked for: ``request[FENCING_RESOURCE]``.
FENCING_RESOURCE = web.RequestKey[str | None]("fencing_resource")

P = ParamSpec("P")
Handler = Callable[P, Awaitable[web.StreamResponse]]


class _RequestFields:
    """What a template is formatted with: ``request.match_info``, then the query string."""

    __slots__ = ("_request",)

    def __init__(self, request: web.BaseRequest) -> None:
        self._request = request

    def __getitem__(self, key: str) -> str:
        match_info = getattr(self._request, "match_info", None)
        if match_info is not None and key in match_info:
            return str(match_info[key])
        value = self._request.query.get(key)
        if value is None:
            raise KeyError(key)
        return value


def _request_of(args: tuple[object, ...]) -> web.BaseRequest:
    # handler(request), a method handler(self, request), or a web.View method (self.request).
    last = args[-1] if args else None
    if isinstance(last, web.BaseRequest):
        return last
    if isinstance(last, web.View):
        return last.request
    raise TypeError(f"@locked wraps aiohttp handlers, called with the request last; got {last!r}")


def locked(
    template: str,
    *,
    client: ClientSource,
    ttl: float = 30.0,
    timeout: float | None = 0,
    busy_status: int = 423,
    lost_status: int = 503,
) -> Callable[[Handler[P]], Handler[P]]:
    """Hold the lock named by ``template`` while the decorated aiohttp handler runs.

    ``template`` is formatted with the route's ``request.match_info`` by name, then with the
    query string; a request missing a name gets 400. ``client`` is an open
    :class:`asynclock.LockClient` or a function returning one (for a client opened in
    ``app.cleanup_ctx``). ``timeout=0`` answers ``busy_status`` (423 Locked) at once when the lock
    is held; a number waits up to that many seconds first, ``None`` waits as long as it takes. If
    the lease is lost while the handler runs, the handler is cancelled and the request answered
    with ``lost_status`` (503). Answers are JSON: ``{"error": "lock_busy" or "lease_lost",
    "lock": name, "message": ...}``.

    A handler that has already started sending a streamed response (``StreamResponse``,
    WebSocket) cannot be answered with 503 any more: then :class:`asynclock.LeaseLost` propagates
    and aiohttp drops the connection, so the client sees a failed request, not a complete one.
    """
    template_fields(template)
    ttl = _validate.positive_seconds(ttl, "ttl")
    timeout = _validate.timeout(timeout)

    def decorate(handler: Handler[P]) -> Handler[P]:
        if not inspect.iscoroutinefunction(handler):
            raise TypeError(f"@locked needs an `async def` handler, got {handler!r}")

        @functools.wraps(handler)
        async def locked_handler(*args: P.args, **kwargs: P.kwargs) -> web.StreamResponse:
            request = _request_of(args)
            try:
                name = _validate.lock_name(template.format_map(_RequestFields(request)))
            except KeyError as exc:
                return _answer(
                    400,
                    "missing_lock_name_part",
                    None,
                    f"the lock name {template!r} needs {exc.args[0]!r} from the path or the "
                    "query string",
                )
            except InvalidArgument as exc:
                return _answer(400, "invalid_lock_name", None, str(exc))
            lease: Lease | None = None
            try:
                async with resolve_client(client).lock(name, ttl=ttl, timeout=timeout) as lease:
                    return await handler(*args, **kwargs)
            except AcquireTimeout:
                if lease is not None:
                    raise  # from a lock the handler itself took
                return _answer(
                    busy_status,
                    "lock_busy",
                    name,
                    f"{name!r} is held by another request; try again later",
                )
            except LeaseLost as exc:
                if lease is None or not lease.lost or request.writer.output_size > 0:
                    raise  # another lock's, or a response is already on its way
                return _answer(
                    lost_status,
                    "lease_lost",
                    name,
                    f"the lock {name!r} was lost while the request ran, so it was stopped "
                    f"({exc.reason}); its effects may be partial, retry it",
                )

        return locked_handler

    return decorate


def _answer(status: int, error: str, name: str | None, message: str) -> web.Response:
    body: dict[str, object] = {"error": error, "message": message}
    if name is not None:
        body["lock"] = name
    return web.json_response(body, status=status)
