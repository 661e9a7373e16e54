"""Fenced Redis commands: the token check, its record and the command, in one script."""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

from .._errors import StaleToken
from ._permits import _REMEMBERED, checked_permits, holding
from ._token import resolve

# Both scripts compare tokens as decimal strings (longer is larger, then lexicographic), so they
# stay exact beyond Lua's 2**53 doubles, and run the command (ARGV past the rule's own) only
# for an accepted token.

# The lock rule (permits=1, _token.HighestToken) on one string key: the highest token.
_LOCK_SCRIPT = """
local highest = redis.call('GET', KEYS[1])
local token = ARGV[1]
if highest then
  local newer = #token > #highest or (#token == #highest and token > highest)
  local same = token == highest
  if not (newer or (same and ARGV[2] == '0')) then
    return {0, highest}
  end
end
redis.call('SET', KEYS[1], token)
if #ARGV > 2 then
  return {1, redis.call(unpack(ARGV, 3))}
end
return {1}
"""

# The permit rule (permits>1, PermitSlots) on one hash per resource: "admitted" (the admitted
# tokens, ascending, space-separated), "floor", "highest", and a field "d:<token>" per departed
# token ("departed" counts them).
_PERMIT_SCRIPT = """
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

    def get(self, name: str) -> Any: ...  # awaitable

    def hmget(self, name: str, keys: list[str]) -> Any: ...  # awaitable


class RedisGuard:
    """Fences Redis commands on a resource: ``await guard.call("orders/42", "SET", "k", "v")``.

    The token check, its record (under ``<prefix><resource>``) and the command run in one Lua
    script, so nothing can interleave. A stale token raises :class:`asynclock.StaleToken` and the
    command does not run. The command's keys must live on the same Redis instance (or, in a
    cluster, the same slot) as the fence key.

    ``permits=N`` (the semaphore's N) keeps :class:`PermitSlots`' rule in a hash (at most N tokens
    admitted; the oldest evicted for a newer one; a token that left never comes back)::

        guard = RedisGuard(redis, permits=3)
        async with sem.lock(ttl=10):
            async with guard.entered("exports"):          # leaves on the way out
                await guard.call("exports", "RPUSH", "exports:queue", "job-7")

    The two rules keep different layouts, so the default ``prefix`` follows ``permits``
    (``asynclock:fence:`` for 1, ``asynclock:permit-fence:`` for more); a ``prefix`` given
    explicitly must not be shared by guards of 1 and of more permits. ``strict=True`` (each
    token for one access only) needs ``permits=1``; ``remembered`` bounds the departed tokens
    kept per resource (permits > 1).
    """

    def __init__(
        self,
        redis: _Redis,
        *,
        permits: int = 1,
        strict: bool = False,
        prefix: str | None = None,
        remembered: int = _REMEMBERED,
    ) -> None:
        self.permits = checked_permits(permits, strict=strict)
        self.strict = strict
        self._redis = redis
        if permits == 1:
            self._prefix = "asynclock:fence:" if prefix is None else prefix
            self._script = redis.register_script(_LOCK_SCRIPT)
        else:
            self._prefix = "asynclock:permit-fence:" if prefix is None else prefix
            self._script = redis.register_script(_PERMIT_SCRIPT)
        self._remembered = remembered

    async def _run(self, op: str, resource: str, token: int, command: tuple[Any, ...]) -> Any:
        if self.permits == 1:
            args = [str(token), "1" if self.strict else "0", *command]
        else:
            args = [op, str(token), self.permits, self._remembered, *command]
        return await self._script(keys=[self._prefix + resource], args=args)

    async def call(
        self,
        resource: str,
        *command: str | bytes | int | float,
        token: int | None = None,
        lock: str | None = None,
    ) -> Any:
        """Run ``command`` if ``token`` (default: the current lock's) is not stale."""
        token = resolve(token, lock)
        reply = await self._run("check", resource, token, command)
        if not reply[0]:
            raise StaleToken(resource, token, int(reply[1]))
        return reply[1] if len(reply) > 1 else None

    async def check(
        self, resource: str, token: int | None = None, *, lock: str | None = None
    ) -> int:
        """Accept ``token`` for ``resource`` or raise StaleToken (no command)."""
        token = resolve(token, lock)
        await self.call(resource, token=token)
        return token

    async def leave(
        self, resource: str, token: int | None = None, *, lock: str | None = None
    ) -> None:
        """The holder of ``token`` is done with ``resource``: free its slot (idempotent).

        Nothing to do with one permit (see ``_token.HighestToken.leave``): no round trip."""
        token = resolve(token, lock)
        if self.permits > 1:
            await self._run("leave", resource, token, ())

    def entered(
        self, resource: str, token: int | None = None, *, lock: str | None = None
    ) -> contextlib.AbstractAsyncContextManager[int]:
        """Accept the token for the block and leave on the way out (also when it fails)."""
        return holding(
            resource,
            lambda: self.check(resource, token, lock=lock),
            lambda token: self.leave(resource, token),
        )

    async def admitted(self, resource: str) -> tuple[int, ...]:
        """The tokens whose accesses ``resource`` accepts now, oldest first."""
        if self.permits == 1:
            highest = await self.highest(resource)
            return () if highest is None else (highest,)
        (admitted,) = await self._redis.hmget(self._prefix + resource, ["admitted"])
        return tuple(int(each) for each in (admitted or b"").split())

    async def highest(self, resource: str) -> int | None:
        """The highest token this guard has accepted for ``resource``."""
        if self.permits == 1:
            value = await self._redis.get(self._prefix + resource)
        else:
            (value,) = await self._redis.hmget(self._prefix + resource, ["highest"])
        return None if value is None else int(value)
