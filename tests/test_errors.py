"""Every public exception pickles: job queues store them, multiprocessing sends them back.

The classes are found from the public modules' ``__all__`` (and every subclass of those defined
in asynclock, the backends' included), so a new exception cannot be left out; an instance of
each is built from sample values chosen by the name of each ``__init__`` parameter.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import inspect
import pickle
import pkgutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import asynclock
import asynclock.backends
import asynclock.fencing
import asynclock.testing
from asynclock import LockError, Waiter

PUBLIC_MODULES: tuple[ModuleType, ...] = (asynclock, asynclock.fencing, asynclock.testing)

CYCLE = (
    Waiter(actor="a/host/1/t#1", holds=("x",), waits="y", since=1700000000.5),
    Waiter(actor="b/host/2/t#2", holds=("y", "z"), waits="x", since=1700000001.25),
)

#: A value for each ``__init__`` parameter name that any public exception takes. A new exception
#: with a parameter not listed here fails its pickling test, which names what to add.
SAMPLES: dict[str, Any] = {
    "message": "something went wrong on redis://127.0.0.1:6379",
    "name": "orders/42",
    "reason": "the server said the lease is gone",
    "timeout": 2.5,
    "resource": "accounts-db",
    "token": 17,
    "highest": 23,
    "cycle": CYCLE,
    "binary": "etcd",
    "apt_package": "etcd-server",
}


# The backends' own subclasses (private ones, which reach users as what they subclass) are
# found only once their modules are imported: import them all, whatever ran before.
for _module in pkgutil.iter_modules(asynclock.backends.__path__, "asynclock.backends."):
    with contextlib.suppress(ImportError):
        importlib.import_module(_module.name)


def _subclasses(cls: type[BaseException]) -> set[type[BaseException]]:
    found = {cls}
    for sub in cls.__subclasses__():
        found |= _subclasses(sub)
    return found


def public_exceptions() -> list[type[BaseException]]:
    classes: set[type[BaseException]] = set()
    for module in PUBLIC_MODULES:
        for name in module.__all__:
            value = getattr(module, name)
            if isinstance(value, type) and issubclass(value, BaseException):
                classes |= _subclasses(value)
    # Those of asynclock's own modules (the backends' private ones too, which reach users as
    # LockErrors); not the subclasses other test modules may have defined.
    classes = {cls for cls in classes if cls.__module__.split(".")[0] == "asynclock"}
    return sorted(classes, key=lambda cls: cls.__qualname__)


EXCEPTIONS = public_exceptions()


def _parameters(cls: type[BaseException]) -> list[inspect.Parameter]:
    defined_by = next(base for base in cls.__mro__ if "__init__" in vars(base))
    if defined_by.__module__ == "builtins":  # Exception's own: the message
        return [inspect.Parameter("message", inspect.Parameter.POSITIONAL_ONLY)]
    return [
        parameter
        for parameter in inspect.signature(cls).parameters.values()
        if parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)
    ]


def sample(cls: type[BaseException]) -> BaseException:
    missing = [p.name for p in _parameters(cls) if p.name not in SAMPLES]
    assert not missing, f"add sample values for {cls.__qualname__}({', '.join(missing)})"
    exc = cls(*[SAMPLES[parameter.name] for parameter in _parameters(cls)])
    exc.add_note("raised while testing pickling")
    return exc


def assert_same(restored: BaseException, original: BaseException) -> None:
    assert type(restored) is type(original)
    assert str(restored) == str(original)
    assert restored.args == original.args
    # name, reason, timeout, resource, token, highest, cycle, binary, ... and the notes.
    assert vars(restored) == vars(original)


def test_the_public_exceptions_are_found_and_lock_error_is_the_base_of_asynclocks_own() -> None:
    expected = """LockError LeaseLost AcquireTimeout StaleToken DeadlockDetected NotHeld
        BackendUnavailable BackendTimeout UnsupportedFeature InvalidArgument InvalidURL
        MissingDependency ServerError ServerNotInstalled ServerStartError"""
    assert set(expected.split()) <= {cls.__name__ for cls in EXCEPTIONS}
    for cls in EXCEPTIONS:
        if not cls.__module__.startswith("asynclock.testing") and not issubclass(cls, Warning):
            assert issubclass(cls, LockError), cls


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
@pytest.mark.parametrize("cls", EXCEPTIONS, ids=lambda cls: cls.__qualname__)
def test_every_exception_has_samples_and_pickles_and_copies_with_its_message_and_attributes(
    cls: type[BaseException], protocol: int
) -> None:
    original = sample(cls)
    assert_same(pickle.loads(pickle.dumps(original, protocol=protocol)), original)
    assert_same(copy.copy(original), original)
    assert_same(copy.deepcopy(original), original)


def test_the_attributes_users_read_survive_pickling() -> None:
    lost = pickle.loads(pickle.dumps(asynclock.LeaseLost("jobs/1", "revoked")))
    assert (lost.name, lost.reason) == ("jobs/1", "revoked")
    assert str(lost) == "lease on lock 'jobs/1' was lost: revoked"
    # A subclass a user defines keeps working too, whatever its __init__ takes.

    class JobFailed(asynclock.LeaseLost):
        def __init__(self, job: int) -> None:
            super().__init__(f"jobs/{job}", "worker paused")
            self.job = job

    expected = {"name": "jobs/7", "reason": "worker paused", "job": 7}
    assert vars(copy.deepcopy(JobFailed(7))) == expected


_CHILD = """
import pickle, sys
received = pickle.load(sys.stdin.buffer)
# Send back what this process rebuilt, and how it reads each one, to be compared there.
pickle.dump(
    [(exc, type(exc).__module__, type(exc).__qualname__, str(exc), vars(exc)) for exc in received],
    sys.stdout.buffer,
)
"""


def test_every_exception_crosses_a_process_boundary() -> None:
    originals = [sample(cls) for cls in EXCEPTIONS]
    child = subprocess.run(
        [sys.executable, "-c", _CHILD],
        input=pickle.dumps(originals),
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert child.returncode == 0, child.stderr.decode()
    returned = pickle.loads(child.stdout)
    for original, (restored, module, qualname, text, attributes) in zip(
        originals, returned, strict=True
    ):
        assert (module, qualname) == (type(original).__module__, type(original).__qualname__)
        assert text == str(original)
        assert attributes == vars(original)
        assert_same(restored, original)


def test_the_warnings_can_be_filtered_by_their_name_in_asynclock(tmp_path: Path) -> None:
    """pytest's ``-W ignore::asynclock.RedisDurabilityWarning`` (and ``filterwarnings``) name the
    class at the top of the package; it was only in ``asynclock.backends.redis``."""
    assert {cls for cls in EXCEPTIONS if issubclass(cls, Warning)} == {
        asynclock.RedisDurabilityWarning
    }
    (tmp_path / "test_filtered.py").write_text("def test_nothing():\n    pass\n")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:asyncio", "-W", "error", "-W",
         "ignore::asynclock.RedisDurabilityWarning", "test_filtered.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_driver_error_without_a_message_still_says_what_it_was() -> None:
    from asynclock.backends._kit import Translator, translate

    table: Translator = {
        TimeoutError: asynclock.BackendTimeout,
        OSError: asynclock.BackendUnavailable,
    }
    with pytest.raises(asynclock.BackendTimeout) as timed_out, translate(table, "checking"):
        raise TimeoutError  # anyio.fail_after's, with no text
    assert str(timed_out.value) == "checking: TimeoutError (the server did not answer in time)"
    with pytest.raises(asynclock.BackendUnavailable) as refused, translate(table, "opening"):
        raise ConnectionResetError
    assert str(refused.value) == "opening: ConnectionResetError"
