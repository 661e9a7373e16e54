"""Fenced Redis commands: check-and-set of the highest token and the command, in one script."""

from __future__ import annotations

from typing import Any, Protocol

from .._errors import StaleToken
from ._token import resolve

# Tokens are compared as decimal strings (longer is larger, then lexicographic), so they stay
# exact beyond Lua's 2**53 doubles.
_SCRIPT = """
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


class _Redis(Protocol):
    """What the guard needs of a client (redis-py's ``redis.asyncio.Redis`` has it)."""

    def register_script(self, script: str) -> Any: ...


class RedisGuard:
    """Fences Redis commands on a resource: ``await guard.call("orders/42", "SET", "k", "v")``.

    The token check, the record of the new highest token (under ``<prefix><resource>``) and the
    command run in one Lua script, so nothing can interleave. A stale token raises
    :class:`asynclock.StaleToken` and the command does not run. The command's keys must live on
    the same Redis instance (or, in a cluster, the same slot) as the fence key.
    """

    def __init__(
        self, redis: _Redis, *, prefix: str = "asynclock:fence:", strict: bool = False
    ) -> None:
        self.strict = strict
        self._prefix = prefix
        self._script = redis.register_script(_SCRIPT)

    async def call(
        self,
        resource: str,
        *command: str | bytes | int | float,
        token: int | None = None,
        lock: str | None = None,
    ) -> Any:
        """Run ``command`` if ``token`` (default: the current lock's) is not stale."""
        token = resolve(token, lock)
        reply = await self._script(
            keys=[self._prefix + resource], args=[str(token), "1" if self.strict else "0", *command]
        )
        if not reply[0]:
            raise StaleToken(resource, token, int(reply[1]))
        return reply[1] if len(reply) > 1 else None

    async def check(
        self, resource: str, token: int | None = None, *, lock: str | None = None
    ) -> int:
        """Record ``token`` for ``resource`` or raise StaleToken (no command)."""
        token = resolve(token, lock)
        await self.call(resource, token=token)
        return token
