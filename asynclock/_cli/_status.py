"""``asynclock status NAME...``: who holds each lock, with which token, and who waits."""

from __future__ import annotations

from collections.abc import Sequence

from .._connect import connect


async def status(url: str, names: Sequence[str]) -> int:
    async with connect(url) as locks:
        for name in names:
            info = await locks.inspect(name)
            if not info.held:
                waiting = "" if info.waiters is None else f", {info.waiters} waiting"
                print(f"{name}: free{waiting}")
                continue
            parts = [
                f"held by {info.holder or info.owner or 'an unknown holder'}",
                f"token {info.token}" if info.token is not None else "",
                f"expires in {info.expires_in:.1f} s" if info.expires_in is not None else "",
                f"{info.waiters} waiting" if info.waiters is not None else "",
            ]
            print(f"{name}: " + ", ".join(part for part in parts if part))
    return 0
