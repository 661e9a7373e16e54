"""The semaphore guard in Redis: :class:`PermitSlots`' rule and the command in one Lua script."""

from __future__ import annotations

from typing import Any, Protocol

from .._errors import InvalidArgument, StaleToken
from ._permits import _REMEMBERED
from ._token import resolve

# The rule of PermitSlots (see _permits.py), on one hash per resource: "admitted" (the admitted
# tokens, ascending, space-separated), "floor", "highest", and a field "d:<token>" per departed
# token ("departed" counts them). Tokens are compared as decimal strings (longer is larger,
# then lexicographic), so they stay exact beyond Lua's 2**53 doubles.
_SCRIPT = """
local function lt(a, b) if #a ~= #b then return #a < #b end return a < b end
local key, op, token = KEYS[1], ARGV[1], ARGV[2]
local permits, remembered = tonumber(ARGV[3]), tonumber(ARGV[4])
local state = redis.call('HMGET', key, 'admitted', 'floor', 'highest')
local admitted = {}
for t in string.gmatch(state[1] or '', '%d+') do admitted[#admitted + 1] = t end
local floor, highest = state[2] or nil, state[3] or nil
local function at(t) for i, a in ipairs(admitted) do if a == t then return i end end end
local function departed()
  local found = {}
  for _, f in ipairs(redis.call('HKEYS', key)) do
    if string.sub(f, 1, 2) == 'd:' then found[#found + 1] = string.sub(f, 3) end
  end
  return found
end
local function raise_floor(to)
  if floor and not lt(floor, to) then return end
  floor = to
  for _, t in ipairs(departed()) do
    if not lt(floor, t) then
      redis.call('HDEL', key, 'd:' .. t)
      redis.call('HINCRBY', key, 'departed', -1)
    end
  end
end
local function save()
  redis.call('HSET', key, 'admitted', table.concat(admitted, ' '))
  if floor then redis.call('HSET', key, 'floor', floor) end
  if highest then redis.call('HSET', key, 'highest', highest) end
end
if op == 'leave' then
  local i = at(token)
  if i then table.remove(admitted, i) end
  if (not floor or lt(floor, token)) and redis.call('HSETNX', key, 'd:' .. token, 1) == 1 then
    if redis.call('HINCRBY', key, 'departed', 1) > remembered then
      local all = departed()
      table.sort(all, lt)
      raise_floor(all[math.max(1, math.floor(remembered / 2))])
    end
  end
  save()
  return {1}
end
if not at(token) then
  local newest = highest or token
  if lt(newest, token) then newest = token end
  if redis.call('HEXISTS', key, 'd:' .. token) == 1 or (floor and not lt(floor, token)) then
    return {0, newest}
  end
  if #admitted >= permits then
    if lt(token, admitted[1]) then return {0, admitted[1]} end
    raise_floor(table.remove(admitted, 1))
  end
  local position = #admitted + 1
  for i, a in ipairs(admitted) do if lt(token, a) then position = i break end end
  table.insert(admitted, position, token)
  highest = newest
  save()
end
if #ARGV > 4 then
  return {1, redis.call(unpack(ARGV, 5))}
end
return {1}
"""


class _Redis(Protocol):
    """What the guard needs of a client (redis-py's ``redis.asyncio.Redis`` has it)."""

    def register_script(self, script: str) -> Any: ...


class RedisSemaphoreGuard:
    """Fences Redis commands on a resource that a semaphore of ``permits`` protects.

    The rule is :class:`MemorySemaphoreGuard`'s (at most ``permits`` tokens admitted; the oldest
    evicted for a newer one; a token that left never comes back). The check, the record of the
    admitted tokens (a hash at ``<prefix><resource>``) and the command run in one Lua script::

        guard = RedisSemaphoreGuard(redis, permits=3)
        async with sem.lock(ttl=10) as permit:
            await guard.call("exports", "RPUSH", "exports:queue", "job-7")
            ...
            await guard.leave("exports")              # done: free the slot

    The command's keys must live on the same Redis instance (in a cluster, the same slot) as
    the fence key.
    """

    def __init__(
        self,
        redis: _Redis,
        permits: int,
        *,
        prefix: str = "asynclock:permit-fence:",
        remembered: int = _REMEMBERED,
    ) -> None:
        if isinstance(permits, bool) or not isinstance(permits, int) or permits < 1:
            raise InvalidArgument(f"permits must be a positive int, got {permits!r}")
        self.permits = permits
        self._prefix = prefix
        self._remembered = remembered
        self._script = redis.register_script(_SCRIPT)

    async def call(
        self,
        resource: str,
        *command: str | bytes | int | float,
        token: int | None = None,
        lock: str | None = None,
    ) -> Any:
        """Run ``command`` if ``token`` (default: the current lease's) is admitted."""
        token = resolve(token, lock)
        reply = await self._script(
            keys=[self._prefix + resource],
            args=["check", str(token), self.permits, self._remembered, *command],
        )
        if not reply[0]:
            raise StaleToken(resource, token, int(reply[1]))
        return reply[1] if len(reply) > 1 else None

    async def check(
        self, resource: str, token: int | None = None, *, lock: str | None = None
    ) -> int:
        """Admit ``token`` for ``resource`` or raise StaleToken (no command)."""
        token = resolve(token, lock)
        await self.call(resource, token=token)
        return token

    async def leave(
        self, resource: str, token: int | None = None, *, lock: str | None = None
    ) -> None:
        """The holder of ``token`` is done with ``resource``: free its slot (idempotent)."""
        token = resolve(token, lock)
        await self._script(
            keys=[self._prefix + resource],
            args=["leave", str(token), self.permits, self._remembered],
        )
