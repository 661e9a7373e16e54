"""``etcd://host:port[,host:port...]``: locks in etcd v3 (the recipe of Go's ``concurrency`` package).

How a lock works here:

* Every client keeps **one etcd lease per distinct ttl** (in whole seconds), granted on the first
  acquire with that ttl and revoked when the client closes. Every key the client creates rides on
  it, so renewing a thousand held locks costs one keepalive per lease (plus one batched read that
  checks the keys are still there), like Go's ``concurrency.Session``.
* Taking ``name`` creates ``<prefix><percent-encoded name>/<lease id>-<owner id>`` on our lease,
  in a transaction guarded by ``create_revision == 0``. The key's create revision is the fencing
  token: etcd's revision is one counter for the whole cluster, so tokens strictly increase. The
  owner id (random per acquisition) makes the key unique, so two acquisitions of one name from one
  client (same lease) are two queue entries that exclude each other like any others.
* The holder is the key with the lowest create revision under the name. A waiter watches only
  the key just before its own for its DELETE (FIFO, no thundering herd), and before reporting
  success re-reads, in one linearizable read, that its own key still exists with its create
  revision (so it is on a live lease: etcd#11456 granted locks on dead leases) and that no lower
  key is left.
* Release deletes our key in a transaction guarded on its create revision. An acquire that is
  cancelled deletes the key it may have created, once its create request is done; both
  clean-ups go through :func:`asynclock._shield.finish`, so they finish whatever cancels the
  caller, a native ``Task.cancel()`` included (bounded by twice ``op_timeout``). A delete that
  fails is retried by the client's later acquires, renewals and waits; the key dies with its
  lease in any case.
* Every request is safe to send twice, so a call is sent again within ``op_timeout`` when the
  connection broke or etcd had no leader, and at once when etcd elected a new leader since it
  was sent (after a leader kill, a forwarded write is otherwise never answered).

The backend runs no task of its own: held locks are renewed by the client's supervisor
(``renew``), and waiters refresh the lease their queue entry rides on (one of them at a time).

It talks to etcd through aetcd's generated gRPC stubs (``aetcd.rpc``) on a ``grpc.aio`` channel
of its own: aetcd's ``Client`` has no TLS, no range limits or create-revision filters, no
keepalive stream, and its watcher returns errors instead of raising them.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import math
import random
import secrets
import socket
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Self, TypeVar
from urllib.parse import quote, unquote

import anyio
import grpc
from aetcd import rpc
from aetcd import transactions as aetcd_transactions

from .._errors import (
    BackendTimeout,
    BackendUnavailable,
    InvalidArgument,
    InvalidURL,
    LeaseLost,
    LockError,
    UnsupportedFeature,
    map_exceptions,
)
from .._lease import Lease
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
    Unknown,
)

if TYPE_CHECKING:
    from .._client import LockClient

__all__ = ("EtcdBackend", "EtcdGrant", "fence_compare", "fenced_txn")

T = TypeVar("T")
Metadata = tuple[tuple[str, str], ...]

DEFAULT_PORT: Final = 2379
DEFAULT_PREFIX: Final = "/asynclock/"
#: etcd never grants a lease shorter than 1.5 election timeouts, rounded up to whole seconds:
#: 2 s with the default settings. A shorter ttl would silently live longer than asked.
MIN_TTL: Final = 2
#: etcd's own ceiling (``lease.MaxLeaseTTL``).
MAX_TTL: Final = 9_000_000_000

_URL_EXAMPLE = "etcd://127.0.0.1:2379 or etcd://10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379"
_KNOWN_OPTIONS = (
    "prefix",
    "op_timeout",
    "user",
    "password",
    "tls",
    "ca_cert",
    "cert_cert",
    "cert_key",
    "tls_server_name",
)
#: Key reads per renewal transaction; below etcd's default ``--max-txn-ops`` (128).
_KEYS_PER_TXN = 64
#: A waiter re-reads the queue this often even without a watch event (a belt to the braces of
#: watch revisions and gRPC keepalive pings).
_RECHECK_EVERY = 30.0
#: When the next waiter's watch may be unsynced (see ``_after_watch``), it looks again after these
#: delays (seconds from the watch's start), covering etcd's 100 ms catch-up period.
_UNSYNCED_POLLS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.07, 0.11)
_BACKOFF_MIN = 0.02
_BACKOFF_MAX = 1.0
#: A call not answered within this long makes the client ask etcd whether a new leader was
#: elected since it was sent (then it is sent again); etcd answers a healthy call in
#: milliseconds.
_SLOW_CALL = 0.25
#: How often a slow call asks again.
_TERM_POLL = 0.1
#: How long a call goes on retrying while no endpoint accepts connections: enough to
#: reconnect after a connection reset, short enough that a wrong URL fails fast.
_UNREACHABLE_GRACE = 1.0

_TRANSIENT_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.CANCELLED,
    }
)

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


@dataclass(eq=False, slots=True)
class EtcdGrant(Grant):
    """A lock held in etcd. ``token`` is the create revision of ``key``, our key on lease
    ``lease_id``; a transaction that compares ``create_revision(key) == token`` commits only
    while we hold the lock (see :func:`fence_compare` and :func:`fenced_txn`)."""

    key: bytes
    lease_id: int
    on_lost: Callable[[str], None] = field(repr=False)


class _EtcdLease:
    """One etcd lease of this client; every key of one ttl bucket rides on it."""

    __slots__ = (
        "bucket",
        "dead",
        "held",
        "id",
        "refreshing",
        "retry_at",
        "ttl",
        "valid_from",
    )

    def __init__(self, lease_id: int, bucket: int, ttl: int, valid_from: float) -> None:
        self.id = lease_id
        self.bucket = bucket
        #: As granted by the server (at least the bucket).
        self.ttl = ttl
        #: When the last grant or keepalive that etcd answered with a ttl was sent: the lease
        #: lives at least until ``valid_from + ttl``.
        self.valid_from = valid_from
        self.dead = False
        self.held: set[EtcdGrant] = set()
        self.refreshing = False
        #: After a keepalive that proved nothing, waiters try again no earlier than this.
        self.retry_at = 0.0

    def fresh(self, now: float) -> bool:
        """Refreshed within the last half of its ttl: good for a new grant (the supervisor
        renews it at once), and no keepalive of its own when locks are taken back to back."""
        return not self.dead and now < self.valid_from + self.ttl / 2.0

    def refresh_due(self) -> float:
        return max(self.valid_from + self.ttl / 3.0, self.retry_at)


@dataclass(slots=True)
class _Attempt:
    """One acquisition's place in the queue."""

    request: LockRequest
    bucket: int
    prefix: bytes
    end: bytes
    lease: _EtcdLease | None = None
    #: Set just before the request that may create it is sent: from then on it may exist.
    key: bytes | None = None
    #: Its create revision once known (0 while unknown).
    rev: int = 0
    #: A request that may create ``key``, still in flight when we were cancelled.
    inflight: Any = None
    #: A request that may have created ``key`` failed or was given up (and sent again).
    ambiguous: bool = False


@dataclass(frozen=True, slots=True)
class _Place:
    """Where our key stands, as one read saw it."""

    #: The key just before ours; None when ours is the lowest (we hold the lock).
    predecessor: bytes | None
    #: The key before ours is the lowest: we are next.
    next_in_line: bool
    #: The revision of the read.
    seen: int


class _Superseded(Exception):
    """etcd elected a new leader while a call waited for its answer: send it again."""


class _LeaseMissing(BackendUnavailable):
    """etcd says our lease does not exist (expired or revoked); handled inside this module."""


class _Backoff:
    """Retry transient failures with capped, jittered backoff until ``window`` seconds of them."""

    def __init__(self, window: float) -> None:
        self.window = window
        self.since: float | None = None
        self.delay = _BACKOFF_MIN

    def reset(self) -> None:
        self.since = None
        self.delay = _BACKOFF_MIN

    async def pause(self, exc: BaseException) -> None:
        now = anyio.current_time()
        if self.since is None:
            self.since = now
        elif now - self.since >= self.window:
            raise exc
        await anyio.sleep(self.delay * random.uniform(0.5, 1.0))
        self.delay = min(self.delay * 2.0, _BACKOFF_MAX)


class EtcdBackend(Backend[EtcdGrant]):
    """Locks in etcd v3. Made by ``asynclock.connect("etcd://...")``; see docs/backends/etcd.md."""

    schemes = ("etcd",)
    driver = "gRPC (grpc.aio, through aetcd)"
    capabilities = Capabilities(
        fencing=True, fifo=True, loss_detection=True, quorum=True, cross_process=True
    )

    def __init__(
        self,
        endpoints: Sequence[tuple[str, int]],
        *,
        prefix: str = DEFAULT_PREFIX,
        op_timeout: float = 5.0,
        user: str | None = None,
        password: str | None = None,
        tls: bool = False,
        ca_cert: str | None = None,
        cert_cert: str | None = None,
        cert_key: str | None = None,
        tls_server_name: str | None = None,
    ) -> None:
        if not endpoints:
            raise InvalidURL(f"etcd:// needs at least one host, for example {_URL_EXAMPLE}")
        if not prefix.endswith("/"):
            raise InvalidArgument(
                f"option 'prefix' of etcd:// must end with '/' (got {prefix!r}), so that the "
                "keys of two prefixes never overlap: for example prefix=/myapp/locks/"
            )
        if (user is None) != (password is None):
            raise InvalidArgument("etcd:// needs both 'user' and 'password', or neither")
        if (cert_cert is None) != (cert_key is None):
            raise InvalidArgument(
                "etcd:// needs both 'cert_cert' (client certificate) and 'cert_key' (its "
                "private key), or neither"
            )
        self.endpoints = tuple(endpoints)
        self.prefix = prefix
        self.op_timeout = op_timeout
        self.user = user
        self._password = password
        self.tls = tls or ca_cert is not None or cert_cert is not None
        self._ca_cert = ca_cert
        self._cert_cert = cert_cert
        self._cert_key = cert_key
        self._tls_server_name = tls_server_name
        self._prefix = prefix.encode("utf-8")

        self._channel: Any = None
        self._kv: Any = None
        self._lease_stub: Any = None
        self._watch_stub: Any = None
        self._auth_stub: Any = None
        self._maintenance: Any = None
        self._metadata: Metadata = ()
        self._server_version: str | None = None
        self._closed = False
        #: The highest raft term seen in a reply, and in a Status probe with a leader.
        self._term = 0
        self._leader_term = 0
        self._probed_at = -math.inf
        self._probing: anyio.Event | None = None

        #: The lease new acquisitions of each ttl bucket (whole seconds) go on.
        self._current: dict[int, _EtcdLease] = {}
        #: Every lease of ours not known to be gone, by id.
        self._leases: dict[int, _EtcdLease] = {}
        #: Lease ids that may exist on the server: revoked in ``aclose``. Includes grants whose
        #: answer never came (we choose the id, so a lost answer leaks nothing).
        self._granted: set[int] = set()
        self._granting: dict[int, anyio.Lock] = {}
        #: Keys whose delete failed, with their create revision (0: delete whatever is there,
        #: the key name is unique to one acquisition).
        self._orphans: dict[bytes, int] = {}

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_url(cls, url: str, options: Mapping[str, object]) -> Self:
        endpoints, url_user, url_password = _parse_url(url)
        opts = Options(options, "etcd://")
        prefix = opts.text("prefix", DEFAULT_PREFIX)
        op_timeout = opts.number("op_timeout", 5.0, minimum=0.001)
        user = opts.optional_text("user")
        password = opts.optional_text("password")
        if url_user is not None:
            if user is not None or password is not None:
                raise InvalidArgument(
                    "etcd:// got a user in the URL and as an option: give it once"
                )
            user, password = url_user, url_password
        tls = opts.flag("tls", False)
        ca_cert = opts.optional_text("ca_cert")
        cert_cert = opts.optional_text("cert_cert")
        cert_key = opts.optional_text("cert_key")
        tls_server_name = opts.optional_text("tls_server_name")
        opts.finish(_KNOWN_OPTIONS)
        return cls(
            endpoints,
            prefix=prefix,
            op_timeout=op_timeout,
            user=user,
            password=password,
            tls=tls,
            ca_cert=ca_cert,
            cert_cert=cert_cert,
            cert_key=cert_key,
            tls_server_name=tls_server_name,
        )

    def describe(self) -> str:
        user = f"{quote(self.user, safe='')}@" if self.user else ""
        hosts = ",".join(f"{_bracket(host)}:{port}" for host, port in self.endpoints)
        return f"etcd://{user}{hosts}"

    def extra_info(self) -> Mapping[str, Any]:
        return {
            "endpoints": [f"{_bracket(host)}:{port}" for host, port in self.endpoints],
            "prefix": self.prefix,
            "op_timeout": self.op_timeout,
            "tls": self.tls,
            "server_version": self._server_version,
            "leases": {bucket: f"{lease.id:016x}" for bucket, lease in self._current.items()},
        }

    def check_ttl(self, ttl: float) -> None:
        if ttl < MIN_TTL:
            raise InvalidArgument(
                f"ttl {ttl:g} s is below etcd's minimum lease of {MIN_TTL} s (1.5 election "
                f"timeouts, rounded up): etcd would keep the lock for {MIN_TTL} s or more. Use "
                f"ttl >= {MIN_TTL}"
            )
        if ttl > MAX_TTL:
            raise InvalidArgument(f"ttl {ttl:g} s is above etcd's maximum lease of {MAX_TTL} s")

    # -- connection --------------------------------------------------------------------------

    async def open(self) -> None:
        if self._channel is not None or self._closed:
            raise RuntimeError("an EtcdBackend is opened once")
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            raise UnsupportedFeature(
                "the etcd:// backend needs asyncio (gRPC's asyncio API); run it under asyncio, "
                "not trio"
            ) from None
        credentials = await self._credentials()
        target, authority = await self._target()
        options = list(_CHANNEL_OPTIONS)
        if self.tls and (self._tls_server_name or authority):
            options.append(("grpc.ssl_target_name_override", self._tls_server_name or authority))
        if credentials is not None:
            self._channel = grpc.aio.secure_channel(target, credentials, options=options)
        else:
            self._channel = grpc.aio.insecure_channel(target, options=options)
        self._kv = rpc.KVStub(self._channel)
        self._lease_stub = rpc.LeaseStub(self._channel)
        self._watch_stub = rpc.WatchStub(self._channel)
        self._auth_stub = rpc.AuthStub(self._channel)
        self._maintenance = rpc.MaintenanceStub(self._channel)
        try:
            if self.user is not None:
                await self._authenticate()
            status = await self._call(
                "connecting",
                lambda md, timeout: self._maintenance.Status(
                    rpc.StatusRequest(), timeout=timeout, metadata=md
                ),
            )
            self._server_version = str(status.version)
            # A linearizable read: proves there is a leader (a quorum), and, with auth, that we
            # may read our prefix.
            await self._call(
                "reading the lock prefix",
                lambda md, timeout: self._kv.Range(
                    rpc.RangeRequest(
                        key=self._prefix, range_end=_prefix_end(self._prefix), count_only=True
                    ),
                    timeout=timeout,
                    metadata=md,
                ),
            )
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._close_channel()
            raise

    async def aclose(self) -> None:
        if self._closed:
            return
        with anyio.CancelScope(shield=True):
            if self._channel is not None:
                # Revoking the leases deletes every key still on them, orphans included.
                with anyio.move_on_after(self.op_timeout):
                    async with anyio.create_task_group() as tg:
                        for lease_id in list(self._granted):
                            tg.start_soon(self._revoke_quietly, lease_id)
            self._closed = True
            await self._close_channel()

    async def _close_channel(self) -> None:
        channel, self._channel = self._channel, None
        self._closed = True
        if channel is not None:
            await channel.close()

    async def _credentials(self) -> Any:
        if not self.tls:
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
            root_certificates=await read(self._ca_cert, "ca_cert"),
            private_key=await read(self._cert_key, "cert_key"),
            certificate_chain=await read(self._cert_cert, "cert_cert"),
        )

    async def _target(self) -> tuple[str, str | None]:
        """The gRPC target, and the name TLS should verify when the target has none."""
        if len(self.endpoints) == 1:
            host, port = self.endpoints[0]
            return f"{_bracket(host)}:{port}", None
        v4: list[str] = []
        v6: list[str] = []
        for host, port in self.endpoints:
            try:
                addresses = [ipaddress.ip_address(host)]
            except ValueError:
                with map_exceptions(
                    {OSError: BackendUnavailable}, f"resolving {host!r} for {self.describe()}"
                ):
                    infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
                addresses = [ipaddress.ip_address(info[4][0]) for info in infos]
            for address in dict.fromkeys(addresses):
                if address.version == 4:
                    v4.append(f"{address}:{port}")
                else:
                    v6.append(f"[{address}]:{port}")
        target = f"ipv4:{','.join(v4)}" if v4 else f"ipv6:{','.join(v6)}"
        return target, self.endpoints[0][0]

    async def _authenticate(self) -> None:
        try:
            reply = await _settle(
                self._auth_stub.Authenticate(
                    rpc.AuthenticateRequest(name=self.user, password=self._password),
                    timeout=self.op_timeout,
                )
            )
        except grpc.aio.AioRpcError as exc:
            if "authentication is not enabled" in (exc.details() or ""):
                self._metadata = ()
                return
            raise self._translate(exc, f"authenticating as {self.user!r}") from exc
        self._metadata = (("token", str(reply.token)),)

    # -- the contract ------------------------------------------------------------------------

    async def try_acquire(self, request: LockRequest) -> EtcdGrant | None:
        attempt = self._attempt(request)
        if self._orphans:
            # A key of ours left behind (a delete that failed) may be the one in the way.
            await self._sweep_orphans()
        try:
            taken = await self._take_if_free(attempt)
        except BaseException:
            await self._abandon(attempt)
            raise
        return self._hand_over(attempt) if taken else None

    async def acquire(self, request: LockRequest) -> EtcdGrant:
        attempt = self._attempt(request)
        if self._orphans:
            await self._sweep_orphans()
        try:
            await self._queue_and_wait(attempt)
        except BaseException:
            await self._abandon(attempt)
            raise
        # No await between the final check and handing the grant over.
        return self._hand_over(attempt)

    async def renew(self, grants: Sequence[EtcdGrant]) -> Sequence[RenewOutcome]:
        outcomes: list[RenewOutcome | None] = [None] * len(grants)
        leases: dict[int, _EtcdLease] = {}
        for index, grant in enumerate(grants):
            lease = self._leases.get(grant.lease_id)
            if lease is None or lease.dead:
                outcomes[index] = Lost(_lease_gone_id(grant.lease_id))
            else:
                leases[lease.id] = lease
        refreshed: dict[int, bool | BaseException] = {}
        present: dict[bytes, int] = {}
        checked: set[bytes] = set()

        async def keepalive(lease: _EtcdLease) -> None:
            try:
                refreshed[lease.id] = await self._refresh(lease)
            except LockError as exc:
                refreshed[lease.id] = exc

        async def check(chunk: list[EtcdGrant]) -> None:
            # A read of each key: an operator's delete proves loss even while the lease lives.
            try:
                reply = await self._txn(
                    f"checking {len(chunk)} lock key(s)",
                    rpc.TxnRequest(success=[_range(grant.key) for grant in chunk]),
                )
            except LockError:
                return
            for grant, response in zip(chunk, reply.responses, strict=True):
                checked.add(grant.key)
                for kv in response.response_range.kvs:
                    present[bytes(kv.key)] = int(kv.create_revision)

        live = [grant for grant, outcome in zip(grants, outcomes, strict=True) if outcome is None]
        async with anyio.create_task_group() as tg:
            for lease in leases.values():
                tg.start_soon(keepalive, lease)
            for start in range(0, len(live), _KEYS_PER_TXN):
                tg.start_soon(check, live[start : start + _KEYS_PER_TXN])
            if self._orphans:
                tg.start_soon(self._sweep_orphans)
        for index, grant in enumerate(grants):
            if outcomes[index] is not None:
                continue
            lease = leases[grant.lease_id]
            result = refreshed[lease.id]
            if isinstance(result, BaseException):
                outcomes[index] = Unknown(result)
            elif not result:
                outcomes[index] = Lost(_lease_gone(lease))
            elif grant.key in checked and present.get(grant.key) != grant.token:
                outcomes[index] = Lost(
                    f"the lock key {grant.key!r} was deleted on the server (by an operator or "
                    "another client); someone else may hold the lock now"
                )
            else:
                outcomes[index] = Renewed(lease.valid_from, float(lease.ttl))
        return [outcome for outcome in outcomes if outcome is not None]

    async def release(self, grant: EtcdGrant) -> None:
        lease = self._leases.get(grant.lease_id)
        if lease is not None:
            lease.held.discard(grant)
        token = grant.token or 0
        # Idempotent (a guarded delete of a key unique to this grant): the core may run it
        # again from the start after a native cancellation, or retry it in the background.
        try:
            await self._delete_key(grant.key, token, f"releasing lock {grant.name!r}")
        except BaseException as exc:
            # Interrupted or failed: whoever comes next (a renewal, a wait, the next acquire,
            # or this release run again) deletes it.
            self._orphans[grant.key] = token
            if isinstance(exc, BackendUnavailable):
                raise type(exc)(
                    f"{exc}. The key is deleted on a later renewal or acquire, or with its "
                    "lease when the client closes"
                ) from exc
            raise
        self._orphans.pop(grant.key, None)

    # -- taking and waiting ------------------------------------------------------------------

    async def _take_if_free(self, attempt: _Attempt) -> bool:
        """Create our key only if there is no key under the name (nobody holds or waits)."""
        for _ in range(3):
            lease = await self._lease_for(attempt.bucket)
            key = self._place(attempt, lease)
            try:
                reply = await self._txn(
                    f"taking lock {attempt.request.name!r}",
                    rpc.TxnRequest(
                        compare=[
                            rpc.Compare(
                                key=attempt.prefix,
                                range_end=attempt.end,
                                target=rpc.Compare.CREATE,
                                result=rpc.Compare.EQUAL,
                                create_revision=0,
                            )
                        ],
                        success=[_put(attempt)],
                        # Our own key, in case an earlier try of this request (given up or
                        # failed, then sent again) created it.
                        failure=[_range(key)],
                    ),
                    keep=attempt,
                )
            except _LeaseMissing:
                attempt.key = None
                self._lease_died(lease, _lease_gone(lease))
                continue
            if reply.succeeded:
                attempt.rev = int(reply.header.revision)
                return True
            own = reply.responses[0].response_range.kvs
            if own:
                # Created by the earlier try, when nothing else was under the name: ours.
                attempt.rev = int(own[0].create_revision)
                return True
            if attempt.ambiguous:
                # An earlier try might still land (it cannot, once etcd answered a later
                # request of ours, but be sure): the next sweep deletes whatever it made.
                self._orphans[key] = 0
            attempt.key = None
            return False
        raise BackendUnavailable(
            f"taking lock {attempt.request.name!r} on {self.describe()}: every lease etcd "
            "granted was gone by the next request"
        )

    def _attempt(self, request: LockRequest) -> _Attempt:
        prefix = self._name_prefix(request.name)
        return _Attempt(request, _bucket(request.ttl), prefix, _prefix_end(prefix))

    async def inspect(self, name: str) -> LockInfo:
        prefix = self._name_prefix(name)
        reply = await self._call(
            f"inspecting lock {name!r}",
            lambda md, timeout: self._kv.Range(
                rpc.RangeRequest(
                    key=prefix,
                    range_end=_prefix_end(prefix),
                    sort_target=rpc.RangeRequest.CREATE,
                    sort_order=rpc.RangeRequest.ASCEND,
                    keys_only=True,
                ),
                timeout=timeout,
                metadata=md,
            ),
        )
        kvs = list(reply.kvs)
        if not kvs:
            return LockInfo(name, held=False, waiters=0)
        # The lowest create revision holds the lock; its key ends in "<lease hex>-<owner>".
        first = kvs[0]
        lease_hex, _, owner = bytes(first.key)[len(prefix) :].decode("ascii").partition("-")
        ttl = await self._call(
            f"reading the lease of lock {name!r}",
            lambda md, timeout: self._lease_stub.LeaseTimeToLive(
                rpc.LeaseTimeToLiveRequest(ID=int(lease_hex, 16)),
                timeout=timeout,
                metadata=md,
            ),
        )
        return LockInfo(
            name,
            held=True,
            owner=owner or None,
            token=int(first.create_revision),
            expires_in=float(ttl.TTL) if int(ttl.TTL) >= 0 else None,
            waiters=len(kvs) - 1,
        )

    def _name_prefix(self, name: str) -> bytes:
        # Percent-encoding with no safe characters is injective and never yields "/", so
        # "<prefix><encoded>/" holds the keys of exactly one name.
        return self._prefix + quote(name, safe="").encode("ascii") + b"/"

    def _place(self, attempt: _Attempt, lease: _EtcdLease) -> bytes:
        """Put the attempt's (next) key on ``lease``."""
        attempt.lease = lease
        attempt.key = attempt.prefix + f"{lease.id:016x}-{attempt.request.owner}".encode("ascii")
        attempt.rev = 0
        return attempt.key

    def _hand_over(self, attempt: _Attempt) -> EtcdGrant:
        lease, key = attempt.lease, attempt.key
        assert lease is not None and key is not None and attempt.rev > 0
        grant = EtcdGrant(
            name=attempt.request.name,
            owner=attempt.request.owner,
            token=attempt.rev,
            valid_from=lease.valid_from,
            ttl=float(lease.ttl),
            key=key,
            lease_id=lease.id,
            on_lost=attempt.request.on_lost,
        )
        lease.held.add(grant)
        return grant

    async def _abandon(self, attempt: _Attempt) -> None:
        """Delete the key a failed or cancelled acquisition may have created.

        Runs to its end whatever cancels the caller, a native ``Task.cancel()`` included (see
        :func:`asynclock._shield.finish`), within twice ``op_timeout``: if its create request was
        still in flight, etcd must be done with it before the delete goes out (the delete
        travels on another stream and could overtake it), then the delete itself. What does
        not finish stays in ``_orphans``, deleted by the next acquire, wait or renewal.
        """
        key, rev, inflight = attempt.key, attempt.rev, attempt.inflight
        attempt.key = None
        attempt.rev = 0
        attempt.inflight = None
        if key is None:
            return
        what = f"withdrawing from lock {attempt.request.name!r}"

        async def withdraw() -> None:
            # Idempotent: finish() may run it again, from the start, in a task of its own.
            landed = inflight is None or await _ended(inflight, self.op_timeout)
            try:
                await self._delete_key(key, rev, what)
            except BaseException as exc:
                self._orphans[key] = rev
                if isinstance(exc, LockError):
                    return  # quiet: the caller's own error or cancellation is what matters
                raise
            if landed:
                self._orphans.pop(key, None)
            else:
                # The create may still land after the delete: look again later.
                self._orphans[key] = rev

        def unfinished() -> None:
            self._orphans[key] = rev

        await finish(withdraw, timeout=2.0 * self.op_timeout, what=what, unfinished=unfinished)

    async def _queue_and_wait(self, attempt: _Attempt) -> None:
        failures = _Backoff(2.0 * self.op_timeout)
        while True:
            try:
                if attempt.rev == 0:
                    if attempt.key is None or attempt.lease is None:
                        self._place(attempt, await self._lease_for(attempt.bucket))
                    lease = attempt.lease
                    assert lease is not None
                    state = await self._enqueue(attempt)
                else:
                    lease = attempt.lease
                    assert lease is not None
                    state = await self._check(attempt)
                if state is None:
                    # Our key is gone: the lease expired or was revoked, or someone deleted it.
                    # Queue again (at the back).
                    attempt.key = None
                    attempt.rev = 0
                    continue
                failures.reset()
                if state.predecessor is None:
                    if lease.fresh(anyio.current_time()):
                        return
                    # Our lease was not refreshed lately: prove it alive, then look again.
                    if not await self._refresh(lease):
                        attempt.key = None
                        attempt.rev = 0
                    continue
                await self._wait_turn(attempt, lease, state)
            except _LeaseMissing:
                if attempt.lease is not None:
                    self._lease_died(attempt.lease, _lease_gone(attempt.lease))
                attempt.key = None
                attempt.rev = 0
            except BackendUnavailable as exc:
                if not self._transient(exc):
                    raise
                await failures.pause(exc)

    async def _enqueue(self, attempt: _Attempt) -> _Place | None:
        """Create our key (or find it, after an ambiguous failure) and name the key before it."""
        key = attempt.key
        assert key is not None
        reply = await self._txn(
            f"queueing for lock {attempt.request.name!r}",
            rpc.TxnRequest(
                compare=[
                    rpc.Compare(
                        key=key,
                        target=rpc.Compare.CREATE,
                        result=rpc.Compare.EQUAL,
                        create_revision=0,
                    )
                ],
                # Our key was created last, so the newest keys are ours, the one before, and
                # whether there is one before that.
                success=[
                    _put(attempt),
                    _range(
                        attempt.prefix,
                        attempt.end,
                        sort_target=rpc.RangeRequest.CREATE,
                        sort_order=rpc.RangeRequest.DESCEND,
                        limit=3,
                    ),
                ],
                failure=[_range(key)],
            ),
            keep=attempt,
        )
        seen = int(reply.header.revision)
        if reply.succeeded:
            kvs = reply.responses[1].response_range.kvs
            attempt.rev = seen
            return _Place(bytes(kvs[1].key) if len(kvs) > 1 else None, len(kvs) == 2, seen)
        kvs = reply.responses[0].response_range.kvs
        if not kvs:  # pragma: no cover - the compare saw it, the read in the same txn must too
            raise BackendUnavailable(f"etcd lost key {key!r} within one transaction")
        # Created by an earlier try whose answer was lost: keep its place.
        attempt.rev = int(kvs[0].create_revision)
        return await self._check(attempt)

    async def _check(self, attempt: _Attempt) -> _Place | None:
        """One linearizable read: ``None`` if our key is gone, else our place."""
        key = attempt.key
        assert key is not None
        reply = await self._txn(
            f"checking our place for lock {attempt.request.name!r}",
            rpc.TxnRequest(
                success=[
                    _range(key),
                    _range(
                        attempt.prefix,
                        attempt.end,
                        max_create_revision=attempt.rev - 1,
                        sort_target=rpc.RangeRequest.CREATE,
                        sort_order=rpc.RangeRequest.DESCEND,
                        limit=2,
                    ),
                ]
            ),
        )
        own = reply.responses[0].response_range.kvs
        if not own or int(own[0].create_revision) != attempt.rev:
            return None
        lower = reply.responses[1].response_range.kvs
        return _Place(
            bytes(lower[0].key) if lower else None, len(lower) == 1, int(reply.header.revision)
        )

    async def _wait_turn(self, attempt: _Attempt, lease: _EtcdLease, place: _Place) -> None:
        """Return when the key before ours, or ours, is deleted (or to look again); keep our
        lease alive meanwhile."""
        own, predecessor = attempt.key, place.predecessor
        assert own is not None and predecessor is not None
        what = f"waiting for lock {attempt.request.name!r}"
        # hasleader: a member cut off from the cluster ends the watch instead of going quiet.
        call = self._watch_stub.Watch(metadata=(*self._metadata, ("hasleader", "true")))
        changed = anyio.Event()
        armed: list[int] = []
        woke: list[bool] = []
        failed: list[BaseException] = []

        async def read() -> None:
            # Never cancelled while waiting: cancelling a gRPC read cancels the whole stream.
            try:
                for key in (predecessor, own):
                    await call.write(
                        rpc.WatchRequest(
                            create_request=rpc.WatchCreateRequest(
                                key=key, filters=[rpc.WatchCreateRequest.NOPUT]
                            )
                        )
                    )
                created = 0
                start = 0
                while True:
                    response = await call.read()
                    if response is grpc.aio.EOF:
                        failed.append(BackendUnavailable(f"{what}: the watch ended"))
                        return
                    if response.created:
                        created += 1
                        start = max(start, int(response.header.revision))
                        if created == 2:
                            armed.append(start)
                            changed.set()
                    if response.events or response.canceled or response.compact_revision:
                        return
            except Exception as exc:  # raised below, out of the task group
                failed.append(exc)
            finally:
                woke.append(True)
                changed.set()

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(read)
                with anyio.move_on_after(self.op_timeout):
                    await changed.wait()
                polls: list[float] | None = []
                if not armed and not woke:
                    failed.append(
                        BackendTimeout(
                            f"{what} on {self.describe()}: etcd did not create the watch "
                            f"within {self.op_timeout:g} s (op_timeout)"
                        )
                    )
                elif armed and not woke and (armed[0] > place.seen or place.next_in_line):
                    try:
                        polls = await self._after_watch(own, predecessor, armed[0], place, what)
                    except LockError as exc:  # raised below, out of the task group
                        failed.append(exc)
                    if polls is None:
                        woke.append(True)
                recheck_at = anyio.current_time() + _RECHECK_EVERY
                while polls is not None and not woke and not failed and not lease.dead:
                    now = anyio.current_time()
                    if now >= recheck_at:
                        break
                    if lease.refreshing:
                        wake_at = now + max(0.05, lease.ttl / 12.0)
                    else:
                        wake_at = lease.refresh_due()
                    if polls:
                        wake_at = min(wake_at, polls[0])
                    changed = anyio.Event()
                    if woke:
                        break
                    with anyio.move_on_at(min(wake_at, recheck_at)):
                        await changed.wait()
                    if woke:
                        break
                    if polls and anyio.current_time() >= polls[0]:
                        polls.pop(0)
                        try:
                            if not await self._both_exist(predecessor, own, what):
                                break
                        except LockError as exc:
                            failed.append(exc)
                    else:
                        # Our queue entry rides on the lease: keep it alive while we wait.
                        await self._refresh_for_waiters(lease)
                tg.cancel_scope.cancel()
        finally:
            call.cancel()
        for error in failed:
            if isinstance(error, grpc.aio.AioRpcError):
                if self.user is not None and _token_rejected(error):
                    await self._authenticate()
                    return
                raise self._translate(error, what) from error
            if isinstance(error, LockError):
                raise error
            raise BackendUnavailable(f"{what} on {self.describe()}: {error!r}") from error

    async def _after_watch(
        self, own: bytes, predecessor: bytes, start: int, place: _Place, what: str
    ) -> list[float] | None:
        """Once the watches exist (from revision ``start``): a read covers what happened since
        ``place.seen``. Returns None if a watched key is already gone, ``[]`` if the watches can
        be trusted alone, else the times at which to look again.

        etcd 3.4 turns a watch "from now" into one from ``Rev() + 1`` before it locks its store;
        a write that commits in between leaves the watch "unsynced", and etcd delivers its
        events from a loop that runs every 100 ms. For the next waiter in line that would delay
        the hand-over by up to 100 ms, so it looks again a few times during that window, unless
        the read proves nothing was written since the watch started (so it is synced).
        """
        exists, revision = await self._both_exist_at(predecessor, own, what)
        if not exists:
            return None
        if not place.next_in_line or revision <= start:
            return []
        now = anyio.current_time()
        return [now + delay for delay in _UNSYNCED_POLLS]

    async def _both_exist(self, first: bytes, second: bytes, what: str) -> bool:
        exists, _ = await self._both_exist_at(first, second, what)
        return exists

    async def _both_exist_at(self, first: bytes, second: bytes, what: str) -> tuple[bool, int]:
        reply = await self._txn(
            what,
            rpc.TxnRequest(
                success=[_range(first, count_only=True), _range(second, count_only=True)]
            ),
        )
        exists = all(response.response_range.count for response in reply.responses)
        return exists, int(reply.header.revision)

    async def _refresh_for_waiters(self, lease: _EtcdLease) -> None:
        now = anyio.current_time()
        if lease.refreshing or lease.dead or now < lease.refresh_due():
            return
        lease.refreshing = True
        try:
            await self._refresh(lease)
        except LockError:
            lease.retry_at = anyio.current_time() + max(0.05, lease.ttl / 12.0)
        finally:
            lease.refreshing = False
        if self._orphans:
            await self._sweep_orphans()

    # -- leases ------------------------------------------------------------------------------

    async def _lease_for(self, bucket: int) -> _EtcdLease:
        """A live lease for ``bucket``, refreshed within the last half of its ttl."""
        lease = self._current.get(bucket)
        if lease is not None and lease.fresh(anyio.current_time()):
            return lease
        lock = self._granting.setdefault(bucket, anyio.Lock())
        async with lock:
            lease = self._current.get(bucket)
            if lease is not None and lease.fresh(anyio.current_time()):
                return lease
            # Not renewed lately (nothing held on it): ask whether it still lives. A lease
            # past its known expiry is most likely gone, but a keepalive whose answer was lost
            # may have kept it: this way none is left behind.
            if lease is not None and not lease.dead and await self._refresh(lease):
                return lease
            return await self._grant_lease(bucket)

    async def _grant_lease(self, bucket: int) -> _EtcdLease:
        for _ in range(3):
            # We choose the id, so a grant whose answer is lost is still revoked in aclose.
            lease_id = secrets.randbits(62) + 1
            self._granted.add(lease_id)
            sent_at = anyio.current_time()
            try:
                reply = await self._call(
                    f"granting a {bucket} s lease",
                    functools.partial(self._grant_rpc, bucket, lease_id),
                )
            except BackendUnavailable as exc:
                cause = exc.__cause__
                if isinstance(cause, grpc.aio.AioRpcError) and "lease already exists" in str(
                    cause.details()
                ):
                    # Almost surely our own grant, sent again after an answer that was lost
                    # (two random 62-bit ids colliding is not worth a thought): adopt it.
                    lease = _EtcdLease(lease_id, bucket, bucket, sent_at)
                    if await self._refresh(lease):
                        self._leases[lease.id] = lease
                        self._current[bucket] = lease
                        return lease
                    continue
                raise
            if reply.error:
                self._granted.discard(lease_id)
                raise BackendUnavailable(
                    f"granting a lease on {self.describe()} failed: {reply.error}"
                )
            lease = _EtcdLease(int(reply.ID), bucket, int(reply.TTL), sent_at)
            self._leases[lease.id] = lease
            self._current[bucket] = lease
            return lease
        raise BackendUnavailable(f"{self.describe()} refused three random lease ids")

    def _grant_rpc(self, bucket: int, lease_id: int, metadata: Metadata, timeout: float) -> Any:
        return self._lease_stub.LeaseGrant(
            rpc.LeaseGrantRequest(TTL=bucket, ID=lease_id),
            timeout=timeout,
            metadata=metadata,
        )

    async def _refresh(self, lease: _EtcdLease) -> bool:
        """One keepalive: True if etcd extended the lease, False if it is gone."""
        sent_at = anyio.current_time()
        ttl: int = await self._call(
            f"renewing lease {lease.id:016x}",
            lambda md, timeout: _in_task(self._keepalive(lease.id, md, timeout)),
        )
        if ttl <= 0:
            self._lease_died(lease, _lease_gone(lease))
            return False
        if not lease.dead:
            lease.valid_from = max(lease.valid_from, sent_at)
            lease.ttl = ttl
            lease.retry_at = 0.0
        return True

    async def _keepalive(self, lease_id: int, metadata: Metadata, timeout: float) -> int:
        """One keepalive on a stream of its own. Like a unary call (see ``_await_unary``), it
        is given up, to be sent again, when it is slow and etcd has elected a new leader since
        it was sent."""
        term = self._term
        call = self._lease_stub.LeaseKeepAlive(timeout=timeout, metadata=metadata)
        replies: list[Any] = []
        errors: list[Exception] = []
        done = anyio.Event()

        async def read() -> None:
            try:
                await call.write(rpc.LeaseKeepAliveRequest(ID=lease_id))
                replies.append(await call.read())
            except Exception as exc:
                errors.append(exc)
            finally:
                done.set()

        superseded = False
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(read)
                with anyio.move_on_after(_SLOW_CALL):
                    await done.wait()
                while not done.is_set() and not superseded:
                    superseded = await self._new_leader_since(term)
                    if not superseded:
                        with anyio.move_on_after(_TERM_POLL):
                            await done.wait()
                # Never cancel the reader (gRPC would turn that into a bare CancelledError):
                # cancelling the call ends its read.
                call.cancel()
        finally:
            call.cancel()
        if superseded and not replies:
            raise _Superseded
        if errors:
            raise errors[0]
        if not replies or replies[0] is grpc.aio.EOF:
            raise BackendUnavailable(f"{self.describe()} closed the keepalive stream")
        return int(replies[0].TTL)

    def _lease_died(self, lease: _EtcdLease, reason: str) -> None:
        if lease.dead:
            return
        lease.dead = True
        if self._current.get(lease.bucket) is lease:
            del self._current[lease.bucket]
        self._leases.pop(lease.id, None)
        self._granted.discard(lease.id)
        for grant in list(lease.held):
            grant.on_lost(reason)
        lease.held.clear()

    async def _revoke_quietly(self, lease_id: int) -> None:
        try:
            await self._call(
                f"revoking lease {lease_id:016x}",
                lambda md, timeout: self._lease_stub.LeaseRevoke(
                    rpc.LeaseRevokeRequest(ID=lease_id), timeout=timeout, metadata=md
                ),
            )
        except _LeaseMissing:
            pass
        except Exception:  # quiet: it expires by itself; nothing else may stop aclose()
            return
        self._granted.discard(lease_id)

    # -- keys --------------------------------------------------------------------------------

    async def _delete_key(self, key: bytes, rev: int, what: str) -> None:
        if rev:
            await self._txn(
                what,
                rpc.TxnRequest(
                    compare=[
                        rpc.Compare(
                            key=key,
                            target=rpc.Compare.CREATE,
                            result=rpc.Compare.EQUAL,
                            create_revision=rev,
                        )
                    ],
                    success=[rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key))],
                ),
            )
        else:
            await self._call(
                what,
                lambda md, timeout: self._kv.DeleteRange(
                    rpc.DeleteRangeRequest(key=key), timeout=timeout, metadata=md
                ),
            )

    async def _sweep_orphans(self) -> None:
        for key, rev in list(self._orphans.items()):
            try:
                await self._delete_key(key, rev, "deleting a lock key left by a failed release")
            except Exception:  # quiet: tried again on the next renewal or wait
                return
            if self._orphans.get(key) == rev:
                del self._orphans[key]

    # -- calls -------------------------------------------------------------------------------

    async def _txn(
        self, what: str, request: Any, *, keep: _Attempt | None = None, retry: bool = True
    ) -> Any:
        return await self._call(
            what,
            lambda md, timeout: self._kv.Txn(request, timeout=timeout, metadata=md),
            keep=keep,
            retry=retry,
        )

    async def _call(
        self,
        what: str,
        call: Callable[[Metadata, float], Any],
        *,
        keep: _Attempt | None = None,
        retry: bool = True,
    ) -> Any:
        """Make a call (``call(metadata, timeout)`` returns a unary gRPC call or a coroutine),
        within ``op_timeout`` in all, and translate its errors; re-authenticates once when etcd
        has dropped our token.

        Every request this module sends is safe to repeat (guarded creates and deletes of keys
        unique to one acquisition, reads, keepalives, grants of a lease id we chose), so with
        ``retry`` it is sent again, until ``op_timeout`` is spent:

        * at once, when etcd has elected a leader of a later term since it was sent (a write
          that a follower forwarded to a leader that just died is never answered: etcd drops
          it and would wait out its own request timeout, 5 s plus two election timeouts);
        * after a short pause, when the connection broke under it or etcd had no leader
          (``UNAVAILABLE``); "nothing listens" only for a second, so that a wrong URL still
          fails fast.

        With ``keep``, a cancelled call is not cancelled on the wire but left to finish, in
        ``keep.inflight``: it may create a key, and the clean-up must delete it only after
        etcd has applied it (the delete travels on another stream and could overtake it).
        """
        if self._channel is None:
            raise BackendUnavailable(f"{what}: {self.describe()} is closed")
        deadline = anyio.current_time() + self.op_timeout
        reauthenticated = False
        unreachable_since: float | None = None
        pause = _BACKOFF_MIN
        while True:
            term = self._term
            try:
                pending = call(self._metadata, max(0.001, deadline - anyio.current_time()))
                if isinstance(pending, grpc.aio.Call):
                    reply = await self._await_unary(pending, keep, term if retry else None)
                else:
                    reply = await pending
            except _Superseded:
                if keep is not None:
                    keep.ambiguous = True
                continue
            except grpc.aio.AioRpcError as exc:
                if self.user is not None and _token_rejected(exc) and not reauthenticated:
                    reauthenticated = True
                    await self._authenticate()
                    continue
                now = anyio.current_time()
                if not retry or self._channel is None or not _retry_soon(exc):
                    raise self._translate(exc, what) from exc
                if _unreachable(exc):
                    unreachable_since = now if unreachable_since is None else unreachable_since
                    if now - unreachable_since >= _UNREACHABLE_GRACE:
                        raise self._translate(exc, what) from exc
                if now + pause >= deadline:
                    raise self._translate(exc, what) from exc
                if keep is not None:
                    keep.ambiguous = True  # it may have reached etcd before the error
                await anyio.sleep(pause * random.uniform(0.5, 1.0))
                pause = min(pause * 2.0, _BACKOFF_MAX / 4.0)
                continue
            header = getattr(reply, "header", None)
            if header is not None:
                self._term = max(self._term, int(header.raft_term))
            return reply

    async def _await_unary(self, call: Any, keep: _Attempt | None, term: int | None) -> Any:
        """:func:`_settle`, and with ``term``: give the call up (:class:`_Superseded`) once it
        has been slow for a while and etcd has a leader of a term later than ``term``."""
        if term is None or call.done():
            return await _settle(call, keep)
        done = anyio.Event()
        call.add_done_callback(lambda _call: done.set())
        superseded = False
        try:
            with anyio.move_on_after(_SLOW_CALL):
                await done.wait()
            while not done.is_set() and not superseded:
                superseded = await self._new_leader_since(term)
                if not superseded:
                    with anyio.move_on_after(_TERM_POLL):
                        await done.wait()
        except BaseException:
            if keep is not None:
                keep.inflight = call
            else:
                call.cancel()
            raise
        if superseded and not call.done():
            call.cancel()
            raise _Superseded
        return await call

    async def _new_leader_since(self, term: int) -> bool:
        """Whether etcd has elected a leader in a term after ``term`` (one ``Status`` probe,
        shared by every slow call of this client)."""
        now = anyio.current_time()
        if now - self._probed_at >= _TERM_POLL / 2.0 and self._probing is None:
            self._probing = anyio.Event()
            try:
                status = await _settle(
                    self._maintenance.Status(
                        rpc.StatusRequest(), timeout=_TERM_POLL * 2.0, metadata=self._metadata
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

    def _translate(self, exc: Any, what: str) -> BackendUnavailable:
        code = exc.code()
        details = str(exc.details() or "").removeprefix("etcdserver: ")
        context = f"{what} on {self.describe()}"
        if code == grpc.StatusCode.NOT_FOUND and "lease not found" in details:
            return _LeaseMissing(f"{context}: the lease is gone ({details})")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return BackendTimeout(
                f"{context}: no answer within {self.op_timeout:g} s (op_timeout); check that "
                "etcd runs and has a leader"
            )
        if "user name is empty" in details:
            return BackendUnavailable(
                f"{context}: etcd refused the request: it has authentication enabled; give the "
                "user and password options (or user:password@ in the URL)"
            )
        if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED) or (
            "authentication failed" in details
        ):
            return BackendUnavailable(
                f"{context}: etcd refused the request ({details}); check the user and password "
                f"options and that the user's role may read and write {self.prefix!r}"
            )
        if code == grpc.StatusCode.UNAVAILABLE:
            return BackendUnavailable(
                f"{context}: etcd is unreachable or has no leader ({details}); check that "
                "etcd runs and that the URL's hosts and ports are right (etcd's client port "
                f"is {DEFAULT_PORT} by default)"
            )
        if code == grpc.StatusCode.CANCELLED and self._channel is None:
            return BackendUnavailable(f"{context}: the client was closed")
        return BackendUnavailable(f"{context}: {code.name}: {details}")

    def _transient(self, exc: BackendUnavailable) -> bool:
        if self._channel is None or isinstance(exc, _LeaseMissing):
            return False
        cause = exc.__cause__
        if isinstance(cause, grpc.aio.AioRpcError):
            return bool(cause.code() in _TRANSIENT_CODES) and not _token_rejected(cause)
        return True

    # -- fencing inside etcd -----------------------------------------------------------------

    async def fenced_txn(
        self,
        lease: Lease | EtcdGrant,
        *,
        compare: Iterable[Any] = (),
        success: Iterable[Any] = (),
        failure: Iterable[Any] = (),
    ) -> tuple[bool, list[Any]]:
        """Run an etcd transaction that commits only while ``lease`` still holds its lock.

        The transaction is nested in one that compares our lock key's create revision with the
        lease's token, so etcd itself refuses it once the lock was lost (and perhaps taken by
        someone else), however late the request arrives. ``compare`` takes ``aetcd``
        comparisons (``client.transactions.value(key) == b"x"``) or ``aetcd.rpc.Compare``
        messages; ``success`` and ``failure`` take ``aetcd`` operations
        (``client.transactions.put(key, value)``, ``.get``, ``.delete``, ``.txn``) or
        ``aetcd.rpc`` request messages.

        Returns ``(succeeded, responses)`` of *your* transaction (``responses`` are
        ``aetcd.rpc.ResponseOp`` messages). Raises :class:`asynclock.LeaseLost` if the lock key
        is no longer ours: nothing was applied.
        """
        grant = _grant_of(lease)
        if not isinstance(grant, EtcdGrant):
            raise InvalidArgument("fenced_txn needs a lease taken on an etcd:// client")
        inner = rpc.TxnRequest(
            compare=[_to_compare(item) for item in compare],
            success=[_to_request_op(item) for item in success],
            failure=[_to_request_op(item) for item in failure],
        )
        reply = await self._txn(
            f"running a transaction fenced by lock {grant.name!r}",
            rpc.TxnRequest(
                compare=[_fence(grant)],
                success=[rpc.RequestOp(request_txn=inner)],
            ),
            # The caller's operations need not be safe to repeat: sent once.
            retry=False,
        )
        if not reply.succeeded:
            raise LeaseLost(
                grant.name,
                f"the lock key no longer has create revision {grant.token} (the lock was lost, "
                "released or taken by someone else); the transaction was not applied",
            )
        result = reply.responses[0].response_txn
        return bool(result.succeeded), list(result.responses)


# -- public helpers ----------------------------------------------------------------------------


def fence_compare(lease: Lease | EtcdGrant) -> Any:
    """An ``aetcd`` comparison that holds only while ``lease`` holds its lock.

    Add it to the ``compare`` list of your own ``aetcd.Client.transaction(...)`` to make etcd
    itself refuse a write from a holder that lost the lock::

        await client.transaction(compare=[fence_compare(lease), ...], success=[...], failure=[])
    """
    grant = _grant_of(lease)
    if not isinstance(grant, EtcdGrant):
        raise InvalidArgument("fence_compare needs a lease taken on an etcd:// client")
    return aetcd_transactions.Create(grant.key) == grant.token


async def fenced_txn(
    locks: LockClient,
    lease: Lease | EtcdGrant,
    *,
    compare: Iterable[Any] = (),
    success: Iterable[Any] = (),
    failure: Iterable[Any] = (),
) -> tuple[bool, list[Any]]:
    """:meth:`EtcdBackend.fenced_txn` on the etcd backend of ``locks``."""
    backend = locks._backend
    if not isinstance(backend, EtcdBackend):
        raise InvalidArgument(f"fenced_txn needs an etcd:// lock client, not {backend.describe()}")
    return await backend.fenced_txn(lease, compare=compare, success=success, failure=failure)


# -- helpers -----------------------------------------------------------------------------------


async def _settle(call: Any, keep: _Attempt | None = None) -> Any:
    """Await a unary gRPC call (and cancel it if we are cancelled, unless ``keep``).

    grpc.aio answers a cancellation with a bare ``CancelledError`` of its own, without the
    message by which anyio recognises its cancel scopes' cancellations, so anyio would let it
    escape ``move_on_after`` and friends. Waiting on an anyio event keeps cancellation anyio's.
    """
    if not call.done():
        done = anyio.Event()
        call.add_done_callback(lambda _call: done.set())
        try:
            await done.wait()
        except BaseException:
            if keep is not None:
                keep.inflight = call
            else:
                call.cancel()
            raise
    return await call


async def _ended(call: Any, timeout: float) -> bool:
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


async def _in_task(work: Awaitable[T]) -> T:
    """Await gRPC streaming work in a child task, for the reason given in :func:`_settle`."""
    box: list[T] = []
    errors: list[Exception] = []

    async def run() -> None:
        try:
            box.append(await work)
        except Exception as exc:
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
    if errors:
        raise errors[0]
    if not box:
        raise BackendUnavailable("the gRPC call was cancelled")
    return box[0]


def _grant_of(lease: Lease | EtcdGrant) -> Grant:
    if isinstance(lease, Lease):
        return lease.grant
    if isinstance(lease, Grant):
        return lease
    raise InvalidArgument(f"expected an asynclock Lease, not {type(lease).__name__}")


def _fence(grant: EtcdGrant) -> Any:
    return rpc.Compare(
        key=grant.key,
        target=rpc.Compare.CREATE,
        result=rpc.Compare.EQUAL,
        create_revision=grant.token or 0,
    )


def _to_compare(item: Any) -> Any:
    if isinstance(item, rpc.Compare):
        return item
    if isinstance(item, aetcd_transactions.BaseCompare):
        return item.build_message()
    raise InvalidArgument(
        f"compare takes aetcd comparisons or aetcd.rpc.Compare, not {type(item).__name__}"
    )


def _to_request_op(item: Any) -> Any:
    if isinstance(item, rpc.RequestOp):
        return item
    if isinstance(item, rpc.PutRequest):
        return rpc.RequestOp(request_put=item)
    if isinstance(item, rpc.RangeRequest):
        return rpc.RequestOp(request_range=item)
    if isinstance(item, rpc.DeleteRangeRequest):
        return rpc.RequestOp(request_delete_range=item)
    if isinstance(item, rpc.TxnRequest):
        return rpc.RequestOp(request_txn=item)
    if isinstance(item, aetcd_transactions.Put):
        lease = item.lease
        return rpc.RequestOp(
            request_put=rpc.PutRequest(
                key=_bytes(item.key),
                value=_bytes(item.value),
                lease=int(getattr(lease, "id", lease) or 0),
                prev_kv=bool(item.prev_kv),
            )
        )
    if isinstance(item, aetcd_transactions.Get):
        return rpc.RequestOp(
            request_range=rpc.RangeRequest(
                key=_bytes(item.key),
                range_end=_bytes(item.range_end) if item.range_end is not None else b"",
            )
        )
    if isinstance(item, aetcd_transactions.Delete):
        return rpc.RequestOp(
            request_delete_range=rpc.DeleteRangeRequest(
                key=_bytes(item.key),
                range_end=_bytes(item.range_end) if item.range_end is not None else b"",
                prev_kv=bool(item.prev_kv),
            )
        )
    if isinstance(item, aetcd_transactions.Txn):
        return rpc.RequestOp(
            request_txn=rpc.TxnRequest(
                compare=[_to_compare(each) for each in item.compare],
                success=[_to_request_op(each) for each in item.success or ()],
                failure=[_to_request_op(each) for each in item.failure or ()],
            )
        )
    raise InvalidArgument(
        f"transaction operations are aetcd operations or aetcd.rpc requests, not "
        f"{type(item).__name__}"
    )


def _bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode("utf-8")


def _put(attempt: _Attempt) -> Any:
    assert attempt.key is not None and attempt.lease is not None
    return rpc.RequestOp(
        request_put=rpc.PutRequest(
            key=attempt.key,
            value=attempt.request.owner.encode("ascii"),
            lease=attempt.lease.id,
        )
    )


def _range(key: bytes, range_end: bytes = b"", **fields: Any) -> Any:
    return rpc.RequestOp(
        request_range=rpc.RangeRequest(key=key, range_end=range_end, keys_only=True, **fields)
    )


def _prefix_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with ``prefix`` (it ends with '/' here)."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


def _bucket(ttl: float) -> int:
    """etcd leases have whole seconds: round up, so the lease never ends before the ttl."""
    return max(MIN_TTL, math.ceil(ttl))


def _lease_gone(lease: _EtcdLease) -> str:
    return _lease_gone_id(lease.id)


def _lease_gone_id(lease_id: int) -> str:
    return f"etcd lease {lease_id:016x} expired or was revoked: its lock keys are gone"


def _retry_soon(exc: Any) -> bool:
    """A failure worth sending the same request again for, after a short pause."""
    code = exc.code()
    details = str(exc.details() or "")
    if code == grpc.StatusCode.UNAVAILABLE:
        return True  # connection reset or refused, no leader, leader changed, etcd timed out
    return code == grpc.StatusCode.UNKNOWN and "proposal dropped" in details


def _unreachable(exc: Any) -> bool:
    return "failed to connect" in str(exc.details() or "").lower()


def _token_rejected(exc: Any) -> bool:
    return "invalid auth token" in str(exc.details() or "")


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _parse_url(url: str) -> tuple[list[tuple[str, int]], str | None, str | None]:
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() != "etcd":
        raise InvalidURL(f"{url!r} is not an etcd URL: expected {_URL_EXAMPLE}")
    netloc, _, path = rest.partition("/")
    if path or "#" in netloc:
        raise InvalidURL(
            f"etcd URLs take no path: got {url!r}. Set the key prefix with the prefix option "
            f"(?prefix=/myapp/locks/); for example {_URL_EXAMPLE}"
        )
    userinfo, at, hosts = netloc.rpartition("@")
    user: str | None = None
    password: str | None = None
    if at:
        name, colon, secret = userinfo.partition(":")
        if not name or not colon:
            raise InvalidURL(
                "etcd URLs carry credentials as user:password@host (percent-encoded), for "
                "example etcd://root:secret@127.0.0.1:2379"
            )
        user, password = unquote(name), unquote(secret)
    if not hosts:
        raise InvalidURL(
            f"etcd URL {url.split('@')[-1]!r} names no host; for example {_URL_EXAMPLE}"
        )
    endpoints = [_parse_endpoint(part, url) for part in hosts.split(",")]
    families = {_family(host) for host, _ in endpoints if _family(host) is not None}
    if len(families) > 1:
        raise InvalidURL(
            f"etcd URL {url.split('@')[-1]!r} mixes IPv4 and IPv6 addresses; list the members "
            f"by one family (or by host name), for example {_URL_EXAMPLE}"
        )
    return endpoints, user, password


def _family(host: str) -> int | None:
    try:
        return ipaddress.ip_address(host).version
    except ValueError:
        return None


def _parse_endpoint(part: str, url: str) -> tuple[str, int]:
    bad = InvalidURL(
        f"cannot read host {part!r} in etcd URL {url.split('@')[-1]!r}: expected host:port "
        f"entries separated by commas, for example {_URL_EXAMPLE}"
    )
    if not part:
        raise bad
    if part.startswith("["):
        host, bracket, tail = part[1:].partition("]")
        if not bracket or (tail and not tail.startswith(":")):
            raise bad
        port_text = tail[1:] if tail else ""
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise bad from None
    else:
        host, _, port_text = part.partition(":")
        if not host or ":" in port_text:
            raise bad
        if not all(char.isalnum() or char in "-._" for char in host):
            raise bad
    if port_text == "" and (part.endswith(":")):
        raise bad
    port = DEFAULT_PORT
    if port_text:
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise InvalidURL(
                f"port {port_text!r} in etcd URL {url.split('@')[-1]!r} is not a TCP port "
                f"(1-65535); for example {_URL_EXAMPLE}"
            )
        port = int(port_text)
    return host, port
