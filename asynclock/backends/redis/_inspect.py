"""``inspect()`` and ``wait_for_change()`` of ``redis://`` (and Sentinel, Cluster): INSPECT's
reply made a :class:`LockInfo`, and an election's change waited for on its Pub/Sub channel."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from .._kit import HolderInfo, Kind, LockInfo
from ._scripts import as_text
from ._wakes import WakeChannel


def _seconds(ms: int) -> float | None:
    return ms / 1000 if ms >= 0 else None


def info_from(name: str, kind: Kind, reply: Any) -> LockInfo:
    """``inspect()``'s answer from INSPECT's reply (see :data:`._queue.INSPECT`)."""
    holder, ms_left, counter, waiters, members, server_ms = reply
    now = int(server_ms)
    holds: list[HolderInfo] = []
    permits: int | None = None
    if holder:
        # Nobody takes while an exclusive holder holds: the counter is its token.
        token = int(counter) if counter is not None else None
        holds.append(HolderInfo(as_text(holder), token, _seconds(int(ms_left))))
    for member, score in zip(members[::2], members[1::2], strict=True):
        if member.startswith(b"#"):
            permits = int(member[1:])
            continue
        token_text, owner, value = member.split(b" ", 2)
        holds.append(
            HolderInfo(
                as_text(owner),
                int(token_text),
                (int(float(score)) - now) / 1000,
                shared=kind == "lock",
                value=value if kind == "election" else None,
            )
        )
    return LockInfo.of(name, kind, holds, waiters=int(waiters), permits=permits)


def differs(now: LockInfo, seen: LockInfo) -> bool:
    """Whether the holds of ``now`` are not those of ``seen`` (who, with which token, value)."""

    def key(info: LockInfo) -> tuple[Any, ...]:
        return (info.held, info.owner, info.token, info.value)

    return key(now) != key(seen)


async def wait_for_election_change(
    wakes: WakeChannel,
    channel: str,
    inspect: Callable[[], Awaitable[LockInfo]],
    seen: LockInfo,
    timeout: float,
    poll_interval: float,
) -> None:
    """Return when the election's holds differ from ``seen``, told on ``channel`` (which its
    scripts PUBLISH every change on), or after ``timeout`` seconds."""
    # An expiry runs no script and tells nobody: look again when the leader's would come.
    if seen.held and seen.expires_in is not None:
        timeout = min(timeout, seen.expires_in + 0.005)
    with anyio.move_on_after(timeout), wakes.watch(channel) as watch:
        if not await watch.ready():
            # No subscribed connection now: poll.
            await anyio.sleep(min(timeout, poll_interval))
            return
        # Subscribed: whatever changes from now on is told; compare with what was seen.
        if differs(await inspect(), seen):
            return
        await watch.changed()
