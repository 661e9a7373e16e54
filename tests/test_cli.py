"""`asynclock run` and `asynclock demo`, as real processes on the embedded backend."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path

import pytest

from asynclock._cli import EXIT_LEASE_LOST, EXIT_TIMEOUT, EXIT_USAGE

ASYNCLOCK = [sys.executable, "-m", "asynclock"]


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*ASYNCLOCK, *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def test_run_exports_the_token_and_returns_the_commands_exit_code(tmp_path: Path) -> None:
    url = f"sqlite://{tmp_path}/locks.db"
    script = 'echo "$ASYNCLOCK_NAME $ASYNCLOCK_TOKEN"; exit 7'
    first = run("run", "job", "--url", url, "--", "sh", "-c", script)
    second = run("run", "job", "--url", url, "--ttl", "5", "--", "sh", "-c", script)
    assert (first.returncode, second.returncode) == (7, 7)
    assert first.stdout.split() == ["job", "1"]
    assert second.stdout.split() == ["job", "2"]


def test_run_reports_a_command_killed_by_a_signal_as_128_plus_n(tmp_path: Path) -> None:
    result = run("run", "job", "--url", f"sqlite://{tmp_path}/l.db", "--", "sh", "-c", "kill -9 $$")
    assert result.returncode == 128 + 9


def test_run_times_out_with_its_own_exit_code(tmp_path: Path) -> None:
    url = f"sqlite://{tmp_path}/locks.db"
    with subprocess.Popen([*ASYNCLOCK, "run", "job", "--url", url, "--", "sleep", "5"]) as holder:
        try:
            time.sleep(1.0)
            started = time.monotonic()
            result = run("run", "job", "--url", url, "--timeout", "0.5", "--", "true")
            assert result.returncode == EXIT_TIMEOUT
            assert "not acquired within 0.5 s" in result.stderr
            assert time.monotonic() - started < 5
        finally:
            holder.kill()


def test_run_kills_the_whole_process_group_when_the_lease_is_revoked(tmp_path: Path) -> None:
    db = tmp_path / "locks.db"
    pidfile = tmp_path / "grandchild.pid"
    # The command starts a grandchild and waits: both must die when the lease is lost.
    script = f"sleep 60 & echo $! > {pidfile}; wait"
    with subprocess.Popen(
        [
            *ASYNCLOCK,
            "run",
            "job",
            "--url",
            f"sqlite://{db}",
            "--ttl",
            "1.5",
            "--grace",
            "1",
            "--",
            "sh",
            "-c",
            script,
        ],
        stderr=subprocess.PIPE,
        text=True,
    ) as process:
        deadline = time.monotonic() + 20
        while not pidfile.exists() or not pidfile.read_text().strip():
            assert time.monotonic() < deadline, "the command never started"
            time.sleep(0.05)
        grandchild = int(pidfile.read_text())
        with closing(sqlite3.connect(db)) as connection, connection:
            connection.execute("DELETE FROM asynclock_locks WHERE name = 'job'")
        revoked_at = time.monotonic()
        _, stderr = process.communicate(timeout=30)
    assert process.returncode == EXIT_LEASE_LOST
    assert "lease on lock 'job' was lost" in stderr
    # Found on the next renewal (ttl / 3), then SIGTERM to the group.
    assert time.monotonic() - revoked_at < 1.5 + 1
    with pytest.raises(ProcessLookupError):
        for _ in range(50):
            os.kill(grandchild, 0)
            time.sleep(0.05)


def test_run_refuses_bad_arguments_with_a_usage_code(tmp_path: Path) -> None:
    result = run("run", "job", "--url", f"sqlite://{tmp_path}/l.db", "--ttl", "0", "--", "true")
    assert result.returncode == EXIT_USAGE
    assert "ttl must be > 0" in result.stderr
    result = run("run", "job", "--url", "nosuch://x", "--", "true")
    assert result.returncode == EXIT_USAGE
    assert "unknown lock backend 'nosuch'" in result.stderr
    result = run("run", "job")
    assert result.returncode == 2
    assert "run needs a command" in result.stderr


def test_demo_shows_exclusive_holds_with_increasing_tokens() -> None:
    result = run("demo", "--workers", "3", "--rounds", "3", "--hold", "0.02")
    assert result.returncode == 0, result.stderr
    assert "9 holds, 0 overlapping, tokens strictly increasing: yes" in result.stdout


def test_status_shows_the_holder_and_its_token(tmp_path: Path) -> None:
    url = f"sqlite://{tmp_path}/locks.db"
    ready = tmp_path / "ready"
    with subprocess.Popen(
        [*ASYNCLOCK, "run", "job", "--url", url, "--", "sh", "-c", f"touch {ready}; sleep 30"]
    ) as holder:
        try:
            deadline = time.monotonic() + 20
            while not ready.exists():
                assert time.monotonic() < deadline, "the command never started"
                time.sleep(0.05)
            result = run("status", "job", "other", "--url", url)
        finally:
            holder.kill()
    assert result.returncode == 0, result.stderr
    job, other = result.stdout.splitlines()
    assert job.startswith("job: held by ")
    assert "token 1" in job
    assert other == "other: free"
