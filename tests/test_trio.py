"""asynclock on trio: the in-process and embedded backends work; the others are refused by name.

anyio is the concurrency layer, so the core runs on trio; the network backends' drivers
(redis-py, asyncpg, grpc.aio, aiozk) are asyncio-only.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

import asynclock
from tests.integrations._memory import memory


@pytest.mark.parametrize("scheme", ["memory", "sqlite"])
def test_the_in_process_backends_run_on_trio(tmp_path: Path, scheme: str) -> None:
    url = "memory://trio-test" if scheme == "memory" else f"sqlite://{tmp_path / 'locks.db'}"

    async def main() -> None:
        async with asynclock.connect(url) as locks, asynclock.connect(url) as other:
            # A clean exit is not a lost lease (trio's scope returns True from __exit__).
            async with locks.lock("a", ttl=1.0) as lease:
                first = lease.token
                assert asynclock.current_token() == first
                assert await other.try_acquire("a", ttl=1.0) is None
            async with locks.lock("a", ttl=1.0) as lease:
                assert lease.token > first
                await anyio.sleep(1.5)  # renewed past its ttl
                assert not lease.lost
            with pytest.raises(asynclock.AcquireTimeout):
                async with other.lock("b", ttl=1.0):
                    async with locks.lock("b", ttl=1.0, timeout=0.05):
                        pass
            async with locks.lock_all(["x", "y"], ttl=1.0) as leases:
                assert len(leases) == 2
            # A caller's cancellation passes through, and the lock is released on the way.
            with anyio.move_on_after(0.1) as scope:
                async with locks.lock("c", ttl=1.0):
                    await anyio.sleep(5)
            assert scope.cancelled_caught
            again = await other.try_acquire("c", ttl=1.0)
            assert again is not None
            await again.release()

    anyio.run(main, backend="trio")


@pytest.mark.parametrize(
    ("url", "driver"),
    [
        ("redis://127.0.0.1:1/0", "redis-py"),
        ("redlock://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3/0", "redis-py"),
        ("etcd://127.0.0.1:1", "grpc"),
        ("zookeeper://127.0.0.1:1", "aiozk"),
        ("postgresql://postgres@127.0.0.1:1/postgres", "asyncpg"),
    ],
)
def test_asyncio_only_backends_are_refused_under_trio_by_name(url: str, driver: str) -> None:
    made_before = asynclock.connect(url)  # made outside any event loop: refused when entered

    async def main() -> None:
        with pytest.raises(asynclock.UnsupportedFeature, match=f"needs asyncio.*{driver}"):
            asynclock.connect(url)
        with pytest.raises(asynclock.UnsupportedFeature, match="needs asyncio"):
            async with made_before:
                pass

    anyio.run(main, backend="trio")


@pytest.mark.expect_log("lease on 'b' lost: the lock was removed on the server")
def test_on_trio_a_client_started_and_closed_by_other_tasks_cancels_a_lost_body() -> None:
    async def main() -> None:
        locks = asynclock.connect("memory://trio-start")
        async with anyio.create_task_group() as startup:
            startup.start_soon(locks.start)
        async with locks.lock("a", ttl=0.5) as lease:
            await anyio.sleep(0.7)  # renewed by the client's own (system) task
            assert not lease.lost
        with pytest.raises(asynclock.LeaseLost):
            async with locks.lock("b", ttl=1.0):
                memory(locks).expire("b", notify=True)
                await anyio.sleep(5)
                pytest.fail("the body ran on after its lease was lost")
        async with anyio.create_task_group() as shutdown:
            shutdown.start_soon(locks.aclose)
        assert locks._host.state == "closed"

    anyio.run(main, backend="trio")
