"""What the contract suite needs to know about a backend, beyond its URL."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import asynclock


@dataclass
class BackendUnderTest:
    name: str
    url: str
    #: A short ttl the backend honours (etcd grants at least 2 s, ZooKeeper negotiates).
    ttl: float
    #: Remove the lock ``name`` on the server behind the holder's back (an operator's delete,
    #: a revoked lease, an expired session): the server-side proof of loss.
    revoke: Callable[[str], Awaitable[None]]
    #: What the backend left on the server (keys, rows, znodes, leases); empty when clean.
    leftovers: Callable[[], Awaitable[list[str]]]
    options: dict[str, Any] = field(default_factory=dict)

    def connect(self, **options: Any) -> asynclock.LockClient:
        return asynclock.connect(self.url, **{**self.options, **options})
