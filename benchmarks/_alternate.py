"""asynclock and its peer across clients, in alternated rounds (issue #29's throughput ratios).

The runs of ``_cross`` measure a backend, then each of its peers, one after the other, once
each: on this machine, whose speed drifts by 10-20 % from one minute to the next, the ratio of
two such runs moves by more than some backends' distance from their peer (Redis over
python-redis-lock with 2 clients: 0.7x in one full run, 0.87 to 1.13x in rounds alternated in
one process). Here the two take turns: a round runs asynclock and the peer back to back with
the same harness (N clients in one process, each its own client, 0 ms hold), the order flipped
every round, and gives one ratio per client count; the report shows every round's ratio and
their median.
"""

from __future__ import annotations

import statistics
from collections.abc import Awaitable, Callable
from typing import Any

from ._contend import Run
from ._cross import one_in_process
from ._peers import Peer
from ._targets import Target

#: The client counts of the rounds (the issue's), and the rounds a run aims for.
CLIENTS = (2, 8)
ROUNDS = 5

Measure = Callable[[Any, Run, str], Awaitable[dict[str, Any]]]


def round_seconds(duration: float) -> float:
    """About what one round takes: for each count, both units' runs, each with its clients'
    connects (tens of ms each for etcd and ZooKeeper) and the end of its last turn."""
    return sum(2 * (duration + 0.3 + 0.1 * count) for count in CLIENTS)


async def alternated(
    target: Target,
    peer: Peer,
    *,
    duration: float,
    grace: float,
    name_of: Callable[[str], str],
    fits: Callable[[float], bool],
    rounds: int = ROUNDS,
    measure: Measure = one_in_process,
) -> dict[str, Any]:
    """Up to ``rounds`` rounds (the first always, the others while ``fits`` their time):
    per client count, asynclock's and the peer's acquisitions/s and share retaken, and
    asynclock's over the peer's (None when the peer made no acquisition)."""
    counts: dict[str, dict[str, Any]] = {
        str(count): {"ours": [], "peer": [], "ratios": [], "ours_retaken": [], "peer_retaken": []}
        for count in CLIENTS
    }
    done = 0
    for index in range(rounds):
        if index and not fits(round_seconds(duration)):
            break
        for count in CLIENTS:
            run = Run(count, 0.0, duration, grace)
            turns: list[tuple[str, Target | Peer]] = [("ours", target), ("peer", peer)]
            if index % 2:
                turns.reverse()
            records = {
                side: await measure(unit, run, name_of(f"alternated-{index}-{count}-{side}"))
                for side, unit in turns
            }
            row = counts[str(count)]
            for side in ("ours", "peer"):
                row[side].append(records[side]["per_second"])
                row[f"{side}_retaken"].append(records[side]["retaken_share"])
            theirs = records["peer"]["per_second"]
            row["ratios"].append(records["ours"]["per_second"] / theirs if theirs else None)
        done += 1
    for row in counts.values():
        ratios = [value for value in row["ratios"] if value is not None]
        row["median"] = statistics.median(ratios) if ratios else None
    return {"rounds": done, "duration_s": duration, "clients": counts}


def rows(data: dict[str, Any]) -> list[list[str]]:
    """The report's rows: per peer and client count, each round's ratio and their median."""
    out = []
    for peer_name, peer in data.get("peers", {}).items():
        record = peer.get("alternated")
        if not isinstance(record, dict) or "clients" not in record:
            continue
        for count, row in record["clients"].items():
            ratios = ", ".join("-" if value is None else f"{value:.2f}" for value in row["ratios"])
            retaken = ", ".join(
                f"{ours:.0%} / {theirs:.0%}"
                for ours, theirs in zip(row["ours_retaken"], row["peer_retaken"], strict=True)
            )
            rates = ", ".join(
                f"{ours:.0f} / {theirs:.0f}"
                for ours, theirs in zip(row["ours"], row["peer"], strict=True)
            )
            median = "-" if row["median"] is None else f"{row['median']:.2f}x"
            out.append(
                [f"{peer['compare_with']} / {peer_name}", count, median, ratios, rates, retaken]
            )
    return out
