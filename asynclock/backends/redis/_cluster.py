"""Redis Cluster routing for ``redis+cluster://``: each call goes to the master of its slot.

Every key of one lock name carries the name as a hash tag (see :mod:`._scripts`), so each script
of one lock runs on one master, in one slot. :class:`ClusterLane` keeps one :class:`Lane` per
master and the slot map (``CLUSTER SLOTS``, asked of any node that answers):

- a script goes to the master of its first key's slot; its undo, if interrupted, follows it on
  the same connection, as on one server;
- ``MOVED`` (the slot moved, or a failover promoted a replica) updates the map from the reply
  and retries; ``ASK``/``TRYAGAIN``/``CLUSTERDOWN`` (a slot being migrated, a failover under
  way) and connection failures re-read the whole map and retry, a few times, within about one
  ``op_timeout``;
- a renewal of locks in many slots is one call per *master*: the keys travel as arguments of a
  variant of RENEW that declares none (Redis lets a script touch undeclared keys that its node
  serves), so a client holding 1,000 locks on 3 masters renews them in 3 round trips;
- commands without keys (PING, INFO, CONFIG) go to one master, ``SCRIPT LOAD`` to every one.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import anyio
import redis.asyncio
import redis.exceptions
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from .._kit import HostPort, RetryPolicy, TaskHost
from . import _scripts as lua
from ._urls import Settings
from ._wire import Dialled, Lane, Undo, Wait

logger = logging.getLogger("asynclock")

#: RENEW with its keys as arguments: ARGV[1] the number of locks, then the keys, then RENEW's
#: ARGV. Derived from RENEW's text, so that the two cannot drift apart.
RENEW_ON_NODE: Final = lua.Script(
    "local n = tonumber(ARGV[1])\n"
    "local KEYS = {unpack(ARGV, 2, n + 1)}\n"
    "local ARGV = {unpack(ARGV, n + 2)}\n" + lua.RENEW.text
)
#: Replies that mean "the slot map changed, or is changing: look it up and try again".
_REDIRECTS: Final = ("MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN")
#: How a routed call is retried while the cluster changes under it.
_RETRY: Final = RetryPolicy(first=0.02, cap=0.2, factor=2.0, jitter=0.2)
_ATTEMPTS: Final = 5


def _redirect(exc: redis.exceptions.ResponseError) -> tuple[str, HostPort | None] | None:
    """("MOVED", the new owner) for a redirection, (kind, None) for the others, else None."""
    words = str(exc).split()
    if not words:
        return None
    if words[0] == "MOVED" and len(words) >= 3:
        host, _, port = words[2].rpartition(":")
        return "MOVED", HostPort(host, int(port))
    if words[0] in _REDIRECTS:
        return words[0], None
    if "non local key" in str(exc):
        return "MOVED", None  # a batch of keys on a node that no longer serves them all
    return None


class AnyNode(Dialled):
    """A connection to the first node of ``nodes`` that accepts one, starting with the one
    that did last time: the client's wake channel, which any node serves (a cluster delivers
    Pub/Sub messages to subscribers on every node), follows the cluster when a node dies."""

    def __init__(self, *, nodes: list[HostPort], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._nodes = nodes

    async def dial(self, open_socket: Callable[[], Any]) -> None:
        error: BaseException | None = None
        for index, node in enumerate(list(self._nodes)):
            self.host, self.port = node.host, node.port
            try:
                await open_socket()
            except OSError as exc:
                error = exc
                continue
            if index:
                self._nodes.insert(0, self._nodes.pop(index))
            return
        assert error is not None
        raise error


@dataclass(frozen=True, slots=True)
class ClusterSettings(Settings):
    """:class:`Settings` whose :meth:`pool` reaches any node (the wake channel's); the routing
    lane makes its per-master pools with :meth:`Settings.pool`."""

    nodes: tuple[HostPort, ...] = ()

    def pool(self, address: HostPort, *_: Any, **__: Any) -> redis.asyncio.ConnectionPool:
        return Settings.pool(self, address, AnyNode, nodes=list(self.nodes))


class ClusterLane(Lane):
    """A :class:`Lane` over every master of a Redis Cluster, routing by hash slot."""

    def __init__(
        self,
        seeds: Sequence[HostPort],
        settings: Settings,
        seed_pool: redis.asyncio.ConnectionPool,
        op_timeout: float,
        host: TaskHost,
    ) -> None:
        # (seeds, settings) first: the backend binds them, and makes the lane as any other.
        super().__init__(seed_pool, op_timeout, host)
        self._seeds = list(seeds)
        self._settings = settings
        self._lanes: dict[HostPort, Lane] = {}
        self._slots: list[HostPort | None] = [None] * REDIS_CLUSTER_HASH_SLOTS
        self._masters: list[HostPort] = []
        self._lookup: anyio.Lock | None = None
        #: How many times the slot map was read (tests read it).
        self.lookups = 0

    # -- nodes and slots -----------------------------------------------------------------------

    @property
    def masters(self) -> list[HostPort]:
        """The masters that serve slots, as the map last said."""
        return list(self._masters)

    @property
    def connections(self) -> int:
        return sum(lane.connections for lane in self._lanes.values())

    def node_of(self, key: str) -> HostPort | None:
        return self._slots[key_slot(key.encode())]

    def _lane(self, address: HostPort) -> Lane:
        lane = self._lanes.get(address)
        if lane is None:
            if self._closed:
                # A call still running when aclose() closed the lanes (an observe() reading the
                # slot map): a lane made now would open a connection that nobody closes.
                raise redis.exceptions.ConnectionError("the lock backend is closed")
            pool = Settings.pool(self._settings, address)
            lane = Lane(pool, self._settings.op_timeout, self._host)
            lane.wait_for = self.wait_for  # one dict: ReplicaWait.install fills it in place
            self._lanes[address] = lane
        return lane

    async def refresh(self) -> None:
        """Read the slot map from the first node that answers (known masters, then seeds)."""
        if self._lookup is None:
            self._lookup = anyio.Lock()
        seen = self.lookups
        async with self._lookup:
            if self.lookups != seen:
                return  # another call read it while this one waited
            self.lookups += 1
            errors = []
            for address in dict.fromkeys([*self._masters, *self._seeds]):
                try:
                    reply = await self._lane(address).call("CLUSTER", "SLOTS")
                except (redis.exceptions.RedisError, OSError) as exc:
                    errors.append(f"{address}: {exc}")
                    continue
                self._apply(reply)
                return
            raise redis.exceptions.ConnectionError(
                f"no node of the cluster told its slots ({'; '.join(errors)})"
            )

    def _apply(self, reply: Any) -> None:
        slots: list[HostPort | None] = [None] * REDIS_CLUSTER_HASH_SLOTS
        masters: dict[HostPort, None] = {}
        for entry in reply:
            start, end, master = int(entry[0]), int(entry[1]), entry[2]
            host = lua.as_text(master[0]) or self._seeds[0].host
            address = HostPort(host, int(master[1]))
            masters[address] = None
            slots[start : end + 1] = [address] * (end - start + 1)
        self._slots = slots
        self._masters = list(masters)
        # Lanes to nodes that serve nothing now (failed, demoted) are closed.
        for address in [a for a in self._lanes if a not in masters and a not in self._seeds]:
            lane = self._lanes.pop(address)
            self._host.start_soon(lane.aclose, name="asynclock: closing a former master's lane")

    async def _node_for(self, slot: int) -> HostPort:
        address = self._slots[slot]
        if address is None:
            await self.refresh()
            address = self._slots[slot]
        if address is None:
            raise redis.exceptions.ConnectionError(f"no master serves hash slot {slot}")
        return address

    # -- calls -------------------------------------------------------------------------------

    async def call(
        self,
        *args: str | int | float | bytes,
        undo: Undo | None = None,
        wait: Wait | None = None,
    ) -> Any:
        """A command without keys: ``SCRIPT`` on every master, anything else on one."""
        if not self._masters:
            await self.refresh()
        if args and args[0] == "SCRIPT":
            reply = None
            for address in self._masters:
                reply = await self._lane(address).call(*args)
            return reply
        return await self._lane(self._masters[0]).call(*args, undo=undo, wait=wait)

    async def script(
        self,
        script: lua.Script,
        keys: Sequence[str],
        args: Sequence[lua.Arg],
        undo: Undo | None = None,
    ) -> Any:
        if not keys:
            return await self._lane((self._masters or self._seeds)[0]).script(script, keys, args)
        if script.sha == lua.RENEW.sha and len({key_slot(k.encode()) for k in keys}) > 1:
            return await self._renew_per_node(keys, args)
        return await self._routed(
            key_slot(keys[0].encode()),
            lambda address: self._lane(address).script(script, keys, args, undo),
        )

    async def _routed(self, slot: int, send: Callable[[HostPort], Awaitable[Any]]) -> Any:
        """``send(master of slot)``, following the cluster while it changes under the call."""
        backoff = _RETRY.backoff()
        for attempt in range(1, _ATTEMPTS + 1):
            address = await self._node_for(slot)
            try:
                return await send(address)
            except redis.exceptions.ResponseError as exc:
                where = _redirect(exc)
                if where is None or attempt == _ATTEMPTS:
                    raise
                await self._follow(slot, where, backoff.next_delay())
            except redis.exceptions.ConnectionError:
                # The lane tried twice already: the node is gone, or failing over.
                if attempt == _ATTEMPTS:
                    raise
                await anyio.sleep(backoff.next_delay())
                await self.refresh()
        raise AssertionError("unreachable")

    async def _follow(self, slot: int, where: tuple[str, HostPort | None], pause: float) -> None:
        kind, address = where
        if kind == "MOVED" and address is not None:
            self._slots[slot] = address  # the reply says where: no lookup needed for this one
            if address not in self._masters:
                await self.refresh()
            return
        await anyio.sleep(pause)
        await self.refresh()

    async def _renew_per_node(self, keys: Sequence[str], args: Sequence[lua.Arg]) -> list[int]:
        """RENEW over many slots: one call per master, run side by side; codes in order."""
        if not self._masters:
            await self.refresh()
        n = len(keys)
        owners, ttls = args[:n], args[n:]
        by_node: dict[HostPort | None, list[int]] = defaultdict(list)
        for index, key in enumerate(keys):
            by_node[self.node_of(key)].append(index)
        codes: list[int] = [0] * n
        errors: list[BaseException] = []

        async def renew_on(indexes: list[int]) -> None:
            reply = await self._renew_batch(
                [keys[i] for i in indexes], [owners[i] for i in indexes], [ttls[i] for i in indexes]
            )
            for index, code in zip(indexes, reply, strict=True):
                codes[index] = int(code)

        async def guarded(indexes: list[int]) -> None:
            try:
                await renew_on(indexes)
            except Exception as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            for indexes in by_node.values():
                tg.start_soon(guarded, indexes)
        if errors:
            raise errors[0]
        return codes

    async def _renew_batch(
        self, keys: list[str], owners: list[lua.Arg], ttls: list[lua.Arg]
    ) -> list[int]:
        async def send(address: HostPort) -> list[int] | None:
            if any(self.node_of(key) != address for key in keys):
                return None  # the map changed since the batch was made
            args = [len(keys), *keys, *owners, *ttls]
            reply = await self._lane(address).script(RENEW_ON_NODE, [], args)
            return [int(code) for code in reply]

        codes: list[int] | None = await self._routed(key_slot(keys[0].encode()), send)
        if codes is not None:
            return codes
        # Keys of this batch on several masters now: one call per key is always right.
        return [
            int((await self.script(lua.RENEW, [key], [owner, ttl]))[0])
            for key, owner, ttl in zip(keys, owners, ttls, strict=True)
        ]

    async def aclose(self) -> None:
        self._closed = True
        lanes, self._lanes = list(self._lanes.values()), {}
        for lane in lanes:
            await lane.aclose()
        await super().aclose()
