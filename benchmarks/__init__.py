"""Benchmarks of asynclock's backends and of peer libraries (issue #9).

Run ``asynclock bench`` (from a source checkout) or ``python -m benchmarks``; ``--help`` lists
the options and ``docs/benchmarks.md`` explains the figures. Not part of the installed package.
"""

from ._cli import main as main

__all__ = ("main",)
