"""The gRPC channel to etcd and every call made on it: deadlines, re-authentication, and the
resend after a broken connection, no leader, or a leader change.

Every request the backend sends is safe to repeat (guarded creates and deletes of keys unique
to one acquisition, reads, keepalives, grants of a lease id we chose), so :meth:`Wire.call`
sends it again, until ``op_timeout`` is spent:

* at once, when etcd has elected a leader of a later term since it was sent (a write that a
  follower forwarded to a leader that just died is never answered: etcd drops it and would
  wait out its own request timeout, 5 s plus two election timeouts);
* after a short pause (from one :class:`RetryPolicy`), when the connection broke under it or
  etcd had no leader (``UNAVAILABLE``); "nothing listens" only for a second, so that a wrong
  URL still fails fast.

gRPC errors become asynclock's at one boundary, :meth:`Wire.call`, through one translator.
"""

from __future__ import annotations

import asyncio
import gc
import ipaddress
import math
import socket
from collections.abc import Callable, Coroutine
from typing import Any, Final, Protocol, TypeVar

import anyio
import grpc
from aetcd import rpc

from .._kit import (
    BackendUnavailable,
    InvalidArgument,
    MayHaveApplied,
    RetryPolicy,
    TaskHost,
    UnsupportedFeature,
    translate,
)
from ._errors import Superseded, etcd_errors, retry_soon, token_rejected, unreachable
from ._proto import prefix_end
from ._urls import DEFAULT_PORT, Settings

__all__ = ("SLOW_CALL", "TERM_POLL", "Keep", "Metadata", "Wire")

T = TypeVar("T")
Metadata = tuple[tuple[str, str], ...]
#: ``call(metadata, timeout)``: a unary gRPC call, or a coroutine (timeout None: no deadline).
Call = Callable[[Metadata, float | None], Any]

#: A call not answered within this long makes the client ask etcd whether a new leader was
#: elected since it was sent (then it is sent again); etcd answers a healthy call in
#: milliseconds.
SLOW_CALL: Final = 0.25
#: How often a slow call asks again.
TERM_POLL: Final = 0.1
#: How long a call goes on retrying while no endpoint accepts connections: enough to
#: reconnect after a connection reset, short enough that a wrong URL fails fast.
_UNREACHABLE_GRACE: Final = 1.0
#: Pauses between sends of one call after a broken connection or no leader.
_RESEND = RetryPolicy(first=0.02, cap=0.25)

_CHANNEL_OPTIONS: Final = (
    # Spread calls over every endpoint and skip the ones that are down: fail over at once.
    ("grpc.lb_policy_name", "round_robin"),
    # gRPC backs off up to 120 s between reconnects by default; a restarted member must be
    # usable again within a second. (Not grpc.min_reconnect_backoff_ms: it is also the time
    # a connection attempt may take.)
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # Find dead connections under idle watches (etcd accepts pings every 5 s or slower).
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
)


def _status_readers_of_finished_calls() -> list[asyncio.Task[Any]]:
    """gRPC's tasks still reading the status of a call that is already done (cancelled).

    gRPC gives no handle on these tasks: each is found by its coroutine's name, and its call by
    the coroutine's references (the call is the ``self`` of its Cython closure). A call not done
    yet (another channel's open stream) is not waited for. Anything unlike that finds nothing.
    """
    found = []
    for task in asyncio.all_tasks():
        coroutine = task.get_coro()
        if getattr(coroutine, "__qualname__", "") != "_AioCall._handle_status_once_received":
            continue
        for scope in gc.get_referents(coroutine):
            calls = [each for each in gc.get_referents(scope) if _is_done_call(each)]
            if calls:
                found.append(task)
                break
    return found


def _is_done_call(candidate: object) -> bool:
    done = getattr(candidate, "done", None)
    return type(candidate).__name__ == "_AioCall" and callable(done) and done() is True


class Keep(Protocol):
    """A request that may create a key (an acquisition's take): not cancelled on the wire when
    its caller is cancelled, and marked ``ambiguous`` when it was sent more than once."""

    inflight: Any
    ambiguous: bool


class Wire:
    """One channel, its stubs and credentials, and the calls made on it."""

    def __init__(self, settings: Settings, host: TaskHost) -> None:
        self.settings = settings
        self.describe = settings.describe()
        self._host = host
        self.channel: Any = None
        self.kv: Any = None
        self.lease: Any = None
        self.watch: Any = None
        self._auth: Any = None
        self._maintenance: Any = None
        self.metadata: Metadata = ()
        self.server_version: str | None = None
        #: The highest raft term seen in a reply, and in a Status probe with a leader.
        self.term = 0
        self._leader_term = 0
        self._probed_at = -math.inf
        self._probing: anyio.Event | None = None
        #: While the backend opens: calls go on for as long as the client's ``connect_timeout``
        #: lets them (the caller's scope), not ``op_timeout``.
        self.connecting = False
        self.errors = etcd_errors(
            op_timeout=settings.op_timeout,
            prefix=settings.prefix,
            default_port=DEFAULT_PORT,
            closed=lambda: self.channel is None,
        )

    # -- the channel -------------------------------------------------------------------------

    async def open(self) -> None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            raise UnsupportedFeature(
                "the etcd:// backend needs asyncio (gRPC's asyncio API); run it under asyncio, "
                "not trio"
            ) from None
        credentials = await self._credentials()
        with translate(self.errors, f"resolving the hosts of {self.describe}"):
            target, authority = await self._target()
        options = list(_CHANNEL_OPTIONS)
        server_name = self.settings.tls_server_name or authority
        if self.settings.tls and server_name:
            options.append(("grpc.ssl_target_name_override", server_name))
        if credentials is not None:
            self.channel = grpc.aio.secure_channel(target, credentials, options=options)
        else:
            self.channel = grpc.aio.insecure_channel(target, options=options)
        self.kv = rpc.KVStub(self.channel)
        self.lease = rpc.LeaseStub(self.channel)
        self.watch = rpc.WatchStub(self.channel)
        self._auth = rpc.AuthStub(self.channel)
        self._maintenance = rpc.MaintenanceStub(self.channel)
        # A server slow to answer now (many clients starting at once, a loaded host) is waited
        # for until connect_timeout; nothing listening still fails within a second.
        self.connecting = True
        if self.settings.user is not None:
            await self.authenticate()
        status = await self.unary("connecting", self._maintenance.Status, rpc.StatusRequest())
        self.server_version = str(status.version)
        # A linearizable read: proves there is a leader (a quorum), and, with auth, that we may
        # read our prefix.
        prefix = self.settings.prefix.encode("utf-8")
        await self.unary(
            "reading the lock prefix",
            self.kv.Range,
            rpc.RangeRequest(key=prefix, range_end=prefix_end(prefix), count_only=True),
        )
        self.connecting = False

    async def close(self) -> None:
        channel, self.channel = self.channel, None
        if channel is not None:
            await channel.close()
            # gRPC reads the status of each streaming call (watch, keepalive) in a task of its
            # own, which ends a few loop turns after the call is cancelled, when gRPC's poller
            # thread hands the status over. An event loop that closes before that leaves the
            # task pending, and the poller then fails on the closed loop inside whatever loop
            # runs gRPC next (grpc/grpc#34139: "Event loop is closed").
            finishing = _status_readers_of_finished_calls()
            if finishing:
                await asyncio.wait(finishing, timeout=1.0)

    async def _credentials(self) -> Any:
        settings = self.settings
        if not settings.tls:
            return None

        async def read(path: str | None, option: str) -> bytes | None:
            if path is None:
                return None
            try:
                return await anyio.Path(path).read_bytes()
            except OSError as exc:
                raise InvalidArgument(
                    f"option {option!r} of etcd:// names {path!r}, which cannot be read: {exc}"
                ) from None

        return grpc.ssl_channel_credentials(
            root_certificates=await read(settings.ca_cert, "ca_cert"),
            private_key=await read(settings.cert_key, "cert_key"),
            certificate_chain=await read(settings.cert_cert, "cert_cert"),
        )

    async def _target(self) -> tuple[str, str | None]:
        """The gRPC target, and the name TLS should verify when the target has none."""
        hosts = self.settings.hosts
        if len(hosts) == 1:
            return str(hosts[0]), None
        v4: list[str] = []
        v6: list[str] = []
        for entry in hosts:
            if entry.family is not None:
                addresses = [ipaddress.ip_address(entry.host)]
            else:
                infos = await anyio.getaddrinfo(entry.host, entry.port, type=socket.SOCK_STREAM)
                addresses = [ipaddress.ip_address(info[4][0]) for info in infos]
            for address in dict.fromkeys(addresses):
                if address.version == 4:
                    v4.append(f"{address}:{entry.port}")
                else:
                    v6.append(f"[{address}]:{entry.port}")
        target = f"ipv4:{','.join(v4)}" if v4 else f"ipv6:{','.join(v6)}"
        return target, hosts[0].host

    async def authenticate(self) -> None:
        user = self.settings.user
        with translate(self.errors, f"authenticating as {user!r} on {self.describe}"):
            try:
                reply = await self._await_unary(
                    self._auth.Authenticate(
                        rpc.AuthenticateRequest(name=user, password=self.settings.password),
                        timeout=None if self.connecting else self.settings.op_timeout,
                    )
                )
            except grpc.aio.AioRpcError as exc:
                if "authentication is not enabled" in (exc.details() or ""):
                    self.metadata = ()
                    return
                raise
        self.metadata = (("token", str(reply.token)),)

    # -- calls -------------------------------------------------------------------------------

    def unary(
        self,
        what: str,
        method: Callable[..., Any],
        request: Any,
        *,
        keep: Keep | None = None,
        retry: bool = True,
    ) -> Coroutine[Any, Any, Any]:
        """:meth:`call` of a stub's unary ``method`` with ``request`` (a plain function that
        returns :meth:`call`'s coroutine: no coroutine of its own on every request)."""
        return self.call(
            what,
            lambda md, timeout: method(request, timeout=timeout, metadata=md),
            keep=keep,
            retry=retry,
        )

    def txn(
        self, what: str, request: Any, *, keep: Keep | None = None, retry: bool = True
    ) -> Coroutine[Any, Any, Any]:
        return self.unary(what, self.kv.Txn, request, keep=keep, retry=retry)

    async def call(
        self, what: str, call: Call, *, keep: Keep | None = None, retry: bool = True
    ) -> Any:
        """Make a call within ``op_timeout`` in all (sent again as the module docs say, with
        ``retry``), and translate its errors; re-authenticates once when etcd has dropped our
        token.

        With ``keep``, a cancelled call is not cancelled on the wire but left to finish, in
        ``keep.inflight``: it may create a key, and the clean-up must delete it only after etcd
        has applied it (the delete travels on another stream and could overtake it).
        """
        if self.channel is None:
            raise BackendUnavailable(f"{what}: {self.describe} is closed")
        try:
            with translate(self.errors, f"{what} on {self.describe}"):
                return await self._send(call, keep, retry)
        except MayHaveApplied:
            if keep is not None:
                keep.ambiguous = True
            raise

    async def _send(self, call: Call, keep: Keep | None, retry: bool) -> Any:
        """:meth:`call` without the translation: raises gRPC's own errors."""
        deadline = math.inf if self.connecting else anyio.current_time() + self.settings.op_timeout
        reauthenticated = False
        unreachable_since: float | None = None
        pauses = _RESEND.backoff()
        while True:
            term = self.term
            try:
                left = None if deadline == math.inf else max(0.001, deadline - anyio.current_time())
                pending = call(self.metadata, left)
                if isinstance(pending, grpc.aio.Call):
                    reply = await self._await_unary(pending, keep, term if retry else None)
                else:
                    reply = await pending
            except Superseded:
                if keep is not None:
                    keep.ambiguous = True
                continue
            except grpc.aio.AioRpcError as exc:
                if self.settings.user is not None and token_rejected(exc) and not reauthenticated:
                    reauthenticated = True
                    await self.authenticate()
                    continue
                now = anyio.current_time()
                if not retry or self.channel is None or not retry_soon(exc):
                    raise
                if unreachable(exc):
                    unreachable_since = now if unreachable_since is None else unreachable_since
                    if now - unreachable_since >= _UNREACHABLE_GRACE:
                        raise
                pause = pauses.next_delay()
                if now + pause >= deadline:
                    raise
                if keep is not None:
                    keep.ambiguous = True  # it may have reached etcd before the error
                await anyio.sleep(pause)
                continue
            header = getattr(reply, "header", None)
            if header is not None:
                self.term = max(self.term, int(header.raft_term))
            return reply

    async def _await_unary(
        self, call: Any, keep: Keep | None = None, term: int | None = None
    ) -> Any:
        """Await a unary gRPC call; cancel it if we are cancelled, unless ``keep``. With
        ``term``: give it up (:class:`Superseded`) once it has been slow for a while and etcd
        has a leader of a term later than ``term``.

        grpc.aio answers a cancellation with a bare ``CancelledError`` of its own, without the
        message by which anyio recognises its cancel scopes' cancellations, so anyio would let
        it escape ``move_on_after`` and friends. Waiting on an anyio event keeps cancellation
        anyio's.
        """
        if not call.done():
            done = anyio.Event()
            call.add_done_callback(lambda _call: done.set())
            try:
                if term is None:
                    await done.wait()
                    superseded = False
                else:
                    superseded = await self.superseded(done, term)
            except BaseException:
                if keep is not None:
                    keep.inflight = call
                else:
                    call.cancel()
                raise
            if superseded and not call.done():
                call.cancel()
                raise Superseded
        return await call

    async def superseded(self, done: anyio.Event, term: int) -> bool:
        """Wait for ``done``; True (without waiting further) if it is slow and etcd has elected
        a leader of a term after ``term`` meanwhile."""
        with anyio.move_on_after(SLOW_CALL):
            await done.wait()
        while not done.is_set():
            if await self._new_leader_since(term):
                return True
            with anyio.move_on_after(TERM_POLL):
                await done.wait()
        return False

    async def _new_leader_since(self, term: int) -> bool:
        """Whether etcd has elected a leader in a term after ``term`` (one ``Status`` probe,
        shared by every slow call of this client)."""
        now = anyio.current_time()
        if now - self._probed_at >= TERM_POLL / 2.0 and self._probing is None:
            self._probing = anyio.Event()
            try:
                status = await self._await_unary(
                    self._maintenance.Status(
                        rpc.StatusRequest(), timeout=TERM_POLL * 2.0, metadata=self.metadata
                    )
                )
            except grpc.aio.AioRpcError:
                pass
            else:
                if int(status.leader):
                    self._leader_term = max(self._leader_term, int(status.raftTerm))
            finally:
                self._probed_at = anyio.current_time()
                self._probing.set()
                self._probing = None
        elif self._probing is not None:
            await self._probing.wait()
        return self._leader_term > term


async def ended(call: Any, timeout: float) -> bool:
    """Wait up to ``timeout`` for a unary gRPC call to end, never cancelling it (a cancelled
    wait leaves it running); whether it ended with an answer (so etcd applied it or refused
    it, and will not apply it later)."""
    if not call.done():
        done = anyio.Event()
        call.add_done_callback(lambda _call: done.set())
        with anyio.move_on_after(timeout):
            await done.wait()
        if not call.done():
            return False
    if call.cancelled():
        return False
    return bool(await call.code() == grpc.StatusCode.OK)
