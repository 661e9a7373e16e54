"""A replica for test_leader_processes.py: a LeaderTask whose job records each run it completed
while its term was valid (pid, token, start, end on the system's monotonic clock), appended to a
file when the replica stops.

python -m tests.integrations.leader_worker URL NAME TTL SECONDS OUT
"""

from __future__ import annotations

import os
import sys
import time

import anyio

import asynclock

RUN = 0.02


async def main(url: str, name: str, ttl: float, seconds: float, out: str) -> None:
    completed: list[str] = []
    async with asynclock.connect(url) as locks:

        async def job(term: asynclock.Lease) -> None:
            started = time.monotonic()
            await anyio.sleep(RUN)
            ended = time.monotonic()
            # Valid to its end: the term's local deadline (the same clock) had not passed.
            if ended < term.deadline and not term.lost:
                completed.append(f"{os.getpid()} {term.token} {started} {ended}\n")

        task = asynclock.LeaderTask(
            locks, name, job, value=str(os.getpid()).encode(), ttl=ttl, every=0.01, retry_after=0.05
        )
        async with task:
            print("running", flush=True)
            await anyio.sleep(seconds)
    with open(out, "a", encoding="utf-8") as file:  # noqa: ASYNC230 (once, at the end)
        file.writelines(completed)


if __name__ == "__main__":
    url, name, ttl, seconds, out = sys.argv[1:]
    anyio.run(main, url, name, float(ttl), float(seconds), out)
