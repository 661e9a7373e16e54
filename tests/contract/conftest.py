from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from tests.conftest import CONTRACT_BACKENDS
from tests.contract.harness import BackendUnderTest


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend" in metafunc.fixturenames:
        selected = metafunc.config.getoption("backends", default=None)
        names = CONTRACT_BACKENDS
        if selected:
            wanted = {name.strip() for name in str(selected).split(",")}
            names = [name for name in CONTRACT_BACKENDS if name in wanted]
        # A contract test that cannot apply to some backends says so with not_on(...): those
        # are left out of its parametrisation (not skipped: there is nothing to run there).
        for marker in metafunc.definition.iter_markers("not_on"):
            names = [name for name in names if name not in marker.args]
        metafunc.parametrize("backend_name", names, indirect=False)


@pytest.fixture
async def backend(
    backend_name: str, request: pytest.FixtureRequest
) -> AsyncIterator[BackendUnderTest]:
    under_test: BackendUnderTest = request.getfixturevalue(f"{backend_name}_backend")
    yield under_test
    # Every test closes its clients; whatever remains on the server is a leak.
    assert await under_test.leftovers() == []


@pytest.fixture
def name() -> str:
    return f"contract/{uuid.uuid4().hex[:12]}"
