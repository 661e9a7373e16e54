"""Finding the master through Redis Sentinel, for ``redis+sentinel://``.

The sentinels are asked ``SENTINEL get-master-addr-by-name <service>`` in turn (the first that
answers is asked first next time, as redis-py's ``Sentinel`` does), and every new connection to
the address they name checks ``ROLE`` before it is used: a sentinel's view can lag a failover,
and a demoted master that is still reachable must not take writes. The address is remembered
until a connection to it fails, times out, finds a replica there, or gets ``READONLY``: then the
next connection asks the sentinels again. So a failover costs the calls in flight on the old
master (they fail or time out, and the core retries renewals), not a reconnect of the client.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import redis.asyncio
import redis.exceptions

from .._kit import Backoff, HostPort, RetryPolicy
from ._scripts import as_text
from ._urls import Settings
from ._wire import Dialled, close_now

logger = logging.getLogger("asynclock")
#: Pauses between two sentinels told to report failovers.
_WATCH = RetryPolicy(first=0.05, cap=1.0, factor=2.0, jitter=0.2)


class MasterLocator:
    """Where the master of ``service`` is, as the sentinels say; shared by one client's
    connections. Never raises anything but redis-py's errors (the lane translates them)."""

    def __init__(
        self,
        sentinels: Sequence[HostPort],
        service: str,
        *,
        op_timeout: float,
        username: str | None = None,
        password: str | None = None,
    ) -> None:
        self.sentinels = list(sentinels)
        self.service = service
        self._op_timeout = op_timeout
        self._username = username
        self._password = password
        self._master: HostPort | None = None
        #: The master before the last ``forget``: a lookup that names another one retires
        #: the connections to it.
        self._last: HostPort | None = None
        self._connections: weakref.WeakSet[MasterConnection] = weakref.WeakSet()
        self._lookup: anyio.Lock | None = None
        #: A call got no reply in time: the next read on any connection asks the sentinels
        #: first (a frozen master gives no error that would make a connection ask).
        self.suspect = False

    @property
    def current(self) -> HostPort | None:
        """The master's address as last learnt, or None until the first lookup."""
        return self._master

    async def verify(self) -> HostPort | None:
        """Ask the sentinels now (after a call got no reply in time): the master they name,
        or None if none answers (then what was known stays, and so do its connections)."""
        self.suspect = False
        known, self._master = self._master, None
        try:
            return await self.master()
        except redis.exceptions.ConnectionError:
            self._master = self._master or known
            return None

    def forget(self, address: HostPort | None) -> None:
        """``address`` failed us: ask the sentinels again on the next connection (unless a
        newer lookup already moved on from it)."""
        if address is None or self._master == address:
            self._master = None

    async def master(self) -> HostPort:
        if self._master is not None:
            return self._master
        if self._lookup is None:
            self._lookup = anyio.Lock()
        # One lookup at a time: the connections that fail together after a failover would
        # otherwise each ask every sentinel.
        async with self._lookup:
            if self._master is not None:
                return self._master
            return await self._look_up()

    async def _look_up(self) -> HostPort:
        errors: list[str] = []
        for index, sentinel in enumerate(list(self.sentinels)):
            try:
                address = await self._ask(sentinel)
            except (OSError, TimeoutError, redis.exceptions.RedisError) as exc:
                errors.append(f"{sentinel}: {exc or type(exc).__name__}")
                continue
            if address is None:
                errors.append(f"{sentinel}: monitors no master named {self.service!r}")
                continue
            if index:
                # The sentinel that answered is asked first from now on.
                self.sentinels.insert(0, self.sentinels.pop(index))
            self._switch(address)
            return address
        raise redis.exceptions.ConnectionError(
            f"no sentinel named the master of {self.service!r} ({'; '.join(errors)}); check "
            "the sentinel addresses and the service name (sentinel monitor <name> ...)"
        )

    def register(self, conn: MasterConnection) -> None:
        self._connections.add(conn)

    def _retire(self, master: HostPort) -> None:
        """The master moved: close every connection to another server, idle or busy, so that
        none is used again. A demoted master still answers reads (a renewal's check, an
        inspect) from the data it is resyncing, and a paused one answers nothing. A busy call
        gets a connection error, which the lane retries on a new connection."""
        for conn in list(self._connections):
            if conn.address != master:
                close_now(conn)

    async def watch(self) -> None:
        """Listen for ``+switch-master`` on one sentinel after another, for ever (the
        backend's task host runs it): a failover is then followed as soon as the sentinels
        end it, also by a client that has nothing in flight to time out on."""
        backoff = _WATCH.backoff()
        while True:
            for sentinel in list(self.sentinels):
                try:
                    await self._listen(sentinel, backoff)
                except (OSError, TimeoutError, redis.exceptions.RedisError) as exc:
                    logger.debug("asynclock: sentinel %s stopped telling: %r", sentinel, exc)
                await anyio.sleep(backoff.next_delay())

    async def _listen(self, sentinel: HostPort, backoff: Backoff) -> None:
        conn = self._connection(sentinel)
        try:
            with anyio.fail_after(self._op_timeout):
                await conn.connect()  # type: ignore[no-untyped-call]
                await conn.send_command("SUBSCRIBE", "+switch-master")
                await conn.read_response()
            backoff.reset()
            while True:
                message = await conn.read_response(timeout=None)
                if not isinstance(message, list) or len(message) < 3:
                    continue
                # "<service> <old ip> <old port> <new ip> <new port>"
                words = as_text(message[2]).split()
                if len(words) == 5 and words[0] == self.service:
                    self._switch(HostPort(words[3], int(words[4])))
        finally:
            close_now(conn)

    def _switch(self, master: HostPort) -> None:
        if master != self._last:
            self._retire(master)
        self._master = self._last = master

    def _connection(self, sentinel: HostPort) -> redis.asyncio.Connection:
        return redis.asyncio.Connection(
            host=sentinel.host,
            port=sentinel.port,
            username=self._username,
            password=self._password,
            socket_timeout=None,
            socket_connect_timeout=self._op_timeout,
        )

    async def _ask(self, sentinel: HostPort) -> HostPort | None:
        conn = self._connection(sentinel)
        try:
            # One bound for connect and reply: a paused sentinel must not hold the lookup.
            with anyio.fail_after(self._op_timeout):
                await conn.connect()  # type: ignore[no-untyped-call]
                await conn.send_command("SENTINEL", "get-master-addr-by-name", self.service)
                reply = await conn.read_response()
        finally:
            close_now(conn)  # no await: a cancelled lookup must not leave the socket open
        if not reply:
            return None
        host, port = (as_text(part) for part in reply)
        return HostPort(host, int(port))


class MasterConnection(Dialled):
    """A connection to whichever server the sentinels name as master, checked with ``ROLE``.

    A failure while connecting, a server that is not (or no longer) a master, and ``READONLY``
    (the master was demoted while we were connected) all make the locator ask again, and the
    last two raise ``ConnectionError``, which the lane answers by retrying on a new connection.
    """

    def __init__(self, *, locator: MasterLocator, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._locator = locator
        #: The server this connection was made to.
        self.address: HostPort | None = None

    async def dial(self, open_socket: Callable[[], Any]) -> None:
        self.address = await self._locator.master()
        self.host, self.port = self.address.host, self.address.port
        try:
            await open_socket()
        except BaseException:
            self._locator.forget(self.address)
            raise
        self._locator.register(self)

    async def on_connect(self) -> None:
        try:
            await super().on_connect()
            await self.send_command("ROLE")
            role = await self.read_response()
        except BaseException:
            self._locator.forget(self.address)
            raise
        if not isinstance(role, list) or not role or as_text(role[0]) != "master":
            self._locator.forget(self.address)
            shown = as_text(role[0]) if isinstance(role, list) and role else role
            raise redis.exceptions.ConnectionError(
                f"{self.address} is a {shown}, not the master of "
                f"{self._locator.service!r} (a failover is under way)"
            )

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        if self._locator.suspect:
            master = await self._locator.verify()
            if master is not None and master != self.address:
                raise redis.exceptions.ConnectionError(
                    f"{self.address} is no longer the master of {self._locator.service!r}: "
                    f"the sentinels name {master}"
                )
        try:
            return await super().read_response(*args, **kwargs)
        except redis.exceptions.ReadOnlyError as exc:
            self._locator.forget(self.address)
            raise redis.exceptions.ConnectionError(
                f"{self.address} was the master of {self._locator.service!r} and is a "
                "replica now (READONLY)"
            ) from exc
        except redis.exceptions.BusyLoadingError:
            raise  # the right server, still loading its data: retried as a connection error
        except (OSError, redis.exceptions.ConnectionError):
            self._locator.forget(self.address)
            raise
        except anyio.get_cancelled_exc_class():
            # The lane's bound ran out (or the caller gave up): perhaps a frozen master.
            self._locator.suspect = True
            raise


@dataclass(frozen=True, slots=True)
class SentinelSettings(Settings):
    """:class:`Settings` whose connections find the master through the sentinels."""

    locator: MasterLocator | None = None

    def pool(self, address: HostPort, *_: Any, **__: Any) -> redis.asyncio.ConnectionPool:
        # ``address`` is where the sentinels last saw the master; each connection asks anew.
        return Settings.pool(self, address, MasterConnection, locator=self.locator)
