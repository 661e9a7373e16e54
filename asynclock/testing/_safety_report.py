"""Run a safety profile on every installed backend and write the results as Markdown.

    python -m asynclock.testing._safety_report --profile short --out docs/safety-results.md

Starts its own servers (loopback only) through the launchers, runs each backend with and without
fencing, with the pauses landing between the read and the write, and prints one table row a run.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace

import anyio

from ._etcd import EtcdServer
from ._host import ServerNotInstalled
from ._postgres import PostgresServer
from ._redis import RedisServer
from ._safety import SafetyConfig, SafetyReport, _capable, run_safety
from ._zookeeper import ZooKeeperServer

_PROFILES = {
    # seconds per run at the shortest ttl; runs scale with the backend's ttl
    "short": 4.0,
    "long": 30.0,
}

_COLUMNS = (
    ("backend", "lock"),
    ("fencing", "fencing"),
    ("cancel_on_loss", "cancel body"),
    ("pause_kind", "pause"),
    ("resource", "resource"),
    ("holds", "holds"),
    ("pauses", "pauses"),
    ("overtaken_holds", "holds overtaken"),
    ("writes_accepted", "writes accepted"),
    ("writes_refused", "refused (stale)"),
    ("lost_updates", "lost updates"),
    ("stale_writes_accepted", "stale writes accepted"),
    ("safe", "safe"),
)


#: The table of the semaphore and election runs.
_PRIMITIVE_COLUMNS = (
    ("backend", "lock"),
    ("primitive", "primitive"),
    ("permits", "permits"),
    ("fencing", "fencing"),
    ("pause_kind", "pause"),
    ("holds", "holds"),
    ("lost_leases", "leases lost"),
    ("most_holds_at_once", "most holds at once"),
    ("most_writers_at_once", "most writers at once (resource)"),
    ("writes_accepted", "holds' writes accepted"),
    ("writes_refused", "refused (stale)"),
    ("lost_updates", "lost updates"),
    ("stale_writes_accepted", "stale writes accepted"),
    ("token_errors", "token errors"),
    ("safe", "safe"),
)


def _row(report: SafetyReport, columns: tuple[tuple[str, str], ...] = _COLUMNS) -> str:
    data = report.as_dict()
    cells = []
    for key, _ in columns:
        value = data[key]
        if isinstance(value, bool):
            value = "yes" if value else "**no**"
        cells.append("-" if value is None else str(value))
    return "| " + " | ".join(cells) + " |"


@contextlib.contextmanager
def _servers() -> Iterator[dict[str, object]]:
    with contextlib.ExitStack() as stack:
        found: dict[str, object] = {}
        for name, factory in (
            ("redis", RedisServer),
            ("redis2", RedisServer),
            ("redis3", RedisServer),
            ("etcd", EtcdServer),
            ("zookeeper", ZooKeeperServer),
            ("postgres", PostgresServer),
        ):
            try:
                found[name] = stack.enter_context(factory())
            except ServerNotInstalled as exc:
                print(f"skipping {name}: {exc}", file=sys.stderr)
        yield found


def _primitive_runs(base: SafetyConfig, resource: str) -> list[SafetyConfig]:
    """Semaphore (2 permits, 5 workers) and election runs, fenced and not, where the backend
    has them. A semaphore's resource is always PostgreSQL (its permit guard)."""
    fenced = [True, False] if _capable(base.url, "fencing") else [False]
    runs = []
    if _capable(base.url, "semaphores"):
        sem = replace(base, primitive="semaphore", permits=2, workers=5, resource=resource)
        runs += [replace(sem, fencing=fencing) for fencing in fenced]
    if _capable(base.url, "elections"):
        runs += [replace(base, primitive="election", fencing=fencing) for fencing in fenced]
    return runs


async def _run(profile: str, out: str | None, primitives: bool = False) -> int:
    seconds = _PROFILES[profile]
    rows: list[str] = []
    unsafe_with_fencing = 0
    with _servers() as servers:
        postgres = servers.get("postgres")
        redis = servers.get("redis")
        if not isinstance(postgres, PostgresServer) or not isinstance(redis, RedisServer):
            print("the safety runs need PostgreSQL and Redis for the resources", file=sys.stderr)
            return 2
        tag = uuid.uuid4().hex[:6]
        locks: list[tuple[str, float]] = [(f"sqlite:///tmp/asynclock-safety-{tag}.db", 0.6)]
        locks.append((f"{redis.url}?prefix=safety-{tag}:&durability_warning=false", 0.6))
        redlock = [
            server
            for name in ("redis", "redis2", "redis3")
            if isinstance(server := servers.get(name), RedisServer)
        ]
        if len(redlock) == 3:
            addresses = ",".join(server.address for server in redlock)
            locks.append((f"redlock://{addresses}/0?prefix=safety-{tag}:", 0.6))
        if isinstance(etcd := servers.get("etcd"), EtcdServer):
            locks.append((f"{etcd.url}?prefix=/safety-{tag}/", 2.0))
        if isinstance(zookeeper := servers.get("zookeeper"), ZooKeeperServer):
            locks.append((f"{zookeeper.url}/safety-{tag}", 1.0))
        locks.append((postgres.url, 1.0))
        for url, ttl in locks:
            base = SafetyConfig(
                url=url,
                resource=postgres.url,
                workers=4,
                duration=max(seconds, ttl * seconds),
                ttl=ttl,
                pause_probability=0.25,
                cancel_on_loss=False,
            )
            fencing_runs = [] if url.startswith("redlock") else [
                base,
                replace(base, resource=redis.url, pause_kind="block"),
                replace(base, cancel_on_loss=True),
            ]  # fmt: skip
            runs = [*fencing_runs, replace(base, fencing=False)]
            if primitives:
                runs = _primitive_runs(base, postgres.url)
            for config in runs:
                started = time.monotonic()
                report = await run_safety(config)
                rows.append(_row(report, _PRIMITIVE_COLUMNS if primitives else _COLUMNS))
                print(rows[-1], f"({time.monotonic() - started:.0f} s)", flush=True)
                if config.fencing and not report.safe:
                    unsafe_with_fencing += 1
    columns = _PRIMITIVE_COLUMNS if primitives else _COLUMNS
    header = "| " + " | ".join(title for _, title in columns) + " |"
    rule = "|" + "---|" * len(columns)
    text = "\n".join(
        [
            f"Profile `{profile}`: 4 worker processes per run (semaphores: 5, sharing 2 "
            "permits), a hold paused with probability 0.25 between its read and its write "
            "(semaphores: its enter and its exit) for 1.5 x ttl and until its hold was taken "
            f"over at the resource; {platform.platform()}, "
            f"Python {platform.python_version()}, measured {time.strftime('%Y-%m-%d')}.",
            "",
            header,
            rule,
            *rows,
            "",
        ]
    )
    if out:
        await anyio.Path(out).write_text(text, encoding="utf-8")
    print(text)
    return 1 if unsafe_with_fencing else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--profile", choices=sorted(_PROFILES), default="short")
    parser.add_argument("--out", help="write the Markdown table here")
    parser.add_argument(
        "--primitives",
        action="store_true",
        help="the semaphore and election runs instead of the lock runs",
    )
    args = parser.parse_args()
    sys.exit(anyio.run(_run, args.profile, args.out, args.primitives))


if __name__ == "__main__":
    main()
