"""Shared test set-up: anyio on asyncio, and the backends the contract suite runs against.

Each backend joins the contract suite with a fixture named ``<name>_backend`` that yields a
``tests.contract.harness.BackendUnderTest``, defined in a module listed in ``pytest_plugins``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

_HERE = Path(__file__).parent
_FIRST = ("memory", "sqlite")

#: The contract suite runs against each backend that has a tests/contract/backend_<name>.py
#: (``--backends`` selects a subset): adding that file is all it takes to join.
CONTRACT_BACKENDS = sorted(
    (path.stem.removeprefix("backend_") for path in (_HERE / "contract").glob("backend_*.py")),
    key=lambda name: (name not in _FIRST, _FIRST.index(name) if name in _FIRST else 0, name),
)
pytest_plugins = [f"tests.contract.backend_{name}" for name in CONTRACT_BACKENDS]
#: The URL scheme of the contract backends whose name is not one (a module name cannot hold "+").
_SCHEMES = {"sentinel": "redis+sentinel", "cluster": "redis+cluster"}


def contract_scheme(name: str) -> str:
    """The URL scheme of the contract backend ``name``, for the registry."""
    return _SCHEMES.get(name, name)


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"
