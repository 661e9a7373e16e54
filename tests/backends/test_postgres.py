"""The PostgreSQL backend against a real server: loss, restarts, partitions, FIFO, leaks, URLs."""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import ssl
import subprocess
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import suppress
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import asyncpg
import pytest

import asynclock
from asynclock.abc import LockRequest, Lost, Renewed
from asynclock.backends.postgres import PostgresBackend, lock_key
from asynclock.backends.postgres._kinds import kind_key, permits_class, slot_keys
from asynclock.backends.postgres._lease import QUERY, TAKE, PostgresGrant
from asynclock.backends.postgres._queue import FREE_BEFORE_LANE
from asynclock.extras.postgres import transaction_lock
from asynclock.testing import FaultProxy, PgBouncerServer, PostgresServer, free_port
from asynclock.testing._safety import SafetyConfig, run_safety
from tests.contract.backend_postgres import Pg, backend_of, start_holder, terminate_holder, until

pytestmark = pytest.mark.anyio


class TLSPostgresServer(PostgresServer):
    """A server that also accepts TLS, with a self-signed certificate for 127.0.0.1 (its own CA)."""

    def _prepare(self) -> None:
        super()._prepare()
        tls = self.data_dir / "tls"  # inside the server's own dir: readable by its OS user
        tls.mkdir()
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", "server.key", "-out", "server.pem", "-days", "1",
             "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName = IP:127.0.0.1"],
            cwd=tls, check=True, capture_output=True,
        )  # fmt: skip
        for path in (tls, *tls.iterdir()):
            shutil.chown(path, "postgres", "postgres")

    def _command(self) -> list[str]:
        tls = self.data_dir / "tls"
        ssl_on = ["-c", "ssl=on", "-c", f"ssl_cert_file={tls}/server.pem"]
        return [*super()._command(), *ssl_on, "-c", f"ssl_key_file={tls}/server.key"]


# -- URL and options (no I/O) -----------------------------------------------------------------


def test_url_options_reach_the_driver_and_keys_depend_on_the_name_and_schema() -> None:
    backend = PostgresBackend.from_url(
        "postgresql://alice:s3cret@db.example:6543/orders",
        {
            "sslmode": "verify-full",
            "sslrootcert": "/etc/ca.pem",
            "application_name": "billing worker",
            "schema": "locks",
            "op_timeout": "1.5",
            "connect_timeout": 2,
            "max_idle": "0",
            "max_waiting": "3",
            "pooler": "session",
            "statement_cache_size": "0",
        },
    )
    assert backend._dsn == (
        "postgresql://alice:s3cret@db.example:6543/orders"
        "?sslmode=verify-full&sslrootcert=%2Fetc%2Fca.pem"
    )
    assert backend.application_name == "billing worker"
    assert backend.schema == "locks"
    assert backend.sequence == '"locks"."asynclock_token_seq"'
    assert (backend.op_timeout, backend.connect_timeout, backend.max_idle) == (1.5, 2.0, 0)
    assert backend.max_waiting == 3
    assert backend.pooler == "session" and backend._sessions._settings.statement_cache_size == 0
    assert backend.queue == '"locks"."asynclock_waiters"'
    # The password never shows in messages.
    assert backend.describe() == "postgresql://alice:***@db.example:6543/orders"
    context = ssl.create_default_context()
    assert PostgresBackend.from_url("postgres://h/db", {"ssl": context})._ssl is context
    # Multi-host and IPv6 URLs are libpq's and asyncpg's; they pass.
    PostgresBackend.from_url("postgresql://u@h1:5432,h2:5433,[::1]:5434/db", {})
    # Lock keys depend on the full name and the schema.
    names = ["a", "a/", "a/b", "ü", "u", "x" * 512, "x" * 511, "%2F", "/"]
    assert len({lock_key(each) for each in names}) == len(names)
    assert lock_key("a") != lock_key("a", schema="other")
    assert lock_key("a") == lock_key("a", schema="public")
    assert all(-(2**63) <= lock_key(each) < 2**63 for each in names)
    # Every kind has a key space of its own; a semaphore's permits class is an int4.
    assert len({kind_key("a", kind) for kind in ("lock", "semaphore", "election")}) == 3
    assert -(2**31) <= permits_class("a") < 2**31
    # Every client and version of a schema must hash a name to the same keys.
    assert lock_key("orders/42") == 7325485902339184980
    assert lock_key("a", schema="ñ") == -1486353011935160441
    assert [kind_key("a", kind) for kind in ("semaphore", "election")] == [
        1316979843198686578,
        3053381955136902804,
    ]
    assert slot_keys("a", 2) == (2250661849208546507, 5599826687813572684)
    assert permits_class("orders/42") == -662521748


def test_malformed_urls_options_and_ttls_are_refused_by_name() -> None:
    # Unknown options: the contract's (tests/contract/test_boundary.py).
    url = "postgresql://127.0.0.1/db"
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("?sslmode=sometimes", {}, "sslmode"),
        ("", {"op_timeout": 0}, "op_timeout"),
        ("?max_idle=-1", {}, "max_idle"),
        ("?max_waiting=many", {}, "max_waiting"),
        ("?pooler=statement", {}, "statement pooling cannot hold a lock"),
        ("?statement_cache_size=-1", {}, "statement_cache_size"),
        ("", {"application_name": "naïve"}, "application_name"),
        ("", {"schema": ""}, "schema"),
        ("", {"ssl": "yes"}, r"ssl\.SSLContext"),
    ]
    for query, options, match in cases:
        with pytest.raises(asynclock.InvalidArgument, match=match):
            asynclock.connect(url + query, **options)
    backend = PostgresBackend.from_url(url, {})
    backend.check_ttl(86400.0)
    with pytest.raises(asynclock.InvalidArgument, match="idle_session_timeout"):
        backend.check_ttl(3e6)  # beyond the range of the server's idle timer
    # Ports, brackets and empty hosts: the contract's (tests/contract/test_boundary.py).
    for bad in (f"{url}/extra", f"{url}#frag", "postgresql://h:1#x/db"):
        with pytest.raises(asynclock.InvalidURL, match=r"postgresql://user:password@127\.0\.0\.1"):
            PostgresBackend.from_url(bad, {})


# -- connecting -------------------------------------------------------------------------------


async def test_connect_errors_say_what_is_wrong_within_the_connect_timeout(pg: Pg) -> None:
    url = f"postgresql://postgres@127.0.0.1:{free_port()}/postgres"
    started = anyio.current_time()
    with pytest.raises(asynclock.BackendUnavailable, match="PostgreSQL runs there") as info:
        async with asynclock.connect(url):
            pytest.fail("connected to a port nobody listens on")
    assert anyio.current_time() - started < 2.0
    assert url in str(info.value)
    with pytest.raises(asynclock.BackendUnavailable, match='"no_such_db" does not exist'):
        async with asynclock.connect(f"postgresql://postgres@{pg.server.address}/no_such_db"):
            pass
    async with FaultProxy(pg.server.host, pg.server.port) as proxy:
        proxy.blackhole()
        # The URL's connect_timeout bounds each connection's opening, below the client's own
        # (10 s by default: the contract's, test_faults.py).
        url = f"postgresql://postgres@{proxy.address}/postgres?connect_timeout=0.5"
        started = anyio.current_time()
        with pytest.raises(asynclock.BackendTimeout, match="connect_timeout"):
            async with asynclock.connect(url):
                pytest.fail("connected through a blackhole")
        assert anyio.current_time() - started < 2.0
        # connect()'s own keyword sets it too, over the URL's: a server silent for 1.5 s is
        # waited for.
        proxy.pass_through()
        started = anyio.current_time()
        proxy.cut(1.5)
        async with asynclock.connect(url, connect_timeout=5.0) as locks:
            assert anyio.current_time() - started >= 1.5
            async with locks.lock("after-the-cut", ttl=2):
                pass


async def test_tls_with_sslmode_and_with_an_ssl_context(pg: Pg, tmp_path: Path) -> None:
    with TLSPostgresServer(max_connections=20) as server:
        ca = tmp_path / "ca.pem"
        shutil.copy(server.data_dir / "tls" / "server.pem", ca)
        admin = await asyncpg.connect(server.dsn, ssl=False)
        try:
            cases: list[tuple[str, dict[str, Any], bool]] = [
                (f"{server.url}?sslmode=verify-full&sslrootcert={ca}", {}, True),
                (server.url, {"ssl": ssl.create_default_context(cafile=str(ca))}, True),
                (f"{server.url}?sslmode=disable", {}, False),
            ]
            for url, options, encrypted in cases:
                async with asynclock.connect(url, **options) as locks:
                    async with locks.lock(pg.name, ttl=5) as lease:
                        pid = lease.grant.pid  # type: ignore[attr-defined]
                        query = "SELECT ssl FROM pg_stat_ssl WHERE pid = $1"
                        assert await admin.fetchval(query, pid) is encrypted, url
            # A certificate that the given CA did not sign is refused, and the error says so.
            with pytest.raises(asynclock.BackendUnavailable, match=r"TLS failed.*sslrootcert"):
                async with asynclock.connect(server.url, ssl=ssl.create_default_context()):
                    pytest.fail("trusted a certificate from an unknown CA")
        finally:
            await admin.close()


# -- holding ----------------------------------------------------------------------------------


async def test_the_default_ttls_holding_connection_opens_with_the_client(
    pg: Pg, request: pytest.FixtureRequest
) -> None:
    """A client opens the holding connection of the default ttl (30 s) as it connects, so that
    its first ``lock()`` opens none (a connection and its setup were most of a first lock's
    11-12 ms); a lock of another ttl opens its own. Through a pooler it opens none."""
    async with pg.connect() as locks:
        # The idle connection open() checked the server on, and the holding one.
        before = {pid for pid, _ in await pg.sessions()}
        assert len(before) == 2
        async with locks.lock(pg.name) as lease:
            assert lease.grant.pid in before  # type: ignore[attr-defined]
            assert {pid for pid, _ in await pg.sessions()} == before
        async with locks.lock(pg.name, ttl=10) as lease:
            assert lease.grant.pid not in before  # type: ignore[attr-defined]
    await pg.nothing_left()
    pooler: PgBouncerServer = request.getfixturevalue("pgbouncer_server")
    async with asynclock.connect(f"{pooler.url}?pooler=session") as locks:
        assert backend_of(locks).extra_info()["holding_connections"] == 0


class ParsesWhileHolding:
    """Records every statement asyncpg parses (a statement's first run, or every run without
    the statement cache) on a connection of ``clients`` that holds a lock."""

    def __init__(self) -> None:
        self.clients: list[asynclock.LockClient] = []
        self.parsed: list[str] = []

    def holding(self, connection: Any) -> str | None:
        for locks in self.clients:
            backend = backend_of(locks)
            lane = backend._lanes.by_connection.get(connection)
            if lane is not None and lane.keys:
                return " (holding connection)"
            if connection in backend._held:
                return ""
        return None


@pytest.fixture
def parses_while_holding(monkeypatch: pytest.MonkeyPatch) -> ParsesWhileHolding:
    parses = ParsesWhileHolding()
    get_statement = asyncpg.Connection._get_statement

    async def recording(self: Any, query: str, *args: Any, **kwargs: Any) -> Any:
        record_class = kwargs.get("record_class") or self._protocol.get_record_class()
        cached = kwargs.get("use_cache", True) and self._stmt_cache.get(
            (query, record_class, kwargs.get("ignore_custom_codec", False))
        )
        where = parses.holding(self)
        if where is not None and not cached:
            parses.parsed.append(" ".join(query.split())[:60] + where)
        return await get_statement(self, query, *args, **kwargs)

    monkeypatch.setattr(asyncpg.Connection, "_get_statement", recording)
    return parses


async def test_no_statement_is_parsed_on_a_connection_while_it_holds_an_exclusive_lock(
    pg: Pg, parses_while_holding: ParsesWhileHolding
) -> None:
    """asyncpg's parse step (a statement's first run, or every run without the cache) ends with
    a Flush, and until the next Sync the server's ``idle_session_timeout``, the lease, is off: a
    client paused then would keep its locks. So nothing is parsed on a connection that holds an
    exclusive lock: not on the holding connection (take, release, renewal, the queue table's
    statements of a waiter), nor on a dedicated connection after its wait (its renewal)."""
    async with pg.connect() as holder, pg.connect(max_waiting=1) as locks:
        parses_while_holding.clients += [holder, locks]
        async with holder.lock(pg.name) as held:
            # One waiter in the server's queue on a dedicated connection, one in the table.
            first = asyncio.create_task(locks.acquire(pg.name, timeout=10))
            await pg.wait_for_waiters(1)
            second = asyncio.create_task(locks.acquire(pg.name, timeout=10))
            await pg.until_queued(1, within=5)
            # The holding connection's renewal, while it holds the lock.
            (outcome,) = await backend_of(holder).renew([held.grant])  # type: ignore[list-item]
            assert isinstance(outcome, Renewed)
        lease = await first
        assert lease.grant.lane is None  # type: ignore[attr-defined]
        (outcome,) = await backend_of(locks).renew([lease.grant])  # type: ignore[list-item]
        assert isinstance(outcome, Renewed)
        await lease.release()
        await (await second).release()
        for _ in range(3):
            async with locks.lock(f"{pg.name}/free"):
                pass
    assert parses_while_holding.parsed == []


async def test_through_transaction_pooling_nothing_is_parsed_while_a_lock_is_held(
    pg: Pg, pgbouncer_transaction_server: PgBouncerServer, parses_while_holding: ParsesWhileHolding
) -> None:
    """Transaction pooling runs without asyncpg's statement cache, so every statement with
    arguments is parsed (ending in a Flush: the lease's timer off) each time it runs. A hold's
    transaction runs none after its take: its renewals and its release are simple queries."""
    url = f"{pgbouncer_transaction_server.url}?pooler=transaction&application_name={pg.app}"
    async with asynclock.connect(url) as holder, asynclock.connect(url) as locks:
        parses_while_holding.clients += [holder, locks]
        async with holder.lock(pg.name, ttl=5) as held:
            waiter = asyncio.create_task(locks.acquire(pg.name, ttl=5, timeout=10))
            await pg.wait_for_waiters(1)
            for _ in range(2):
                (outcome,) = await backend_of(holder).renew([held.grant])  # type: ignore[list-item]
                assert isinstance(outcome, Renewed)
        lease = await waiter
        (outcome,) = await backend_of(locks).renew([lease.grant])  # type: ignore[list-item]
        assert isinstance(outcome, Renewed)
        await lease.release()
    assert parses_while_holding.parsed == []


async def test_a_renewal_answered_by_another_server_process_reports_the_lease_lost(pg: Pg) -> None:
    """The renewal checks, in its own statement, that the server session that took the lock
    answers it: a connection that reaches another one (a pooler that moved it) held nothing
    there. Shown by giving the grant another server process's id, on a lane and on a dedicated
    connection; with the right one the same renewal renews."""
    async with pg.connect() as locks, pg.connect() as other:
        backend = backend_of(locks)
        # A dedicated connection's grant: other's, after a wait in the server's queue.
        first = await locks.acquire(pg.name, ttl=10)
        waiter = asyncio.create_task(other.acquire(pg.name, ttl=10, timeout=10))
        await pg.wait_for_waiters(1)
        await first.release()
        dedicated = await waiter
        on_lane = await locks.acquire(f"{pg.name}/2", ttl=10)
        lane_grant = on_lane.grant
        dedicated_grant = dedicated.grant
        assert isinstance(lane_grant, PostgresGrant) and lane_grant.lane is not None
        assert isinstance(dedicated_grant, PostgresGrant) and dedicated_grant.lane is None
        # A lane's renewal names the lane's server process, a dedicated one its grant's.
        owners: tuple[tuple[asynclock.LockClient, PostgresGrant, Any], ...] = (
            (locks, lane_grant, lane_grant.lane),
            (other, dedicated_grant, dedicated_grant),
        )
        for holder, grant, owner in owners:
            real = owner.pid
            owner.pid = real + 100_000
            try:
                (outcome,) = await backend_of(holder).renew([grant])
            finally:
                owner.pid = real
            assert isinstance(outcome, Lost)
            assert f"no longer reaches server process {real + 100_000}" in outcome.reason
            (outcome,) = await backend_of(holder).renew([grant])
            assert isinstance(outcome, Renewed)
        await on_lane.release()
        await dedicated.release()
        assert backend._lanes.by_ttl[10000].renewals >= 2
    assert await pg.settle_sessions(0) == 0


async def test_1000_locks_of_one_client_share_one_connection_per_ttl(pg: Pg) -> None:
    """Locks of one ttl live on one holding connection (its idle timer is the lease), renewed
    by one statement; a release unlocks its own key only; idle connections hold nothing."""
    async with pg.connect(max_idle=2) as locks:
        backend = backend_of(locks)
        leases = [await locks.acquire(f"{pg.name}/{index}", ttl=10) for index in range(1000)]
        short = [await locks.acquire(f"{pg.name}/short/{index}", ttl=5) for index in range(3)]
        held = await pg.sessions()
        # One holding connection per ttl, plus the idle one that open() checked the server on
        # and the default ttl's (30 s), which the client opened as it connected.
        assert sorted(count for _, count in held) == [0, 0, 3, 1000]
        for lease in leases[:3] + short:
            assert await pg.holders(lease.name) == [lease.grant.pid]  # type: ignore[attr-defined]
        # One statement renews the 1,000 locks of a ttl.
        calls_before = backend._lanes.by_ttl[10000].renewals
        outcomes = await backend.renew([lease.grant for lease in leases])  # type: ignore[misc]
        assert all(isinstance(outcome, Renewed) for outcome in outcomes)
        assert backend._lanes.by_ttl[10000].renewals == calls_before + 1
        # Releasing one leaves the others held on the same session.
        await leases[0].release()
        assert await pg.holders(leases[0].name) == []
        assert await pg.holders(leases[1].name) == [leases[1].grant.pid]  # type: ignore[attr-defined]
        for lease in leases[1:] + short:
            await lease.release()
        assert all(count == 0 for _, count in await pg.sessions())
        for connection in backend._sessions.pool._idle:
            assert await connection.fetchval("SHOW idle_session_timeout") == "0"
    assert await pg.settle_sessions(0) == 0


async def test_a_lane_statement_whose_caller_left_before_it_was_sent_is_not_sent(pg: Pg) -> None:
    """A statement queued on a busy lane whose caller is cancelled meanwhile is dropped: a
    waiter's place in the queue table, made after its cancelled acquire had returned, held
    every take of a semaphore up (a CI run's other client waited past 100 ms)."""
    async with pg.connect() as locks, locks.lock(pg.name, ttl=10):
        lane = backend_of(locks)._lanes.by_ttl[10000]
        lane.detach(lane.submit(QUERY, 0, "SELECT pg_sleep(0.05)"))
        dropped = lane.submit(QUERY, 0, "SELECT set_config('asynclock.test', 'sent', false)")
        dropped.future.cancel()  # as a caller's cancellation does, while it waits
        probe = lane.submit(QUERY, 0, "SELECT current_setting('asynclock.test', true)")
        row = await probe.future
        assert row[0] in (None, "")


async def test_a_lanes_statements_run_one_at_a_time_in_the_order_they_came(pg: Pg) -> None:
    """The first statement on an idle lane is sent at once; those that come while it is in
    flight wait their turn, each sent when the one before it ended (``Lane._pump``)."""
    async with pg.connect() as locks:
        async with locks.lock(pg.name, ttl=10) as lease:
            lane = lease.grant.lane  # type: ignore[attr-defined]
            ops = [
                lane.submit(QUERY, 0, f"SELECT set_config('asynclock.test', '{n}', false)")
                for n in range(5)
            ]
            assert lane._current is ops[0] and list(lane._ops) == ops[1:]
            probe = lane.submit(QUERY, 0, "SELECT current_setting('asynclock.test')")
            rows = [await op.future for op in ops]
            assert [row[0] for row in rows] == [str(n) for n in range(5)]
            assert (await probe.future)[0] == "4"
            assert not lane.pending and lane.dead is None
            assert [op.sent_at for op in ops] == sorted(op.sent_at for op in ops)


@pytest.mark.parametrize("cancels", [1, 3])
async def test_native_cancels_of_a_take_in_flight_leave_its_lane_working(
    pg: Pg, cancels: int
) -> None:
    """A take on an idle lane is sent from its caller's call, and the lane drives it from there
    (``Lane._step``): ``Task.cancel()``, once or several times while the reply is on its way,
    ends the caller's wait, never the statement. The lane keeps its connection (its other locks
    with it), and the take that succeeded behind the cancelled caller is undone."""
    async with pg.connect() as locks, asynclock.connect(pg.server.url) as other:
        kept = await locks.acquire(f"{pg.name}/kept", ttl=10)
        lane = kept.grant.lane  # type: ignore[attr-defined]
        sent = lane.renewals, lane.pid

        async def take() -> None:
            await locks.acquire(pg.name, ttl=10)

        task = asyncio.get_running_loop().create_task(take())
        await asyncio.sleep(0)  # its first step sends the take (the lane is idle)
        assert lane._current is not None and lane._current.kind == TAKE
        for _ in range(cancels):
            task.cancel()
            await asyncio.sleep(0)
        with pytest.raises(asyncio.CancelledError):
            await task
        async with other.lock(pg.name, ttl=10, timeout=5):
            pass  # undone behind the cancelled caller
        assert lane.dead is None and (lane.renewals, lane.pid) == sent
        assert not lane.pending and lane.keys == {kept.grant.key}  # type: ignore[attr-defined]
        assert await pg.holders(kept.name) == [lane.pid]
        await kept.release()


@pytest.mark.expect_log(r"a lane to .* failed \(RuntimeError\('a bug in the lane'\)\)")
@pytest.mark.expect_log(r"lease on '.*/kept' lost: the connection holding the advisory lock")
async def test_a_lane_whose_own_bookkeeping_fails_ends_rather_than_hangs(
    pg: Pg, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error in the lane's handling of a reply (``Lane._end``, run from a future's callback,
    where an exception reaches only the loop's handler) ends the lane as a broken connection
    does: the caller gets BackendUnavailable at once (after the take was tried on two more
    lanes, as after any lane that died under it), not a wait until op_timeout; the other lock
    on the lane is reported lost; the server frees both; the next take opens a new lane."""
    async with pg.connect(op_timeout=30) as locks, asynclock.connect(pg.server.url) as other:
        kept = await locks.acquire(f"{pg.name}/kept", ttl=10)
        lane = kept.grant.lane  # type: ignore[attr-defined]
        real_end = type(lane)._end

        def failing_end(self: Any, op: Any, result: Any, error: BaseException | None) -> None:
            if op.kind == TAKE:
                raise RuntimeError("a bug in the lane")
            real_end(self, op, result, error)

        monkeypatch.setattr(type(lane), "_end", failing_end)
        with anyio.fail_after(5):
            with pytest.raises(asynclock.BackendUnavailable, match="a bug in the lane"):
                await locks.acquire(pg.name, ttl=10)
        monkeypatch.undo()
        assert lane.dead is not None and not lane.busy
        with anyio.fail_after(5):
            while not kept.lost:  # noqa: ASYNC110
                await anyio.sleep(0.01)
        for name in (pg.name, kept.name):
            async with other.lock(name, ttl=10, timeout=5):
                pass  # freed with the session
        async with locks.lock(pg.name, ttl=10) as again:
            assert again.grant.lane is not lane  # type: ignore[attr-defined]
        await kept.release()


async def test_a_holding_connection_without_locks_is_closed_before_its_idle_timer_fires(
    pg: Pg,
) -> None:
    """Closed by the client after half its ttl without locks (so the server's idle timer, at one
    ttl, never ends a session the client still counts on); the next take opens another."""
    async with pg.connect(max_idle=1) as locks:
        backend = backend_of(locks)
        async with locks.lock(pg.name, ttl=0.5) as lease:
            holding = lease.grant.pid  # type: ignore[attr-defined]
        lane = backend._lanes.by_ttl[500]
        with anyio.fail_after(2):
            while holding in {pid for pid, _ in await pg.sessions()}:  # noqa: ASYNC110
                await anyio.sleep(0.02)
        assert anyio.current_time() - lease.grant.valid_from >= 0.25
        assert str(lane.dead) == "the lane was closed"  # by the client, not by the server
        assert 500 not in backend._lanes.by_ttl
        async with locks.lock(pg.name, ttl=0.5) as again:
            assert again.grant.pid != holding  # type: ignore[attr-defined]
        assert not lease.lost and not again.lost


@pytest.mark.expect_log(r"unlocking .* failed \(UndefinedTableError.*closed its connection instead")
async def test_tokens_come_from_the_sequence_in_the_configured_schema(pg: Pg) -> None:
    schema = f"locks_{uuid.uuid4().hex[:6]}"
    with pytest.raises(asynclock.BackendUnavailable, match=f"schema '{schema}' does not exist"):
        async with pg.connect(schema=schema):
            pass
    await pg.admin.execute(f'CREATE SCHEMA "{schema}"')
    try:
        async with pg.connect(schema=schema) as locks:
            async with locks.lock(pg.name, ttl=10) as lease:
                assert await pg.holders(pg.name, schema) == [lease.grant.pid]  # type: ignore[attr-defined]
                assert await pg.holders() == []
                last = await pg.admin.fetchval(
                    f'SELECT last_value FROM "{schema}".asynclock_token_seq'
                )
                assert lease.token == last
            # A release the server refuses (its table gone) closes the permit's connection
            # instead: the permit ends with the session.
            permit = await locks.semaphore(pg.name, permits=1).acquire(ttl=10)
            await pg.admin.execute(f'DROP TABLE "{schema}".asynclock_holders')
            await permit.release()
            query = "SELECT count(*) FROM pg_locks WHERE pid = $1 AND locktype = 'advisory'"
            with anyio.fail_after(5):
                while await pg.admin.fetchval(query, permit.grant.pid):  # type: ignore[attr-defined]  # noqa: ASYNC110
                    await anyio.sleep(0.01)
        # A sequence with a per-session cache would hand out tokens out of order: refused.
        await pg.admin.execute(f'ALTER SEQUENCE "{schema}".asynclock_token_seq CACHE 10')
        with pytest.raises(asynclock.BackendUnavailable, match="CACHE 1"):
            async with pg.connect(schema=schema):
                pass
    finally:
        await pg.admin.execute(f'DROP SCHEMA "{schema}" CASCADE')


async def test_renew_reports_every_grant_and_proves_loss_of_a_terminated_one(pg: Pg) -> None:
    """Two ttls, so two holding connections: terminating one loses the locks on it (they share
    its session), and only those; one renewal statement per connection renews the rest."""
    lost: list[str] = []
    async with pg.backend() as backend:
        grants = [
            await backend.acquire(
                LockRequest(f"{pg.name}/{index}", 5.0 if index % 2 else 6.0, "owner", lost.append)
            )
            for index in range(6)
        ]
        assert len({grant.pid for grant in grants}) == 2
        await terminate_holder(pg.server.dsn, f"{pg.name}/3")
        before = anyio.current_time()
        outcomes = await backend.renew(grants)
        for index, outcome in enumerate(outcomes):
            if index % 2:
                assert isinstance(outcome, Lost)
            else:
                assert isinstance(outcome, Renewed)
                assert outcome.valid_from >= before and outcome.ttl == 6.0
        # The termination was also pushed, without waiting for a renewal, once per lock.
        assert len(lost) == 3 and all("pg_terminate_backend" in reason for reason in lost)
        for grant in grants:
            await backend.release(grant)


# -- loss -------------------------------------------------------------------------------------


async def test_tokens_keep_rising_after_a_crash(pg: Pg) -> None:
    # A clean restart: the contract's (test_faults.py, (e)). Here SIGKILL: no clean shutdown,
    # the server recovers the token sequence from its WAL.
    with PostgresServer(max_connections=20) as server:
        async with asynclock.connect(server.url) as locks:
            async with locks.lock(pg.name, ttl=10) as before:
                pass
        server.kill()
        await anyio.to_thread.run_sync(server.restart)
        async with asynclock.connect(server.url) as locks:
            async with locks.lock(pg.name, ttl=10) as after:
                assert after.token > before.token


@pytest.mark.expect_log(r"lost: no successful renewal before the local deadline")
@pytest.mark.expect_log(r"releasing .* did not complete in 0\.25 s; retrying in the background")
async def test_blackholed_connection_cancels_the_body_before_the_server_frees_the_lock(
    pg: Pg,
) -> None:
    # The body stops ttl * drift + margin (0.33 s here) before the server may free the lock.
    ttl = 3.0
    async with FaultProxy(pg.server.host, pg.server.port) as proxy:
        url = f"postgresql://postgres@{proxy.address}/postgres?op_timeout=0.3"
        async with asynclock.connect(url) as locks:
            with pytest.raises(asynclock.LeaseLost, match="deadline"):
                async with locks.lock(pg.name, ttl=ttl) as lease:
                    holder = await pg.holders()
                    proxy.blackhole()
                    blackholed_at = anyio.current_time()
                    try:
                        await anyio.sleep(30)
                    finally:
                        cancelled_at = anyio.current_time()
                        with anyio.CancelScope(shield=True):
                            held_when_cancelled = await pg.holders()
            # The body stopped while the server still kept the lock for us: nobody overlapped.
            assert held_when_cancelled == holder
            assert cancelled_at < lease.grant.valid_from + ttl
            assert cancelled_at - blackholed_at < ttl
            # The server ends the silent session ttl after the last renewal it received.
            await pg.until_free(ttl + 2, 0.02)
            assert anyio.current_time() >= lease.grant.valid_from + ttl


async def test_a_network_cut_shorter_than_the_lease_costs_nothing(pg: Pg) -> None:
    """Renewals time out during the cut (op_timeout 0.3 s) but are not cancelled: the one that
    waited in the network reaches the server after the cut and renews the lease."""
    ttl = 3.0
    async with FaultProxy(pg.server.host, pg.server.port) as proxy:
        url = f"postgresql://postgres@{proxy.address}/postgres?op_timeout=0.3"
        async with asynclock.connect(url) as locks:
            async with locks.lock(pg.name, ttl=ttl) as lease:
                holder = await pg.holders()
                proxy.cut(1.5)
                await anyio.sleep(ttl + 1.0)
                assert not lease.lost
                assert await pg.holders() == holder
            assert locks.renew_calls >= 4


@pytest.mark.expect_log(r"^asynclock: lease on '.*' lost: ")
async def test_a_silent_client_or_a_blocked_loop_loses_the_lock_and_releases_it_quietly(
    pg: Pg,
) -> None:
    """No renewals at all (as a paused process): the server frees the lock after ttl, not before.
    The event loop blocked past the ttl (a long GC, a blocking call: a pause of this process
    alone): the server ends the session, the body is cancelled, and releasing a lock whose
    session is gone says nothing (it used to warn that the release did not complete)."""
    ttl = 1.0
    lost: list[str] = []
    async with pg.backend() as backend:
        grant = await backend.acquire(LockRequest(pg.name, ttl, "owner", lost.append))
        assert grant.ttl == ttl
        await pg.until_free(ttl + 2)
        freed_seen_at = anyio.current_time()
        assert freed_seen_at >= grant.valid_from + ttl
        assert freed_seen_at < grant.valid_from + ttl + 1.0
        await until(lambda: lost, 1)  # the listener runs on the loop
        # Pushed by the connection closing, once (nothing renewed it, so nothing else could).
        assert len(lost) == 1 and "closed" in lost[0]
        await backend.release(grant)
    async with pg.connect() as locks:
        with pytest.raises(asynclock.LeaseLost):
            async with locks.lock(pg.name, ttl=ttl):
                time.sleep(ttl + 0.5)  # noqa: ASYNC251 (the point: the loop does not run)
                await anyio.sleep(1)
        assert await pg.holders() == []
        async with locks.lock(pg.name, ttl=ttl, timeout=1):
            pass


# -- behind a connection pooler ---------------------------------------------------------------


async def test_a_pooler_is_found_and_only_the_mode_the_url_names_is_accepted(pg: Pg) -> None:
    """Session locks through transaction or statement pooling exclude nobody, silently (#26): a
    pooler is refused unless the URL names its pool mode; a pool that shares server sessions
    between client connections is refused as ?pooler=session, and statement pooling (which
    ends every transaction) as ?pooler=transaction. PgBouncer answers the login itself and
    queues statements until a server connection is free: a pool too small for a client is a
    timeout, which names the pool and the options."""
    async with (
        asynclock.connect(pg.url) as direct,
        FaultProxy(pg.server.host, pg.server.port) as proxy,
    ):
        assert direct._backend.extra_info()["pooler_found"] is False
        # A TCP proxy (port forward, NAT, Kubernetes service) is not a pooler.
        async with asynclock.connect(f"postgresql://postgres@{proxy.address}/postgres") as via:
            assert via._backend.extra_info()["pooler_found"] is False
    for mode in ("session", "transaction", "statement"):
        # Stock PgBouncer (no ignore_startup_parameters): our settings go as SQL.
        with PgBouncerServer(pg.server, pool_mode=mode, pool_size=2) as pooler:
            with pytest.raises(asynclock.UnsupportedFeature, match=r"\?pooler=transaction"):
                async with asynclock.connect(pooler.url):
                    pytest.fail("connected through a pooler the URL did not mention")
            if mode == "session":
                url = f"{pooler.url}?pooler=session&max_idle=0&connect_timeout=0.5&op_timeout=0.5"
                async with asynclock.connect(url) as locks:
                    # One server connection per ttl in use: the third ttl finds the pool full.
                    async with locks.lock(pg.name, ttl=5), locks.lock(f"{pg.name}/2", ttl=6):
                        with pytest.raises(
                            asynclock.BackendTimeout, match="lower max_waiting and max_idle"
                        ):
                            await locks.acquire(f"{pg.name}/3", ttl=7)
            else:
                with pytest.raises(asynclock.UnsupportedFeature, match="transaction or statement"):
                    async with asynclock.connect(f"{pooler.url}?pooler=session"):
                        pytest.fail(f"connected through {mode} pooling")
            if mode == "statement":
                with pytest.raises(asynclock.UnsupportedFeature, match="statement pooling"):
                    async with asynclock.connect(f"{pooler.url}?pooler=transaction"):
                        pytest.fail("connected through statement pooling")
            # Session and transaction pooling: the contract suite runs through both
            # (backend_pgbouncer*.py).
    assert await pg.admin.fetchval("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'") == 0


async def test_through_transaction_pooling_other_kinds_are_refused_and_waiters_keep_order(
    pg: Pg, pgbouncer_transaction_server: PgBouncerServer
) -> None:
    """Each hold is a transaction of its own: the kinds that keep a row for others to read are
    refused by name; waiters queue in the server, granted in the order they asked; nothing of
    ours stays on the pooler's server sessions."""
    url = f"{pgbouncer_transaction_server.url}?pooler=transaction&application_name={pg.app}"
    async with asynclock.connect(url) as locks, asynclock.connect(url) as other:
        assert locks.capabilities.semaphores is False
        for refused in (
            lambda: locks.lock(pg.name, shared=True),
            lambda: locks.semaphore(pg.name, permits=2),
            lambda: locks.election(pg.name),
        ):
            with pytest.raises(asynclock.UnsupportedFeature, match="transaction pooling"):
                refused()
        order: list[int] = []
        holder = await other.acquire(pg.name, ttl=5)

        async def waiter(index: int) -> None:
            async with locks.lock(pg.name, ttl=5, timeout=20):
                order.append(index)

        async with anyio.create_task_group() as tg:
            for index in range(30):
                tg.start_soon(waiter, index)
                await pg.wait_for_waiters(index + 1)
            await holder.release()
        assert order == list(range(30))
        # Every setting is a transaction's own (SET LOCAL): a session a client left shows the
        # server's defaults.
        probe = await asyncpg.connect(pgbouncer_transaction_server.url, statement_cache_size=0)
        try:
            for _ in range(5):
                assert await probe.fetchval("SHOW idle_in_transaction_session_timeout") == "0"
                assert await probe.fetchval(
                    "SELECT current_setting('asynclock.connection', true)"
                ) in (None, "")
        finally:
            await probe.close()


@pytest.mark.parametrize("mode", ["session", "transaction"])
@pytest.mark.parametrize("signal_number", [signal.SIGSTOP, signal.SIGKILL])
async def test_a_stopped_or_killed_holder_behind_a_pooler_frees_the_lock_in_time(
    pg: Pg, request: pytest.FixtureRequest, mode: str, signal_number: int
) -> None:
    """Its settings reach the server through the pooler: a stopped holder's lock is free at
    ttl (the server's idle timer), a killed one's at once (PgBouncer resets or closes the server
    connection it used)."""
    ttl = 1.0
    fixture = "pgbouncer_server" if mode == "session" else "pgbouncer_transaction_server"
    pooler: PgBouncerServer = request.getfixturevalue(fixture)
    url = f"{pooler.url}?pooler={mode}"
    holder, _ = await start_holder(url, pg.name, ttl=ttl)
    try:
        # Open before the signal: what is measured is how long the lock stays held, not how
        # long a client takes to open through the pooler (0.9 s beside a CPU hog, run 54).
        async with asynclock.connect(url) as locks:
            os.kill(holder.pid, signal_number)
            stopped = anyio.current_time()
            with anyio.fail_after(ttl + 2):
                while (lease := await locks.try_acquire(pg.name, ttl=ttl)) is None:  # noqa: ASYNC110
                    await anyio.sleep(0.02)
            freed = anyio.current_time() - stopped
            await lease.release()
    finally:
        with suppress(ProcessLookupError):
            os.kill(holder.pid, signal.SIGKILL)
        await holder.wait()
    assert freed < (ttl + 1 if signal_number == signal.SIGSTOP else 0.5)


@pytest.mark.parametrize("mode", ["session", "transaction"])
async def test_five_processes_through_a_pooler_exclude_each_other(
    pg: Pg, request: pytest.FixtureRequest, mode: str
) -> None:
    """5 worker processes read then write one row under the lock through PgBouncer: no two
    holds overlap, no write is refused, no update is lost, nothing stays held. (Holders paused
    past their ttl: the contract's paused-client test, through both modes.)"""
    fixture = "pgbouncer_server" if mode == "session" else "pgbouncer_transaction_server"
    pooler: PgBouncerServer = request.getfixturevalue(fixture)
    url = f"{pooler.url}?pooler={mode}"
    report = await run_safety(
        SafetyConfig(url, pg.server.url, workers=5, duration=3.0, pause_probability=0, lock=pg.name)
    )
    described = f"{report.as_dict()} errors={report.errors[:3]}"
    assert not report.errors and report.safe and report.writes_refused == 0, described
    # Enough holds that overlaps could show (not a speed bound: 86 to 150, as loaded).
    assert report.holds >= 20 and report.overlapping_holds == 0, described
    assert report.final_value == report.writes_accepted, described
    assert await pg.admin.fetchval("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'") == 0


# -- waiting ----------------------------------------------------------------------------------


async def test_300_waiters_that_start_at_once_keep_to_max_waiting_connections(pg: Pg) -> None:
    """Started in one go, the waiters count each other before their first await: 8 take a
    connection for the server's queue, the rest a place in the table (before the fix, each
    saw 0 waiting and opened a connection of its own)."""
    async with pg.connect(max_idle=1) as locks, asynclock.connect(pg.server.url) as holder_client:
        holder = await holder_client.acquire(pg.name, ttl=30)
        passed = 0

        async def waiter() -> None:
            nonlocal passed
            async with locks.lock(pg.name, ttl=30):
                passed += 1

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for _ in range(300):
                    tg.start_soon(waiter)
                while ((await locks.inspect(pg.name)).waiters or 0) < 300:  # noqa: ASYNC110
                    await anyio.sleep(0.01)
                assert len(await pg.sessions()) <= 12
                await holder.release()
        assert passed == 300


async def test_when_connections_run_out_waiters_get_a_named_error_not_a_hang(pg: Pg) -> None:
    """Waiters of one lock need no connection beyond the queue table's head; waiters of as
    many locks each need one: past max_connections they get a named error."""
    with PostgresServer(max_connections=12) as server:
        async with (
            asynclock.connect(f"{server.url}?max_waiting=50") as locks,
            asynclock.connect(server.url) as other,
        ):
            names = [f"{pg.name}/{index}" for index in range(20)]
            holders = [await other.acquire(name, ttl=30) for name in names]
            errors: list[BaseException] = []

            async def waiter(name: str) -> None:
                try:
                    async with locks.lock(name, ttl=30, timeout=20):
                        pass
                except asynclock.BackendUnavailable as exc:
                    errors.append(exc)

            with anyio.fail_after(15):
                async with anyio.create_task_group() as tg:
                    for name in names:
                        tg.start_soon(waiter, name)
                    while not errors:  # noqa: ASYNC110
                        await anyio.sleep(0.01)
                    for holder in holders:
                        await holder.release()
            assert "raise max_connections on the server, or lower max_waiting" in str(errors[0])


async def test_waiters_cancelled_in_the_queue_table_give_their_places_up(pg: Pg) -> None:
    """Native cancels (once to three times) of waiters in the queue table, while they wait and
    while their statements run: their places go, the others keep their order."""
    rng = random.Random(3)
    async with pg.connect(max_waiting=1) as locks, asynclock.connect(pg.server.url) as other:
        holder = await other.acquire(pg.name, ttl=10)
        order: list[int] = []

        async def run(index: int) -> None:
            async with locks.lock(pg.name, ttl=10):
                order.append(index)

        tasks: list[asyncio.Task[None]] = []
        cancelled = set(rng.sample(range(1, 40), 15))
        with anyio.fail_after(20):
            for index in range(40):
                tasks.append(asyncio.create_task(run(index)))
                if index in cancelled and rng.random() < 0.5:
                    await asyncio.sleep(rng.uniform(0, 0.001))  # mid-statement
                    tasks[index].cancel()
                    continue
                if index == 0:
                    await pg.wait_for_waiters(1)
                else:
                    while await pg.queue_rows() < len(  # noqa: ASYNC110
                        [i for i in range(1, index + 1) if not tasks[i].done()]
                    ):
                        await anyio.sleep(0.002)
            for index in sorted(cancelled):
                for _ in range(rng.choice((1, 2, 3))):
                    tasks[index].cancel()
                    await asyncio.sleep(rng.uniform(0, 0.001))
            for index in cancelled:
                with suppress(asyncio.CancelledError):
                    await tasks[index]
            while await pg.queue_rows() != 39 - len(cancelled):  # noqa: ASYNC110
                await anyio.sleep(0.005)
            await holder.release()
            await asyncio.gather(*(tasks[i] for i in range(40) if i not in cancelled))
    assert order == [index for index in range(40) if index not in cancelled]
    assert await pg.queue_rows() == 0


@pytest.mark.parametrize("cancels", [1, 3, 0], ids=["cancelled", "cancelled 3 times", "closed"])
async def test_a_burst_passes_the_turn_on_when_a_checked_waiter_is_cancelled_or_its_client_closes(
    pg: Pg, monkeypatch: pytest.MonkeyPatch, cancels: int
) -> None:
    """In a burst, the next waiter takes its place once the one before it shows in the server's
    queue (a background check, ``Waiting._give_when_entered``). Cancelled natively while that
    check runs, the first waiter gives the turn up and the others are granted in order; a
    client closed while it runs (cancels=0) ends the check and every waiter, leaving nothing."""
    async with asynclock.connect(pg.server.url) as other:
        holder = await other.acquire(pg.name, ttl=10)
        before = asyncio.all_tasks()  # other's included
        locks = pg.connect()
        await locks.__aenter__()
        try:
            queue = locks._backend._waiter._queue  # type: ignore[attr-defined]
            checking, entered = anyio.Event(), queue.entered

            async def slow_entered(ttl_ms: int, pid: int, key: int) -> bool:
                checking.set()
                await anyio.sleep(0.2)  # the window the cancels and the close land in
                return bool(await entered(ttl_ms, pid, key))

            monkeypatch.setattr(queue, "entered", slow_entered)
            order: list[int] = []

            async def run(index: int) -> None:
                async with locks.lock(pg.name, ttl=10, timeout=10):
                    order.append(index)

            tasks = [asyncio.create_task(run(index)) for index in range(3)]
            with anyio.fail_after(10):
                await checking.wait()
                if not cancels:
                    await locks.__aexit__(None, None, None)
                    results = await asyncio.gather(*tasks, return_exceptions=True)
                    assert all(isinstance(r, asynclock.BackendUnavailable) for r in results)
                    assert order == []
                else:
                    for _ in range(cancels):
                        tasks[0].cancel()
                        await asyncio.sleep(0)
                    with suppress(asyncio.CancelledError):
                        await tasks[0]
                    await holder.release()
                    await asyncio.gather(*tasks[1:])
                    assert order == [1, 2]
        finally:
            await locks.__aexit__(None, None, None)
        if not cancels:
            await holder.release()
        assert [t for t in asyncio.all_tasks() - before if not t.done()] == []
        assert await pg.waiters() == []
    assert await pg.settle_sessions(0) == 0


async def test_the_place_of_a_vanished_waiter_expires_and_holds_nobody_up_after(pg: Pg) -> None:
    """A place nobody refreshes (its client died or is paused) is skipped once it expires: the
    next waiter finds out by its poll (no NOTIFY comes), within POLL of the expiry."""
    async with pg.connect() as locks:
        await pg.admin.execute(
            "INSERT INTO asynclock_waiters VALUES ($1, nextval('asynclock_token_seq'), 'gone', "
            "'gone', 1000, clock_timestamp() + interval '600 ms')",
            lock_key(pg.name),
        )
        started = anyio.current_time()
        assert await locks.try_acquire(pg.name, ttl=5) is None  # a place in the queue: not free
        async with locks.lock(pg.name, ttl=5, timeout=3):
            waited = anyio.current_time() - started
        assert 0.5 < waited < 0.6 + 0.25 + 0.3
        # Expired places are ignored at once.
        async with locks.lock(pg.name, ttl=5, timeout=0.5):
            pass
        await pg.admin.execute("DELETE FROM asynclock_waiters WHERE waiter = 'gone'")


async def test_a_paused_waiters_place_expires_and_it_queues_again_when_it_resumes(pg: Pg) -> None:
    async with (
        asynclock.connect(pg.server.url) as holder_client,
        pg.connect(max_waiting=0) as first_client,
        pg.connect(max_waiting=0) as last_client,
    ):
        holder = await holder_client.acquire(pg.name, ttl=10)
        first = asyncio.create_task(first_client.acquire(pg.name, ttl=10))
        await pg.until_queued(1, 10)
        # A waiter in the queue table, in a process of its own, that lets go once it holds.
        url = f"{pg.server.url}?max_waiting=0"
        process, output = await start_holder(url, pg.name, ttl=1, hold=0, held=False)
        async with process:
            await pg.until_queued(2, 20)
            last = asyncio.create_task(last_client.acquire(pg.name, ttl=10))
            await pg.until_queued(3, 10)
            os.kill(process.pid, signal.SIGSTOP)
            stopped_at = anyio.current_time()
            try:
                await holder.release()
                await (await first).release()
                # The paused waiter's place (ttl 1 s, last refreshed at most 1/3 s before the
                # pause) holds the last one up until it expires, then the poll finds out.
                with anyio.fail_after(5):
                    lease = await last
                waited = anyio.current_time() - stopped_at
                assert 0.6 < waited < 1.0 + 0.25 + 0.5
                os.kill(process.pid, signal.SIGCONT)
                await anyio.sleep(0.5)
                assert await pg.queue_rows() == 1  # queued again, behind the holder
                await lease.release()
                with anyio.fail_after(10):
                    assert await output.receive_until(b"\n", 100) == b"held"
                    assert await process.wait() == 0
            finally:
                if process.returncode is None:
                    os.kill(process.pid, signal.SIGCONT)
    assert await pg.queue_rows() == 0


@pytest.mark.parametrize(("max_idle", "cycles"), [(4, 1000), (0, 400)])
async def test_no_connection_leaks_after_acquire_cancel_cycles(
    pg: Pg, max_idle: int, cycles: int
) -> None:
    """With no idle pool (max_idle=0) every acquire connects, so many cancellations hit a
    connect half-way (which makes asyncpg log an unretrieved error unless the connect is left
    to finish)."""
    rng = random.Random(7)
    async with pg.connect(max_idle=max_idle) as locks, asynclock.connect(pg.server.url) as other:
        for cycle in range(cycles):
            if cycle % 2:
                # Cancel an acquire of a free lock somewhere in its round trip or its body.
                with anyio.move_on_after(rng.uniform(0, 0.002)):
                    async with locks.lock(pg.name, ttl=10):
                        await anyio.sleep(1)
            else:
                # Cancel a waiter, queued or not yet.
                holder = await other.acquire(pg.name, ttl=10)
                with anyio.move_on_after(rng.uniform(0, 0.004)):
                    async with locks.lock(pg.name, ttl=10):
                        pytest.fail("entered a held lock")
                await holder.release()
        # The last cancelled take may still run on its lane, with the unlock queued behind it
        # (a try at once may find the key taken): the lock comes free once they have run.
        async with other.lock(pg.name, ttl=10, timeout=5):
            pass
        assert await pg.waiters() == []
        # max_idle, the holding connections of ttl 10 and of the default ttl (opened with the
        # client) and the listener (with no idle connection at hand, a waiter waits in the
        # queue table).
        assert await pg.settle_sessions(max_idle + 3) <= max_idle + 3
        assert all(count == 0 for _, count in await pg.sessions())
    assert await pg.settle_sessions(0) == 0


async def test_a_lock_the_client_waited_for_goes_straight_to_the_servers_queue(pg: Pg) -> None:
    """After a wait, the client's next acquire of the lock is one statement in the server's
    queue, which takes it when free; the acquire after ``FREE_BEFORE_LANE`` such ones in a row
    tries on the lane again, and a wait in between starts the count again. Such a wait, timed
    out or cancelled anywhere, leaves nothing behind."""
    rng = random.Random(11)
    async with pg.connect() as locks, asynclock.connect(pg.server.url) as other:
        contended = locks._backend._waiter.contended  # type: ignore[attr-defined]
        key = lock_key(pg.name)

        async def wait_once() -> None:
            leases: list[asynclock.Lease] = []

            async def waiter() -> None:
                leases.append(await locks.acquire(pg.name, ttl=10, timeout=5))

            holder = await other.acquire(pg.name, ttl=10)
            async with anyio.create_task_group() as tg:
                tg.start_soon(waiter)
                await pg.wait_for_waiters(1)
                await holder.release()
            assert key in contended
            await leases[0].release()

        await wait_once()
        for free in range(1, FREE_BEFORE_LANE):
            async with locks.lock(pg.name, ttl=10, timeout=5) as lease:
                assert lease.grant.lane is None  # type: ignore[attr-defined]
            assert contended[key] == free
        await wait_once()
        assert contended[key] == 0
        for _ in range(FREE_BEFORE_LANE):
            async with locks.lock(pg.name, ttl=10, timeout=5) as lease:
                assert lease.grant.lane is None  # type: ignore[attr-defined]
        assert key not in contended
        lease = await locks.acquire(pg.name, ttl=10, timeout=5)  # on the lane again
        assert lease.grant.lane is not None  # type: ignore[attr-defined]
        token = lease.token
        await lease.release()
        await wait_once()
        holder = await other.acquire(pg.name, ttl=10)
        with pytest.raises(asynclock.AcquireTimeout):
            await locks.acquire(pg.name, ttl=10, timeout=0.05)
        for _ in range(12):
            with anyio.move_on_after(rng.uniform(0, 0.004)):
                async with locks.lock(pg.name, ttl=10):
                    pytest.fail("entered a held lock")
        assert key in contended
        await holder.release()
        async with locks.lock(pg.name, ttl=10, timeout=5) as lease:
            assert lease.token is not None and token is not None and lease.token > token
        async with other.lock(pg.name, ttl=10, timeout=5):
            pass
        assert await pg.waiters() == []
        assert all(count == 0 for _, count in await pg.sessions())
    assert await pg.settle_sessions(0) == 0


async def test_a_cancelled_acquire_does_not_wait_for_its_connect(pg: Pg) -> None:
    async with FaultProxy(pg.server.host, pg.server.port) as proxy:
        url = f"postgresql://postgres@{proxy.address}/postgres?application_name={pg.app}"
        async with asynclock.connect(url) as locks:
            backend = backend_of(locks)
            held = [await locks.acquire(pg.name, ttl=10)]  # the idle connection is now in use
            proxy.delay(150)  # a connect takes several round trips: over a second now
            started = anyio.current_time()
            with anyio.move_on_after(0.1):
                await locks.acquire(f"{pg.name}/2", ttl=10)
            assert anyio.current_time() - started < 0.5
            proxy.pass_through()
            # The connect ends on its own and its connection joins the idle pool.
            await until(lambda: backend._sessions.pool._idle, 10, 0.05)
            await held[0].release()
    assert await pg.settle_sessions(0) == 0


# -- client pauses, dead connections, interrupted statements (issue 15, item 2) ---------------


def terminate_while_the_loop_is_blocked(dsn: str, pid: int) -> None:
    """``pg_terminate_backend(pid)`` from another thread, waiting for the session to end, while
    this thread's event loop does not run: the client learns of the close only when it next
    uses the connection (as after a process pause, or a close that races a checkout)."""

    async def terminate() -> None:
        connection = await asyncpg.connect(dsn)
        try:
            assert await connection.fetchval("SELECT pg_terminate_backend($1, 5000)", pid)
        finally:
            await connection.close()

    thread = threading.Thread(target=asyncio.run, args=(terminate(),))
    thread.start()
    thread.join()


async def test_closing_with_a_statement_in_flight_sends_no_cancel_request(
    pg: Pg, monkeypatch: pytest.MonkeyPatch
) -> None:
    """aclose() drops a connection whose statement has no reply yet without a CancelRequest:
    the statement's own error path drops the connection at once, which aborts asyncpg's
    request half-way, and PgBouncer before 1.20 (Debian 12 ships 1.18) exits on that
    (pgbouncer/pgbouncer#801). Dropping the connection ends the statement anyway."""
    sent: list[object] = []
    send = asyncpg.Connection._cancel_current_command

    def spy(connection: asyncpg.Connection, *args: Any) -> None:
        sent.append(connection)
        send(connection, *args)

    monkeypatch.setattr(asyncpg.Connection, "_cancel_current_command", spy)
    async with FaultProxy(pg.server.host, pg.server.port) as proxy:
        async with asynclock.connect(f"postgresql://postgres@{proxy.address}/postgres") as locks:
            await locks.inspect(pg.name)
            proxy.drop_replies()
            async with anyio.create_task_group() as tg:
                tg.start_soon(look_until_closed, locks, pg.name)
                await anyio.sleep(0.2)  # the statement is sent; its reply never comes
                with anyio.fail_after(2):  # not the op_timeout (5 s) of a close that waits
                    await locks.aclose()
    assert sent == []


async def look_until_closed(locks: asynclock.LockClient, name: str) -> None:
    with suppress(asynclock.LockError):
        await locks.inspect(name)


async def test_an_idle_pooled_connection_ended_by_the_server_is_replaced_without_an_error(
    pg: Pg,
) -> None:
    async with pg.connect(max_idle=1) as locks:
        backend = backend_of(locks)
        # Takes run on the holding connection of their ttl (kept a while after its last lock
        # went), the others on an idle pooled one: either may have died unnoticed.
        for take in ("lock", "try_acquire", "transaction_lock", "inspect"):
            async with locks.lock(pg.name, ttl=5):
                pass
            if take in ("lock", "try_acquire"):
                victim = backend._lanes.by_ttl[5000].connection
            else:
                (victim,) = backend._sessions.pool._idle
            terminate_while_the_loop_is_blocked(pg.server.dsn, victim.get_server_pid())
            assert not victim.is_closed()  # not noticed yet: the next take will use it
            if take == "lock":
                async with locks.lock(pg.name, ttl=5) as lease:
                    pass
                assert lease.grant.connection is not victim  # type: ignore[attr-defined]
            elif take == "try_acquire":
                taken = await locks.try_acquire(pg.name, ttl=5)
                assert taken is not None
                assert taken.grant.connection is not victim  # type: ignore[attr-defined]
                await taken.release()
            elif take == "transaction_lock":
                async with transaction_lock(locks, pg.name, timeout=1) as (connection, _):
                    assert connection is not victim
            else:
                assert not (await locks.inspect(pg.name)).held
            assert victim.is_closed()
        # Pushed over pg_terminate_backend the way a client sees it: once noticed, a dead
        # pooled connection is skipped at checkout.
        (pooled,) = backend._sessions.pool._idle
        await pg.admin.execute("SELECT pg_terminate_backend($1, 5000)", pooled.get_server_pid())
        await until(pooled.is_closed, 2, 0.005)  # asyncpg notices on its own
        assert not (await locks.inspect(pg.name)).held
    assert await pg.settle_sessions(0) == 0


async def test_a_wait_cancelled_mid_statement_is_not_reused_and_the_next_acquire_succeeds(
    pg: Pg,
) -> None:
    """A wait cancelled in the server's queue (anyio cancellation, a native cancel, a timeout),
    also at the moment the lock is granted to it: its connection is closed and its session
    ended before the cancelled call returns (reusing that connection gave asyncpg's "another
    operation is in progress" after a pause), and the next acquire on the same client works."""
    rng = random.Random(5)
    async with pg.connect(max_idle=1) as locks, asynclock.connect(pg.server.url) as other:
        backend = backend_of(locks)
        interrupted = 0

        async def wait(kind: str, taken: list[asynclock.Lease], scope: anyio.CancelScope) -> None:
            if kind == "timeout":
                with suppress(asynclock.AcquireTimeout):
                    taken.append(await locks.acquire(pg.name, ttl=10, timeout=0.3))
            else:
                with scope:
                    taken.append(await locks.acquire(pg.name, ttl=10))

        for cycle in range(60):
            holder = await other.acquire(pg.name, ttl=10)
            kind = ("anyio", "native", "timeout")[cycle % 3]
            at_grant = cycle >= 30  # cancel just after the lock was handed to the waiter
            taken: list[asynclock.Lease] = []
            scope = anyio.CancelScope()
            task = asyncio.create_task(wait(kind, taken, scope))
            await pg.wait_for_waiters(1)
            (waiter,) = await pg.waiters()
            if at_grant:
                await holder.release()
                await asyncio.sleep(rng.uniform(0, 0.002))
            if kind == "native":
                task.cancel()
            elif kind == "anyio":
                scope.cancel()
            with suppress(asyncio.CancelledError):
                await task
            for lease in taken:
                await lease.release()  # granted before the cancel or the timeout arrived
            if not taken:
                # Interrupted: the waiting session has ended, and its connection is not kept.
                assert not await pg.admin.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE pid = $1", waiter
                )
                assert waiter not in {c.get_server_pid() for c in backend._sessions.all}
                interrupted += 1
            assert await pg.waiters() == []
            if not holder.released:
                assert await pg.holders() == [holder.grant.pid]  # type: ignore[attr-defined]
                await holder.release()
            async with locks.lock(pg.name, ttl=10, timeout=5):
                pass
        assert interrupted >= 30
        # The idle one, and the holding connections of ttl 10 and of the default ttl.
        assert await pg.settle_sessions(3) <= 3
        assert all(count == 0 for _, count in await pg.sessions())


async def test_a_killed_waiter_process_leaves_the_servers_queue_within_the_check_interval(
    pg: Pg,
) -> None:
    """A session blocked in the lock queue does not read its socket, so a waiter whose process
    died stayed queued until it was granted the lock. client_connection_check_interval (1 s,
    set on our connections where the server supports it) makes the server notice."""
    async with pg.connect() as locks:
        backend = backend_of(locks)
        assert backend._server_settings["client_connection_check_interval"] == "1000"
        holder = await locks.acquire(pg.name, ttl=30)
        process, _ = await start_holder(pg.server.url, pg.name, held=False)
        async with process:
            await pg.wait_for_waiters(1)
            process.kill()
            killed_at = anyio.current_time()
            await process.wait()
            await pg.wait_for_waiters(0, within=3)
        assert anyio.current_time() - killed_at < 1.5
        await holder.release()


@pytest.mark.expect_log(
    r"unlocking .* did not complete .*the unlock stays queued on its holding connection, so "
    r"the server frees the lock when it answers"
)
async def test_takes_and_a_release_on_a_server_that_stopped_answering_return_in_bounds(
    pg: Pg,
) -> None:
    """A take whose statement times out is one op_timeout (no second wait for ending a session
    that only ran a short statement); a timed-out wait gives up ending its session after at
    most op_timeout. An unlock that times out (no renewal in flight) stays queued on its
    holding connection (closing it would lose its other locks) and frees the lock when the
    server answers; the warning says so, and the release neither fails nor lingers."""
    op_timeout = 0.3
    async with FaultProxy(pg.server.host, pg.server.port) as proxy:
        url = (
            f"postgresql://postgres@{proxy.address}/postgres?op_timeout={op_timeout}"
            f"&application_name={pg.app}"
        )
        async with asynclock.connect(url) as locks, asynclock.connect(pg.server.url) as other:
            async with locks.lock(pg.name, ttl=5):
                pass  # a pooled connection, through the proxy
            proxy.blackhole()
            started = anyio.current_time()
            with pytest.raises(asynclock.BackendTimeout):
                await locks.try_acquire(pg.name, ttl=5)
            assert anyio.current_time() - started < op_timeout + 0.2
            proxy.pass_through()
            holder = await other.acquire(pg.name, ttl=5)
            waiting = asyncio.create_task(locks.acquire(pg.name, ttl=5, timeout=0.5))
            await pg.wait_for_waiters(1)
            proxy.blackhole()
            started = anyio.current_time()
            with pytest.raises(asynclock.AcquireTimeout):
                await waiting
            assert anyio.current_time() - started < 0.5 + op_timeout + 0.2
            proxy.pass_through()
            await holder.release()
            lease = await locks.acquire(pg.name, ttl=10, timeout=5)  # renewed after 3.3 s
            neighbour = await locks.acquire(f"{pg.name}/neighbour", ttl=10)
            proxy.blackhole()
            started = anyio.current_time()
            await lease.release()
            assert anyio.current_time() - started < op_timeout + 0.2
            assert await pg.holders() == [lease.grant.pid]  # type: ignore[attr-defined]
            proxy.pass_through()
            freed = await other.acquire(pg.name, ttl=10, timeout=2)
            await freed.release()
            assert await pg.holders(neighbour.name) == [neighbour.grant.pid]  # type: ignore[attr-defined]
            assert not neighbour.lost
            await neighbour.release()
    assert await pg.settle_sessions(0) == 0


# -- the minimum ttl (issue 15, item 13) -------------------------------------------------------


async def test_a_ttl_below_the_minimum_is_refused_and_the_minimum_holds(pg: Pg) -> None:
    assert PostgresBackend.min_ttl == 0.5
    async with pg.connect() as locks:
        takes: list[tuple[float, Callable[[], Awaitable[object]]]] = [
            (0.001, lambda: locks.lock(pg.name, ttl=0.001).__aenter__()),
            (0.05, lambda: locks.lock_all([pg.name], ttl=0.05).__aenter__()),
            (0.001, lambda: locks.acquire(pg.name, ttl=0.001)),
            (0.499, lambda: locks.try_acquire(pg.name, ttl=0.499)),
        ]
        for ttl, take in takes:
            with pytest.raises(
                asynclock.InvalidArgument, match=rf"ttl {ttl} s is too short.*0\.5 s"
            ):
                await take()
        # The minimum itself is honoured: renewed every 167 ms, kept for 2 s (4 ttls).
        async with locks.lock(pg.name, ttl=PostgresBackend.min_ttl) as lease:
            await anyio.sleep(2.0)
        assert not lease.lost


# -- the transaction-scoped lock ------------------------------------------------------------


@pytest.fixture
async def table(pg: Pg) -> AsyncIterator[str]:
    table = f"t_{uuid.uuid4().hex[:8]}"
    await pg.admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, fence bigint)")
    try:
        yield table
    finally:
        await pg.admin.execute(f"DROP TABLE {table}")


async def test_transaction_lock_commits_or_rolls_back_and_excludes_session_locks_on_any_client(
    pg: Pg, table: str
) -> None:
    async with pg.connect() as locks, asynclock.connect(pg.server.url) as other:
        async with transaction_lock(locks, pg.name) as (connection, token):
            assert connection.is_in_transaction()
            await connection.execute(f"INSERT INTO {table} VALUES (1, $1)", token)
            # Held for the transaction: session locks of the same name wait.
            assert await other.try_acquire(pg.name, ttl=10) is None
            assert await pg.admin.fetchval(f"SELECT count(*) FROM {table}") == 0  # not committed
        assert await pg.admin.fetchval(f"SELECT fence FROM {table} WHERE id = 1") == token
        async with other.lock(pg.name, ttl=10) as lease:
            assert lease.token > token
            with pytest.raises(asynclock.AcquireTimeout):
                async with transaction_lock(locks, pg.name, timeout=0):
                    pytest.fail("entered a lock held by a session")
            started = anyio.current_time()
            with pytest.raises(asynclock.AcquireTimeout):
                async with transaction_lock(locks, pg.name, timeout=0.3):
                    pytest.fail("entered a lock held by a session")
            assert 0.25 <= anyio.current_time() - started < 2
            assert await pg.waiters() == []
        # An error rolls the body back; its token is never handed out again.
        with pytest.raises(ZeroDivisionError):
            async with transaction_lock(locks, pg.name, timeout=0) as (connection, failed):
                assert failed > lease.token
                await connection.execute(f"INSERT INTO {table} VALUES (2, $1)", failed)
                _ = 1 / 0
        assert await pg.admin.fetchval(f"SELECT count(*) FROM {table}") == 1
        assert await pg.holders() == []
        async with transaction_lock(locks, pg.name, timeout=0) as (_, later):
            assert later > failed
    # On a URL, and on an asyncpg connection of the caller's.
    async with transaction_lock(pg.server.url, pg.name) as (connection, first):
        assert first > later
        await connection.execute(f"UPDATE {table} SET fence = $1 WHERE id = 1", first)
    own = await asyncpg.connect(pg.server.dsn)
    try:
        async with transaction_lock(own, pg.name, timeout=1) as (connection, second):
            assert connection is own
            await connection.execute(f"UPDATE {table} SET fence = $1 WHERE id = 1", second)
        assert second > first
        assert not own.is_in_transaction()
        assert await own.fetchval(f"SELECT fence FROM {table} WHERE id = 1") == second
    finally:
        await own.close()
    with pytest.raises(asynclock.InvalidArgument, match="asyncpg connection"):
        async with transaction_lock(42, pg.name):
            pass
    # Checked before anything connects (nothing listens on port 1), as are the others' URLs.
    for target, error in [("postgresql://127.0.0.1:1/db", "idle_timeout"), ("redis://h", "URL")]:
        with pytest.raises(asynclock.InvalidArgument, match=error):
            async with transaction_lock(target, pg.name, idle_timeout=0 if "db" in target else 1):
                pass


async def test_transaction_lock_returns_a_clean_connection_and_a_cancelled_wait_no_waiter(
    pg: Pg,
) -> None:
    async with pg.connect() as locks:
        backend = backend_of(locks)
        async with transaction_lock(locks, pg.name) as (connection, _):
            # Session-level changes made by the body, which must not reach a later lease.
            await connection.execute("SET lock_timeout = '1s'")
            await connection.execute("SELECT pg_advisory_lock(12345)")
            await connection.execute("LISTEN somewhere")
        assert backend._sessions.pool._idle == [connection]
        assert await connection.fetchval("SHOW lock_timeout") == "0"
        assert await connection.fetchval("SHOW application_name") == pg.app
        assert await connection.fetchval("SELECT count(*) FROM pg_listening_channels()") == 0
        # Besides it, only the default ttl's holding connection (opened with the client).
        lanes = [(lane.pid, 0) for lane in backend._lanes.by_ttl.values()]
        assert await pg.sessions() == sorted([(connection.get_server_pid(), 0), *lanes])
        holder = await locks.acquire(pg.name, ttl=10)
        async with anyio.create_task_group() as tg:

            async def wait_then_cancel() -> None:
                await pg.wait_for_waiters(1)
                tg.cancel_scope.cancel()

            tg.start_soon(wait_then_cancel)
            async with transaction_lock(locks, pg.name):
                pytest.fail("entered a held lock")
        assert await pg.waiters() == []
        await holder.release()
        async with transaction_lock(locks, pg.name, timeout=0):
            pass


async def test_transaction_lock_of_a_stalled_client_is_freed_by_the_server(
    pg: Pg, table: str
) -> None:
    async with pg.connect() as locks:
        with pytest.raises(asyncpg.InterfaceError):
            async with transaction_lock(locks, pg.name, idle_timeout=0.3) as (connection, token):
                await connection.execute(f"INSERT INTO {table} VALUES (1, $1)", token)
                await anyio.sleep(1.0)  # a stall between two statements
                assert await pg.holders() == []
                await connection.execute(f"INSERT INTO {table} VALUES (2, $1)", token)
        assert await pg.admin.fetchval(f"SELECT count(*) FROM {table}") == 0
