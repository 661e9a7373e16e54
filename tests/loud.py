"""Loud tests: a test fails on anything it did not expect, not only on a failed assertion.

- A WARNING or ERROR record of the ``asynclock`` loggers (or an ERROR of ``asyncio``'s, such as
  "Task exception was never retrieved") fails the test it was logged in, during set-up, the
  call or tear-down, unless the test declared it: ``@pytest.mark.expect_log(pattern)`` or
  ``expected_logs.expect(pattern)`` (it must be logged: the test fails if it never was), or
  ``@pytest.mark.allow_log(pattern)`` or ``expected_logs.allow(pattern)`` (it may be logged:
  a fault whose timing decides). ``expected_logs.matching(pattern)`` lists what came so far.
- A task still running when the test's event loop closes fails the test with its stack: a
  background task nobody owns (asyncio's runner would cancel it without a word).
- Warnings, unraisable exceptions ("unclosed transport", "coroutine was never awaited") fail
  through ``filterwarnings = ["error"]`` in pyproject.toml.

Records logged in worker processes that a test starts are not seen here: such tests read the
workers' output themselves.
"""

from __future__ import annotations

import asyncio
import asyncio.runners
import logging
import re
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field

import pytest

#: Loggers whose records at or above the level fail a test that did not expect them.
WATCHED = {"asynclock": logging.WARNING, "asyncio": logging.ERROR}


@dataclass
class _Expectation:
    pattern: re.Pattern[str]
    required: bool
    level: int
    seen: int = 0


@dataclass
class ExpectedLogs:
    """What a test declares it logs (see the module's docstring)."""

    records: list[logging.LogRecord] = field(default_factory=list)
    _expectations: list[_Expectation] = field(default_factory=list)
    failed: bool = False

    def expect(self, pattern: str, *, level: int = logging.WARNING) -> None:
        """A record whose message matches ``pattern`` (``re.search``) at ``level`` or above
        must be logged before the test ends; every such record is accepted."""
        self._expectations.append(_Expectation(re.compile(pattern, re.S), True, level))

    def allow(self, pattern: str, *, level: int = logging.WARNING) -> None:
        """Records that match ``pattern`` may be logged, or not."""
        self._expectations.append(_Expectation(re.compile(pattern, re.S), False, level))

    def matching(self, pattern: str) -> list[str]:
        """The messages logged so far that match ``pattern``."""
        found = re.compile(pattern, re.S)
        return [m for record in self.records if found.search(m := record.getMessage())]

    def problems(self) -> list[str]:
        problems = []
        for record in self.records:
            message = record.getMessage()
            matched = [
                e
                for e in self._expectations
                if record.levelno >= e.level and e.pattern.search(message)
            ]
            for expectation in matched:
                expectation.seen += 1
            if not matched:
                problems.append(f"unexpected log {record.levelname} {record.name}: {message}")
        problems += [
            f"expected a log matching {e.pattern.pattern!r}, none came"
            for e in self._expectations
            if e.required and not e.seen and not self.failed
        ]
        return problems


class _Collector(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.current: ExpectedLogs | None = None

    def emit(self, record: logging.LogRecord) -> None:
        threshold = WATCHED.get(record.name.partition(".")[0])
        if self.current is not None and threshold is not None and record.levelno >= threshold:
            self.current.records.append(record)


_collector = _Collector()


def _deaf_loggers() -> list[str]:
    """What keeps a watched record from reaching the collector (a library's logging set-up
    in a test, a ``logging.disable()``), as problems; the collector is attached again."""
    problems = []
    if logging.root.manager.disable >= logging.WARNING:
        problems.append(f"logging.disable({logging.root.manager.disable}) left in force")
        logging.disable(logging.NOTSET)
    for name, threshold in WATCHED.items():
        logger = logging.getLogger(name)
        if _collector not in logger.handlers:
            logger.addHandler(_collector)
            problems.append(f"the collector was taken off the {name!r} logger")
        if logger.getEffectiveLevel() > threshold:
            problems.append(f"the {name!r} logger's level was raised above {threshold}")
    for name, each in logging.root.manager.loggerDict.items():
        watched = name.partition(".")[0] in WATCHED
        if watched and isinstance(each, logging.Logger) and each.disabled:
            problems.append(f"the {name!r} logger was disabled")
            each.disabled = False
    return problems


_deaf_loggers()

#: Tasks found running when an event loop of a test closed.
_left_running: list[str] = []
_cancel_all_tasks = asyncio.runners._cancel_all_tasks  # type: ignore[attr-defined]


def _noting_cancel_all_tasks(loop: asyncio.AbstractEventLoop) -> None:
    for task in asyncio.all_tasks(loop):
        # anyio's test runner keeps one task of its own for the tests and fixtures.
        if not task.done() and task.get_coro().__name__ != "_run_tests_and_fixtures":  # type: ignore[union-attr]
            stack = "".join(f"\n    {frame}" for frame in task.get_stack(limit=8))
            _left_running.append(f"{task!r}{stack}")
    _cancel_all_tasks(loop)


asyncio.runners._cancel_all_tasks = _noting_cancel_all_tasks  # type: ignore[attr-defined]


@pytest.fixture
def expected_logs(request: pytest.FixtureRequest) -> ExpectedLogs:
    """Declare what the test logs (see :mod:`tests.loud`)."""
    logs: ExpectedLogs = request.node.stash[_LOGS]
    return logs


_LOGS = pytest.StashKey[ExpectedLogs]()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    # Something before this test (not in it: its teardown would have said) made the loggers
    # deaf: hear them again, so that this test is checked.
    _deaf_loggers()
    logs = item.stash[_LOGS] = _collector.current = ExpectedLogs()
    for marker in item.iter_markers("expect_log"):
        logs.expect(*marker.args, **marker.kwargs)
    for marker in item.iter_markers("allow_log"):
        logs.allow(*marker.args, **marker.kwargs)
    _left_running.clear()
    return (yield)


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    result = yield
    logs = item.stash.get(_LOGS, None)
    _collector.current = None
    problems = logs.problems() if logs is not None else []
    problems += [f"{problem}: this test's logs were not all checked" for problem in _deaf_loggers()]
    problems += [f"task left running when the event loop closed: {t}" for t in _left_running]
    _left_running.clear()
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    logs = item.stash.get(_LOGS, None)
    if logs is not None and (report.failed or report.skipped):
        # A test that failed already, or never ran, need not also say that its expected log
        # never came.
        logs.failed = True
    return report


def pytest_configure(config: pytest.Config) -> None:
    for name in ("expect_log", "allow_log"):
        config.addinivalue_line(
            "markers", f"{name}(pattern, level=logging.WARNING): see tests/loud.py"
        )
