"""PostgreSQL through PgBouncer in transaction pooling (``?pooler=transaction``: every hold in a
transaction of its own) in the contract suite, exclusive locks only."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from asynclock.testing import PgBouncerServer, PostgresServer
from tests.contract.backend_pgbouncer import through_pgbouncer
from tests.contract.harness import BackendUnderTest


@pytest.fixture(scope="session")
def pgbouncer_transaction_server(postgres_server: PostgresServer) -> Iterator[PgBouncerServer]:
    with PgBouncerServer(postgres_server, pool_mode="transaction", pool_size=100) as server:
        yield server


@pytest.fixture
def pgbouncer_transaction_backend(
    postgres_server: PostgresServer, pgbouncer_transaction_server: PgBouncerServer
) -> BackendUnderTest:
    return through_pgbouncer(
        "pgbouncer_transaction", "transaction", postgres_server, pgbouncer_transaction_server
    )
