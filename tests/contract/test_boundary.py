"""Bad input and unreachable servers: refused or reported the same way on every backend.

Server addresses in every backend's URL are read by the backend kit, so the same mistake gets
the same words everywhere; an unreachable server is a BackendUnavailable within a few seconds,
never a hang or a driver's own exception.
"""

from __future__ import annotations

import asyncio
import time

import pytest

import asynclock
from asynclock.testing import free_port
from tests.contract.harness import BackendUnderTest

pytestmark = pytest.mark.anyio

SERVERLESS = ("memory", "sqlite")

#: (host list as written in the URL, what the message says)
MALFORMED_HOSTS = [
    ("127.0.0.1:0", r"port '0' is not a number from 1 to 65535"),
    ("127.0.0.1:99999", r"port '99999' is not a number from 1 to 65535"),
    ("127.0.0.1:abc", r"port 'abc' is not a number from 1 to 65535"),
    ("::1:2181", r"IPv6 addresses go in brackets"),
    ("[::1", r"unbalanced '\['"),
    ("[::1]x", r"unexpected 'x' after \[::1\]"),
    ("[db]:1", r"\[db\] is not an IPv6 address"),
]


@pytest.mark.not_on(*SERVERLESS, reason="no server address in the URL")
@pytest.mark.parametrize(("hosts", "message"), MALFORMED_HOSTS)
async def test_malformed_server_addresses_are_refused_in_the_same_words(
    backend: BackendUnderTest, hosts: str, message: str
) -> None:
    assert backend.url_for_hosts is not None
    url = backend.url_for_hosts(hosts)
    with pytest.raises(asynclock.InvalidURL, match=message) as info:
        asynclock.connect(url, **backend.options)
    assert "for example" in str(info.value), "the message shows a well-formed URL"


@pytest.mark.not_on(*SERVERLESS, reason="no server address in the URL")
async def test_an_empty_entry_in_a_server_list_is_refused(backend: BackendUnderTest) -> None:
    assert backend.url_for_hosts is not None
    if not backend.many_hosts:
        # One server only: a list is refused as such (the message names the alternative).
        with pytest.raises(asynclock.InvalidURL):
            asynclock.connect(backend.url_for_hosts("127.0.0.1:1,127.0.0.1:2"), **backend.options)
        return
    with pytest.raises(asynclock.InvalidURL, match="empty host"):
        asynclock.connect(backend.url_for_hosts("127.0.0.1:1,,127.0.0.1:2"), **backend.options)


async def test_unknown_options_are_refused_by_name(backend: BackendUnderTest) -> None:
    with pytest.raises(asynclock.InvalidArgument, match="no_such_option"):
        backend.connect(no_such_option="1")


@pytest.mark.not_on(*SERVERLESS, reason="no server to be unreachable")
async def test_an_unreachable_server_is_backend_unavailable_within_seconds(
    backend: BackendUnderTest,
) -> None:
    assert backend.url_for_hosts is not None
    dead = ",".join(f"127.0.0.1:{free_port()}" for _ in range(3 if backend.many_hosts else 1))
    url = backend.url_for_hosts(dead)
    started = time.monotonic()
    with pytest.raises(asynclock.BackendUnavailable) as info:
        async with asynclock.connect(url, **backend.options, connect_timeout=5):
            pass
    assert time.monotonic() - started < 6
    assert "127.0.0.1" in str(info.value), "the message names the server"


@pytest.mark.not_on(*SERVERLESS, reason="no server to be unreachable")
async def test_start_on_an_unreachable_server_raises_and_leaves_no_task(
    backend: BackendUnderTest,
) -> None:
    assert backend.url_for_hosts is not None
    url = backend.url_for_hosts(f"127.0.0.1:{free_port()}")
    before = {task.get_name() for task in asyncio.all_tasks()}
    locks = asynclock.connect(url, **backend.options, connect_timeout=2)
    with pytest.raises(asynclock.BackendUnavailable):
        await locks.start()
    await locks.aclose()  # harmless after a failed start
    assert {task.get_name() for task in asyncio.all_tasks()} == before
