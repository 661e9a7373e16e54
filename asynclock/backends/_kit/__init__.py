"""The backend kit: what every backend needs and no backend should write again.

A backend imports from here (and from its driver), nothing else of asynclock:

- the contract (:mod:`asynclock.abc`) and the error hierarchy;
- :mod:`._address`: host/port lists in URLs, IPv6 brackets, passwords kept out of messages;
- :mod:`._retry`: one backoff policy with jitter;
- :mod:`._tasks`: background tasks owned from ``open()`` to ``aclose()``, work abandoned after
  a time bound, and deferred cleanup;
- :func:`finish`: cleanup after a cancelled acquire that survives any cancellation;
- :mod:`._pool`: idle connections, never reused after an interrupted request;
- :mod:`._translate`: driver errors into the hierarchy, with "may have been applied" and
  "proven gone" outcomes;
- :data:`RENEWAL`: when leases are renewed (for a backend-side keepalive).
"""

from ..._clock import cancel_scope, checkpoint, now
from ..._errors import (
    AcquireTimeout,
    BackendTimeout,
    BackendUnavailable,
    InvalidArgument,
    InvalidURL,
    LockError,
    RedisDurabilityWarning,
    UnsupportedFeature,
)
from ..._renewal import RENEWAL
from ..._shield import finish
from ..._validate import DEFAULT_TTL, Options, redact
from ...abc import (
    Backend,
    Capabilities,
    Grant,
    HolderInfo,
    Kind,
    LockInfo,
    LockRequest,
    Lost,
    Renewed,
    RenewOutcome,
    Unknown,
    WaiterRegistry,
    permits_mismatch,
)
from ._address import (
    HostPort,
    parse_host,
    parse_hosts,
    split_server_url,
    split_userinfo,
)
from ._order import CallOrder, Turn
from ._pool import IdlePool
from ._retry import Backoff, RetryPolicy
from ._tasks import TaskHost
from ._translate import MayHaveApplied, ProvenGone, Translator, translate

__all__ = (
    "DEFAULT_TTL",
    "RENEWAL",
    "AcquireTimeout",
    "Backend",
    "BackendTimeout",
    "BackendUnavailable",
    "Backoff",
    "CallOrder",
    "Capabilities",
    "Grant",
    "HolderInfo",
    "HostPort",
    "IdlePool",
    "InvalidArgument",
    "InvalidURL",
    "Kind",
    "LockError",
    "LockInfo",
    "LockRequest",
    "Lost",
    "MayHaveApplied",
    "Options",
    "ProvenGone",
    "RedisDurabilityWarning",
    "RenewOutcome",
    "Renewed",
    "RetryPolicy",
    "TaskHost",
    "Translator",
    "Turn",
    "Unknown",
    "UnsupportedFeature",
    "WaiterRegistry",
    "cancel_scope",
    "checkpoint",
    "finish",
    "now",
    "parse_host",
    "parse_hosts",
    "permits_mismatch",
    "redact",
    "split_server_url",
    "split_userinfo",
    "translate",
)
