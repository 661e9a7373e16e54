"""Real servers, clusters and network faults for testing code that uses distributed locks.

.. code-block:: python

    from asynclock.testing import FaultProxy, RedisServer

    with RedisServer() as server:  # sync: fits session-scoped pytest fixtures
        ...

    async with FaultProxy(server.host, server.port) as proxy:
        client = connect(f"redis://{proxy.address}/0")
        proxy.blackhole()  # the client's requests now time out

The pytest plugin (loaded automatically) provides the servers as session fixtures:
``redis_server``, ``redis_servers``, ``redis_sentinel_group``, ``redis_cluster_nodes``,
``etcd_server``, ``etcd_cluster``, ``zookeeper_server``,
``zookeeper_ensemble``, ``postgres_server``, plus ``selected_backends`` and ``--backends``.
"""

from ._cluster import Cluster as Cluster
from ._etcd import EtcdCluster as EtcdCluster
from ._etcd import EtcdMember as EtcdMember
from ._etcd import EtcdServer as EtcdServer
from ._host import ServerError as ServerError
from ._host import ServerNotInstalled as ServerNotInstalled
from ._host import ServerStartError as ServerStartError
from ._host import find_binary as find_binary
from ._host import free_port as free_port
from ._pgbouncer import PgBouncerServer as PgBouncerServer
from ._postgres import PostgresServer as PostgresServer
from ._process import Server as Server
from ._proxy import FaultProxy as FaultProxy
from ._proxy import ProxyMode as ProxyMode
from ._redis import RedisServer as RedisServer
from ._redis_topologies import RedisClusterNodes as RedisClusterNodes
from ._redis_topologies import RedisSentinelGroup as RedisSentinelGroup
from ._safety import SafetyConfig as SafetyConfig
from ._safety import SafetyReport as SafetyReport
from ._safety import run_safety as run_safety
from ._zookeeper import ZooKeeperEnsemble as ZooKeeperEnsemble
from ._zookeeper import ZooKeeperMember as ZooKeeperMember
from ._zookeeper import ZooKeeperServer as ZooKeeperServer

__all__ = (
    "Cluster",
    "EtcdCluster",
    "EtcdMember",
    "EtcdServer",
    "FaultProxy",
    "PgBouncerServer",
    "PostgresServer",
    "ProxyMode",
    "RedisClusterNodes",
    "RedisSentinelGroup",
    "RedisServer",
    "SafetyConfig",
    "SafetyReport",
    "Server",
    "ServerError",
    "ServerNotInstalled",
    "ServerStartError",
    "ZooKeeperEnsemble",
    "ZooKeeperMember",
    "ZooKeeperServer",
    "find_binary",
    "free_port",
    "run_safety",
)

# Docs and tracebacks show the public path, not the private module (as anyio does). ProxyMode
# is a Literal alias, which has no module of its own to rewrite.
for _name in __all__:
    _value = globals()[_name]
    if isinstance(_value, type) or (callable(_value) and hasattr(_value, "__code__")):
        _value.__module__ = __name__
del _name, _value
