"""The job-queue examples (examples/jobs_*.py) run as scripts and do what their docstrings say."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from asynclock.testing import RedisServer

from .test_examples import run_example

pytestmark = pytest.mark.anyio

EXAMPLES = Path(__file__).parents[2] / "examples"
NAMES = ["jobs_arq.py", "jobs_saq.py", "jobs_taskiq.py"]


async def test_every_job_example_runs_and_no_two_jobs_on_one_account_overlap(
    redis_server: RedisServer,
) -> None:
    # Each on the session's Redis (the examples give their keys a prefix of their own), and
    # the first also on the redis-server it starts itself when no URL is given.
    runs = [(name, redis_server.url) for name in NAMES] + [(NAMES[0], None)]
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
