"""Small helpers shared by the tests of asynclock.testing and of the core."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
from aiozk import ZKClient


def process_gone(pid: int) -> bool:
    """True when ``pid`` has exited. A zombie counts as gone: where PID 1 never reaps, a killed
    orphan stays a zombie, though it holds no port, memory or file."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    # The state follows the parenthesised command name, which may itself contain spaces.
    return stat.rpartition(")")[2].split()[0] in {"Z", "X"}


def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


async def cancel_natively(task: asyncio.Future[Any], times: int, pause: float = 0) -> None:
    """``task.cancel()`` ``times`` times, each after ``pause`` s (as a framework's shutdown or a
    timeout may do again and again); the task must end cancelled."""
    for _ in range(times):
        await asyncio.sleep(pause)
        task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@asynccontextmanager
async def zookeeper_client(address: str, timeout: float) -> AsyncIterator[ZKClient]:
    """A started client of ``address``, its start and use within ``timeout``."""
    client = ZKClient(address, session_timeout=5)
    try:
        with anyio.fail_after(timeout):
            await client.start()
        with anyio.fail_after(timeout):
            yield client
    finally:
        with anyio.fail_after(10):
            await client.close()
