from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from asynclock._registry import backend_class
from asynclock.abc import Capabilities
from asynclock.backends.postgres._transactions import TRANSACTION_CAPABILITIES
from tests.conftest import CONTRACT_BACKENDS, contract_scheme
from tests.contract.harness import BackendUnderTest
from tests.contract.kinds import KINDS


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
        # A test of a primitive runs on the backends that have it (test_primitives.py checks
        # that each backend has what its documentation promises).
        for marker in metafunc.definition.iter_markers("needs"):
            names = [
                name
                for name in names
                if all(getattr(_capabilities(name), capability) for capability in marker.args)
            ]
        if "kind" not in metafunc.fixturenames:
            metafunc.parametrize("backend_name", names, indirect=False)
            return
        # A test of every kind of hold runs on each backend for each kind it has
        # (tests/contract/kinds.py).
        pairs = [
            pytest.param(name, kind, id=f"{name}-{kind}")
            for name in names
            for kind, capability in KINDS.items()
            if capability is None or getattr(_capabilities(name), capability)
        ]
        metafunc.parametrize(("backend_name", "kind"), pairs)


def _capabilities(name: str) -> Capabilities:
    if name == "pgbouncer_transaction":  # set by the URL's ?pooler=transaction
        return TRANSACTION_CAPABILITIES
    return backend_class(contract_scheme(name)).capabilities


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
