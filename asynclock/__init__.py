"""asyncio-native distributed locks with leases, fencing tokens and cancellation on loss.

.. code-block:: python

    async with asynclock.connect("etcd://127.0.0.1:2379") as locks:
        async with locks.lock("orders/42", ttl=10) as lease:
            await write(order, fence=lease.token)
"""

from ._client import LockClient as LockClient
from ._connect import connect as connect
from ._decorator import locked as locked
from ._errors import AcquireTimeout as AcquireTimeout
from ._errors import BackendTimeout as BackendTimeout
from ._errors import BackendUnavailable as BackendUnavailable
from ._errors import DeadlockDetected as DeadlockDetected
from ._errors import InvalidArgument as InvalidArgument
from ._errors import InvalidURL as InvalidURL
from ._errors import LeaseLost as LeaseLost
from ._errors import LockError as LockError
from ._errors import MissingDependency as MissingDependency
from ._errors import NotHeld as NotHeld
from ._errors import RedisDurabilityWarning as RedisDurabilityWarning
from ._errors import StaleToken as StaleToken
from ._errors import UnsupportedFeature as UnsupportedFeature
from ._errors import Waiter as Waiter
from ._errors import WrongEventLoop as WrongEventLoop
from ._events import ConnectionState as ConnectionState
from ._events import StateChange as StateChange
from ._fencing import current_lease as current_lease
from ._fencing import current_token as current_token
from ._fencing import held_leases as held_leases
from ._leader import LeaderTask as LeaderTask
from ._lease import Lease as Lease
from ._primitives import Election as Election
from ._primitives import Leader as Leader
from ._primitives import Semaphore as Semaphore
from ._scope import LockContext as LockContext
from ._scope import MultiLockContext as MultiLockContext
from .abc import Capabilities as Capabilities
from .abc import HolderInfo as HolderInfo
from .abc import LockInfo as LockInfo

__all__ = (
    "AcquireTimeout",
    "BackendTimeout",
    "BackendUnavailable",
    "Capabilities",
    "ConnectionState",
    "DeadlockDetected",
    "Election",
    "HolderInfo",
    "InvalidArgument",
    "InvalidURL",
    "Leader",
    "LeaderTask",
    "Lease",
    "LeaseLost",
    "LockClient",
    "LockContext",
    "LockError",
    "LockInfo",
    "MissingDependency",
    "MultiLockContext",
    "NotHeld",
    "RedisDurabilityWarning",
    "Semaphore",
    "StaleToken",
    "StateChange",
    "UnsupportedFeature",
    "Waiter",
    "WrongEventLoop",
    "connect",
    "current_lease",
    "current_token",
    "held_leases",
    "locked",
)

# Tracebacks and docs show the public path, not the private module (as anyio does).
for _name in __all__:
    _obj = globals()[_name]
    if getattr(_obj, "__module__", "").startswith("asynclock."):
        _obj.__module__ = __name__
del _name, _obj
