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
    **dict.fromkeys(
        ("fastapi_app.py", "aiohttp_app.py"),
        ("5 withdrawals at once: ", "423 lock_busy (Retry-After 1)", "409 fencing token"),
    ),
    "worker_pool.py": ("overlapping jobs on one account: 0",),
    **dict.fromkeys(
        ("jobs_arq.py", "jobs_saq.py", "jobs_taskiq.py"),
        ("overlapping jobs on one account: 0; failed jobs: 0",),
    ),
}


async def run_example(name: str, url: str | None) -> str:
    """Run ``examples/name`` with ``url`` in its environment variable (none: its own server);
    check that it succeeded, and return what it printed."""
    variable = "ASYNCLOCK_REDIS_URL" if name.startswith("jobs_") else "ASYNCLOCK_URL"
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
    output = done.stdout.decode()
    assert done.returncode == 0, f"{name} failed:\n{output}"
    return output


async def test_every_example_runs_on_its_own_server_and_on_a_real_one(
    redis_server: RedisServer,
) -> None:
    """The web examples lock on the embedded backend by default, the job examples start a
    redis-server; each also runs on the session's Redis (a key prefix of its own per run:
    the examples use the same lock names)."""

    def real(name: str) -> str:
        if name.startswith("jobs_"):
            return redis_server.url  # the job examples give their keys a prefix themselves
        return f"{redis_server.url}?prefix=ex-{uuid.uuid4().hex[:6]}:&durability_warning=false"

    # Starting a redis-server of its own is the same code in every job example: once is enough.
    runs: list[tuple[str, str | None]] = [(name, real(name)) for name in EXPECTED]
    runs += [(name, None) for name in EXPECTED if not name.startswith("jobs_")]
    runs.append(("jobs_arq.py", None))
    results: dict[tuple[str, str | None], str] = {}

    async def run(name: str, url: str | None) -> None:
        results[name, url] = await run_example(name, url)

    async with anyio.create_task_group() as task_group:
        for name, url in runs:
            task_group.start_soon(run, name, url)

    for (name, url), output in results.items():
        assert "as expected" in output, output
        for line in EXPECTED[name]:
            assert line in output, f"{name} did not print {line!r}:\n{output}"
        if name.startswith("jobs_"):
            assert output.count(" settled with token ") == 12, output
        if url is not None:
            assert f"locks on {url.split('?')[0]}" in output, output
        elif not name.startswith("jobs_"):
            assert "locks on sqlite:///" in output, output


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


def test_the_readmes_smallest_program_runs_as_written() -> None:
    """What a new user copies first (#28 item 11); and the docs link to nothing made up."""
    root = EXAMPLES.parent
    section = (root / "README.md").read_text().split("## Use it in your project")[1]
    program = section.split("```python\n")[1].split("```")[0]
    # As written, it makes its SQLite file in /tmp: removed after, unless it was there before.
    made = [Path(f"/tmp/asynclock-example.db{suffix}") for suffix in ("", "-wal", "-shm")]
    assert f'"sqlite://{made[0]}"' in program
    before = [path.exists() for path in made]
    try:
        done = subprocess.run(
            [sys.executable, "-c", program], capture_output=True, text=True, timeout=60, check=False
        )
    finally:
        for path, existed in zip(made, before, strict=True):
            if not existed:
                path.unlink(missing_ok=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("holding nightly-report with fencing token ")
    assert "example.invalid" not in (root / "mkdocs.yml").read_text()
