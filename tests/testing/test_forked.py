"""The forked worker processes of the fault, safety and primitive tests (``asynclock.testing._forked``):
what ``python -m`` would do, at a fraction of the start-up cost, and nothing left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import anyio
import pytest

from asynclock.testing._forked import PIPE, ForkedPython

pytestmark = pytest.mark.anyio

WORKER = textwrap.dedent(
    """
    import os, sys, time
    mode = sys.argv[1]
    print("argv", sys.argv[1:], "cwd", os.getcwd(), "env", os.environ.get("FORKED_TEST"), flush=True)
    print("to stderr", file=sys.stderr)
    if mode == "exit3":
        sys.exit(3)
    if mode == "raise":
        raise ValueError("boom")
    if mode == "sleep":
        time.sleep(60)
    print("unflushed")
    """
)


@pytest.fixture
def module(tmp_path: Path) -> str:
    # Found by the worker through its cwd (sys.path[0] is the current directory).
    (tmp_path / "forked_test_worker.py").write_text(WORKER)
    return "forked_test_worker"


def run(tmp_path: Path, module: str, mode: str) -> tuple[ForkedPython, str, str]:
    with (tmp_path / "err.log").open("w") as err:
        worker = ForkedPython(
            module, [mode], stdout=PIPE, stderr=err, cwd=tmp_path,
            env={**os.environ, "FORKED_TEST": "yes"},
        )  # fmt: skip
    out, _ = worker.communicate(timeout=30)
    worker.close()
    return worker, out, (tmp_path / "err.log").read_text()


@pytest.mark.parametrize(
    ("mode", "code", "said"),
    [("ok", 0, "unflushed"), ("exit3", 3, ""), ("raise", 1, "ValueError: boom")],
)
def test_a_worker_runs_its_module_as_python_m_would(
    tmp_path: Path, module: str, mode: str, code: int, said: str
) -> None:
    worker, out, err = run(tmp_path, module, mode)
    assert worker.returncode == code, (out, err)
    assert f"argv ['{mode}'] cwd {tmp_path} env yes" in out
    assert "to stderr" in err
    assert said in out + err


async def test_a_stopped_worker_is_killed_by_close_and_its_end_awaited(
    tmp_path: Path, module: str
) -> None:
    worker = ForkedPython(module, ["sleep"], stdout=PIPE, cwd=tmp_path)
    assert worker.stdout is not None
    assert (await anyio.to_thread.run_sync(worker.stdout.readline)).startswith("argv")
    os.kill(worker.pid, signal.SIGSTOP)
    assert worker.poll() is None and worker.wait(0.05) is None
    worker.close()
    worker.close()
    assert worker.returncode == -signal.SIGKILL
    with pytest.raises(ProcessLookupError):
        os.kill(worker.pid, 0)  # reaped: not even a zombie is left

    worker = ForkedPython(module, ["sleep"], cwd=tmp_path)
    worker.kill()
    with anyio.fail_after(5):
        assert await worker.exited() == -signal.SIGKILL
    worker.close()


def test_communicate_gives_up_at_its_timeout_as_popen_does(tmp_path: Path, module: str) -> None:
    worker = ForkedPython(module, ["sleep"], stdout=PIPE, cwd=tmp_path)
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        worker.communicate(timeout=0.3)
    assert 0.3 <= time.monotonic() - started < 5
    worker.close()  # kills it, and the reader of its output ends with it
    assert worker.returncode == -signal.SIGKILL
