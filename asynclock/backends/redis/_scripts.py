"""The Lua scripts of ``redis://`` and ``redlock://``, and the keys they work on (one copy each).

Every script is idempotent for one owner id: a call is sent again after a reconnect, and a
retry of a call whose reply was lost must find the same state, not a new one.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, TypeAlias

from .._kit import BackendUnavailable, InvalidArgument

# Each kind of key has its own tag; no tag is a prefix of another, and the lock name, in braces,
# is the rest of the key, so distinct names (and kinds) always give distinct keys. The braces are
# a Redis Cluster hash tag: every key of one name (lock, counter, queue, queue expiry) hashes to
# the same slot, so one script may touch them all on a cluster. (A prefix with braces of its own
# puts every name in one slot: still one slot per name.)
#: A script's argument, as the wire sends it.
Arg: TypeAlias = str | int | bytes

LOCK_TAG: Final = "lock:"
TOKEN_TAG: Final = "token:"
QUEUE_TAG: Final = "queue:"
QUEUE_TTL_TAG: Final = "queue-ttl:"
WAKE_TAG: Final = "wake:"
#: The holds that are not an exclusive lock: shared holds, permits, an election's leader.
HOLDS_TAG: Final = "holds:"
#: The Pub/Sub channel told of every change of an election's holds (a channel, not a key).
CHANGE_TAG: Final = "change:"
#: Each kind of hold is a namespace of its own (the lock "a" and the semaphore "a" are
#: unrelated): its keys' tags start with this. No tag starts with another kind's namespace.
KIND_SPACE: Final = {"lock": "", "semaphore": "sem:", "election": "election:"}
#: Deadlock detection's two keys (whole keys, not tags: no lock name follows).
WAITERS_KEY: Final = "deadlock:waiters"
WAITERS_TTL_KEY: Final = "deadlock:expiry"


def _key(prefix: str, tag: str, name: str, kind: str = "lock") -> str:
    return f"{prefix}{KIND_SPACE[kind]}{tag}{{{name}}}"


def fair_keys(prefix: str, name: str, kind: str = "lock") -> list[str]:
    """The KEYS of the fair queue's scripts for ``name`` of ``kind`` (see :mod:`._queue`)."""
    return [
        _key(prefix, tag, name, kind)
        for tag in (LOCK_TAG, TOKEN_TAG, QUEUE_TAG, QUEUE_TTL_TAG, HOLDS_TAG)
    ]


def holds_key(prefix: str, name: str, kind: str = "lock") -> str:
    """Sorted set of the holds of ``name`` that are not an exclusive lock (see :mod:`._queue`)."""
    return _key(prefix, HOLDS_TAG, name, kind)


def change_channel(prefix: str, name: str, kind: str) -> str:
    """The Pub/Sub channel the scripts tell of every change of the holds of ``name``."""
    return _key(prefix, CHANGE_TAG, name, kind)


def lock_key(prefix: str, name: str, kind: str = "lock") -> str:
    """The key that holds the lock ``name`` (its value is the owner id of the lease)."""
    return _key(prefix, LOCK_TAG, name, kind)


def token_key(prefix: str, name: str, kind: str = "lock") -> str:
    """The fencing counter of ``name`` (the last token); it never expires. The take never
    hands out less than the server's clock in microseconds (see ``next_token`` in
    :data:`TAKE`), so a counter lost or restored old in a restart does not repeat tokens."""
    return _key(prefix, TOKEN_TAG, name, kind)


def queue_key(prefix: str, name: str, kind: str = "lock") -> str:
    """Sorted set of the waiters for ``name``, scored by arrival."""
    return _key(prefix, QUEUE_TAG, name, kind)


def wake_prefix(prefix: str) -> str:
    """Prefix of the clients' wake channels (``<prefix>wake:<client id>``): Pub/Sub channels,
    not keys, so they belong to no hash slot."""
    return f"{prefix}{WAKE_TAG}"


def hold_member(token: int, owner: str, value: bytes = b"") -> bytes:
    """A hold's member in the holds set (see :mod:`._queue`), as RENEW and RELEASE name it."""
    return b"%d %s " % (token, owner.encode()) + value


@dataclass(frozen=True, slots=True)
class Script:
    """A Lua script and its SHA1, for ``EVALSHA``."""

    text: str
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.text.encode()).hexdigest())


#: Runs a script on the server, its errors translated: (script, keys, args, what it does).
Run: TypeAlias = Callable[[Script, Sequence[str], Sequence[Arg], str], Awaitable[Any]]


# -- Lua ------------------------------------------------------------------------------------

#: Renew many holds in one call. KEYS: lock keys, or holds sets (see :mod:`._queue`). ARGV:
#: owner ids (for a hold in a holds set: its member, ``"<token> <owner> <value>"``, which has
#: spaces, where an owner id has none), then ttls in ms, one each (a ttl of 0 only checks:
#: which holds are still ours, after a restart say, changing nothing). Returns one code per
#: key: 1 renewed (or held), 0 the hold is gone, -1 another owner holds the lock.
RENEW: Final = Script(
    """
local n = #KEYS
local out = {}
local now = nil
for i = 1, n do
  local key, ms = KEYS[i], tonumber(ARGV[n + i])
  if string.find(ARGV[i], ' ', 1, true) then
    if not now then
      local t = redis.call('TIME')
      now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    end
    local score = redis.call('ZSCORE', key, ARGV[i])
    if score and tonumber(score) > now then
      if ms > 0 then
        redis.call('ZADD', key, 'XX', now + ms, ARGV[i])
        if redis.call('PTTL', key) < ms then
          redis.call('PEXPIRE', key, ms)
        end
      end
      out[i] = 1
    else
      out[i] = 0
    end
  else
    local holder = redis.call('GET', key)
    if holder == ARGV[i] then
      if ms > 0 then
        redis.call('PEXPIRE', key, ms)
      end
      out[i] = 1
    elseif holder then
      out[i] = -1
    else
      out[i] = 0
    end
  end
end
return out
"""
)

#: Returns {1, 0} when the lock is ours now, {0, pttl of the holder} otherwise.
REDLOCK_TAKE: Final = Script(
    """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {1, 0}
end
if holder then
  return {0, redis.call('PTTL', KEYS[1])}
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return {1, 0}
"""
)

#: Delete the lock if, and only if, its value is our owner id. KEYS: lock key. ARGV: owner id.
COMPARE_AND_DELETE: Final = Script(
    """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""
)

# Deadlock detection's wait-for records: a hash of records and a sorted set of when each
# expires (server ms). KEYS: the hash, the sorted set.

#: ARGV: record key, value, ttl in ms.
PUBLISH_WAITER: Final = Script(
    """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[3])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[2], now + ttl, ARGV[1])
for _, key in ipairs(KEYS) do
  if redis.call('PTTL', key) < ttl then
    redis.call('PEXPIRE', key, ttl)
  end
end
return 1
"""
)

#: ARGV: record key.
WITHDRAW_WAITER: Final = Script(
    """
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
"""
)

#: Drop expired records, return the values of the others.
SCAN_WAITERS: Final = Script(
    """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for _, key in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)) do
  redis.call('HDEL', KEYS[1], key)
  redis.call('ZREM', KEYS[2], key)
end
return redis.call('HVALS', KEYS[1])
"""
)


def ttl_ms(ttl: float) -> int:
    """The ttl in whole milliseconds as the server applies it (never rounded up)."""
    return math.floor(ttl * 1000 + 1e-6)


def check_ttl_ms(ttl: float, source: str, minimum_ms: int = 1) -> None:
    if ttl_ms(ttl) < minimum_ms:
        raise InvalidArgument(
            f"{source} stores ttls in whole milliseconds; {ttl!r} s is below {minimum_ms} ms"
        )


def codes(reply: object, expected: int) -> list[int]:
    """A script's list of integer codes, checked, so a surprise is an error and not a guess."""
    if not isinstance(reply, list) or len(reply) != expected:
        raise BackendUnavailable(f"unexpected reply from a lock script: {reply!r}")
    return [int(code) for code in reply]


def as_text(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)
