"""The resource side of fencing: guards that refuse accesses carrying a stale token.

A lock alone cannot keep a resource safe: its holder can pause (GC, swap, SIGSTOP) after its last
check and write after its lease expired and another client took the lock. Each guard here records
the highest token it has seen for a resource and refuses an older one, atomically with the access.
The token comes from the lock held in the current context unless one is passed.

There is one guard per store, :class:`MemoryGuard`, :class:`RedisGuard` and
:class:`PostgresGuard`, with one vocabulary (``check``, ``leave``, ``admitted``, ``highest``).
For a resource that a semaphore of N permits protects, give the guard ``permits=N`` (or use
:class:`PermitSlots`, the rule, inside a guard of another store): it accepts the tokens of at
most N holders at once, and refuses the oldest one when a newer token needs its slot.

Across services the token travels in the ``Fencing-Token`` header (and the lock's name in
``Fencing-Lock``): :func:`httpx_request_hook` and :func:`aiohttp_client_middleware` send them,
:class:`FencingMiddleware` (ASGI) and :func:`aiohttp_fencing_middleware` check them.
"""

from .._errors import StaleToken as StaleToken
from ._aiohttp import aiohttp_client_middleware as aiohttp_client_middleware
from ._aiohttp import aiohttp_fencing_middleware as aiohttp_fencing_middleware
from ._asgi import FencingMiddleware as FencingMiddleware
from ._etcd import fence_compare as fence_compare
from ._etcd import fenced_txn as fenced_txn
from ._http import LOCK_HEADER as LOCK_HEADER
from ._http import TOKEN_HEADER as TOKEN_HEADER
from ._http import Guard as Guard
from ._http import encode_lock_name as encode_lock_name
from ._http import fencing_headers as fencing_headers
from ._http import httpx_request_hook as httpx_request_hook
from ._http import incoming_token as incoming_token
from ._http import parse_lock_name as parse_lock_name
from ._http import parse_token as parse_token
from ._memory import MemoryGuard as MemoryGuard
from ._permits import PermitSlots as PermitSlots
from ._postgres import PostgresGuard as PostgresGuard
from ._redis import RedisGuard as RedisGuard
from ._token import MAX_TOKEN as MAX_TOKEN

__all__ = (
    "LOCK_HEADER",
    "MAX_TOKEN",
    "TOKEN_HEADER",
    "FencingMiddleware",
    "Guard",
    "MemoryGuard",
    "PermitSlots",
    "PostgresGuard",
    "RedisGuard",
    "StaleToken",
    "aiohttp_client_middleware",
    "aiohttp_fencing_middleware",
    "encode_lock_name",
    "fence_compare",
    "fenced_txn",
    "fencing_headers",
    "httpx_request_hook",
    "incoming_token",
    "parse_lock_name",
    "parse_token",
)

# Tracebacks and docs show asynclock.fencing, not the private module (StaleToken stays
# asynclock.StaleToken, where it is defined).
for _name in __all__:
    _obj = globals()[_name]
    if getattr(_obj, "__module__", "").startswith(__name__ + "."):
        _obj.__module__ = __name__
del _name, _obj
