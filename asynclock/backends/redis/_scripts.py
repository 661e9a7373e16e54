"""The Lua scripts of ``redis://`` and ``redlock://``, and the keys they work on (one copy each).

Every script is idempotent for one owner id: a call is sent again after a reconnect, and a
retry of a call whose reply was lost must find the same state, not a new one.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Final

from .._kit import BackendUnavailable, InvalidArgument

# Each kind of key has its own tag; no tag is a prefix of another, and the lock name, in braces,
# is the rest of the key, so distinct names (and kinds) always give distinct keys. The braces are
# a Redis Cluster hash tag: every key of one name (lock, counter, queue, queue expiry) hashes to
# the same slot, so one script may touch them all on a cluster. (A prefix with braces of its own
# puts every name in one slot: still one slot per name.)
LOCK_TAG: Final = "lock:"
TOKEN_TAG: Final = "token:"
QUEUE_TAG: Final = "queue:"
QUEUE_TTL_TAG: Final = "queue-ttl:"
WAKE_TAG: Final = "wake:"
#: Deadlock detection's two keys (whole keys, not tags: no lock name follows).
WAITERS_KEY: Final = "deadlock:waiters"
WAITERS_TTL_KEY: Final = "deadlock:expiry"


def _key(prefix: str, tag: str, name: str) -> str:
    return f"{prefix}{tag}{{{name}}}"


def lock_key(prefix: str, name: str) -> str:
    """The key that holds the lock ``name`` (its value is the owner id of the lease)."""
    return _key(prefix, LOCK_TAG, name)


def token_key(prefix: str, name: str) -> str:
    """The fencing counter of ``name`` (the last token); it never expires. The take never
    hands out less than the server's clock in microseconds (see ``next_token`` in
    :data:`TAKE`), so a counter lost or restored old in a restart does not repeat tokens."""
    return _key(prefix, TOKEN_TAG, name)


def queue_key(prefix: str, name: str) -> str:
    """Sorted set of the waiters for ``name``, scored by arrival."""
    return _key(prefix, QUEUE_TAG, name)


def queue_ttl_key(prefix: str, name: str) -> str:
    """Sorted set of the same waiters, scored by when their place expires (server ms)."""
    return _key(prefix, QUEUE_TTL_TAG, name)


def wake_prefix(prefix: str) -> str:
    """Prefix of the clients' wake channels (``<prefix>wake:<client id>``): Pub/Sub channels,
    not keys, so they belong to no hash slot."""
    return f"{prefix}{WAKE_TAG}"


def queue_member(client: str, ttl_ms: int, place_ms: int, owner: str) -> str:
    """A waiter's entry in the queue: its client (whose channel is told when the lock is handed
    to it), the ttl its lease gets, how long its place lasts unrefreshed, and its owner id.
    Built the same way by the scripts."""
    return f"{client} {ttl_ms} {place_ms} {owner}"


@dataclass(frozen=True, slots=True)
class Script:
    """A Lua script and its SHA1, for ``EVALSHA``."""

    text: str
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.text.encode()).hexdigest())


# -- Lua ------------------------------------------------------------------------------------

#: Renew many locks in one call. KEYS: lock keys. ARGV: owner ids, then ttls in ms, one each
#: (a ttl of 0 only checks: which locks are still ours, after a restart say, changing nothing).
#: Returns one code per key: 1 renewed (or held), 0 the key is gone, -1 another owner holds it.
RENEW: Final = Script(
    """
local n = #KEYS
local out = {}
for i = 1, n do
  local holder = redis.call('GET', KEYS[i])
  if holder == ARGV[i] then
    if tonumber(ARGV[n + i]) > 0 then
      redis.call('PEXPIRE', KEYS[i], ARGV[n + i])
    end
    out[i] = 1
  elseif holder then
    out[i] = -1
  else
    out[i] = 0
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

# The fair queue of the single-instance backend. KEYS, for all three scripts: the lock key, the
# fencing counter, the queue (arrival order) and the queue's expiry set (all in one hash slot).
# ARGV[1] is the owner id of the lease, ARGV[2] the wake channel prefix; TAKE and LEAVE add
# ARGV[3] how long, in ms, a waiter's place lasts without a refresh, ARGV[4] the lease's ttl in
# ms and ARGV[5] the client's id, which make the waiter's queue member
# ("<client> <ttl> <place> <owner>").
#
# Hand-over: whoever frees the lock (RELEASE, LEAVE, a TAKE that finds it free with another
# waiter first) gives it to the first live waiter in the same script: SET lock to its owner id,
# draw its token, take it out of the queue, and PUBLISH "g <owner> <token> <px>" on its client's
# channel, so it wakes holding the lock. px is its ttl, cut to what is left of its place: a
# waiter that died in line holds the lock no longer than its place would have held up the line.
# The waiter behind it is told "f <owner> <px>": it is first now, and the lease it waits behind
# expires in px ms unless renewed (it takes over then if the new holder died). Not when that
# waiter refreshes its place (every third of its life) well before then anyway: the refresh
# tells it the same, and most hand-overs cost one message, not two.
_QUEUE_FUNCTIONS = """
local lock, counter, queue, expiry = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local owner, wake = ARGV[1], ARGV[2]

local function server_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- The next fencing token: one more than the last, but never below the server's clock in
-- microseconds. So a counter that Redis forgot (a restart without persistence, an eviction) or
-- brought back old (an RDB snapshot, the last second of an AOF lost in a crash) still gives a
-- token above every one handed out before, as long as the clock does not go back and the name
-- was taken fewer times than microseconds went by. Below 2^53: exact as a Lua number.
local function next_token()
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local last = redis.call('GET', counter)
  local token = math.max(last and tonumber(last) + 1 or 0, now)
  local text = string.format('%d', token)
  redis.call('SET', counter, text)
  return token, text
end

-- Forget waiters whose place expired (their process died or stalled).
local function prune(now)
  local dead = redis.call('ZRANGEBYSCORE', expiry, '-inf', now)
  for _, member in ipairs(dead) do
    redis.call('ZREM', queue, member)
    redis.call('ZREM', expiry, member)
  end
end

-- A queue member: "<client> <ttl ms> <place ms> <owner>".
local function parse(member)
  return string.match(member, '^(%S+) (%d+) (%d+) (.*)$')
end

-- Tell the first waiter that it is first, and in how many ms the lease ahead of it expires,
-- unless its next refresh (at most a third of its place's life after the last) comes well
-- before that.
local function tell_first(now, px)
  local head = redis.call('ZRANGE', queue, 0, 0)[1]
  if head then
    local client, _, place, heir = parse(head)
    local refreshed_by = tonumber(redis.call('ZSCORE', expiry, head)) - tonumber(place) / 3
    if now + tonumber(px) < refreshed_by then
      redis.call('PUBLISH', wake .. client, 'f ' .. heir .. ' ' .. px)
    end
  end
end

-- The lock is free: hand it to the first live waiter (see above). A waiter of the client
-- ``local_client`` is not told on its channel: the caller's reply tells it ({owner, token, px}).
local function hand_over(local_client)
  if redis.call('EXISTS', queue) == 0 then
    return nil
  end
  local now = server_ms()
  prune(now)
  local head = redis.call('ZRANGE', queue, 0, 0)[1]
  if not head then
    return nil
  end
  local client, ttl, _, heir = parse(head)
  local left = math.floor(tonumber(redis.call('ZSCORE', expiry, head))) - now
  local px = math.max(1, math.min(tonumber(ttl), left))
  redis.call('SET', lock, heir, 'PX', px)
  local _, token = next_token()
  redis.call('ZREM', queue, head)
  redis.call('ZREM', expiry, head)
  tell_first(now, px)
  if client == local_client then
    return {heir, token, px}
  end
  redis.call('PUBLISH', wake .. client, 'g ' .. heir .. ' ' .. token .. ' ' .. px)
  return nil
end
"""

#: Take the lock, or (``ARGV[6] == 'wait'``) join or refresh the queue.
#: Returns {1, token} when the lock is ours, else {0, hint}: ms until it is worth looking again
#: (-1: no idea, wait for a wake or the refresh interval).
TAKE: Final = Script(
    _QUEUE_FUNCTIONS
    + """
local waiter_ttl, ttl, mode = tonumber(ARGV[3]), ARGV[4], ARGV[6]
local holder = redis.call('GET', lock)
if holder == owner then
  -- Handed to us while this call was on its way, or a retried take whose reply was lost.
  redis.call('PEXPIRE', lock, ttl)
  return {1, tonumber(redis.call('GET', counter))}
end
if not holder and redis.call('EXISTS', queue) == 0 then
  -- Free and nobody waits: the common case.
  redis.call('SET', lock, owner, 'PX', ttl)
  return {1, (next_token())}
end
local now = server_ms()
prune(now)
local member = ARGV[5] .. ' ' .. ttl .. ' ' .. ARGV[3] .. ' ' .. owner
local head = redis.call('ZRANGE', queue, 0, 0)[1]
if not holder then
  if not head or head == member then
    redis.call('SET', lock, owner, 'PX', ttl)
    local token = next_token()
    if head then
      redis.call('ZREM', queue, member)
      redis.call('ZREM', expiry, member)
      tell_first(now, ttl)
    end
    return {1, token}
  end
  -- Free, but another waiter is first: it gets the lock now.
  hand_over()
end
if mode ~= 'wait' then
  return {0, -1}
end
if not redis.call('ZSCORE', queue, member) then
  local last = redis.call('ZRANGE', queue, -1, -1, 'WITHSCORES')
  local score = 0
  if last[2] then
    score = tonumber(last[2]) + 1
  end
  redis.call('ZADD', queue, score, member)
end
redis.call('ZADD', expiry, now + waiter_ttl, member)
for _, key in ipairs({queue, expiry}) do
  if redis.call('PTTL', key) < waiter_ttl then
    redis.call('PEXPIRE', key, waiter_ttl)
  end
end
if redis.call('ZRANGE', queue, 0, 0)[1] == member then
  return {0, redis.call('PTTL', lock)}
end
return {0, -1}
"""
)

#: What ``asynclock status`` shows, in one atomic read. KEYS as for TAKE. Returns {holder or
#: false, ms left, counter, live waiters}.
INSPECT: Final = Script(
    """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return {
  redis.call('GET', KEYS[1]),
  redis.call('PTTL', KEYS[1]),
  redis.call('GET', KEYS[2]),
  redis.call('ZCOUNT', KEYS[4], '(' .. now, '+inf'),
}
"""
)

#: Release: delete the lock if it is ours and hand it to the first waiter. ARGV[3]: the
#: releasing client's id. Returns 0 if the lock was not ours, {owner, token, px} if it went to
#: a waiter of the same client (which the reply, not its channel, tells), else 1.
RELEASE: Final = Script(
    _QUEUE_FUNCTIONS
    + """
if redis.call('GET', lock) ~= owner then
  return 0
end
redis.call('DEL', lock)
return hand_over(ARGV[3]) or 1
"""
)

#: Undo whatever an interrupted acquire may have left: the lock if it is ours (a take whose
#: reply never came, or a hand-over to a waiter that was cancelled meanwhile) and our place in
#: the queue; then, if the lock is free, hand it to the next waiter.
LEAVE: Final = Script(
    _QUEUE_FUNCTIONS
    + """
if redis.call('GET', lock) == owner then
  redis.call('DEL', lock)
end
local member = ARGV[5] .. ' ' .. ARGV[4] .. ' ' .. ARGV[3] .. ' ' .. owner
redis.call('ZREM', queue, member)
redis.call('ZREM', expiry, member)
if redis.call('EXISTS', lock) == 0 then
  hand_over()
end
return 1
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
