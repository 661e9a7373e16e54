"""The redis:// backend against real redis-server processes: faults, fairness, durability, TLS."""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from contextlib import suppress
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis.asyncio

import asynclock
from asynclock.abc import LockRequest, Lost, Renewed
from asynclock.backends.redis import RedisBackend, RedisDurabilityWarning, RedisGrant
from asynclock.backends.redis import _scripts as lua
from asynclock.testing import FaultProxy, PostgresServer, RedisServer
from tests.contract.backend_redis import (
    RedisServerWith,
    acl_user,
    backend_of,
    connect,
    kill_connections,
    lane_of,
    redis_leftovers,
    wait_for_queue,
)
from tests.contract.harness import until

pytestmark = pytest.mark.anyio


def test_url_forms_give_address_db_credentials_and_tls() -> None:
    backend = RedisBackend.from_url(
        "rediss://alice:p%40ss@cache.example:6380/3",
        {"prefix": "app:", "op_timeout": "0.5", "waiter_ttl": 2, "ssl_ca_certs": "/ca.pem"},
    )
    assert (backend.address.host, backend.address.port) == ("cache.example", 6380)
    settings = backend.settings
    assert (settings.db, settings.username, settings.password) == (3, "alice", "p@ss")
    assert settings.tls and settings.ssl_ca_certs == "/ca.pem"
    assert (settings.prefix, settings.op_timeout, backend.waiter_ttl) == ("app:", 0.5, 2.0)
    # The description never shows the password.
    assert backend.describe() == "rediss://alice@cache.example:6380/3"

    plain = RedisBackend.from_url("redis://:secret@[::1]", {})
    assert (plain.address.host, plain.address.port, plain.settings.db) == ("::1", 6379, 0)
    assert (plain.settings.username, plain.settings.password) == (None, "secret")
    assert not plain.settings.tls
    assert plain.settings.prefix == "asynclock:"
    assert "secret" not in plain.describe()


URL, ARG = asynclock.InvalidURL, asynclock.InvalidArgument  # an InvalidURL is an InvalidArgument


# The Redis family's URLs (redis://, redis+sentinel://, redis+cluster://, redlock://).
@pytest.mark.parametrize(
    ("url", "options", "error", "message"),
    [
        ("redis://127.0.0.1:6379/zero", {}, URL, "database number"),
        ("redis://10.0.0.1:6379,10.0.0.2:6379/0", {}, URL, "redlock://"),
        ("redis://127.0.0.1:6379/0#x", {}, URL, "fragment"),
        ("redis://127.0.0.1/0", {"op_timeout": "0"}, ARG, "op_timeout"),
        ("redis://127.0.0.1/0", {"waiter_ttl": "soon"}, ARG, "waiter_ttl"),
        ("redis://127.0.0.1/0", {"durability_warning": "maybe"}, ARG, "durability_warning"),
        ("redis://127.0.0.1/0", {"client_name": "two words"}, ARG, "client_name"),
        ("redis://127.0.0.1/0", {"client_name": 7}, ARG, "client_name"),
        ("redis://127.0.0.1/0", {"ssl_ca_certs": "/ca.pem"}, ARG, "rediss://"),
        ("rediss://127.0.0.1/0", {"ssl_cert_reqs": "sometimes"}, ARG, "ssl_cert_reqs"),
        ("redis+sentinel://h:26379", {}, URL, "names no master"),
        ("redis+sentinel://h:26379/", {}, URL, "names no master"),
        ("redis+sentinel://h:26379/svc/x", {}, URL, "database number"),
        ("redis+sentinel:///svc", {}, URL, "lists no sentinel"),
        ("redis+sentinel://h/svc", {"wait_timeout": "2", "op_timeout": "1", "wait_replicas": 1}, ARG, "shorter than"),
        ("redis+sentinel://h/svc", {"wait_replicas": "-1"}, ARG, "wait_replicas"),
        ("redis+sentinel://h/svc", {"sentinels": "x"}, ARG, "sentinels"),
        ("redis+cluster://h:7000/2", {}, URL, "only database 0"),
        ("redis+cluster:///", {}, URL, "lists no node"),
        ("redlock:///0", {}, URL, "names no masters"),
        ("redlock://a:1,b:2,a:1/0", {}, URL, "twice"),
        ("redlock://a,b,c/x", {}, URL, "database number"),
        ("redlock://a,b,c/0", {"drift": "0.7"}, ARG, "drift"),
        ("redlock://a,b,c/0", {"ssl_certfile": "/c"}, ARG, "tls=true"),
    ],
)  # fmt: skip
def test_bad_urls_and_options_are_refused_by_name(
    url: str, options: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        asynclock.connect(url, **options)


async def test_ttl_below_a_millisecond_is_refused(redis_server: RedisServer, prefix: str) -> None:
    async with connect(redis_server, prefix) as locks:
        # The core's minimum (a lease must outlast a round trip and the margin) comes first.
        with pytest.raises(asynclock.InvalidArgument, match=r"too short .* the minimum is 0.1 s"):
            await locks.try_acquire("x", ttl=0.0004)
        assert locks._backend.min_ttl == 0.1
    # Redis's own check still stands behind it: PX takes whole milliseconds, so a ttl that
    # would round down to 0 ms (or a core minimum below 1 ms one day) is refused by name.
    backend = RedisBackend.from_url(redis_server.url, {})
    with pytest.raises(asynclock.InvalidArgument, match="whole milliseconds"):
        backend.check_ttl(0.0004)
    backend.check_ttl(0.001)  # one millisecond is what PX can express


@pytest.mark.expect_log(r"releasing .* did not complete \(BackendUnavailable")
async def test_a_waiter_whose_server_dies_gets_backend_unavailable(
    own_redis_server: RedisServer, prefix: str, name: str
) -> None:
    async with (
        connect(own_redis_server, prefix) as first,
        connect(own_redis_server, prefix) as second,
    ):
        holder = await first.acquire(name, ttl=30)
        waiter = asyncio.ensure_future(second.acquire(name, ttl=30, timeout=10))
        await anyio.sleep(0.2)
        own_redis_server.kill()
        killed = anyio.current_time()
        with pytest.raises(asynclock.BackendUnavailable, match=re.escape(own_redis_server.address)):
            await waiter
        assert anyio.current_time() - killed < 1.0
        await holder.release()  # against a dead server: logged, not raised
        assert holder.released


async def test_acl_users_a_wrong_password_and_users_without_config_client_or_the_wake_channel(
    redis_server: RedisServer, raw_redis: redis.asyncio.Redis, prefix: str
) -> None:
    # A user that may not run CONFIG, as on many managed services.
    async with acl_user(raw_redis, redis_server, commands=["+@all", "-config"]) as url:
        # durability_warning stays on: a server that hides its settings is not an error and
        # must not warn (pytest turns warnings into errors here).
        async with asynclock.connect(url, prefix=prefix) as locks:
            async with locks.lock("acl", ttl=5) as lease:
                assert lease.token >= 1
            assert "appendonly" not in locks._backend.extra_info()  # CONFIG GET was refused
        with pytest.raises(asynclock.BackendUnavailable, match="password"):
            async with asynclock.connect(url.replace(":pw@", ":wrong@"), prefix=prefix):
                pytest.fail("connected with a wrong password")
    # One that may not name its connections: an empty client_name serves it.
    async with acl_user(raw_redis, redis_server, commands=["+@all", "-client"]) as url:
        with pytest.raises(asynclock.BackendUnavailable, match=r"(?i)permission"):
            async with connect(url, prefix):
                pytest.fail("CLIENT SETNAME was allowed")
        async with connect(url, prefix, client_name="") as locks:
            async with locks.lock("plain", ttl=5) as lease:
                assert lease.token >= 1
    # One without the wake channel's Pub/Sub pattern cannot wait: refused at connect, by name.
    async with acl_user(raw_redis, redis_server, channels=[], reset_channels=True) as url:
        with pytest.raises(asynclock.BackendUnavailable, match=rf"'&{prefix}wake:\*'"):
            async with connect(url, prefix):
                pytest.fail("connected without the permission to wait")


async def test_a_missing_database_and_a_server_that_is_not_redis_are_named(
    redis_server: RedisServer, postgres_server: PostgresServer
) -> None:
    """Both said "cannot reach ... (is redis-server running there?)" (#28 item 8)."""
    url = f"redis://{redis_server.address}/99?durability_warning=false"
    with pytest.raises(asynclock.InvalidArgument, match=r"has no database 99 .*'databases'"):
        async with asynclock.connect(url):
            pytest.fail("connected to database 99")

    # Another service on the port (PostgreSQL's): it closes the connection at the first command.
    with pytest.raises(asynclock.BackendUnavailable, match="is it a Redis server"):
        async with asynclock.connect(f"redis://{postgres_server.address}/0"):
            pytest.fail("connected to a server that is not Redis")


async def test_durability_warning_without_an_append_only_file_on_eviction_and_none_if_durable(
    own_redis_server: RedisServer, prefix: str
) -> None:
    url = own_redis_server.url
    # The test servers keep an append-only file: no warning (filterwarnings = error) ...
    async with asynclock.connect(url, prefix=prefix):
        pass
    async with redis.asyncio.Redis(host=own_redis_server.host, port=own_redis_server.port) as admin:
        await admin.config_set("appendonly", "no")
    # ... and one without it.
    with pytest.warns(RedisDurabilityWarning, match="appendonly") as record:
        async with asynclock.connect(url, prefix=prefix):
            pass
    assert len(record) == 1
    assert "durability_warning=false" in str(record[0].message)
    # The option silences it (pytest's filterwarnings=error would fail this otherwise).
    async with asynclock.connect(url, prefix=prefix, durability_warning="false"):
        pass
    async with redis.asyncio.Redis(host=own_redis_server.host, port=own_redis_server.port) as admin:
        await admin.config_set("appendonly", "yes")
        await admin.config_set("maxmemory", "100mb")
        for policy, words in (("allkeys-lru", "fencing counters"), ("volatile-lru", "held locks;")):
            await admin.config_set("maxmemory-policy", policy)
            with pytest.warns(RedisDurabilityWarning, match=policy) as record:
                async with asynclock.connect(url, prefix=prefix):
                    pass
            assert words in str(record[0].message)
            assert "appendonly" not in str(record[0].message)
        await admin.config_set("maxmemory-policy", "noeviction")
        # Durable now: no warning (it would be an error here).
        async with asynclock.connect(url, prefix=prefix) as locks:
            assert locks._backend.extra_info()["appendonly"] == "yes"
        await admin.config_set("appendonly", "no")  # else stopping the server waits for AOF


@pytest.mark.parametrize(
    ("tls_ports", "scheme", "options"),
    [
        (1, "rediss", {"durability_warning": False}),
        (3, "redlock", {"tls": True}),
        ("cluster", "rediss+cluster", {"durability_warning": False}),
    ],
    indirect=["tls_ports"],
)
async def test_tls_with_our_ca_or_unverified_and_an_unknown_certificate_is_refused(
    tls_ports: tuple[list[int], Path], scheme: str, options: dict[str, Any], prefix: str, name: str
) -> None:
    ports, ca = tls_ports
    url = f"{scheme}://" + ",".join(f"127.0.0.1:{port}" for port in ports)
    url += "" if scheme.endswith("cluster") else "/0"  # a cluster has one database
    # ssl_cert_reqs=none: encrypted, not verified.
    for trust in ({"ssl_ca_certs": str(ca)}, {"ssl_cert_reqs": "none"}):
        async with asynclock.connect(url, prefix=prefix, **options | trust) as locks:
            assert locks._backend.describe() == url
            async with locks.lock(name, ttl=2) as lease:
                assert lease.held
    # Without our CA the server's certificate cannot be verified.
    with pytest.raises(asynclock.BackendUnavailable, match="certificate"):
        async with asynclock.connect(url, prefix=prefix, **options):
            pytest.fail("trusted a certificate from an unknown CA")


@pytest.mark.parametrize("tls_ports", ["client-auth"], indirect=True)
async def test_tls_with_a_client_certificate_where_the_server_asks_for_one(
    tls_ports: tuple[list[int], Path], prefix: str, name: str
) -> None:
    (port,), certificate = tls_ports
    url = f"rediss://127.0.0.1:{port}/0"
    trust: dict[str, Any] = {"ssl_ca_certs": str(certificate), "durability_warning": False}
    mine: dict[str, Any] = {"ssl_certfile": str(certificate)}
    mine["ssl_keyfile"] = str(certificate.with_suffix(".key"))
    async with asynclock.connect(url, prefix=prefix, **trust, **mine) as locks:
        async with locks.lock(name, ttl=2) as lease:
            assert lease.held
    with pytest.raises(asynclock.BackendUnavailable):
        async with asynclock.connect(url, prefix=prefix, **trust):
            pytest.fail("connected without the certificate the server asks for")


async def test_take_sets_the_owner_with_an_expiry_and_the_token_comes_from_the_counter(
    redis_server: RedisServer, raw_redis: redis.asyncio.Redis, prefix: str, name: str
) -> None:
    async with connect(redis_server, prefix) as locks:
        # No counter yet: it starts from the server's clock (in microseconds).
        first = await locks.acquire(name, ttl=5)
        await first.release()
        seconds, micros = await raw_redis.time()
        assert abs(first.token - (seconds * 1_000_000 + micros)) < 5_000_000
        # A counter ahead of the clock counts on by one.
        ahead = 8 * 10**15  # below 2**53, far above the clock in microseconds
        await raw_redis.set(lua.token_key(prefix, name), ahead)
        lease = await locks.acquire(name, ttl=7.5)
        assert lease.token == ahead + 1
        assert await raw_redis.get(lua.lock_key(prefix, name)) == lease.grant.owner.encode()
        assert 7000 < await raw_redis.pttl(lua.lock_key(prefix, name)) <= 7500
        assert lease.ttl == 7.5
        await lease.release()
        assert await raw_redis.exists(lua.lock_key(prefix, name)) == 0
        # The counter outlives the lock, so the next token is larger still.
        assert await raw_redis.get(lua.token_key(prefix, name)) == str(ahead + 1).encode()
        again = await locks.acquire(name, ttl=1)
        assert again.token == ahead + 2
        await again.release()
        # A counter behind the clock (restored from an old snapshot, say) jumps to the clock;
        # so does one deleted (an eviction, an operator): the next token is not 1.
        for behind in (True, False):
            key = lua.token_key(prefix, name)
            await (raw_redis.set(key, 41) if behind else raw_redis.delete(key))
            seconds, micros = await raw_redis.time()
            later = await locks.acquire(name, ttl=1)
            assert later.token >= seconds * 1_000_000 + micros
            await later.release()


async def test_a_stale_owner_can_neither_renew_nor_release_in_the_urls_database(
    redis_server: RedisServer, raw_redis: redis.asyncio.Redis, prefix: str, name: str
) -> None:
    url, key = f"redis://{redis_server.address}/5", lua.lock_key(prefix, name)
    async with (
        redis.asyncio.Redis(host=redis_server.host, port=redis_server.port, db=5) as raw,
        connect(url, prefix) as first,
        connect(url, prefix) as second,
    ):
        stale = await first.acquire(name, ttl=5)
        assert await raw_redis.exists(key) == 0
        assert await raw.delete(key) == 1  # in the URL's database; expired, say
        current = await second.acquire(name, ttl=5)
        (outcome,) = await first._backend.renew([stale.grant])
        assert isinstance(outcome, Lost)
        assert "held by another owner" in outcome.reason
        await first._backend.release(stale.grant)
        assert await raw.get(key) == current.grant.owner.encode()
        assert await raw.pttl(key) > 4000  # not shortened either
        await current.release()


async def test_renewing_many_locks_is_one_script_call_per_interval(
    own_redis_server: RedisServer, prefix: str
) -> None:
    async with (
        redis.asyncio.Redis(host=own_redis_server.host, port=own_redis_server.port) as admin,
        connect(own_redis_server, prefix) as locks,
    ):
        leases = [await locks.acquire(f"many/{index}", ttl=0.9) for index in range(40)]
        await admin.config_resetstat()
        before = locks.renew_calls
        await anyio.sleep(1.0)  # renewals every 0.3 s
        renewals = locks.renew_calls - before
        stats = await admin.info("commandstats")
        assert all(not lease.lost for lease in leases)
        assert 2 <= renewals <= 5
        # Each renewal of all 40 locks was exactly one EVALSHA on the server.
        assert stats["cmdstat_evalsha"]["calls"] == renewals


@pytest.mark.parametrize("kill", ["CLIENT KILL", "proxy reset"])
async def test_pooled_connections_killed_between_holds_cost_the_next_acquire_nothing(
    redis_server: RedisServer, prefix: str, name: str, kill: str
) -> None:
    """The call goes out at once on a dead connection and is sent again on a new one. (A reset
    noticed before the next call: tests/contract/test_faults.py, (b).)"""
    client_name = f"pool-{uuid.uuid4().hex[:6]}"
    async with FaultProxy(redis_server.host, redis_server.port) as proxy:
        async with connect(f"redis://{proxy.address}/0", prefix, client_name=client_name) as locks:

            async def hold(index: int) -> None:
                async with locks.lock(f"{name}/{index}", ttl=5, timeout=5):
                    await anyio.sleep(0.01)

            for _ in range(2):
                # Concurrent calls leave several idle connections in the pool (locks of
                # different names: one name's acquires place themselves one at a time).
                async with anyio.create_task_group() as tg:
                    for index in range(4):
                        tg.start_soon(hold, index)
                assert lane_of(locks).connections >= 3
                if kill == "CLIENT KILL":
                    assert await kill_connections(redis_server, client_name) >= 3
                else:
                    proxy.reset()
                # Every idle connection is dead: the next calls go over new ones, silently.
                lease = await locks.try_acquire(name, ttl=5)
                assert lease is not None
                await lease.release()
                async with locks.lock(name, ttl=5, timeout=5) as held:
                    assert not held.lost


@pytest.mark.expect_log(r"restarted and the key of (lock|semaphore|election) .* is gone")
async def test_a_restart_without_persistence_ends_every_hold_at_once_and_tokens_keep_rising(
    prefix: str, name: str
) -> None:
    """A Redis without AOF forgets holds and counters when it restarts: the client notices at
    once (its watching connection ends, the run id changed) and ends every kind of lease then,
    not at its next renewal (10 s here); the counter starts again from the server's clock."""
    with RedisServer(appendonly=False) as server:
        async with connect(server, prefix) as locks, connect(server, prefix) as other:
            leases = [
                await locks.acquire(name, ttl=30),
                await locks.acquire(f"{name}/r", ttl=30, shared=True),
                await locks.semaphore(name, permits=2).acquire(ttl=30),
            ]
            term = locks.election(name).campaign(b"me", ttl=30)
            leases.append(await term.__aenter__())
            before = leases[0].token
            try:
                await anyio.to_thread.run_sync(server.restart)
                restarted = anyio.current_time()
                with anyio.fail_after(5):
                    reasons = [await lease.wait_lost() for lease in leases]
                noticed = anyio.current_time() - restarted
                assert noticed < 1.5, f"loss reported {noticed:.2f} s after the restart"
                assert all("restarted" in reason and "is gone" in reason for reason in reasons)
            finally:
                # The body "ended" after the loss: the exit logs it and frees nothing (it is gone).
                await term.__aexit__(None, None, None)
            # The other client takes the free lock with a larger token: no guard can confuse them.
            again = await other.acquire(name, ttl=30, timeout=5)
            assert before < again.token < 2**53
            await again.release()
            for lease in leases[:3]:
                await lease.release()  # already gone: quietly nothing


async def test_a_restart_with_persistence_keeps_the_leases_whose_keys_survived(
    prefix: str, name: str
) -> None:
    # An append-only file fsynced on every write.
    with RedisServerWith("--appendonly", "yes", "--appendfsync", "always") as server:
        async with connect(server, prefix) as locks:
            lease = await locks.acquire(name, ttl=30)
            backend = backend_of(locks)
            run_id = backend._run_id
            await anyio.to_thread.run_sync(server.restart)
            # The watcher reconnected to the new run of the server (polling: no event).
            await until(lambda: backend._run_id != run_id)
            await anyio.sleep(0.2)  # its check of the held keys is done
            assert not lease.lost
            assert isinstance(lease.grant, RedisGrant)
            (outcome,) = await backend.renew([lease.grant])
            assert isinstance(outcome, Renewed)
            again = await locks.acquire(f"{name}/next", ttl=5)
            assert again.token > lease.token
            await again.release()
            await lease.release()


@pytest.mark.expect_log(r"lost: the hold of .* is gone from")
async def test_a_forward_clock_jump_on_the_server_is_found_by_the_next_renewal(
    prefix: str, name: str
) -> None:
    """Redis expires keys by its wall clock: a step forward ends a lease early, which no client
    can prevent; the holder learns of it at its next renewal, within ttl / 3."""
    with RedisServer(faketime="+0") as server:
        async with connect(server, prefix) as locks:
            with pytest.raises(asynclock.LeaseLost, match="is gone"):
                async with locks.lock(name, ttl=3) as lease:
                    server.jump_clock(60)
                    jumped = anyio.current_time()
                    await anyio.sleep(10)
            assert anyio.current_time() - jumped < 3 / 3 + 0.5
            assert anyio.current_time() < lease.deadline


async def test_a_reply_that_came_while_the_event_loop_stalled_is_read_not_timed_out(
    redis_server: RedisServer, raw_redis: redis.asyncio.Redis, prefix: str, name: str
) -> None:
    """A loop blocked past op_timeout with a call in flight finds, when it runs again, both the
    reply in its socket and the timer run out: the timer must not win."""
    op_timeout = 0.2

    async def stalled(call: Any) -> Any:
        task = asyncio.ensure_future(call)
        await asyncio.sleep(0)  # the task sends its command and waits for the reply
        assert not task.done()
        time.sleep(2.5 * op_timeout)  # noqa: ASYNC251 (the whole event loop stalls, as in a SIGSTOP)
        return await task

    async with (
        connect(redis_server, prefix, op_timeout=op_timeout, waiter_ttl=0.6) as locks,
        connect(redis_server, prefix) as other,
    ):
        backend = locks._backend
        lease = await stalled(locks.try_acquire(name, ttl=5))
        assert lease is not None
        (outcome,) = await stalled(backend.renew([lease.grant]))
        assert isinstance(outcome, Renewed)
        await stalled(lease.release())
        assert await raw_redis.exists(lua.lock_key(prefix, name)) == 0
        # A waiter waiting for its wake (on the client's wake channel) through a stall.
        holder = await other.acquire(name, ttl=5)
        waiter = asyncio.ensure_future(locks.acquire(name, ttl=5, timeout=10))
        await wait_for_queue(raw_redis, prefix, name, 1)
        await asyncio.sleep(0.05)
        time.sleep(1.0)  # noqa: ASYNC251 (a stall while the waiter waits for its wake)
        await asyncio.sleep(0.3)
        await holder.release()
        taken = await waiter
        # Handed over with the rest of its 0.6 s place, less than the 0.5 s margin kept from a
        # 5 s lease's deadline: renewed at once, not lost as it was granted.
        assert not taken.lost and taken.ttl == 5
        await taken.release()


async def test_a_waiter_takes_a_lock_whose_key_ran_out_or_that_a_release_finds_gone_at_once(
    redis_server: RedisServer, raw_redis: redis.asyncio.Redis, prefix: str, name: str
) -> None:
    """At once: not at the waiter's next refresh (waiter_ttl / 3 = 1.7 s)."""
    async with connect(redis_server, prefix) as locks:
        # A holder that died without releasing: its key simply runs out.
        await raw_redis.set(lua.lock_key(prefix, name), "dead-holder", px=400)
        started = anyio.current_time()
        async with locks.lock(name, ttl=5, timeout=5):
            waited = anyio.current_time() - started
        # It slept until the key's expiry.
        assert 0.35 < waited < 0.8
        # The lock expired (here: deleted) while a task of the same client waited: the release,
        # finding nothing to hand over, has that waiter take it.
        holder = await locks.acquire(name, ttl=30)
        waiter = asyncio.ensure_future(locks.acquire(name, ttl=30, timeout=10))
        await wait_for_queue(raw_redis, prefix, name, 1)
        await raw_redis.delete(lua.lock_key(prefix, name))
        released = anyio.current_time()
        await holder.release()
        taken = await waiter
        assert anyio.current_time() - released < 0.5
        await taken.release()


async def test_a_take_given_up_on_a_frozen_server_is_undone_when_the_server_wakes(
    own_redis_server: RedisServer, prefix: str, name: str
) -> None:
    """A take given up after one op_timeout runs when the server resumes, and so does the undo
    queued behind it on the same connection: the lock is free at once, not after a ttl."""
    op_timeout = 0.5
    async with (
        connect(own_redis_server, prefix, op_timeout=op_timeout) as first,
        connect(own_redis_server, prefix) as second,
    ):
        for attempt in ("try_acquire", "acquire with a timeout"):
            own_redis_server.pause()
            try:
                started = anyio.current_time()
                with pytest.raises(asynclock.BackendTimeout, match="taking lock"):
                    if attempt == "try_acquire":
                        await first.try_acquire(name, ttl=5)
                    else:
                        await first.acquire(name, ttl=5, timeout=3)
                took = anyio.current_time() - started
            finally:
                own_redis_server.resume()
            assert took < op_timeout + 0.4, f"{attempt} took {took:.2f} s, not one op_timeout"
            resumed = anyio.current_time()
            lease = await second.try_acquire(name, ttl=5)
            assert lease is not None, f"a ghost holds the lock after the {attempt} was given up"
            assert anyio.current_time() - resumed < 0.5
            await lease.release()
            # The replies of take and undo were read (polling: nothing signals it).
            await until(lambda: not lane_of(first).draining, timeout=2)
    assert await redis_leftovers(own_redis_server, prefix, "asynclock-none") == []


async def test_cancelling_a_take_in_flight_leaves_nothing_also_if_the_client_closes_at_once(
    redis_server: RedisServer, raw_redis: redis.asyncio.Redis, prefix: str, name: str
) -> None:
    """A take cancelled after it was sent (it may have run) is undone on the server: the undo
    goes right behind it on its connection, also when the client closes without reading the
    replies. (With the client reading them: the contract's cancellation tests.)"""
    async with FaultProxy(redis_server.host, redis_server.port) as proxy:
        async with connect(f"redis://{proxy.address}/0", prefix) as locks:
            proxy.delay(50)  # the take reaches the server, the reply comes back late
            request = LockRequest(name, 5.0, uuid.uuid4().hex, lambda reason: None)
            with anyio.move_on_after(0.07):
                await locks._backend.try_acquire(request)
                pytest.fail("the take was not cancelled")
        proxy.pass_through()
        # The proxy's link ends when the server closes its side, which Redis does only after
        # running what came before the client's FIN: the take, then the undo.
        await until(lambda: proxy.connections == 0)
        assert await raw_redis.exists(lua.lock_key(prefix, name)) == 0


@pytest.mark.parametrize("behind", ["comes later", "waits behind it"])
@pytest.mark.parametrize(("waiter_ttl", "ttl"), [(1.0, 30.0), (5.0, 1.0)])
async def test_a_waiter_cut_off_first_in_line_holds_up_a_free_lock_as_long_as_its_place(
    redis_server: RedisServer,
    raw_redis: redis.asyncio.Redis,
    prefix: str,
    name: str,
    waiter_ttl: float,
    ttl: float,
    behind: str,
) -> None:
    """A waiter cut off first in line keeps a free lock from everyone behind it until its place
    expires (``waiter_ttl``, or its ttl when shorter), and not before. One that waits behind it
    learns the expiry of the lock handed on at once, not at its next refresh (the safety runs
    found a paused holder never overtaken)."""
    place = min(waiter_ttl, ttl)
    async with (
        FaultProxy(redis_server.host, redis_server.port) as proxy,
        connect(f"redis://{proxy.address}/0", prefix, waiter_ttl=waiter_ttl) as stalled,
        connect(redis_server, prefix) as holder,
        connect(redis_server, prefix) as later,
        anyio.create_task_group() as tg,
    ):
        lease = await holder.acquire(name, ttl=5)

        async def wait_in_line() -> None:
            with suppress(asynclock.LockError):
                await stalled.acquire(name, ttl=ttl, timeout=10)

        tg.start_soon(wait_in_line)
        await wait_for_queue(raw_redis, prefix, name, 1)
        taking = None
        if behind == "waits behind it":
            taking = asyncio.ensure_future(later.acquire(name, ttl=1, timeout=place + 3))
            await wait_for_queue(raw_redis, prefix, name, 2)
        proxy.blackhole()
        cut_at = anyio.current_time()
        await lease.release()  # hands the lock to the first in line, who never hears of it
        taken = await (taking or later.acquire(name, ttl=1, timeout=place + 3))
        waited = anyio.current_time() - cut_at
        await taken.release()
        tg.cancel_scope.cancel()
        proxy.pass_through()
    # Its last refresh came at most place / 3 before the cut; then its place lasts ``place``.
    assert place * 2 / 3 - 0.1 < waited < place + 0.5, f"held up the free lock {waited:.2f} s"


async def test_a_connection_that_connects_after_aclose_is_closed_not_kept() -> None:
    """aclose() closes the connections it finds; one still connecting has no socket to close
    yet. When it connects, the call must close it (it was kept, and leaked as an "unclosed
    transport", when an election's observe() was refreshing a cluster's slot map as its client
    closed)."""
    from asynclock.backends._kit import TaskHost
    from asynclock.backends.redis._wire import Lane

    connecting, go_on = asyncio.Event(), asyncio.Event()
    closed = asyncio.Event()

    class SlowToConnect(redis.asyncio.Connection):
        async def connect(self) -> None:
            connecting.set()
            await go_on.wait()
            await super().connect()  # type: ignore[no-untyped-call]

    async def server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while line := await reader.readline():  # +OK to every command
            if line.startswith(b"*"):
                writer.write(b"+OK\r\n")
                await writer.drain()
        closed.set()
        writer.close()

    stub = await asyncio.start_server(server, "127.0.0.1", 0)
    port = stub.sockets[0].getsockname()[1]
    host = TaskHost()
    await host.open()
    pool = redis.asyncio.ConnectionPool(host="127.0.0.1", port=port, connection_class=SlowToConnect)
    lane = Lane(pool, 5.0, host)
    try:
        call = asyncio.ensure_future(lane.call("PING"))
        await connecting.wait()
        await lane.aclose()
        go_on.set()
        with pytest.raises(redis.exceptions.ConnectionError, match="closed"):
            await call
        with anyio.fail_after(2):
            await closed.wait()
    finally:
        await host.aclose()
        stub.close()
        await stub.wait_closed()


@pytest.mark.parametrize(
    "args",
    [
        ("EVALSHA", "a" * 40, 2, "asynclock:{name}", "asynclock:{name}:queue", "owner", 9000),
        ("SET", "k", b"\x00\xff", "PX", 1.5, "é", ""),
        ["PING"],  # a list: hiredis takes tuples only
    ],
)
def test_commands_are_written_as_redis_py_writes_them(args: Any) -> None:
    """``_wire.pack`` (hiredis's, or the Python one for what hiredis refuses) against
    redis-py's own ``pack_command``."""
    from redis.asyncio.connection import Connection

    from asynclock.backends.redis._wire import pack

    assert pack(args) == b"".join(Connection().pack_command(*args))
    # redis-py refuses a bool; ours writes it as Python does, as it always did.
    assert pack(("SET", "k", True)) == b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$4\r\nTrue\r\n"
