"""Two FastAPI services: "orders" holds a lock per account, "ledger" checks its fencing tokens.

    python examples/fastapi_app.py                            # embedded SQLite backend
    ASYNCLOCK_URL=redis://127.0.0.1:6379 python examples/fastapi_app.py

The script starts both services with uvicorn on free ports of 127.0.0.1, sends them concurrent
requests, prints what happened and exits (status 1 if anything was not as expected):

* ``@locked`` on an endpoint: of five withdrawals from one account sent at once, one runs and the
  others get 423 Locked with ``Retry-After: 1``; five deposits sent at once wait their turn
  (``timeout=5``) and all run. (A lock server that is down gets 503 ``lock_unavailable`` with
  ``Retry-After``; a lease lost while the endpoint runs cancels it and gets 503 ``lease_lost``;
  one lost after the endpoint returned keeps its answer, with ``Asynclock-Lease-Lost``.)
* Each endpoint calls the ledger with httpx; the request hook adds the lock's ``Fencing-Token``
  and ``Fencing-Lock`` headers, and the ledger's ``FencingMiddleware`` refuses a stale token
  (a holder that was paused while newer holders wrote) with 409.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
import uvicorn
from fastapi import FastAPI

import asynclock
from asynclock.fencing import FencingMiddleware, MemoryGuard, httpx_request_hook, incoming_token
from asynclock.integrations.fastapi import locked


def make_ledger() -> Any:
    """The resource: it keeps balances and refuses writes with a stale fencing token."""
    ledger = FastAPI()
    balances: dict[str, int] = {}

    @ledger.post("/entries/{account}")
    async def add_entry(account: str, amount: int) -> dict[str, Any]:
        # The middleware already refused tokens older than the newest it has seen. With a
        # database, also check in the write's own transaction, which closes the race between
        # two requests in flight: await pg_guard.check(conn, f"accounts/{account}",
        # incoming_token()).
        balances[account] = balances.get(account, 0) + amount
        return {"balance": balances[account], "token": incoming_token()}

    # The resource is the lock name sent in Fencing-Lock ("accounts/alice").
    return FencingMiddleware(ledger, guard=MemoryGuard())


def make_orders(lock_url: str, ledger_url: str) -> FastAPI:
    """The service users call: it holds the account's lock while it works."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with (
            asynclock.connect(lock_url) as locks,
            httpx.AsyncClient(
                base_url=ledger_url, event_hooks={"request": [httpx_request_hook()]}
            ) as ledger,
        ):
            app.state.locks = locks
            app.state.ledger = ledger
            yield

    app = FastAPI(lifespan=lifespan)

    async def book(account: str, amount: int) -> dict[str, Any]:
        answer = await app.state.ledger.post(f"/entries/{account}", params={"amount": amount})
        answer.raise_for_status()
        entry: dict[str, Any] = answer.json()
        return {"balance": entry["balance"], "token": asynclock.current_token()}

    @app.post("/accounts/{account}/withdraw")
    @locked("accounts/{account}", client=lambda: app.state.locks)  # busy: 423 at once
    async def withdraw(account: str, amount: int) -> dict[str, Any]:
        await anyio.sleep(1.0)  # checking the balance, talking to the bank, ...
        return await book(account, -amount)

    @app.post("/accounts/{account}/deposit")
    @locked("accounts/{account}", client=lambda: app.state.locks, timeout=5)  # busy: wait
    async def deposit(account: str, amount: int) -> dict[str, Any]:
        await anyio.sleep(0.05)
        return await book(account, amount)

    return app


@asynccontextmanager
async def serve(app: Any) -> AsyncIterator[str]:
    """Run ``app`` with uvicorn on a free port of 127.0.0.1 until the block ends."""
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", ws="none")
    )
    async with anyio.create_task_group() as task_group:
        task_group.start_soon(server.serve)
        while not server.started:
            if server.should_exit:
                raise RuntimeError("the server did not start")
            await anyio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            server.should_exit = True


async def demo(lock_url: str) -> bool:
    async with (
        serve(make_ledger()) as ledger_url,
        serve(make_orders(lock_url, ledger_url)) as orders_url,
        httpx.AsyncClient(base_url=orders_url, timeout=30) as user,
    ):
        print(f"orders on {orders_url}, ledger on {ledger_url}")

        async def post(path: str, amount: int) -> httpx.Response:
            return await user.post(path, params={"amount": amount})

        deposits = await gather(*(post("/accounts/alice/deposit", 10) for _ in range(5)))
        print("5 deposits at once:   ", describe(deposits))
        withdrawals = await gather(*(post("/accounts/alice/withdraw", 5) for _ in range(5)))
        print("5 withdrawals at once:", describe(withdrawals))

        # A holder that was paused (GC, swap) while newer holders wrote wakes up and writes with
        # its old token: the ledger has seen newer tokens for accounts/alice and refuses it.
        oldest = min(answer.json()["token"] for answer in deposits)
        async with httpx.AsyncClient(base_url=ledger_url) as paused_holder:
            stale = await paused_holder.post(
                "/entries/alice",
                params={"amount": -1000},
                headers={"Fencing-Token": str(oldest), "Fencing-Lock": "accounts%2Falice"},
            )
        print(f"a stale token {oldest}:", stale.status_code, stale.json()["detail"])

    tokens = [answer.json()["token"] for answer in deposits]
    statuses = Counter(answer.status_code for answer in withdrawals)
    return (
        all(answer.status_code == 200 for answer in deposits)
        and len(set(tokens)) == 5
        and statuses == {200: 1, 423: 4}
        and all(
            answer.headers.get("retry-after") == "1"
            for answer in withdrawals
            if answer.status_code == 423
        )
        and stale.status_code == 409
    )


async def gather(*calls: Any) -> list[httpx.Response]:
    results: list[httpx.Response] = list(await asyncio.gather(*calls))
    return results


def describe(answers: list[httpx.Response]) -> str:
    parts = []
    for answer in answers:
        body = answer.json()
        if answer.status_code == 200:
            parts.append(f"200 (token {body['token']}, balance {body['balance']})")
        else:
            retry = answer.headers.get("retry-after")
            parts.append(f"{answer.status_code} {body['detail']['error']} (Retry-After {retry})")
    return ", ".join(parts)


def main() -> int:
    with tempfile.TemporaryDirectory() as directory:
        lock_url = os.environ.get("ASYNCLOCK_URL") or f"sqlite://{directory}/locks.db"
        print(f"locks on {lock_url}")
        ok = asyncio.run(demo(lock_url))
    print("as expected" if ok else "NOT as expected")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
