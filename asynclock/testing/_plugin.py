"""pytest plugin (entry point ``asynclock``): real servers as session fixtures, and ``--backends``.

Importing this module must stay cheap, since pytest loads it in every project that has asynclock
installed: the server modules are imported inside the fixtures, and no driver is imported at all.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import pytest

if TYPE_CHECKING:
    from ._host import ServerNotInstalled
    from ._redis import RedisServer

    _S = TypeVar("_S", bound=AbstractContextManager[object])

#: Which ``--backends`` names need which server; any one of them selects the server.
_SERVER_BACKENDS: dict[str, frozenset[str]] = {
    "redis": frozenset({"redis", "rediss", "redlock"}),
    "redis-sentinel": frozenset({"sentinel", "redis+sentinel"}),
    "redis-cluster": frozenset({"cluster", "redis+cluster"}),
    "etcd": frozenset({"etcd"}),
    "zookeeper": frozenset({"zookeeper"}),
    "postgres": frozenset({"postgres", "postgresql", "pgbouncer"}),
}
#: Backends that need no server; listed so that the default selection includes them even when
#: asynclock's registry cannot be imported.
_OTHER_BACKENDS = frozenset({"memory", "sqlite", "redlock"})


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("asynclock")
    group.addoption(
        "--backends",
        default=None,
        metavar="NAMES",
        help=(
            "comma-separated asynclock backends to test, e.g. 'redis,etcd' (default: all). "
            "Server fixtures of backends not listed skip their tests."
        ),
    )


def _option(config: pytest.Config) -> frozenset[str] | None:
    """The names given to ``--backends``, or None for all."""
    value = config.getoption("backends", default=None)
    if not value:
        return None
    names = frozenset(name.strip().lower() for name in str(value).split(",") if name.strip())
    return names or None


def _all_backends() -> set[str]:
    names = set(_OTHER_BACKENDS).union(*_SERVER_BACKENDS.values())
    try:
        from asynclock._registry import schemes
    except ImportError:  # the registry is optional for the testing toolkit
        return names
    return names.union(schemes())


def pytest_report_header(config: pytest.Config) -> str:
    selected = _option(config)
    return f"asynclock backends: {'all' if selected is None else ','.join(sorted(selected))}"


@pytest.fixture(scope="session")
def selected_backends(pytestconfig: pytest.Config) -> set[str]:
    """The backend names chosen with ``--backends`` (every known backend by default)."""
    selected = _option(pytestconfig)
    return _all_backends() if selected is None else set(selected)


def _missing(exc: ServerNotInstalled) -> NoReturn:
    # On CI a missing server is a broken machine, not a reason to pass with nothing tested.
    if os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}:
        pytest.fail(f"{exc} (CI is set, so this fails instead of skipping)", pytrace=False)
    pytest.skip(str(exc))


@contextmanager
def _running(config: pytest.Config, server: str, factory: Callable[[], _S]) -> Iterator[_S]:
    selected = _option(config)
    if selected is not None and not selected & _SERVER_BACKENDS[server]:
        pytest.skip(f"{server} is not among --backends={','.join(sorted(selected))}")
    from ._host import ServerNotInstalled

    try:
        instance = factory()
    except ServerNotInstalled as exc:
        _missing(exc)
    with instance:
        yield instance


def _session_server(server: str, module: str, cls: str, doc: str) -> Any:
    """A session fixture running one ``cls`` from ``module`` (imported only when used)."""

    def fixture(pytestconfig: pytest.Config) -> Iterator[Any]:
        factory = getattr(importlib.import_module(f"{__package__}.{module}"), cls)
        with _running(pytestconfig, server, factory) as instance:
            yield instance

    fixture.__doc__ = doc
    return pytest.fixture(scope="session")(fixture)


redis_server = _session_server(
    "redis", "_redis", "RedisServer", "A :class:`~asynclock.testing.RedisServer` for the session."
)
etcd_server = _session_server(
    "etcd", "_etcd", "EtcdServer", "A single-member :class:`~asynclock.testing.EtcdServer`."
)
etcd_cluster = _session_server(
    "etcd", "_etcd", "EtcdCluster", "A three-member :class:`~asynclock.testing.EtcdCluster`."
)
zookeeper_server = _session_server(
    "zookeeper",
    "_zookeeper",
    "ZooKeeperServer",
    "A standalone :class:`~asynclock.testing.ZooKeeperServer`.",
)
zookeeper_ensemble = _session_server(
    "zookeeper",
    "_zookeeper",
    "ZooKeeperEnsemble",
    "A three-member :class:`~asynclock.testing.ZooKeeperEnsemble`.",
)
redis_sentinel_group = _session_server(
    "redis-sentinel",
    "_redis_topologies",
    "RedisSentinelGroup",
    "A Redis master, a replica and three sentinels (``redis+sentinel://``).",
)
redis_cluster_nodes = _session_server(
    "redis-cluster",
    "_redis_topologies",
    "RedisClusterNodes",
    "A Redis Cluster of three masters (``redis+cluster://``).",
)
postgres_server = _session_server(
    "postgres", "_postgres", "PostgresServer", "A :class:`~asynclock.testing.PostgresServer`."
)


@pytest.fixture(scope="session")
def redis_servers(pytestconfig: pytest.Config) -> Iterator[list[RedisServer]]:
    """Three independent :class:`~asynclock.testing.RedisServer` (for Redlock)."""
    from ._redis import RedisServer

    with ExitStack() as stack:
        servers = [
            stack.enter_context(_running(pytestconfig, "redis", RedisServer)) for _ in range(3)
        ]
        yield servers
