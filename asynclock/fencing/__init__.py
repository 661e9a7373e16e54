"""The resource side of fencing: guards that refuse accesses carrying a stale token.

A lock alone cannot keep a resource safe: its holder can pause (GC, swap, SIGSTOP) after its last
check and write after its lease expired and another client took the lock. Each guard here records
the highest token it has seen for a resource and refuses an older one, atomically with the access.
The token comes from the lock held in the current context unless one is passed.
"""

from .._errors import StaleToken as StaleToken
from ._memory import MemoryGuard as MemoryGuard
from ._postgres import PostgresGuard as PostgresGuard
from ._redis import RedisGuard as RedisGuard
from ._token import MAX_TOKEN as MAX_TOKEN

__all__ = ("MAX_TOKEN", "MemoryGuard", "PostgresGuard", "RedisGuard", "StaleToken")

for _name in ("MemoryGuard", "PostgresGuard", "RedisGuard"):
    globals()[_name].__module__ = __name__
del _name
