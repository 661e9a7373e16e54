"""``sqlite:///path/to/locks.db``: the embedded backend, no server needed.

Locks exclude each other across every process on one host that opens the same file. A hold's
row carries an expiry on ``CLOCK_MONOTONIC`` (``time.monotonic()``, one clock for every process
on a Linux host) and the kernel's boot id, so a row left by a killed process frees itself when
its ttl runs out, and a row from before a reboot never looks held. Tokens come from a counter
row per name bumped in the same transaction as the take, so they strictly increase across
restarts of every process (``synchronous=full``, the default, also across power loss).

Every kind of hold is here: exclusive and shared locks (a writer waiting ahead blocks later
readers), semaphores (one row per permit, each with its own expiry) and elections (the leader's
row keeps its value). Waiters are rows too, in arrival order, kept alive by their process while
it waits; they poll with capped, jittered backoff, and waiters in this process are also woken
at once by a release in this process.

The package, imported in one direction:

* ``backend.py``: :class:`SQLiteBackend`, the contract's calls, the worker thread, waiting;
* ``_sql.py``: the store's statements: the tables and the transactions on them (plain
  functions on a connection).
"""

from .backend import SQLiteBackend as SQLiteBackend

__all__ = ("SQLiteBackend",)
