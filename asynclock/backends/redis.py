"""``redis://host:port/db`` and ``rediss://`` (TLS): locks on one Redis server.

Take: one Lua script does ``SET lock owner NX PX ttl`` and ``INCR``s the name's fencing counter,
so the token and the lock come from one atomic step. Renew and release compare the owner id (one
per lease) before they act; one script renews every lock a client holds, in one round trip.

Waiting is a fair queue kept by the same scripts: a sorted set of waiters by arrival, each with
a place that expires unless its waiter refreshes it (so a dead waiter cannot stall the line for
longer than ``waiter_ttl``). Only the first live waiter may take a free lock. A release pushes
onto the first waiter's own wake list, on which that waiter blocks (``BLPOP``); the list keeps
the wake even if it comes while the waiter is between two calls. A holder that dies without
releasing is noticed by the first waiter when the key's expiry passes (it sleeps until then,
with jitter), and everyone else refreshes their place every ``waiter_ttl / 3``.

Tokens never repeat for a name, also when Redis forgets the counter or brings it back old (a
restart without persistence, an eviction, a snapshot): a token is never below the server's clock
in microseconds, so it is above every token handed out before, as long as that clock does not go
back. Held locks are another
matter: :func:`RedisBackend.open` reads the server's persistence and eviction settings and warns
(:class:`RedisDurabilityWarning`) when a restart or eviction could lose them. One idle connection
per client notices a restart at once, and leases whose keys it took are reported lost then.

Failures: every call is bounded by ``op_timeout``, with the backend's own timer, which lets a
reply that arrived while the process was stalled be read rather than counted as a timeout. A
take interrupted in flight (timeout, cancellation) has its undo written right behind it on the
same connection, so the server runs the two in order whenever it gets to them: a frozen server
that wakes up cannot leave the lock to a caller that has given up.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import random
import warnings
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, Self
from urllib.parse import urlsplit

import anyio
import redis.exceptions

from .._errors import (
    BackendTimeout,
    BackendUnavailable,
    InvalidURL,
    UnsupportedFeature,
    map_exceptions,
)
from .._registry import redact
from .._shield import finish
from .._validate import Options
from ..abc import (
    Backend,
    Capabilities,
    Grant,
    LockInfo,
    LockRequest,
    Lost,
    Renewed,
    RenewOutcome,
    WaiterRegistry,
)
from . import _redis_scripts as lua

__all__ = ("RedisBackend", "RedisDurabilityWarning")

logger = logging.getLogger("asynclock")

_EXAMPLE = "redis://127.0.0.1:6379/0 or rediss://user:password@redis.example:6380/0"
_DEFAULT_WAITER_TTL = 5.0
#: Oldest server with what the scripts need (TIME in scripts, fractional BLPOP timeouts).
_MIN_VERSION = (6, 0)


class RedisDurabilityWarning(UserWarning):
    """The Redis server may lose held locks (eviction, or no AOF).

    A restart without the append-only file forgets every held lock (their holders are told at
    once, but another client may take the lock first), and an eviction policy other than
    ``noeviction`` (with ``maxmemory`` set) may drop locks that are still held. Tokens stay safe
    either way: no token is below the server's clock in microseconds. Silence it with the option
    ``durability_warning=false`` once you have decided that this is acceptable.
    """


class RedisBackend(Backend[Grant]):
    """Locks on one Redis server, with fencing tokens and a fair (FIFO) waiter queue."""

    schemes = ("redis", "rediss")
    driver = "redis-py"
    capabilities = Capabilities(
        fencing=True, fifo=True, loss_detection=True, quorum=False, cross_process=True
    )

    def __init__(
        self,
        address: lua.Address,
        settings: lua.Settings,
        *,
        waiter_ttl: float = _DEFAULT_WAITER_TTL,
        durability_warning: bool = True,
    ) -> None:
        self.address = address
        self.settings = settings
        self.waiter_ttl = waiter_ttl
        self.durability_warning = durability_warning
        self._waiter_ttl_ms = max(1, lua.ttl_ms(waiter_ttl))
        self._wake_prefix = lua.wake_prefix(settings.prefix)
        self._pool: redis.asyncio.ConnectionPool | None = None
        self._lane: lua.Lane | None = None
        self._closed = False
        self._server_info: dict[str, str] = {}
        #: The server's run id (a new one at every start), if INFO may be read.
        self._run_id: str | None = None
        #: Leases granted and not released, by owner id: told at once when a restart lost them.
        self._held: dict[str, tuple[Grant, Callable[[str], None]]] = {}
        #: Background work: the restart watcher, clean-ups that wait for the server to answer.
        self._tasks: set[asyncio.Task[None]] = set()

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_url(cls, url: str, options: Mapping[str, object]) -> Self:
        try:
            parts = urlsplit(url)
            netloc = parts.netloc
        except ValueError as exc:
            raise InvalidURL(f"malformed Redis URL {redact(url)!r}: {exc}") from None
        scheme = parts.scheme.lower()
        if scheme not in cls.schemes:
            raise InvalidURL(f"{redact(url)!r} is not a redis:// or rediss:// URL")
        if parts.fragment:
            raise InvalidURL(f"{redact(url)!r}: a Redis URL has no #fragment; e.g. {_EXAMPLE}")
        username, password, hosts = lua.split_userinfo(netloc)
        if "," in hosts:
            raise InvalidURL(
                f"{redact(url)!r} lists several servers: redis:// is one server; for Redlock "
                "over several independent masters use redlock://h1:6379,h2:6379,h3:6379"
            )
        address = lua.parse_address(hosts or "localhost", redact(url), _EXAMPLE)
        db = lua.parse_db(parts.path, redact(url), _EXAMPLE)
        source = f"{scheme}://"
        opts = Options(options, source)
        settings = lua.common_settings(
            opts,
            source=source,
            db=db,
            username=username,
            password=password,
            tls=scheme == "rediss",
        )
        waiter_ttl = opts.number("waiter_ttl", _DEFAULT_WAITER_TTL, minimum=0.05)
        durability_warning = opts.flag("durability_warning", True)
        opts.finish((*lua.COMMON_OPTIONS, "waiter_ttl", "durability_warning"))
        return cls(address, settings, waiter_ttl=waiter_ttl, durability_warning=durability_warning)

    def describe(self) -> str:
        scheme = "rediss" if self.settings.tls else "redis"
        user = f"{self.settings.username}@" if self.settings.username else ""
        return f"{scheme}://{user}{self.address}/{self.settings.db}"

    def extra_info(self) -> Mapping[str, Any]:
        return {
            "prefix": self.settings.prefix,
            "waiter_ttl": self.waiter_ttl,
            "op_timeout": self.settings.op_timeout,
            **self._server_info,
        }

    # -- keys (public so that tests and tools can find a lock on the server) -----------------

    def lock_key(self, name: str) -> str:
        return lua.lock_key(self.settings.prefix, name)

    def token_key(self, name: str) -> str:
        return lua.token_key(self.settings.prefix, name)

    def queue_key(self, name: str) -> str:
        return lua.queue_key(self.settings.prefix, name)

    def _keys(self, name: str) -> list[str]:
        prefix = self.settings.prefix
        return [
            lua.lock_key(prefix, name),
            lua.token_key(prefix, name),
            lua.queue_key(prefix, name),
            lua.queue_ttl_key(prefix, name),
        ]

    # -- life cycle --------------------------------------------------------------------------

    async def open(self) -> None:
        if self._lane is not None or self._closed:
            raise RuntimeError("a RedisBackend can be opened once")
        pool = self._pool = self.settings.pool(self.address)
        lane = self._lane = lua.Lane(pool, self.settings.op_timeout)
        try:
            with map_exceptions(
                lua.ERRORS,
                f"cannot reach {self.describe()} (is redis-server running there, and are the "
                "host, port, user and password right?)",
            ):
                await lane.call("PING")
                await self._inspect_server(lane)
                # Load the scripts now, so that the first acquire costs one round trip.
                for script in (lua.TAKE, lua.RELEASE, lua.LEAVE, lua.RENEW, lua.HELD):
                    await lane.call("SCRIPT", "LOAD", script.text)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.aclose()
            raise
        self._spawn(self._watch_restarts())

    async def _inspect_server(self, lane: lua.Lane) -> None:
        """Check the version, and warn when the server can lose counters or held locks."""
        try:
            info = lua.as_text(await lane.call("INFO", "server"))
        except redis.exceptions.ResponseError:
            info = ""  # INFO disabled by ACL or rename-command: nothing to check
        for line in info.splitlines():
            key, _, value = line.partition(":")
            if key == "run_id":
                self._run_id = value.strip()
            if key == "redis_version":
                self._server_info["redis_version"] = value.strip()
                numbers = tuple(int(part) for part in value.split(".")[:2] if part.isdigit())
                if numbers < _MIN_VERSION:
                    raise UnsupportedFeature(
                        f"{self.describe()} runs Redis {value.strip()}; asynclock needs Redis "
                        f"{'.'.join(map(str, _MIN_VERSION))} or newer"
                    )
        settings: dict[str, str] = {}
        try:
            for key in ("appendonly", "appendfsync", "maxmemory", "maxmemory-policy"):
                reply = await lane.call("CONFIG", "GET", key)
                # A map (RESP3, or redis-py's parser) or a flat list of names and values.
                items = (
                    list(reply.items())
                    if isinstance(reply, dict)
                    else list(zip(reply[::2], reply[1::2], strict=True))
                )
                settings.update(
                    (lua.as_text(name).lower(), lua.as_text(value).lower()) for name, value in items
                )
        except redis.exceptions.ResponseError as exc:
            # CONFIG is often disabled on managed services: not knowing is not an error.
            logger.info(
                "asynclock: cannot read the persistence settings of %s (%s); the durability "
                "check is skipped",
                self.describe(),
                exc,
            )
            return
        self._server_info.update(settings)
        if self.durability_warning:
            problems = durability_problems(settings)
            if problems:
                warnings.warn(
                    RedisDurabilityWarning(
                        f"{self.describe()} can lose what the locks rely on: "
                        + "; ".join(problems)
                        + ". Pass durability_warning=false if that is acceptable (for example "
                        "for efficiency locks)"
                    ),
                    stacklevel=2,
                )

    async def aclose(self) -> None:
        self._closed = True
        self._held.clear()
        tasks, self._tasks = self._tasks, set()
        for task in tasks:
            task.cancel()
        if tasks:
            with anyio.CancelScope(shield=True), anyio.move_on_after(1.0):
                await asyncio.wait(tasks)
        lane, self._lane = self._lane, None
        if lane is not None:
            await lane.aclose()

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` in a task of its own until it ends or the backend closes."""
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _watch_restarts(self) -> None:
        """Hold one idle connection and learn at once when it ends: the server went away
        (restart, kill) or dropped it. After a restart (a new run id, or no run id to compare)
        every lease whose key is gone is reported lost now, not at its next renewal."""
        assert self._pool is not None
        first, pause = True, 0.05
        while not self._closed:
            conn = self._pool.make_connection()  # type: ignore[no-untyped-call]
            try:
                with anyio.fail_after(self.settings.op_timeout):
                    await conn.connect()
                    await conn.send_packed_command(lua.pack(("INFO", "server")), False)
                    try:
                        info = lua.as_text(await conn.read_response(timeout=math.inf))
                    except redis.exceptions.ResponseError:
                        info = ""  # INFO refused (ACL): every reconnect is then checked
                run_id = next(
                    (
                        line.partition(":")[2].strip()
                        for line in info.splitlines()
                        if line.startswith("run_id:")
                    ),
                    None,
                )
                restarted = not first and (run_id is None or run_id != self._run_id)
                if run_id is not None and run_id != self._run_id:
                    restarted = restarted or self._run_id is not None
                    self._run_id = run_id
                first, pause = False, 0.05
                if restarted and self._held:
                    await self._report_lost_after_restart()
                # Nothing is ever sent on this connection again: this read ends only when the
                # connection does.
                await conn.read_response(timeout=math.inf, disconnect_on_error=False)
            except Exception as exc:
                logger.debug("asynclock: restart watcher of %s: %r", self.describe(), exc)
            finally:
                if conn._writer is not None:
                    conn._writer.close()
                conn._reader = conn._writer = None
            await anyio.sleep(pause)
            pause = min(0.5, pause * 2)

    async def _report_lost_after_restart(self) -> None:
        held = list(self._held.values())
        reply = await self._script(
            lua.HELD,
            [self.lock_key(grant.name) for grant, _ in held],
            [grant.owner for grant, _ in held],
            f"checking {len(held)} lock(s) after a restart",
        )
        for (grant, on_lost), code in zip(held, lua.codes(reply, len(held)), strict=True):
            if code == 1 or grant.owner not in self._held:
                continue  # kept (the server has persistence), or released meanwhile
            what = "is gone" if code == 0 else "is held by another owner"
            on_lost(
                f"{self.describe()} restarted and the key of lock {grant.name!r} {what} "
                "(a restart without persistence forgets every lock)"
            )

    # -- the contract ------------------------------------------------------------------------

    def check_ttl(self, ttl: float) -> None:
        lua.check_ttl_ms(ttl, "redis://")

    def waiter_registry(self) -> WaiterRegistry:
        return _RedisWaiters(self)

    def _connected(self) -> lua.Lane:
        if self._lane is None:
            raise BackendUnavailable(f"{self.describe()} is closed (or was never opened)")
        return self._lane

    async def _script(
        self, script: lua.Script, keys: Sequence[str], args: Sequence[str | int], what: str
    ) -> Any:
        lane = self._connected()
        with map_exceptions(lua.ERRORS, f"{what} on {self.describe()}"):
            return await lane.script(script, keys, args)

    async def inspect(self, name: str) -> LockInfo:
        holder, ms_left, counter, waiters = await self._script(
            lua.INSPECT, self._keys(name), [], f"inspecting lock {name!r}"
        )
        if not holder:
            return LockInfo(name, held=False, waiters=int(waiters))
        # Every take bumps the counter, so while the key is held it is the holder's token.
        return LockInfo(
            name,
            held=True,
            owner=holder.decode() if isinstance(holder, bytes) else str(holder),
            token=int(counter) if counter is not None else None,
            expires_in=int(ms_left) / 1000 if int(ms_left) >= 0 else None,
            waiters=int(waiters),
        )

    def _undo_for(self, request: LockRequest) -> lua.Undo:
        """LEAVE for ``request``, sent as plain EVAL (it must not depend on the script cache)."""
        return lua.Undo(
            "EVAL",
            lua.LEAVE.text,
            4,
            *self._keys(request.name),
            request.owner,
            self._wake_prefix,
            self._waiter_ttl_ms,
        )

    async def _take_once(
        self, request: LockRequest, mode: str, undo: lua.Undo
    ) -> tuple[Grant | None, int]:
        ms = lua.ttl_ms(request.ttl)
        lane = self._connected()
        sent_at = anyio.current_time()
        with map_exceptions(lua.ERRORS, f"taking lock {request.name!r} on {self.describe()}"):
            reply = await lane.script(
                lua.TAKE,
                self._keys(request.name),
                [request.owner, self._wake_prefix, self._waiter_ttl_ms, ms, mode],
                undo,
            )
        taken, value = lua.codes(reply, 2)
        if taken:
            grant = Grant(request.name, request.owner, value, sent_at, ms / 1000)
            self._held[grant.owner] = (grant, request.on_lost)
            return grant, 0
        return None, value

    async def try_acquire(self, request: LockRequest) -> Grant | None:
        undo = self._undo_for(request)
        try:
            grant, _ = await self._take_once(request, "try", undo)
        except BaseException as exc:
            # Cancelled or failed with the take in flight: it may have run. Undo it.
            await self._clean_up(request, undo, exc)
            raise
        return grant

    async def acquire(self, request: LockRequest) -> Grant:
        lane = self._connected()
        wake_key = f"{self._wake_prefix}{request.owner}"
        refresh = self.waiter_ttl / 3.0
        undo = self._undo_for(request)
        try:
            while True:
                # Joins the queue (or refreshes our place) when the lock is not ours yet.
                grant, hint_ms = await self._take_once(request, "wait", undo)
                if grant is not None:
                    return grant
                if hint_ms >= 0:
                    # We are first and the holder's key expires in hint_ms (or the first waiter
                    # is silent and its place runs out then): look again just after that.
                    wait = min(refresh, hint_ms / 1000 + random.uniform(0.001, 0.003))
                else:
                    wait = refresh * random.uniform(0.8, 1.0)
                wait = max(wait, 0.001)
                with map_exceptions(
                    lua.ERRORS, f"waiting for lock {request.name!r} on {self.describe()}"
                ):
                    await lane.call(
                        "BLPOP", wake_key, f"{wait:.3f}", timeout=wait + self.settings.op_timeout
                    )
        except BaseException as exc:
            await self._clean_up(request, undo, exc)
            raise

    async def _clean_up(self, request: LockRequest, undo: lua.Undo, error: BaseException) -> None:
        """Leave nothing behind after an interrupted or failed acquire.

        A take interrupted in flight has its undo queued behind it on its own connection
        already (the server runs the two in order, whenever it gets to them): nothing to do.
        Otherwise (interrupted while waiting, or the connection failed), LEAVE is sent now,
        surviving any cancellation, or, when the server does not answer, in the background
        until it does; it never holds the caller for longer than one ``op_timeout``.
        """
        if not undo.sent or undo.queued:
            return
        if isinstance(error, BackendTimeout | TimeoutError):
            # The server did not answer in time: do not wait for it a second time.
            self._leave_later(request)
            return
        await finish(
            functools.partial(self._leave, request),
            timeout=self.settings.op_timeout,
            what=f"cleaning up after an acquire of {request.name!r} on {self.describe()}",
            unfinished=functools.partial(self._leave_later, request),
        )

    async def _leave(self, request: LockRequest) -> None:
        try:
            await self._leave_once(request)
        except Exception:
            self._leave_later(request)

    async def _leave_once(self, request: LockRequest) -> None:
        await self._script(
            lua.LEAVE,
            self._keys(request.name),
            [request.owner, self._wake_prefix, self._waiter_ttl_ms],
            f"cleaning up after an acquire of {request.name!r}",
        )

    def _leave_later(self, request: LockRequest) -> None:
        if self._closed:
            return
        self._spawn(self._keep_leaving(request))

    async def _keep_leaving(self, request: LockRequest) -> None:
        # Past this, whatever the acquire left has expired on the server by itself.
        keep = max(request.ttl, self.waiter_ttl) + self.settings.op_timeout
        give_up = anyio.current_time() + keep
        pause, problem = 0.05, None
        while anyio.current_time() < give_up:
            try:
                await self._leave_once(request)
            except Exception as exc:
                problem = exc
            else:
                return
            await anyio.sleep(pause)
            pause = min(1.0, pause * 2)
        logger.warning(
            "asynclock: could not clean up after an interrupted acquire of %r on %s (%s); "
            "the server drops what is left within %g s",
            request.name,
            self.describe(),
            problem,
            keep,
        )

    async def renew(self, grants: Sequence[Grant]) -> Sequence[RenewOutcome]:
        if not grants:
            return []
        keys = [self.lock_key(grant.name) for grant in grants]
        args: list[str | int] = [grant.owner for grant in grants]
        args += [lua.ttl_ms(grant.ttl) for grant in grants]
        sent_at = anyio.current_time()
        reply = await self._script(lua.RENEW, keys, args, f"renewing {len(grants)} lock(s)")
        outcomes: list[RenewOutcome] = []
        for grant, code in zip(grants, lua.codes(reply, len(grants)), strict=True):
            if code == 1:
                outcomes.append(Renewed(sent_at, grant.ttl))
            elif code == 0:
                outcomes.append(
                    Lost(
                        f"the key of lock {grant.name!r} is gone from {self.describe()} "
                        "(expired, deleted or evicted)"
                    )
                )
            else:
                outcomes.append(
                    Lost(f"lock {grant.name!r} is held by another owner on {self.describe()}")
                )
        return outcomes

    async def release(self, grant: Grant) -> None:
        self._held.pop(grant.owner, None)
        await self._script(
            lua.RELEASE,
            self._keys(grant.name),
            [grant.owner, self._wake_prefix, self._waiter_ttl_ms],
            f"releasing lock {grant.name!r}",
        )


class _RedisWaiters(WaiterRegistry):
    """Deadlock detection's records on the same server as the locks (see ``asynclock._deadlock``)."""

    def __init__(self, backend: RedisBackend) -> None:
        self._backend = backend
        prefix = backend.settings.prefix
        self._keys = [f"{prefix}{lua.WAITERS_KEY}", f"{prefix}{lua.WAITERS_TTL_KEY}"]

    async def publish(self, key: str, value: str, ttl: float) -> None:
        ms = max(1, lua.ttl_ms(ttl))
        await self._backend._script(
            lua.PUBLISH_WAITER, self._keys, [key, value, ms], "publishing a wait record"
        )

    async def withdraw(self, key: str) -> None:
        await self._backend._script(
            lua.WITHDRAW_WAITER, self._keys, [key], "withdrawing a wait record"
        )

    async def scan(self) -> list[str]:
        values = await self._backend._script(
            lua.SCAN_WAITERS, self._keys, [], "reading the wait records"
        )
        return [lua.as_text(value) for value in values]


def durability_problems(settings: Mapping[str, str]) -> list[str]:
    """What in ``CONFIG GET appendonly appendfsync maxmemory maxmemory-policy`` (lowercased)
    can lose fencing counters or held locks; empty when nothing can."""
    problems = []
    if settings.get("appendonly") == "no":
        problems.append(
            "appendonly is 'no', so a restart loses every held lock (another client can take a "
            "lock while its holder, told at once, is still stopping); set 'appendonly yes'"
        )
    elif settings.get("appendfsync") == "no":
        problems.append(
            "appendfsync is 'no', so a crash of the machine can lose the last ~30 s of writes, "
            "locks taken then among them; set 'appendfsync everysec' or 'always'"
        )
    policy = settings.get("maxmemory-policy", "noeviction")
    if settings.get("maxmemory", "0") not in ("0", "") and policy != "noeviction":
        what = "held locks and fencing counters" if policy.startswith("allkeys") else "held locks"
        problems.append(
            f"maxmemory-policy is {policy!r}, so under memory pressure Redis may evict {what}; "
            "set 'maxmemory-policy noeviction'"
        )
    return problems
