"""Small helpers shared by the tests of asynclock.testing."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path


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
