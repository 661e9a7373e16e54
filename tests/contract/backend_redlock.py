from __future__ import annotations

from collections.abc import Sequence

import pytest

from asynclock.testing import RedisServer
from tests.contract.backend_redis import leftovers_on, redis_family
from tests.contract.harness import BackendUnderTest

redlock_leftovers = leftovers_on


def redlock_url(masters: Sequence[str | RedisServer]) -> str:
    addresses = [each if isinstance(each, str) else each.address for each in masters]
    return "redlock://" + ",".join(addresses) + "/0"


@pytest.fixture
def redlock_backend(redis_servers: list[RedisServer]) -> BackendUnderTest:
    return redis_family(
        "redlock",
        redlock_url(redis_servers),
        # A majority of masters forget the lock: no majority can hold it for us any more.
        lambda key: redis_servers[:2],
        lambda: redis_servers,
        servers=list(redis_servers),
        url_via=redlock_url,
        # Three masters are the minimum: the entry under test plus two more.
        url_for_hosts=lambda hosts: f"redlock://{hosts},127.0.0.1:1,127.0.0.1:2/0",
        many_hosts=True,
        persistent=False,
        long_waits={},
    )
