"""Two aiohttp services: "orders" holds a lock per account, "ledger" checks its fencing tokens.

    python examples/aiohttp_app.py                            # embedded SQLite backend
    ASYNCLOCK_URL=etcd://127.0.0.1:2379 python examples/aiohttp_app.py

The script starts both services on free ports of 127.0.0.1, sends them concurrent requests,
prints what happened and exits (status 1 if anything was not as expected):

* ``@locked`` on a handler: of five withdrawals from one account sent at once, one runs and the
  others get 423 Locked with ``Retry-After: 1``; five deposits sent at once wait their turn
  (``timeout=5``) and all run. (A lock server that is down gets 503 ``lock_unavailable`` with
  ``Retry-After``; a lease lost while the handler runs cancels it and gets 503 ``lease_lost``;
  one lost after the handler returned keeps its answer, with ``Asynclock-Lease-Lost``.)
* Each handler calls the ledger with an aiohttp session whose client middleware adds the lock's
  ``Fencing-Token`` and ``Fencing-Lock`` headers; the ledger's fencing middleware refuses a stale
  token (a holder that was paused while newer holders wrote) with 409.
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

import aiohttp
from aiohttp import web

import asynclock
from asynclock.fencing import (
    MemoryGuard,
    aiohttp_client_middleware,
    aiohttp_fencing_middleware,
    incoming_token,
)
from asynclock.integrations.aiohttp import locked

LOCKS = web.AppKey("locks", asynclock.LockClient)
LEDGER = web.AppKey("ledger", aiohttp.ClientSession)


def make_ledger() -> web.Application:
    """The resource: it keeps balances and refuses writes with a stale fencing token."""
    balances: dict[str, int] = {}

    async def add_entry(request: web.Request) -> web.Response:
        # With a database, also check incoming_token() in the write's own transaction
        # (PostgresGuard.check): that closes the race between two requests in flight.
        account = request.match_info["account"]
        balances[account] = balances.get(account, 0) + int(request.query["amount"])
        return web.json_response({"balance": balances[account], "token": incoming_token()})

    # The resource is the lock name sent in Fencing-Lock ("accounts/alice").
    app = web.Application(middlewares=[aiohttp_fencing_middleware(guard=MemoryGuard())])
    app.router.add_post("/entries/{account}", add_entry)
    return app


def make_orders(lock_url: str, ledger_url: str) -> web.Application:
    """The service users call: it holds the account's lock while it works."""
    app = web.Application()

    async def resources(app: web.Application) -> AsyncIterator[None]:
        async with (
            asynclock.connect(lock_url) as locks,
            aiohttp.ClientSession(ledger_url, middlewares=(aiohttp_client_middleware(),)) as ledger,
        ):
            app[LOCKS] = locks
            app[LEDGER] = ledger
            yield

    app.cleanup_ctx.append(resources)

    async def book(account: str, amount: int) -> web.Response:
        async with app[LEDGER].post(f"/entries/{account}", params={"amount": amount}) as answer:
            answer.raise_for_status()
            entry = await answer.json()
        return web.json_response({"balance": entry["balance"], "token": asynclock.current_token()})

    @locked("accounts/{account}", client=lambda: app[LOCKS])  # busy: 423 at once
    async def withdraw(request: web.Request) -> web.Response:
        await asyncio.sleep(1.0)  # checking the balance, talking to the bank, ...
        return await book(request.match_info["account"], -int(request.query["amount"]))

    @locked("accounts/{account}", client=lambda: app[LOCKS], timeout=5)  # busy: wait
    async def deposit(request: web.Request) -> web.Response:
        await asyncio.sleep(0.05)
        return await book(request.match_info["account"], int(request.query["amount"]))

    app.router.add_post("/accounts/{account}/withdraw", withdraw)
    app.router.add_post("/accounts/{account}/deposit", deposit)
    return app


@asynccontextmanager
async def serve(app: web.Application) -> AsyncIterator[str]:
    """Run ``app`` on a free port of 127.0.0.1 until the block ends."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def demo(lock_url: str) -> bool:
    async with serve(make_ledger()) as ledger_url:
        async with (
            serve(make_orders(lock_url, ledger_url)) as orders_url,
            aiohttp.ClientSession(orders_url) as user,
        ):
            print(f"orders on {orders_url}, ledger on {ledger_url}")

            async def post(path: str, amount: int) -> tuple[int, dict[str, Any]]:
                async with user.post(path, params={"amount": amount}) as answer:
                    body = await answer.json()
                    if "Retry-After" in answer.headers:
                        body["retry_after"] = answer.headers["Retry-After"]
                    return answer.status, body

            deposits = await asyncio.gather(
                *(post("/accounts/alice/deposit", 10) for _ in range(5))
            )
            print("5 deposits at once:   ", describe(deposits))
            withdrawals = await asyncio.gather(
                *(post("/accounts/alice/withdraw", 5) for _ in range(5))
            )
            print("5 withdrawals at once:", describe(withdrawals))

        # A holder that was paused (GC, swap) while newer holders wrote wakes up and writes with
        # its old token: the ledger has seen newer tokens for accounts/alice and refuses it.
        oldest = min(body["token"] for _, body in deposits)
        async with (
            aiohttp.ClientSession(ledger_url) as paused_holder,
            paused_holder.post(
                "/entries/alice",
                params={"amount": -1000},
                headers={"Fencing-Token": str(oldest), "Fencing-Lock": "accounts%2Falice"},
            ) as stale,
        ):
            stale_body = await stale.json()
        print(f"a stale token {oldest}:", stale.status, stale_body["detail"])

    tokens = [body["token"] for _, body in deposits]
    statuses = Counter(status for status, _ in withdrawals)
    return (
        all(status == 200 for status, _ in deposits)
        and len(set(tokens)) == 5
        and statuses == {200: 1, 423: 4}
        and all(body.get("retry_after") == "1" for status, body in withdrawals if status == 423)
        and stale.status == 409
    )


def describe(answers: list[tuple[int, dict[str, Any]]]) -> str:
    parts = []
    for status, body in answers:
        if status == 200:
            parts.append(f"200 (token {body['token']}, balance {body['balance']})")
        else:
            parts.append(f"{status} {body['error']} (Retry-After {body.get('retry_after')})")
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
