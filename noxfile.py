"""Developer sessions: `nox -s tests`, `nox -s lint`, `nox -s mypy`, `nox -s safety`.

CI runs `.ci/run` (which calls scripts/test, the README's test command); these sessions are the
same steps in isolated virtualenvs, for working on one piece at a time.
"""

from __future__ import annotations

import nox

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["tests", "lint", "mypy"]


@nox.session(python=["3.11", "3.12", "3.13"])
def tests(session: nox.Session) -> None:
    session.install("-e", ".[all]", "--group", "tests")
    session.run("pytest", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    session.install("--group", "lint")
    session.run("ruff", "check", "asynclock", "tests", "examples", "benchmarks")
    session.run("ruff", "format", "--check", "asynclock", "tests", "examples", "benchmarks")


@nox.session
def mypy(session: nox.Session) -> None:
    session.install("-e", ".[all]", "--group", "typing")
    session.run("mypy")


@nox.session
def safety(session: nox.Session) -> None:
    """The long safety profile on every installed backend (30 s a run), written to the docs."""
    session.install("-e", ".[all]")
    session.run(
        "python", "-m", "asynclock.testing._safety_report", "--profile", "long",
        "--out", "docs/safety-results.md",
    )  # fmt: skip
