"""pytest plugin (entry point ``asynclock``): real servers as session fixtures, and ``--backends``.

Importing this module must stay cheap, since pytest loads it in every project that has asynclock
installed: the server modules are imported inside the fixtures, and no driver is imported at all.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import TYPE_CHECKING, NoReturn, TypeVar

import pytest

if TYPE_CHECKING:
    from ._etcd import EtcdCluster, EtcdServer
    from ._host import ServerNotInstalled
    from ._postgres import PostgresServer
    from ._redis import RedisServer
    from ._zookeeper import ZooKeeperEnsemble, ZooKeeperServer

    _S = TypeVar("_S", bound=AbstractContextManager[object])

#: Which ``--backends`` names need which server; any one of them selects the server.
_SERVER_BACKENDS: dict[str, frozenset[str]] = {
    "redis": frozenset({"redis", "rediss", "redlock"}),
    "etcd": frozenset({"etcd"}),
    "zookeeper": frozenset({"zookeeper"}),
    "postgres": frozenset({"postgres", "postgresql"}),
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


@pytest.fixture(scope="session")
def redis_server(pytestconfig: pytest.Config) -> Iterator[RedisServer]:
    """A :class:`~asynclock.testing.RedisServer` shared by the whole session."""
    from ._redis import RedisServer

    with _running(pytestconfig, "redis", RedisServer) as server:
        yield server


@pytest.fixture(scope="session")
def redis_servers(pytestconfig: pytest.Config) -> Iterator[list[RedisServer]]:
    """Three independent :class:`~asynclock.testing.RedisServer` (for Redlock)."""
    from ._redis import RedisServer

    with ExitStack() as stack:
        servers = [
            stack.enter_context(_running(pytestconfig, "redis", RedisServer)) for _ in range(3)
        ]
        yield servers


@pytest.fixture(scope="session")
def etcd_server(pytestconfig: pytest.Config) -> Iterator[EtcdServer]:
    """A single-member :class:`~asynclock.testing.EtcdServer` shared by the whole session."""
    from ._etcd import EtcdServer

    with _running(pytestconfig, "etcd", EtcdServer) as server:
        yield server


@pytest.fixture(scope="session")
def etcd_cluster(pytestconfig: pytest.Config) -> Iterator[EtcdCluster]:
    """A three-member :class:`~asynclock.testing.EtcdCluster` shared by the whole session."""
    from ._etcd import EtcdCluster

    with _running(pytestconfig, "etcd", EtcdCluster) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def zookeeper_server(pytestconfig: pytest.Config) -> Iterator[ZooKeeperServer]:
    """A standalone :class:`~asynclock.testing.ZooKeeperServer` shared by the whole session."""
    from ._zookeeper import ZooKeeperServer

    with _running(pytestconfig, "zookeeper", ZooKeeperServer) as server:
        yield server


@pytest.fixture(scope="session")
def zookeeper_ensemble(pytestconfig: pytest.Config) -> Iterator[ZooKeeperEnsemble]:
    """A three-member :class:`~asynclock.testing.ZooKeeperEnsemble` shared by the session."""
    from ._zookeeper import ZooKeeperEnsemble

    with _running(pytestconfig, "zookeeper", ZooKeeperEnsemble) as ensemble:
        yield ensemble


@pytest.fixture(scope="session")
def postgres_server(pytestconfig: pytest.Config) -> Iterator[PostgresServer]:
    """A :class:`~asynclock.testing.PostgresServer` shared by the whole session."""
    from ._postgres import PostgresServer

    with _running(pytestconfig, "postgres", PostgresServer) as server:
        yield server
