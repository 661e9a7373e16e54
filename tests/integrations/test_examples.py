"""Each example under examples/ runs as a script and does what its docstring says."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import anyio
import pytest

from asynclock.testing import RedisServer

pytestmark = pytest.mark.anyio

EXAMPLES = Path(__file__).parents[2] / "examples"

#: What each example must print, besides "as expected".
EXPECTED = {
    "fastapi_app.py": [
        "5 withdrawals at once: ",
        "423 lock_busy (Retry-After 1)",
        "409 fencing token",
    ],
    "aiohttp_app.py": [
        "5 withdrawals at once: ",
        "423 lock_busy (Retry-After 1)",
        "409 fencing token",
    ],
    "worker_pool.py": ["overlapping jobs on one account: 0"],
}


async def run_example(
    name: str, url: str | None, variable: str = "ASYNCLOCK_URL"
) -> tuple[int, str]:
    """Run ``examples/name`` with ``url`` in the environment ``variable`` (unset when None)."""
    env = {key: value for key, value in os.environ.items() if key != variable}
    if url is not None:
        env[variable] = url
    with anyio.fail_after(60):
        done = await anyio.run_process(
            [sys.executable, "-W", "error", str(EXAMPLES / name)],
            env=env,
            check=False,
            stderr=subprocess.STDOUT,
        )
    return done.returncode, done.stdout.decode()


async def test_every_example_runs_on_the_embedded_backend_and_on_a_real_server(
    redis_server: RedisServer,
) -> None:
    def real() -> str:  # a key prefix of its own per run: the examples use the same lock names
        return f"{redis_server.url}?prefix=ex-{uuid.uuid4().hex[:6]}:&durability_warning=false"

    runs = [(name, None) for name in EXPECTED] + [(name, real()) for name in EXPECTED]
    results: dict[tuple[str, str | None], tuple[int, str]] = {}

    async def run(name: str, lock_url: str | None) -> None:
        results[name, lock_url] = await run_example(name, lock_url)

    async with anyio.create_task_group() as task_group:
        for name, lock_url in runs:
            task_group.start_soon(run, name, lock_url)

    for (name, lock_url), (returncode, output) in results.items():
        assert returncode == 0, f"{name} failed:\n{output}"
        assert "as expected" in output, output
        for line in EXPECTED[name]:
            assert line in output, f"{name} did not print {line!r}:\n{output}"
        where = lock_url.split("?")[0] if lock_url else "sqlite:///"
        assert f"locks on {where}" in output, output


JOB_EXAMPLES = ["jobs_arq.py", "jobs_saq.py", "jobs_taskiq.py"]


async def test_every_job_example_runs_and_no_two_jobs_on_one_account_overlap(
    redis_server: RedisServer,
) -> None:
    # Each on the session's Redis (the examples give their keys a prefix of their own), and
    # the first also on the redis-server it starts itself when no URL is given.
    runs = [(name, redis_server.url) for name in JOB_EXAMPLES] + [(JOB_EXAMPLES[0], None)]
    results: dict[tuple[str, str | None], tuple[int, str]] = {}

    async def run(name: str, redis_url: str | None) -> None:
        results[name, redis_url] = await run_example(name, redis_url, "ASYNCLOCK_REDIS_URL")

    async with anyio.create_task_group() as task_group:
        for name, redis_url in runs:
            task_group.start_soon(run, name, redis_url)

    for (name, redis_url), (returncode, output) in results.items():
        assert returncode == 0, f"{name} failed:\n{output}"
        assert "overlapping jobs on one account: 0; failed jobs: 0" in output, output
        assert output.count(" settled with token ") == 12, output
        assert "as expected" in output, output
        if redis_url is not None:
            assert f"locks on {redis_url}" in output, output


_WITHOUT_FRAMEWORKS = """
import sys
import asynclock.fencing
for name in ("aiohttp", "httpx", "fastapi", "starlette"):
    assert name not in sys.modules, name
sys.modules["aiohttp"] = None  # as if not installed
sys.modules["fastapi"] = None
import asynclock
for make in (
    lambda: asynclock.fencing.aiohttp_fencing_middleware(guard=None),
    lambda: __import__("asynclock.integrations.aiohttp"),
    lambda: __import__("asynclock.integrations.fastapi"),
):
    try:
        make()
    except asynclock.MissingDependency as exc:
        print(exc)
    else:
        raise AssertionError("no MissingDependency")
"""


async def test_fencing_imports_no_framework_and_missing_ones_name_the_extra() -> None:
    done = await anyio.run_process(
        [sys.executable, "-W", "error", "-c", _WITHOUT_FRAMEWORKS], check=False
    )
    output = done.stdout.decode() + done.stderr.decode()
    assert done.returncode == 0, output
    assert output.count("pip install 'asynclock[aiohttp]'") == 2
    assert output.count("pip install 'asynclock[fastapi]'") == 1
