"""Locks on Redis: ``redis://`` / ``rediss://`` (one server), ``redis+sentinel://`` (the master
Sentinel names), ``redis+cluster://`` (a Redis Cluster) and ``redlock://`` (Redlock over several
independent masters), side by side on one set of Lua scripts and settings.

Layout (imports go down this list, never up):

- :mod:`.sentinel`, :mod:`.cluster`: :class:`RedisBackend` on a master found through the
  sentinels, or routed by hash slot (loaded by their schemes, not from here);
- :mod:`._sentinel`: finding the master (sentinels asked, ``ROLE`` checked);
- :mod:`._cluster`: the slot map and the routing lane (``MOVED``, renewals per master);
- :mod:`._replicas`: ``wait_replicas`` (``WAIT`` behind takes and renewals);
- :mod:`.backend`: :class:`RedisBackend` (one server, fencing tokens, a fair queue: taking,
  waiting and the clean-up of an interrupted acquire);
- :mod:`._lease`: :class:`RedisGrant` and the leases a client holds (renew, extend, release,
  checked after a restart);
- :mod:`._inspect`: ``inspect()`` and an election's ``wait_for_change()``;
- :mod:`.redlock`: :class:`RedlockBackend` (a majority of masters, no fencing);
- :mod:`._quorum`: Redlock's majority arithmetic and its local queue of waiters;
- :mod:`._server`: what the single-server backend checks on its server (version, durability,
  restarts);
- :mod:`._wakes`: the single-server client's wake channel (hand-overs to its waiters, restarts);
- :mod:`._pipeline`: Redlock's link to each master (one pipelined connection, in-order cleanup);
- :mod:`._wire`: the connections, for every mode (redis-py's handshake and parser, writes
  without an await; the only module that touches redis-py's private members) and the
  per-call :class:`~._wire.Lane` of the other modes;
- :mod:`._urls`: URL forms, shared options, TLS; :mod:`._errors`: error translation;
- :mod:`._queue`: the fair queue's Lua scripts (take and wait in order), for every kind of
  hold (exclusive and shared locks, semaphore permits, election terms);
- :mod:`._scripts`: the other Lua scripts and the key names (one copy of each).
"""

from .._kit import RedisDurabilityWarning
from ._server import durability_problems
from .backend import RedisBackend, RedisGrant
from .redlock import MIN_MASTERS, RedlockBackend, RedlockGrant

__all__ = (
    "MIN_MASTERS",
    "RedisBackend",
    "RedisDurabilityWarning",
    "RedisGrant",
    "RedlockBackend",
    "RedlockGrant",
    "durability_problems",
)
