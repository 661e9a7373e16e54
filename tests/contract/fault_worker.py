"""One worker process of the fault contract's client-pause test (and that test's pause schedule).

It takes the lock over and over and does a fenced read-modify-write on a counter in an SQLite
file (the resource), then prints one JSON line: what it saw. The test SIGSTOPs and resumes
workers while they run. Once the test has resumed every worker for the last time, it writes that
moment (``time.time()``) into ``stop_file``; each worker stops as soon as it has taken the lock
after it (or when ``seconds`` are up, which the test then reports as a starved worker).

Usage: python -m tests.contract.fault_worker '<json config>'
"""

from __future__ import annotations

import json
import random
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

import anyio

import asynclock


def open_resource(path: str) -> sqlite3.Connection:
    db = sqlite3.connect(path, timeout=30, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("CREATE TABLE IF NOT EXISTS counter (id INTEGER PRIMARY KEY, value INT, fence INT)")
    db.execute("CREATE TABLE IF NOT EXISTS accepted (worker INT, token INT, value INT)")
    db.execute("INSERT OR IGNORE INTO counter VALUES (1, 0, 0)")
    return db


def fenced_read(db: sqlite3.Connection, token: int | None) -> int | None:
    """Read the counter, recording the token (a read is an access the guard must see too)."""
    db.execute("BEGIN IMMEDIATE")
    try:
        refused = token is not None and (
            db.execute("UPDATE counter SET fence = ? WHERE fence <= ?", (token, token)).rowcount
            != 1
        )
        if refused:
            return None
        (value,) = db.execute("SELECT value FROM counter").fetchone()
        return int(value)
    finally:
        db.execute("COMMIT")


def fenced_write(db: sqlite3.Connection, worker: int, token: int | None, value: int) -> bool:
    db.execute("BEGIN IMMEDIATE")
    try:
        if token is None:
            db.execute("UPDATE counter SET value = ?", (value,))
        elif (
            db.execute(
                "UPDATE counter SET value = ?, fence = ? WHERE fence <= ?", (value, token, token)
            ).rowcount
            != 1
        ):
            return False
        db.execute("INSERT INTO accepted VALUES (?, ?, ?)", (worker, token or 0, value))
        return True
    finally:
        db.execute("COMMIT")


def pause_schedule(pauses: int, at_once: int) -> list[tuple[int, bool, int]]:
    """The client pauses as (step, resume?, pause number), in order: pause ``i`` stops its
    worker at step ``i`` and resumes it at step ``i + at_once`` (a step is a pause length
    divided by ``at_once``), so ``at_once`` workers are stopped at a time; at a step where one
    resumes and another stops, the resume comes first."""
    events = [(i, False, i) for i in range(pauses)] + [
        (i + at_once, True, i) for i in range(pauses)
    ]
    return sorted(events, key=lambda event: (event[0], not event[1]))


def read_last_resume(path: Path) -> float | None:
    """When the test resumed the workers for the last time, once it has said so."""
    try:
        return float(path.read_text())
    except FileNotFoundError:
        return None


async def main(config: dict[str, Any]) -> dict[str, Any]:
    worker: int = config["worker"]
    ttl: float = config["ttl"]
    fenced: bool = config["fenced"]
    db = open_resource(config["resource"])
    seen: dict[str, Any] = {
        "worker": worker,
        "acquired": 0,
        "lost": 0,
        "timeouts": 0,
        "refused": 0,
        "errors": [],
        "acquired_at": [],
    }
    end = time.monotonic() + config["seconds"]
    stop_file = Path(config["stop_file"])
    last_resume: float | None = None
    async with asynclock.connect(config["url"], **config["options"]) as locks:
        print("ready", flush=True)
        while time.monotonic() < end:
            if last_resume is None:
                last_resume = read_last_resume(stop_file)
            if last_resume is not None and max(seen["acquired_at"], default=0.0) > last_resume:
                break  # the lock is still usable after every pause: what the test waits for
            try:
                async with locks.lock(config["name"], ttl=ttl, timeout=ttl * 3) as lease:
                    seen["acquired"] += 1
                    seen["acquired_at"].append(time.time())
                    token = lease.token if fenced else None
                    value = fenced_read(db, token)
                    if value is None:
                        seen["refused"] += 1
                        continue
                    await anyio.sleep(random.uniform(0, 0.005))
                    if not fenced_write(db, worker, token, value + 1):
                        seen["refused"] += 1
            except asynclock.LeaseLost:
                seen["lost"] += 1
            except asynclock.AcquireTimeout:
                seen["timeouts"] += 1
            except Exception as exc:
                seen["errors"].append(f"{type(exc).__name__}: {exc}")
            await anyio.sleep(random.uniform(0, 0.01))
    return seen


if __name__ == "__main__":
    result = anyio.run(main, json.loads(sys.argv[1]))
    print(json.dumps(result), flush=True)
