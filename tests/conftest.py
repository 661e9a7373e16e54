"""Shared test set-up: anyio on asyncio, and the backends the contract suite runs against.

Each backend joins the contract suite with a fixture named ``<name>_backend`` that yields a
``tests.contract.harness.BackendUnderTest``, defined in a module listed in ``pytest_plugins``.
"""

from __future__ import annotations

import asyncio.selector_events
import gc
import sys
import traceback
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

_HERE = Path(__file__).parent
_FIRST = ("memory", "sqlite")

#: The contract suite runs against each backend that has a tests/contract/backend_<name>.py
#: (``--backends`` selects a subset): adding that file is all it takes to join.
CONTRACT_BACKENDS = sorted(
    (path.stem.removeprefix("backend_") for path in (_HERE / "contract").glob("backend_*.py")),
    key=lambda name: (name not in _FIRST, _FIRST.index(name) if name in _FIRST else 0, name),
)
pytest_plugins = ["tests.loud", *(f"tests.contract.backend_{name}" for name in CONTRACT_BACKENDS)]
#: The URL scheme of the contract backends whose name is not one (a module name cannot hold "+").
_SCHEMES = {
    "sentinel": "redis+sentinel",
    "cluster": "redis+cluster",
    "pgbouncer": "postgresql",
    "pgbouncer_transaction": "postgresql",
    "valkey": "redis",
}


def contract_scheme(name: str) -> str:
    """The URL scheme of the contract backend ``name``, for the registry."""
    return _SCHEMES.get(name, name)


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def name(request: pytest.FixtureRequest) -> str:
    """A lock name of the test's own, prefixed by its module's name (``test_redis/1f0c...``)."""
    return f"{request.path.stem}/{uuid.uuid4().hex[:12]}"


# -- running in parallel ----------------------------------------------------------------------
#
# scripts/test runs pytest-xdist with --dist loadgroup: the tests of one server backend (its
# contract cases and its own module) run on one worker, so each worker starts only the servers
# of the backends it was given and no two workers fault-inject one server; the rest (memory,
# SQLite, the core, the integrations) go to whichever worker is free.

#: Backends whose server the suite starts (the others need none and run anywhere).
_SERVER_BACKENDS = frozenset(CONTRACT_BACKENDS) - {"memory", "sqlite"}
#: Store test modules whose name does not start with their backend's name.
_MODULE_BACKENDS = {"redis_sentinel": "sentinel", "redis_cluster": "cluster"}


def _backend_of(item: pytest.Item) -> str | None:
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "backend_name" in callspec.params:
        return str(callspec.params["backend_name"])
    if item.path.parent.name == "backends" and item.path.stem.startswith("test_"):
        stem = item.path.stem.removeprefix("test_")
        for prefix, backend in _MODULE_BACKENDS.items():
            if stem.startswith(prefix):
                return backend
        return stem.split("_")[0]
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        backend = _backend_of(item)
        if backend in _SERVER_BACKENDS:
            item.add_marker(pytest.mark.xdist_group(backend))


def pytest_collection_finish(session: pytest.Session) -> None:
    # What is imported and collected by now lives to the end of the run: out of the garbage
    # collector's way. A full collection walked all of it (~165,000 objects) and paused a worker
    # for 0.3-0.5 s mid-test on a loaded run (measured with a gc callback), past the margins of
    # the tests that time a deadline (a body cancelled 0.26 s after its local deadline).
    gc.collect()
    gc.freeze()


# -- hunting unclosed transports (opt-in) ---------------------------------------------------
#
# An asyncio transport that a test never closes is only reported when the garbage collector
# reaches it, often after that test's event loop has closed and in some later test ("unclosed
# transport", "unclosed socket" as unraisable warnings, with nothing naming who made it).
# Every socket transport records where it was made (frames only: source lines are read if it
# leaks), and a test whose teardown leaves one open on a closed loop fails with that stack; the
# socket is then closed. Otherwise the leak surfaces as a ResourceWarning in whichever later test
# runs the garbage collector (test_scale's gc.collect() got a Redis connection of an earlier test).
_Transport = asyncio.selector_events._SelectorSocketTransport  # type: ignore[attr-defined]
_made: list[tuple[Any, traceback.StackSummary]] = []
_init = _Transport.__init__


def _recording_init(self: Any, *args: Any, **kwargs: Any) -> None:
    _init(self, *args, **kwargs)
    frames = traceback.walk_stack(sys._getframe(1))
    _made.append((self, traceback.StackSummary.extract(frames, limit=30, lookup_lines=False)))


_Transport.__init__ = _recording_init


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    yield
    left = []
    for transport, stack in _made:
        loop = transport._loop
        if transport._sock is not None and not transport._closing and loop.is_closed():
            made_at = "".join(reversed(stack.format()))
            left.append(f"{transport._sock!r}, made at:\n{made_at}")
            transport._sock.close()
            transport._sock = None
    _made.clear()
    if left:
        pytest.fail("unclosed transport(s) on a closed loop:\n" + "\n".join(left))
