"""Shared test set-up: anyio on asyncio, and the backends the contract suite runs against.

Each backend joins the contract suite with a fixture named ``<name>_backend`` that yields a
``tests.contract.harness.BackendUnderTest``, defined in a module listed in ``pytest_plugins``.
"""

from __future__ import annotations

import os
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
_SCHEMES = {"sentinel": "redis+sentinel", "cluster": "redis+cluster"}


def contract_scheme(name: str) -> str:
    """The URL scheme of the contract backend ``name``, for the registry."""
    return _SCHEMES.get(name, name)


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


# -- hunting unclosed transports (opt-in) ---------------------------------------------------
#
# An asyncio transport that a test never closes is only reported when the garbage collector
# reaches it, often after that test's event loop has closed and in some later test ("unclosed
# transport", "unclosed socket" as unraisable warnings, with nothing naming who made it).
# ASYNCLOCK_TRANSPORT_LEAKS=1 records where each socket transport is made and fails the test
# whose teardown leaves one open on a closed loop, with that stack; the socket is then closed,
# so that no later test gets the warning.

if os.environ.get("ASYNCLOCK_TRANSPORT_LEAKS", "").strip() in {"1", "true", "yes"}:
    import asyncio.selector_events
    import traceback

    _Transport = asyncio.selector_events._SelectorSocketTransport  # type: ignore[attr-defined]
    _made: list[tuple[Any, list[str]]] = []
    _init = _Transport.__init__

    def _recording_init(self: Any, *args: Any, **kwargs: Any) -> None:
        _init(self, *args, **kwargs)
        _made.append((self, traceback.format_stack(limit=30)[:-1]))

    _Transport.__init__ = _recording_init

    @pytest.hookimpl(hookwrapper=True, trylast=True)
    def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
        yield
        left = []
        for transport, stack in _made:
            loop = transport._loop
            if transport._sock is not None and not transport._closing and loop.is_closed():
                left.append(f"{transport._sock!r}, made at:\n{''.join(stack)}")
                transport._sock.close()
                transport._sock = None
        _made.clear()
        if left:
            pytest.fail("unclosed transport(s) on a closed loop:\n" + "\n".join(left))
