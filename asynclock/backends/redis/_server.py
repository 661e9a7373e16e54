"""What the ``redis://`` backend learns about its server: version, durability, run id (restarts
are noticed by the watch connection, :mod:`._wakes`)."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from typing import Final

import redis.asyncio
import redis.exceptions

from .._kit import RedisDurabilityWarning, UnsupportedFeature
from ._scripts import as_text
from ._wire import Lane

logger = logging.getLogger("asynclock")

#: Oldest server with what the backends need (TIME in scripts, a user name in AUTH).
MIN_VERSION: Final = (6, 0)


def run_id_of(info: str) -> str | None:
    for line in info.splitlines():
        if line.startswith("run_id:"):
            return line.partition(":")[2].strip()
    return None


async def check_server(
    lane: Lane, describe: str, *, durability_warning: bool
) -> tuple[str | None, dict[str, str]]:
    """Check the version, and warn when the server can lose counters or held locks.

    Returns the server's run id (None if INFO may not be read) and what ``extra_info`` shows.
    """
    server_info: dict[str, str] = {}
    try:
        info = as_text(await lane.call("INFO", "server"))
    except redis.exceptions.ResponseError:
        info = ""  # INFO disabled by ACL or rename-command: nothing to check
    for line in info.splitlines():
        key, _, value = line.partition(":")
        if key == "redis_version":
            server_info["redis_version"] = value.strip()
            numbers = tuple(int(part) for part in value.split(".")[:2] if part.isdigit())
            if numbers < MIN_VERSION:
                raise UnsupportedFeature(
                    f"{describe} runs Redis {value.strip()}; asynclock needs Redis "
                    f"{'.'.join(map(str, MIN_VERSION))} or newer"
                )
    settings: dict[str, str] = {}
    try:
        for key in ("appendonly", "appendfsync", "maxmemory", "maxmemory-policy"):
            reply = await lane.call("CONFIG", "GET", key)
            # A map (RESP3, or redis-py's parser) or a flat list of names and values.
            items = (
                list(reply.items())
                if isinstance(reply, dict)
                else list(zip(reply[::2], reply[1::2], strict=True))
            )
            settings.update(
                (as_text(name).lower(), as_text(value).lower()) for name, value in items
            )
    except redis.exceptions.ResponseError as exc:
        # CONFIG is often disabled on managed services: not knowing is not an error.
        logger.info(
            "asynclock: cannot read the persistence settings of %s (%s); the durability "
            "check is skipped",
            describe,
            exc,
        )
        return run_id_of(info), server_info
    server_info.update(settings)
    problems = durability_problems(settings) if durability_warning else []
    if problems:
        warnings.warn(
            RedisDurabilityWarning(
                f"{describe} can lose what the locks rely on: "
                + "; ".join(problems)
                + ". Pass durability_warning=false if that is acceptable (for example "
                "for efficiency locks)"
            ),
            stacklevel=3,
        )
    return run_id_of(info), server_info


def durability_problems(settings: Mapping[str, str]) -> list[str]:
    """What in ``CONFIG GET appendonly appendfsync maxmemory maxmemory-policy`` (lowercased)
    can lose fencing counters or held locks; empty when nothing can."""
    problems = []
    if settings.get("appendonly") == "no":
        problems.append(
            "appendonly is 'no', so a restart loses every held lock (another client can take a "
            "lock while its holder, told at once, is still stopping); set 'appendonly yes'"
        )
    elif settings.get("appendfsync") == "no":
        problems.append(
            "appendfsync is 'no', so a crash of the machine can lose the last ~30 s of writes, "
            "locks taken then among them; set 'appendfsync everysec' or 'always'"
        )
    policy = settings.get("maxmemory-policy", "noeviction")
    if settings.get("maxmemory", "0") not in ("0", "") and policy != "noeviction":
        what = "held locks and fencing counters" if policy.startswith("allkeys") else "held locks"
        problems.append(
            f"maxmemory-policy is {policy!r}, so under memory pressure Redis may evict {what}; "
            "set 'maxmemory-policy noeviction'"
        )
    return problems
