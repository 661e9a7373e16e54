"""``FencingMiddleware``: check the fencing token of each incoming request in any ASGI app.

Plain ASGI (no Starlette needed), so it wraps FastAPI, Starlette, Quart, Litestar and the rest.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from ._http import LOCK_HEADER, TOKEN_HEADER, Door, Guard, Refusal, entered

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class FencingMiddleware:
    """Refuse HTTP requests whose ``Fencing-Token`` is malformed (400) or stale (409).

    ``app = FencingMiddleware(app, guard=MemoryGuard())`` (or, in FastAPI and Starlette,
    ``app.add_middleware(FencingMiddleware, guard=guard)``). For each HTTP request that carries
    the token header:

    * a malformed header (not a decimal integer, negative, above 2**63-1, empty, sent more than
      once) is answered with 400 and a JSON body saying why; the app is not called;
    * the token is checked with ``guard.check(resource, token)`` (``guard=None`` skips this and
      leaves the check to the app); :class:`asynclock.StaleToken` is answered with 409 and a JSON
      body naming the stale token and the highest one seen;
    * the app runs with the token in :func:`incoming_token` and in
      ``scope["state"]["fencing_token"]`` (``request.state.fencing_token`` in Starlette), the
      resource in ``scope["state"]["fencing_resource"]``.

    ``resource(scope)`` names the resource the token is checked for; the default is the lock name
    from the ``Fencing-Lock`` header, else the request path. The default trusts the caller to
    name the lock; where callers are not trusted to, derive the resource from the request.
    A request without the header passes with no token, or gets 428 with ``required=True``.
    WebSocket and lifespan messages pass through unchecked.

    A check at the door refuses tokens older than the highest seen so far, but two requests can
    still be in flight at once: only a check in the same atomic step as the write (for example
    ``PostgresGuard.check`` in the write's transaction, with :func:`incoming_token`) closes that
    race.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        guard: Guard | None,
        resource: Callable[[Scope], str] | None = None,
        header: str = TOKEN_HEADER,
        lock_header: str | None = LOCK_HEADER,
        required: bool = False,
    ) -> None:
        self.app = app
        self._door = Door(
            guard=guard,
            header=header,
            lock_header=lock_header,
            required=required,
            resource=resource,
            path=lambda scope: str(scope["path"]),
        )
        self._token_key = header.lower().encode("latin-1")
        self._lock_key = None if lock_header is None else lock_header.lower().encode("latin-1")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        token_values: list[str] = []
        lock_values: list[str] = []
        for key, value in scope.get("headers", ()):
            key = bytes(key).lower()
            if key == self._token_key:
                token_values.append(bytes(value).decode("latin-1"))
            elif key == self._lock_key:
                lock_values.append(bytes(value).decode("latin-1"))
        checked = await self._door.check(scope, token_values, lock_values)
        if isinstance(checked, Refusal):
            await _refuse(send, checked)
            return
        token, resource = checked
        state = scope.setdefault("state", {})
        state["fencing_token"] = token
        state["fencing_resource"] = resource
        with entered(token):
            await self.app(scope, receive, send)


async def _refuse(send: Send, refusal: Refusal) -> None:
    body = json.dumps(refusal.body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": refusal.status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
