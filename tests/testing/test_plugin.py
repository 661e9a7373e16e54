"""The pytest plugin, run in a separate pytest process the way a user's project would run it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import asynclock.testing

CHECKS = """
import pytest

def test_selected(selected_backends):
    print("SELECTED=" + ",".join(sorted(selected_backends)))

def test_redis(redis_server):
    import socket
    with socket.create_connection((redis_server.host, redis_server.port), timeout=5) as s:
        s.sendall(b"PING\\r\\n")
        assert s.recv(16) == b"+PONG\\r\\n"
    assert redis_server.url == f"redis://127.0.0.1:{redis_server.port}/0"

def test_redis_servers(redis_servers, redis_server):
    assert len(redis_servers) == 3
    assert len({s.port for s in [*redis_servers, redis_server]}) == 4
    assert all(s.is_running for s in redis_servers)

def test_postgres(postgres_server):
    assert postgres_server.is_running

def test_etcd(etcd_server, etcd_cluster):
    assert etcd_server.is_running
    assert len(etcd_cluster.members) == 3
    assert etcd_cluster.leader() in etcd_cluster.members

def test_zookeeper(zookeeper_server, zookeeper_ensemble):
    assert zookeeper_server.mode() == "standalone"
    assert zookeeper_ensemble.leader().mode() == "leader"
"""


def run_pytest(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_checks.py").write_text(textwrap.dedent(CHECKS))
    base = {k: v for k, v in os.environ.items() if k not in {"CI", "PYTEST_ADDOPTS"}}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs", "-s", *args],
        cwd=tmp_path,
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_fixtures_default_selection_and_the_backends_option(tmp_path: Path) -> None:
    done = run_pytest(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "6 passed" in done.stdout
    selected = done.stdout.split("SELECTED=")[1].split()[0].split(",")
    assert {"redis", "redlock", "etcd", "zookeeper", "postgres", "memory"} <= set(selected)
    assert "asynclock backends: all" in done.stdout
    # --backends selects and skips.
    done = run_pytest(
        tmp_path, "--backends", " etcd, PostgreSQL ", "-k", "selected or redis or postgres"
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SELECTED=etcd,postgresql" in done.stdout
    assert "redis is not among --backends=etcd,postgresql" in done.stdout
    assert "2 passed, 2 skipped" in done.stdout
    assert "asynclock backends: etcd,postgresql" in done.stdout


@pytest.mark.parametrize(("ci", "code", "outcome"), [("", 0, "2 skipped"), ("true", 1, "2 error")])
def test_a_missing_server_names_the_apt_package_and_fails_only_on_ci(
    tmp_path: Path, ci: str, code: int, outcome: str
) -> None:
    # Python is found by its absolute path; redis-server is not on this PATH.
    done = run_pytest(tmp_path, "-k", "redis", env={"PATH": str(tmp_path), "CI": ci})
    assert done.returncode == code, done.stdout + done.stderr
    assert "apt-get install redis-server" in done.stdout
    assert outcome in done.stdout
    assert ("CI is set" in done.stdout) == bool(ci)


def test_plugin_import_is_cheap_and_public_names_are_documented() -> None:
    drivers = ("redis", "aetcd", "aiozk", "asyncpg", "grpc")
    code = (
        "import sys, asynclock.testing._plugin\n"
        f"print(sorted(m for m in {drivers!r} if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.strip() == "[]"
    assert isinstance(asynclock.testing.__all__, tuple)
    assert sorted(asynclock.testing.__all__) == list(asynclock.testing.__all__)
    for name in asynclock.testing.__all__:
        value = getattr(asynclock.testing, name)
        if name == "ProxyMode":  # a Literal alias: no module of its own
            continue
        assert value.__module__ == "asynclock.testing", name
        assert value.__doc__, f"{name} has no docstring"


PYTEST_ASYNCIO = """
import pytest, pytest_asyncio, asynclock

# As users write them: each client entered in a fixture's set-up task, left in its tear-down.
@pytest_asyncio.fixture(loop_scope="session", scope="session")
async def session_locks(postgres_server):
    async with asynclock.connect(postgres_server.url) as locks:
        yield locks

@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def module_locks(tmp_path_factory):
    async with asynclock.connect(f"sqlite:///{tmp_path_factory.mktemp('m')}/l.db") as locks:
        yield locks

@pytest_asyncio.fixture
async def function_locks():
    async with asynclock.connect("memory://") as locks:
        yield locks

@pytest.mark.asyncio(loop_scope="session")
async def test_session_loop(session_locks):
    async with session_locks.lock("a", ttl=5) as lease:
        assert lease.token

@pytest.mark.asyncio(loop_scope="module")
async def test_module_loop(module_locks):
    async with module_locks.lock("a", ttl=5) as lease:
        assert lease.token

@pytest.mark.asyncio
async def test_function_loop(function_locks):
    async with function_locks.lock("a", ttl=5) as lease:
        assert lease.token
"""


@pytest.mark.parametrize("mode", ["strict", "auto"])
def test_clients_in_pytest_asyncio_fixtures_of_every_loop_scope(tmp_path: Path, mode: str) -> None:
    """pytest-asyncio sets a fixture up and tears it down in two tasks: a client's ``async
    with`` must allow that (it raised "Attempted to exit cancel scope in a different task")."""
    (tmp_path / "test_users_suite.py").write_text(textwrap.dedent(PYTEST_ASYNCIO))
    done = run_pytest(
        tmp_path,
        "test_users_suite.py",
        "-p", "asyncio",
        "-W", "error",
        "-o", f"asyncio_mode={mode}",
        "-o", "asyncio_default_fixture_loop_scope=function",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 passed" in done.stdout
