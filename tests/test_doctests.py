"""The examples in public docstrings run, and say what they show."""

from __future__ import annotations

import doctest
from collections.abc import Callable
from typing import Any

import pytest

import asynclock
import asynclock.fencing

# Public names live in private modules, which doctest's module scan would skip: name them.
DOCUMENTED: list[Callable[..., Any]] = [
    asynclock.connect,
    asynclock.current_token,
    asynclock.fencing.parse_token,
]


@pytest.mark.parametrize("obj", DOCUMENTED, ids=lambda obj: obj.__qualname__)
def test_docstring_examples(obj: Callable[..., Any]) -> None:
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    tests = finder.find(
        obj, obj.__qualname__, globs={"asynclock": asynclock, **vars(asynclock.fencing)}
    )
    assert sum(len(test.examples) for test in tests) > 0, "no examples"
    for test in tests:
        runner.run(test)
    assert runner.summarize(verbose=False).failed == 0
