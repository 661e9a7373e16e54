"""Shared test set-up: anyio on asyncio, and the backends the contract suite runs against.

Each backend joins the contract suite with a fixture named ``<name>_backend`` that yields a
``tests.contract.harness.BackendUnderTest``, defined in a module listed in ``pytest_plugins``.
"""

from __future__ import annotations

import pytest

pytest_plugins = [
    "tests.contract.backend_memory",
    "tests.contract.backend_sqlite",
]

#: The contract suite runs against each of these (``--backends`` selects a subset).
CONTRACT_BACKENDS = [
    "memory",
    "sqlite",
]


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"
