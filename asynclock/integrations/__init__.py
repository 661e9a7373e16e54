"""Holding locks where applications do their work: web endpoints and job functions.

* :mod:`asynclock.integrations.fastapi`: ``@locked(template, client=...)`` for FastAPI endpoints.
* :mod:`asynclock.integrations.aiohttp`: the same for aiohttp handlers.
* :mod:`asynclock.integrations.arq`, :mod:`~asynclock.integrations.saq`,
  :mod:`~asynclock.integrations.taskiq`: ``@locked(template)`` for jobs, which defers a job whose
  lock is busy in that queue's own way (arq ``Retry``, saq's retry, taskiq ``Context.requeue()``)
  and never drops it, and ``WorkerLocks``, which opens a lock client at worker start-up and closes
  it at shutdown.

A plain asyncio worker pool needs no integration: decorate its job functions with
:func:`asynclock.locked`. Each submodule imports its framework, so import only the one you use.
"""

from __future__ import annotations

import inspect
import re
import string
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .._errors import InvalidArgument, MissingDependency

__all__ = ()


@contextmanager
def requires(module: str, framework: str | None = None) -> Iterator[None]:
    """Import ``framework`` (default: ``module``, the name of the integration and its extra) in
    this block; if it is missing, name the extra to install."""
    try:
        yield
    except ImportError as exc:  # pragma: no cover - every framework is installed in the tests
        raise MissingDependency(
            f"asynclock.integrations.{module} needs {framework or module}: "
            f"pip install 'asynclock[{module}]'"
        ) from exc


def template_fields(template: str) -> set[str]:
    """The argument names a lock name template refers to (``"a/{b.c}/{d[0]}"`` -> b, d)."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise InvalidArgument(f"lock name template {template!r} is malformed: {exc}") from None
    names = set()
    for _, field, _, _ in parsed:
        if field is None:
            continue
        name = re.split(r"[.\[]", field, maxsplit=1)[0]
        if not name or name.isdigit():
            raise InvalidArgument(
                f"lock name template {template!r} has a positional field {{{field}}}; name the "
                "parameter, as in 'orders/{order_id}'"
            )
        names.add(name)
    return names


def with_keyword(signature: inspect.Signature, name: str, **details: Any) -> inspect.Signature:
    """``signature`` with a keyword-only parameter ``name`` added (``details``: its default or
    annotation): last, but before ``**kwargs``, where a keyword-only parameter must come."""
    parameters = list(signature.parameters.values())
    at = len(parameters)
    if parameters and parameters[-1].kind is inspect.Parameter.VAR_KEYWORD:
        at -= 1
    parameters.insert(at, inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, **details))
    return signature.replace(parameters=parameters)
