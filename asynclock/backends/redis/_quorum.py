"""Redlock's majority arithmetic: what a master's answer says, when a round or a renewal is
decided, what a renewal's votes mean, and the local queue of one client's waiters."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import anyio

from .._kit import (
    BackendTimeout,
    BackendUnavailable,
    InvalidArgument,
    LockInfo,
    Lost,
    Renewed,
    RenewOutcome,
    Unknown,
)
from ._pipeline import Failed, Master, gather

logger = logging.getLogger("asynclock")

EXAMPLE: Final = "redlock://127.0.0.1:6379,127.0.0.1:6380,127.0.0.1:6381/0"
#: Fewer masters than this are refused (see :func:`check_master_count`).
MIN_MASTERS: Final = 3
#: The pause before masters too slow to answer while the client connects are asked again.
_ASK_AGAIN: Final = 0.05


def round_decided(results: list[Any], *, count: int, quorum: int) -> bool:
    """A take is decided: ours on a majority; or held elsewhere, as a majority of answers
    shows (masters that failed prove nothing: the others are waited for, so that try_acquire
    can tell "held" from "cannot tell")."""
    yes = sum(1 for r in results if said(r) == 1)
    no = sum(1 for r in results if said(r) == 0)
    return yes >= quorum or (count - no < quorum and yes + no >= quorum)


def majority_answered(results: list[Any], *, quorum: int) -> bool:
    answered = sum(1 for r in results if r is not None and not isinstance(r, Failed))
    return answered >= quorum


@dataclass(slots=True, eq=False)
class RenewVotes:
    """The replies of ``count`` masters to one RENEW of ``size`` locks."""

    count: int
    quorum: int
    size: int

    def codes(self, result: Any) -> list[int] | None:
        if isinstance(result, list) and len(result) == self.size:
            return [int(code) for code in result]
        return None

    def _tally(self, replies: list[list[int] | None], index: int) -> tuple[int, int]:
        ok = sum(1 for r in replies if r is not None and r[index] == 1)
        no = sum(1 for r in replies if r is not None and r[index] != 1)
        return ok, no

    def decided(self, results: list[Any]) -> bool:
        """Every lock renewed on a majority, or lost on enough masters that none can be."""
        replies = [self.codes(r) for r in results]
        for index in range(self.size):
            ok, no = self._tally(replies, index)
            if ok < self.quorum and self.count - no >= self.quorum:
                return False
        return True

    def outcomes(
        self,
        locks: Sequence[tuple[str, float]],
        results: list[Any],
        *,
        sent_at: float,
        elapsed: float,
        allowance: Callable[[float], float],
        where: str,
    ) -> list[RenewOutcome]:
        """One outcome per (name, ttl) in ``locks``; ``allowance(ttl)`` is the drift allowance."""
        replies = [self.codes(r) for r in results]
        failures = [r.error for r in results if isinstance(r, Failed)]
        failures += [
            BackendUnavailable(f"unexpected reply from a lock script: {r!r}")
            for r, reply in zip(results, replies, strict=True)
            if reply is None and not isinstance(r, Failed)
        ]
        outcomes: list[RenewOutcome] = []
        count = self.count
        for index, (name, ttl) in enumerate(locks):
            ok, no = self._tally(replies, index)
            if ok >= self.quorum and ttl - elapsed - allowance(ttl) > 0:
                outcomes.append(Renewed(sent_at, ttl - allowance(ttl)))
            elif count - no < self.quorum:
                outcomes.append(
                    Lost(
                        f"{no} of {count} masters of {where} no longer hold lock {name!r}, "
                        "so no majority can"
                    )
                )
            else:
                error = failures[0] if failures else TimeoutError("renewal took too long")
                outcomes.append(
                    Unknown(
                        BackendUnavailable(
                            f"only {ok} of {count} masters of {where} renewed lock {name!r} "
                            f"in time (first error: {error!r})"
                        )
                    )
                )
        return outcomes


class Room:
    """The tasks of this client waiting for one name: they take turns, first come first
    served, and only the one whose turn it is runs rounds."""

    __slots__ = ("kick", "turn", "users")

    def __init__(self) -> None:
        self.turn = asyncio.Lock()
        #: Set when this client released the name: the waiter whose turn it is looks again now.
        self.kick = asyncio.Event()
        self.users = 0


def check_master_count(count: int, url: str | None = None) -> None:
    if count >= MIN_MASTERS:
        return
    where = f"{url!r} names" if url else "got"
    raise InvalidArgument(
        f"Redlock needs at least {MIN_MASTERS} independent masters; {where} {count}. A "
        f"majority of {count} master{'s' if count != 1 else ''} is "
        f"{'it' if count == 1 else 'all of them'}, so the lock would tolerate no failure "
        "while costing more than one server: use redis://host:port for a single Redis "
        f"server, or list {MIN_MASTERS} or more masters (5 tolerate 2 failing), e.g. {EXAMPLE}"
    )


def never(results: list[Any]) -> bool:
    return False


def said(result: Any) -> int | None:
    """1: the master said yes; 0: it said no (someone else holds the key); None: no answer
    (or one that proves nothing)."""
    if isinstance(result, list) and len(result) == 2 and isinstance(result[0], int):
        return 1 if result[0] == 1 else 0
    return None


def still_queued(name: str) -> None:
    logger.debug(
        "asynclock: the release of %r after an interrupted Redlock round is still on its way "
        "to a master that does not answer; its key expires with its ttl otherwise",
        name,
    )


def reason(result: object) -> str:
    if isinstance(result, Failed):
        error = result.error
        text = str(error) or type(error).__name__
        return text if len(text) < 120 else text[:117] + "..."
    return "ok"


#: A master's view of one lock: {holder or false, pttl}.
PEEK: Final = "return {redis.call('GET', KEYS[1]), redis.call('PTTL', KEYS[1])}"


def majority_view(name: str, results: list[Any], quorum: int, where: str) -> LockInfo:
    """``inspect()`` from every master's PEEK: held when a majority name one holder, expiring
    when fewer than a majority would still have its key."""
    replies = [r for r in results if isinstance(r, list) and len(r) == 2]
    if len(replies) < quorum:
        raise BackendUnavailable(
            f"inspecting {name!r}: only {len(replies)} masters of {where} answered; a "
            f"majority ({quorum}) is needed to say who holds it"
        )
    holders = Counter(bytes(r[0]) for r in replies if r[0])
    if holders:
        holder, votes = holders.most_common(1)[0]
        if votes >= quorum:
            left = sorted((int(r[1]) for r in replies if r[0] == holder), reverse=True)
            ms = left[quorum - 1]
            return LockInfo(
                name,
                held=True,
                owner=holder.decode("utf-8", "replace"),
                expires_in=ms / 1000 if ms >= 0 else None,
            )
    return LockInfo(name, held=False)


async def check_majority(
    masters: Sequence[Master], timeout: float, quorum: int, where: str, grace: float
) -> None:
    """PING every master; raise unless a majority answers (warn about the others).

    Masters that only answered too late are asked again, for as long as the caller's scope
    (the client's ``connect_timeout``) lets them: many clients starting at once, or a loaded
    host, make a healthy server slow. Masters that refuse or fail end it at once.
    """
    decided = functools.partial(majority_answered, quorum=quorum)
    while True:
        futures = [master.submit(("PING",)) for master in masters]
        results = await gather(futures, timeout, decided, grace=grace)
        failed = [result for result in results if isinstance(result, Failed)]
        if len(masters) - len(failed) >= quorum or not all(
            isinstance(result.error, BackendTimeout) for result in failed
        ):
            break
        await anyio.sleep(_ASK_AGAIN)
    down = [
        f"{master.address} ({reason(result)})"
        for master, result in zip(masters, results, strict=True)
        if isinstance(result, Failed)
    ]
    if len(masters) - len(down) < quorum:
        raise BackendUnavailable(
            f"cannot reach a majority of {where}: {len(down)} of {len(masters)} masters did "
            f"not answer ({'; '.join(down)}); check that redis-server runs on each and that "
            "the hosts, ports and password are right"
        )
    if down:
        logger.warning(
            "asynclock: %s: %d of %d masters did not answer (%s); locking goes on with the "
            "majority",
            where,
            len(down),
            len(masters),
            "; ".join(down),
        )
