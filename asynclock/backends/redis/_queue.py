"""The fair queue of ``redis://`` (and Sentinel, Cluster): TAKE, RELEASE, LEAVE and INSPECT,
for every kind of hold (exclusive and shared locks, semaphore permits, election terms).

KEYS, for all four scripts, in this order (all in one hash slot, see :func:`layout`):

1. ``lock``: the exclusive holder's owner id, with the lease's PX expiry (exclusive locks only);
2. ``counter``: the fencing counter (no expiry), one per name and kind;
3. ``queue``: sorted set of waiters by arrival;
4. ``queue-ttl``: the same members, scored by when their place expires (server ms);
5. ``holds``: sorted set of the holds that are not an exclusive lock (shared holds of a lock,
   a semaphore's permits, an election's leader), one member ``"<token> <owner> <value>"`` each,
   scored by when that hold expires (server ms): every hold expires on its own, so a crashed
   holder frees its own hold only. A semaphore's number of permits is the member ``"#<N>"``,
   scored ``+inf``, there while anyone holds or waits. The key's own expiry is the latest of
   its holds' (and, for a semaphore, of its waiters' places), so it vanishes when they do.

ARGV: 1 owner id, 2 wake channel prefix, 3 how long (ms) a waiter's place lasts unrefreshed,
4 the lease's ttl (ms), 5 the client's id, 6 the mode (``x`` exclusive lock, ``s`` shared
hold of a lock, ``p`` a permit of a semaphore or an election, which is a semaphore of one),
7 the permits, 8 the value (an election's candidate), 9 the Pub/Sub channel told of every
change of the holds ('' for none: only elections have one), then TAKE's ``wait``/``try`` or
RELEASE's token. A queue member is ``"<client> <ttl> <place> <mode> <owner> <value>"``.

Hand-over: whatever frees a hold (RELEASE, LEAVE, a TAKE that finds the queue's head could go
in) grants the head of the queue all it can in the same script: one exclusive waiter; or every
shared waiter up to the first exclusive one (a waiting writer blocks the readers behind it);
or, for a semaphore, as many waiters as there are free permits. Each gets its hold and token,
leaves the queue, and is told ``"g <owner> <token> <px>"`` on its client's wake channel (or by
the reply, when it is a waiter of the releasing client: a flat list of owner, token, px). px
is its ttl, cut to what is left of its place. The new head may be told ``"f <owner> <px>"``:
what it waits behind expires in px ms unless renewed. A message may be read late (its client
was stopped, and its take ran first on resuming): a TAKE that leaves its waiter in line says
which tokens came before it, so that a hand-over told late, and gone, is not taken for one.
"""

from __future__ import annotations

from typing import Final

from ._scripts import Script

_HEAD: Final = """
local lock, counter, queue, expiry, holds = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local owner, wake, mode = ARGV[1], ARGV[2], ARGV[6]
local permits, value, change = tonumber(ARGV[7]), ARGV[8], ARGV[9]

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

-- Observers (elections' wait_for_change) hear of every change once per script.
local told = false
local function changed()
  if change ~= '' and not told then
    told = true
    redis.call('PUBLISH', change, 'c')
  end
end

"""

# The rest is defined only past the fast paths: a closure per function per call is most of
# what a script costs the server beyond its commands.
_FUNCTIONS: Final = """
local function keep(key, ms)
  if redis.call('PTTL', key) < ms then
    redis.call('PEXPIRE', key, ms)
  end
end

-- Forget waiters whose place expired and holds whose lease did (their process died or stalled).
local function prune(now)
  local dead = redis.call('ZRANGEBYSCORE', expiry, '-inf', now)
  for _, member in ipairs(dead) do
    redis.call('ZREM', queue, member)
    redis.call('ZREM', expiry, member)
  end
  if redis.call('ZREMRANGEBYSCORE', holds, '-inf', now) > 0 then
    changed()
  end
end

-- A queue member: "<client> <ttl ms> <place ms> <mode> <owner> <value>".
local function parse(member)
  return string.match(member, '^(%S+) (%d+) (%d+) (%S+) (%S+) (.*)$')
end

-- A semaphore's permits, as the clients that hold or wait for it set them.
local function stored_permits()
  local m = redis.call('ZRANGEBYSCORE', holds, '+inf', '+inf')[1]
  return m and tonumber(string.sub(m, 2))
end

-- Holds in the holds set (after a prune: the live ones).
local function live_holds()
  local n = redis.call('ZCARD', holds)
  if n > 0 and stored_permits() then
    n = n - 1
  end
  return n
end

-- The hold of ``who`` in the holds set: its member and token, if any.
local function find_hold(who)
  for _, m in ipairs(redis.call('ZRANGE', holds, 0, -1)) do
    local token, o = string.match(m, '^(%d+) (%S+) ')
    if o == who then
      return m, token
    end
  end
  return nil, nil
end

-- Whether a request of mode ``m`` may hold now (the queue aside).
local function free_for(m)
  if m == 'p' then
    return live_holds() < (stored_permits() or permits)
  end
  if redis.call('EXISTS', lock) == 1 then
    return false
  end
  return m == 's' or redis.call('EXISTS', holds) == 0
end

-- ms until what keeps a waiter of mode ``m`` out may go (unless renewed), or -1: unknown.
local function ahead_ms(m, now)
  if m == 'p' then
    local first = redis.call('ZRANGEBYSCORE', holds, '-inf', '(+inf', 'WITHSCORES', 'LIMIT', 0, 1)
    if first[2] then
      return math.max(0, math.floor(tonumber(first[2])) - now)
    end
    return -1
  end
  local px = redis.call('PTTL', lock)
  if px >= 0 or m == 's' then
    return px
  end
  local last = redis.call('ZRANGE', holds, -1, -1, 'WITHSCORES')
  if last[2] then
    return math.max(0, math.floor(tonumber(last[2])) - now)
  end
  return -1
end

-- A hold for ``who``, lasting ``px`` ms; returns its token (text).
local function grant(m, who, val, px, now)
  local _, token = next_token()
  if m == 'x' then
    redis.call('SET', lock, who, 'PX', px)
  else
    redis.call('ZADD', holds, now + px, token .. ' ' .. who .. ' ' .. val)
    keep(holds, px)
  end
  changed()
  return token
end

-- Tell the first waiter that it is first, and in how many ms what it waits behind expires,
-- unless its next refresh (at most a third of its place's life after the last) comes well
-- before that.
local function tell_first(now)
  local head = redis.call('ZRANGE', queue, 0, 0)[1]
  if head then
    local client, _, place, m, heir = parse(head)
    local px = ahead_ms(m, now)
    local refreshed_by = tonumber(redis.call('ZSCORE', expiry, head)) - tonumber(place) / 3
    if px >= 0 and now + px < refreshed_by then
      redis.call('PUBLISH', wake .. client, 'f ' .. heir .. ' ' .. px)
    end
  end
end

-- Grant the head of the queue what it can hold now (see the module's docstring). Waiters of
-- ``local_client`` are not told on their channel but returned ({owner, token, px, ...}); the
-- member ``me`` (the caller of a TAKE) gets its full ttl, and its token is returned second.
local function hand_over(local_client, me)
  local told, mine = {}, nil
  if redis.call('EXISTS', queue) == 0 then
    return told, mine
  end
  local now = server_ms()
  prune(now)
  local any = false
  while true do
    local head = redis.call('ZRANGE', queue, 0, 0)[1]
    if not head then
      break
    end
    local client, ttl, _, m, heir, val = parse(head)
    if not free_for(m) then
      break
    end
    local px = tonumber(ttl)
    if head ~= me then
      local left = math.floor(tonumber(redis.call('ZSCORE', expiry, head))) - now
      px = math.max(1, math.min(px, left))
    end
    local token = grant(m, heir, val, px, now)
    redis.call('ZREM', queue, head)
    redis.call('ZREM', expiry, head)
    any = true
    if head == me then
      mine = token
    elseif client == local_client then
      table.insert(told, heir)
      table.insert(told, token)
      table.insert(told, px)
    else
      redis.call('PUBLISH', wake .. client, 'g ' .. heir .. ' ' .. token .. ' ' .. px)
    end
    if m == 'x' then
      break
    end
  end
  if any then
    tell_first(now)
  end
  return told, mine
end

-- No hand-over from now on gets a token at or below this one (see next_token): a waiter told
-- of one that is (a message read late, after a stall) knows it came before this take.
local function token_floor()
  local t = redis.call('TIME')
  local last = redis.call('GET', counter)
  return math.max(last and tonumber(last) or 0, tonumber(t[1]) * 1000000 + tonumber(t[2]) - 1)
end

-- A semaphore nobody holds or waits for keeps nothing (its permits may change then).
local function tidy()
  if mode == 'p' and redis.call('EXISTS', queue) == 0 then
    redis.call('ZREMRANGEBYSCORE', holds, '-inf', server_ms())
    if live_holds() == 0 then
      redis.call('DEL', holds)
    end
  end
end
"""

#: Take a hold, or (``ARGV[10] == 'wait'``) join or refresh the queue. Returns {1, token}
#: when the hold is ours, {0, hint} when not: ms until it is worth looking again (-1: no
#: idea, wait for a wake or the refresh), {-1, permits} when a semaphore's permits differ.
#: A take that leaves its waiter in line returns {0, hint, floor}: every hand-over from now
#: on gets a token above floor, so a hand-over told with a token at or below it came before
#: this take, and is gone (else the take would have found it and returned {1, token}).
TAKE: Final = Script(
    _HEAD
    + """
local waiter_ttl, ttl, op = tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[10]
if mode == 'x' then
  local holder = redis.call('GET', lock)
  if holder == owner then
    -- Handed to us while this call was on its way, or a retried take whose reply was lost.
    redis.call('PEXPIRE', lock, ttl)
    return {1, tonumber(redis.call('GET', counter))}
  end
  if not holder and redis.call('EXISTS', queue, holds) == 0 then
    -- Free and nobody waits: the common case.
    redis.call('SET', lock, owner, 'PX', ttl)
    changed()
    return {1, (next_token())}
  end
end
"""
    + _FUNCTIONS
    + """
local now = server_ms()
prune(now)
if mode ~= 'x' then
  local m, token = find_hold(owner)
  if m then
    redis.call('ZADD', holds, now + ttl, m)
    keep(holds, ttl)
    return {1, tonumber(token)}
  end
end
if mode == 'p' then
  local held = stored_permits()
  if held and held ~= permits then
    if redis.call('EXISTS', queue) == 1 or live_holds() > 0 then
      return {-1, held}
    end
    redis.call('DEL', holds)
    held = nil
  end
  if not held then
    redis.call('ZADD', holds, '+inf', '#' .. permits)
  end
end
local member = ARGV[5] .. ' ' .. ARGV[4] .. ' ' .. ARGV[3] .. ' ' .. mode .. ' ' .. owner
  .. ' ' .. value
if redis.call('EXISTS', queue) == 1 then
  -- Someone waits: the head goes first (perhaps with us in its group).
  local _, mine = hand_over(nil, member)
  if mine then
    return {1, tonumber(mine)}
  end
end
if redis.call('EXISTS', queue) == 0 and free_for(mode) then
  return {1, tonumber(grant(mode, owner, value, ttl, now))}
end
if op ~= 'wait' then
  tidy()
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
local kept = {queue, expiry}
if mode == 'p' then
  kept[3] = holds  -- the permits stay while anyone waits
end
for _, key in ipairs(kept) do
  keep(key, waiter_ttl)
end
if redis.call('ZRANGE', queue, 0, 0)[1] == member then
  return {0, ahead_ms(mode, now), token_floor()}
end
return {0, -1, token_floor()}
"""
)

#: Release: end the hold if it is ours and hand over. ARGV[10]: the hold's token (``s``, ``p``).
#: Returns 0 if it was not ours, {owner, token, px, ...} if it went to waiters of the same
#: client (which the reply, not their channel, tells), else 1.
RELEASE: Final = Script(
    _HEAD
    + """
if mode == 'x' then
  if redis.call('GET', lock) ~= owner then
    return 0
  end
  redis.call('DEL', lock)
  changed()
  if redis.call('EXISTS', queue) == 0 then
    return 1  -- nobody waits: the common case
  end
end
"""
    + _FUNCTIONS
    + """
-- (An exclusive lock was deleted above.)
if mode ~= 'x' and redis.call('ZREM', holds, ARGV[10] .. ' ' .. owner .. ' ' .. value) == 0 then
  return 0
end
changed()
local heirs = hand_over(ARGV[5], nil)
tidy()
if #heirs > 0 then
  return heirs
end
return 1
"""
)

#: Undo whatever an interrupted acquire may have left: the hold if it is ours (a take whose
#: reply never came, or a hand-over to a waiter that was cancelled meanwhile) and our place in
#: the queue; then hand over to the next waiters.
LEAVE: Final = Script(
    _HEAD
    + _FUNCTIONS
    + """
if mode == 'x' then
  if redis.call('GET', lock) == owner then
    redis.call('DEL', lock)
    changed()
  end
else
  local m = find_hold(owner)
  if m then
    redis.call('ZREM', holds, m)
    changed()
  end
end
local member = ARGV[5] .. ' ' .. ARGV[4] .. ' ' .. ARGV[3] .. ' ' .. mode .. ' ' .. owner
  .. ' ' .. value
redis.call('ZREM', queue, member)
redis.call('ZREM', expiry, member)
hand_over(nil, nil)
tidy()
return 1
"""
)

#: What ``inspect()`` shows, in one atomic read. KEYS as for TAKE. Returns {holder or false,
#: its ms left, counter, live waiters, the holds set with scores, the server's ms}.
INSPECT: Final = Script(
    """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return {
  redis.call('GET', KEYS[1]),
  redis.call('PTTL', KEYS[1]),
  redis.call('GET', KEYS[2]),
  redis.call('ZCOUNT', KEYS[4], '(' .. now, '+inf'),
  redis.call('ZRANGEBYSCORE', KEYS[5], '(' .. now, '+inf', 'WITHSCORES'),
  string.format('%d', now),
}
"""
)
