"""``asynclock status NAME...``: who holds each lock (every reader, every permit of a
semaphore, an election's leader), with which token, and who waits."""

from __future__ import annotations

from collections.abc import Sequence

from .._connect import connect
from ..abc import HolderInfo, Kind, LockInfo


async def status(url: str, names: Sequence[str], kind: Kind = "lock") -> int:
    async with connect(url) as locks:
        for name in names:
            print(describe(name, await locks.inspect(name, kind)))
    return 0


def describe(name: str, info: LockInfo) -> str:
    """One line per name, then one per hold when there are several (readers, permits)."""
    waiting = "" if info.waiters is None else f", {info.waiters} waiting"
    permits = f" ({info.permits} permits)" if info.permits is not None else ""
    if not info.held:
        return f"{name}{permits}: free{waiting}"
    if info.kind == "election":
        value = info.value.decode("utf-8", "backslashreplace") if info.value is not None else "?"
        head = f"{name}: led by {value!r}"
    elif len(info.holders) > 1 or info.kind == "semaphore" or any(h.shared for h in info.holders):
        count = len(info.holders)
        if info.kind == "semaphore":
            what = f"{count} in use"
        else:
            shared = " shared" if any(holder.shared for holder in info.holders) else ""
            what = f"{count}{shared} hold{'s' if count != 1 else ''}"
        lines = [f"{name}{permits}: {what}{waiting}"]
        lines += [f"  {_hold(holder)}" for holder in info.holders]
        return "\n".join(lines)
    else:
        head = f"{name}: held"
    parts = [
        f"by {info.holder or info.owner or 'an unknown holder'}",
        f"token {info.token}" if info.token is not None else "",
        f"expires in {info.expires_in:.1f} s" if info.expires_in is not None else "",
        f"{info.waiters} waiting" if info.waiters is not None else "",
    ]
    return f"{head} " + ", ".join(part for part in parts if part)


def _hold(holder: HolderInfo) -> str:
    parts = [
        f"{holder.owner or 'an unknown holder'}",
        f"token {holder.token}" if holder.token is not None else "",
        f"expires in {holder.expires_in:.1f} s" if holder.expires_in is not None else "",
        "shared" if holder.shared else "",
    ]
    return ", ".join(part for part in parts if part)
