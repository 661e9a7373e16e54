"""ZooKeeper backend: what the contract suite cannot see (sessions, faults, ACLs, order, RW,
the tree of each kind of hold)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import re
import struct
import time
import unicodedata
import uuid
from typing import Any
from urllib.parse import unquote

import anyio
import anyio.to_thread
import pytest
from aiozk import exc, protocol

import asynclock
from asynclock.abc import LockInfo, LockRequest
from asynclock.backends.zookeeper import ZooKeeperBackend, ZooKeeperGrant, _proto, encode_name
from asynclock.backends.zookeeper._lease import LockSession
from asynclock.backends.zookeeper._wire import Connection, frame
from asynclock.testing import FaultProxy, ZooKeeperEnsemble
from tests.contract.backend_zookeeper import (
    Zk,
    admin_client,
    assert_session_state_clean,
    backend_of,
    delete_tree,
    expire_session,
    grant_of,
    watched_paths,
)
from tests.contract.harness import until

pytestmark = pytest.mark.anyio

# -- URLs and names (no server) ----------------------------------------------------------------


def test_the_requests_and_replies_encode_as_aiozks_classes_do() -> None:
    """``_proto`` writes the bytes aiozk's generic classes write, and reads what they render."""
    from aiozk import ACL as ZkACL
    from aiozk.protocol.create import Create2Request

    path = "/locks/ünï%2Fname/_c_0123-lock-0000000007"
    acls = [protocol.UNRESTRICTED_ACCESS, ZkACL.make("auth", "", True, True, True, True, True)]
    acl = _proto.encode_acl(acls)
    pairs = [
        (
            _proto.create(path, b"v", acl, 3),
            Create2Request(path=path, data=b"v", acl=acls, flags=3),
        ),
        (_proto.get_children(path, watch=True), protocol.GetChildrenRequest(path=path, watch=True)),
        (_proto.get_data(path, watch=True), protocol.GetDataRequest(path=path, watch=True)),
        (_proto.exists(path), protocol.ExistsRequest(path=path, watch=False)),
        (_proto.delete(path), protocol.DeleteRequest(path=path, version=-1)),
        (_proto.close(), protocol.CloseRequest()),
    ]
    transaction = protocol.TransactionRequest()
    transaction.add(protocol.SetDataRequest(path=path, data=b"r", version=-1))
    transaction.add(protocol.DeleteRequest(path=path, version=-1))
    pairs.append((_proto.release(path, b"r"), transaction))
    for ours, theirs in pairs:
        assert ours.serialize(7) == theirs.serialize(7), type(theirs).__name__
    container = _proto.create(path, b"", acl, _proto.CONTAINER)
    assert container.opcode == 19  # createContainer; its body is create2's
    assert container.body == Create2Request(path=path, data=b"", acl=acls, flags=4).serialize(7)[8:]

    def rendered(part: Any) -> bytes:
        fmt, values = part.render()
        return struct.pack("!" + fmt, *values)

    stat = _proto.Stat(*range(1, 12))
    theirs = protocol.stat.Stat(**stat._asdict())
    created = rendered(protocol.Create2Response(path=path, stat=theirs))
    assert container.read(created) == _proto.Created(path, stat)
    node = rendered(protocol.GetDataResponse(data=b"x", stat=theirs))
    assert _proto.get_data(path).read(node) == _proto.Node(b"x", stat)
    exists = rendered(protocol.ExistsResponse(stat=theirs))
    assert _proto.exists(path).read(exists) == _proto.Node(None, stat)
    children = rendered(protocol.GetChildrenResponse(children=["a", "ü"]))
    assert _proto.get_children(path).read(children) == _proto.Children(["a", "ü"])
    event = rendered(protocol.WatchEvent(type=2, state=3, path=path))
    assert _proto.read_event(event) == _proto.Event(2, 3, path)
    # A multi's reply: each operation's header, then its result; one that failed, its code.
    header = struct.Struct("!i?i")
    stat_bytes = struct.pack("!qqqqiiiqiiq", *stat)
    done = header.pack(-1, True, -1)
    applied = header.pack(5, False, 0) + stat_bytes + header.pack(2, False, 0) + done
    assert _proto.release(path, b"r").read(applied) == [stat, None]
    refused = header.pack(-1, False, -101) + struct.pack("!i", -101) + header.pack(-1, False, -2)
    marked, deleted = _proto.release(path, b"r").read(refused + struct.pack("!i", -2) + done)
    assert isinstance(marked, exc.NoNode) and isinstance(deleted, exc.RuntimeInconsistency)


def test_url_with_servers_chroot_credentials_and_options() -> None:
    backend = ZooKeeperBackend.from_url(
        "zookeeper://app:p%40ss@10.0.0.1:2281,10.0.0.2,[::1]:2182/locks/ünï",
        {"op_timeout": "2.5", "session_timeout": 4},
    )
    settings = backend._settings
    hosts = tuple((host.host, host.port) for host in settings.hosts)
    assert hosts == (("10.0.0.1", 2281), ("10.0.0.2", 2181), ("::1", 2182))
    assert settings.chroot == "/locks/ünï"
    assert (settings.user, settings.password) == ("app", "p@ss")
    assert (settings.op_timeout, settings.session_timeout) == (2.5, 4.0)
    described = backend.describe()
    assert "p@ss" not in described and "p%40ss" not in described
    assert described == "zookeeper://app:***@10.0.0.1:2281,10.0.0.2:2181,[::1]:2182/locks/ünï"


@pytest.mark.parametrize(
    ("url", "options", "message"),
    [
        ("zookeeper://", {}, "names no server"),
        ("zookeeper://h//x", {}, r"bad chroot '//x'.*empty part \(a doubled '/'\)"),
        ("zookeeper://h///", {}, r"empty part \(a doubled '/'\)"),
        ("zookeeper://h/a//b", {}, r"bad chroot '/a//b'.*doubled '/'"),
        ("zookeeper://h/a/", {}, r"bad chroot '/a/'.*empty part \(a trailing '/'\)"),
        ("zookeeper://h/a/../b", {}, r"'\.\.' is not allowed"),
        ("zookeeper://h/./b", {}, r"'\.' is not allowed"),
        ("zookeeper://h/a/%2E%2E", {}, r"'\.\.' is not allowed"),
        ("zookeeper://h/a%00b", {}, r"part 'a\\x00b' contains '\\x00'"),
        ("zookeeper://h/a%2Fb", {}, r"part 'a/b' contains '/'"),
        ("zookeeper://h/50%25", {}, r"part '50%' contains '%'"),
        ("zookeeper://h/a%C2%85b", {}, r"contains '\\x85'"),
        ("zookeeper://h/zookeeper/locks", {}, "ZooKeeper's own subtree"),
        ("zookeeper://useronly@h/x", {}, "user:password"),
        ("zookeeper://h/x#frag", {}, "fragment"),
        # Unknown options: the contract's (tests/contract/test_boundary.py).
        ("zookeeper://h/x?op_timeout=soon", {}, "op_timeout"),
        ("zookeeper://h/x", {"session_timeout": 0}, "session_timeout"),
        ("zookeeper://h/x", {"op_timeout": -1}, "op_timeout"),
    ],
)
def test_malformed_urls_and_bad_options_are_refused(
    url: str, options: dict[str, Any], message: str
) -> None:
    # Ports, empty entries and IPv6 brackets: the contract suite (test_boundary.py).
    bad_option = bool(options) or "?" in url
    with pytest.raises(asynclock.InvalidArgument if bad_option else asynclock.InvalidURL) as info:
        asynclock.connect(url, **options)
    assert re.search(message, str(info.value))
    assert bad_option or "zookeeper://" in str(info.value), "the message shows a well-formed URL"


@pytest.mark.parametrize(
    ("path", "chroot"),
    [
        # Without a path the locks live under /asynclock, never at the root of the tree.
        ("", "/asynclock"),
        ("/", "/asynclock"),
        ("/x", "/x"),
        ("/a/b.c/_d-1", "/a/b.c/_d-1"),
        ("/z%C3%BC", "/zü"),
        ("/zookeeper2", "/zookeeper2"),
        ("/a/zookeeper", "/a/zookeeper"),
    ],
)
def test_well_formed_chroots_are_kept(path: str, chroot: str) -> None:
    assert ZooKeeperBackend.from_url(f"zookeeper://h{path}", {})._settings.chroot == chroot


TRICKY_NAMES = [
    "a/b",
    "a%2Fb",
    "a%2fb",
    "a%b",
    "%",
    "/",
    ".",
    "..",
    "zookeeper",
    "zookeeper/",
    "%2E",
    "%7Aookeeper",
    "ünï/cødé ☃",
    "emoji 😀",
    "c1 \x85 control",
    "private \ue000 use",
    "specials \ufff5\uffff",
]


async def test_names_encode_injectively_and_reversibly_into_znode_names_zookeeper_accepts(
    zk: Zk,
) -> None:
    # The core refuses C0 controls and DEL in names; the encoding copes with them anyway.
    names = [*TRICKY_NAMES, "del \x7f", "nul \x00", "tab\t"]
    encoded = [encode_name(name) for name in names]
    assert len(set(encoded)) == len(names)
    await zk.admin.create(zk.chroot)
    for name, component in zip(names, encoded, strict=True):
        assert unquote(component) == name
        assert component != "zookeeper"
        # The server checks every path it is asked to create (PathUtils.validatePath).
        await zk.admin.create(f"{zk.chroot}/{component}")
    # Plain names stay readable.
    assert encode_name("orders-42") == "orders-42"
    assert encode_name("ünï") == unicodedata.normalize("NFC", "ünï")


def test_a_lock_node_is_blocked_by_a_count_and_watches_only_the_nearest_of_them() -> None:
    from asynclock.backends.zookeeper._order import blockers

    def node(owner: str, kind: str, number: int) -> str:
        return f"_c_{owner}-{kind}-{number:010d}"

    # Listed in the server's order (none), with a foreign node that takes no part.
    children = [
        node("c", "read", 7),
        node("a", "lock", 3),
        "not-ours-0000000004",
        node("b", "read", 5),
        node("d", "lock", 9),
    ]
    # A writer waits for everyone ahead of it and watches the nearest (2: two or more).
    assert blockers(children, node("d", "lock", 9), "lock") == (2, node("c", "read", 7))
    # A reader waits for the writers ahead of it only.
    assert blockers(children, node("c", "read", 7), "read") == (1, node("a", "lock", 3))
    assert blockers(children, node("b", "read", 5), "read") == (1, node("a", "lock", 3))
    assert blockers(children, node("a", "lock", 3), "lock") == (0, "")
    # Our node is gone: None (the caller queues again).
    assert blockers(children, node("e", "lock", 11), "lock") is None
    # Past the nearest four: a reader behind many readers, a writer behind foreign nodes.
    readers = [node(f"r{number}", "read", number) for number in range(20, 40)]
    queue_ = [node("w", "lock", 10), *readers, node("x", "read", 50)]
    assert blockers(queue_, node("x", "read", 50), "read") == (1, node("w", "lock", 10))
    foreign = [f"_c_-lock-{number:010d}" for number in range(20, 40)]
    queue_ = [node("w", "lock", 10), *foreign, node("x", "lock", 50)]
    assert blockers(queue_, node("x", "lock", 50), "lock") == (1, node("w", "lock", 10))


def test_one_translator_turns_session_outcomes_and_server_errors_into_the_hierarchy() -> None:
    from asynclock.backends._kit import MayHaveApplied, ProvenGone
    from asynclock.backends.zookeeper import _errors

    context = "acquiring 'x' on zookeeper://127.0.0.1:2181/asynclock"
    not_sent = _errors.zk_errors(_errors.NotConnected("not connected"), context)
    assert isinstance(not_sent, asynclock.BackendTimeout)
    assert not isinstance(not_sent, MayHaveApplied)  # nothing was sent
    assert isinstance(_errors.zk_errors(_errors.ConnectionLoss("broke"), context), MayHaveApplied)
    gone = _errors.zk_errors(_errors.SessionGone("expired"), context)
    assert isinstance(gone, ProvenGone)
    assert str(gone) == f"{context}: expired"
    refused = _errors.zk_errors(exc.NoAuth(), context)
    assert isinstance(refused, asynclock.BackendUnavailable)
    assert "refused access (NoAuth)" in str(refused)
    assert isinstance(_errors.zk_errors(_errors.error_for(-9999), context), asynclock.LockError)
    assert _errors.zk_errors(ValueError("not ours"), context) is None


# -- ttl and sessions ------------------------------------------------------------------------


async def test_ttl_is_the_negotiated_session_timeout_and_others_are_refused(zk: Zk) -> None:
    """tickTime 500 ms, maxSessionTimeout 60 s: session timeouts of 1 to 60 s, exactly."""
    async with zk.connect() as locks:
        for ttl in (1.0, 2.5, 10.0):
            async with locks.lock("t", ttl=ttl) as lease:
                assert lease.ttl == ttl
                assert grant_of(lease).session is not None
                assert grant_of(lease).session.timeout == ttl  # type: ignore[union-attr]
        # The default ttl (30 s) works against the project's own test server.
        async with locks.lock("t") as lease:
            assert lease.ttl == 30.0
        # 90 s is asked for, the server negotiates 60 s: refused, saying what to do, and the
        # bound is learned (the lower one is not known yet).
        with pytest.raises(asynclock.InvalidArgument) as info:
            async with locks.lock("t", ttl=90):
                pytest.fail("a 90 s lock in a 60 s session")
        assert str(info.value) == (
            f"ttl 90 s cannot be honoured by ZooKeeper at {backend_of(locks).describe()}: a "
            "lock's ttl is the timeout of its ZooKeeper session, and this server allows session "
            "timeouts of at most 60 s; pass ttl=60 or less (locks.lock(name, ttl=60)), or raise "
            "the server's maxSessionTimeout to at least 90000 ms (zoo.cfg; by default it is 20 "
            "times tickTime)"
        )
        # The bound refuses the next one before any round trip (lock() itself raises).
        with pytest.raises(asynclock.InvalidArgument, match=r"at most 60 s; pass ttl=60 or less"):
            locks.lock("t", ttl=61)
        with pytest.raises(
            asynclock.InvalidArgument,
            match=r"allows session timeouts from 1 to 60 s; pass ttl=1 or more, or lower the "
            r"server's minSessionTimeout to at most 500 ms",
        ):
            await locks.acquire("t", ttl=0.5)
        for ttl, advice in ((0.2, "ttl=1 or more"), (90, "ttl=60 or less")):
            with pytest.raises(asynclock.InvalidArgument, match=f"from 1 to 60 s; pass {advice}"):
                locks.lock("t", ttl=ttl)
        sessions = backend_of(locks).extra_info()["sessions"]
        assert sorted(sessions) == [1000, 2500, 10000, 30000]  # the refused ones were closed
    async with zk.connect() as fresh:
        # Only the lower bound learned: it says so, and what to do.
        with pytest.raises(
            asynclock.InvalidArgument,
            match=r"allows session timeouts of at least 1 s; pass ttl=1 or more, or lower the "
            r"server's minSessionTimeout to at most 500 ms \(zoo.cfg; by default it is 2 times "
            r"tickTime\)$",
        ):
            await fresh.try_acquire("t", ttl=0.5)
        assert sorted(backend_of(fresh).extra_info()["sessions"]) == [10000]


async def test_locks_of_one_ttl_share_a_session_renewed_in_one_call_and_closed_once_unused(
    zk: Zk, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("asynclock.backends.zookeeper._session.IDLE_SESSION", 0.5)
    async with zk.connect(session_timeout=3) as locks:
        leases = [await locks.acquire(f"n{index}", ttl=3) for index in range(20)]
        other = await locks.acquire("other", ttl=2)
        sessions = {id(grant_of(lease).session) for lease in leases}
        assert len(sessions) == 1
        assert id(grant_of(other).session) not in sessions
        before = locks.renew_calls
        await anyio.sleep(1.2)  # one renewal interval of the 3 s locks (and of the 2 s one)
        assert all(not lease.lost for lease in [*leases, other])
        # 21 leases in two sessions: renewed in a handful of batched calls, not 21 per round.
        assert 1 <= locks.renew_calls - before <= 4
        # Held, the 2 s session outlives the idle time; unused, it is closed (on the server
        # too), while the session of connect() stays; and it is opened again when needed.
        assert sorted(backend_of(locks).extra_info()["sessions"]) == [2000, 3000]
        for lease in [*leases, other]:
            await lease.release()
        await until(lambda: sorted(backend_of(locks).extra_info()["sessions"]) == [3000], 3)
        async with locks.lock("other", ttl=2) as again:
            assert again.ttl == 2


# -- loss ------------------------------------------------------------------------------------


@pytest.mark.expect_log(
    r"ZooKeeper session 0x\w+ is gone \(ZooKeeper says .* expired or was closed"
)
@pytest.mark.expect_log(r"lease on '(body|flagged)' lost: ZooKeeper says session 0x\w+ has expired")
async def test_session_expired_from_outside_loses_every_lease_and_the_next_acquire_works(
    zk: Zk,
) -> None:
    async with zk.proxied() as (proxy, locks), zk.connect() as other:
        flagged = await locks.acquire("flagged", ttl=4)
        blocker = await other.acquire("contended", ttl=4)
        waiter_done = anyio.Event()
        waiter_token: list[int] = []

        async def waiter() -> None:
            # Waits in the session that is about to expire; carries on in a new one.
            async with locks.lock("contended", ttl=4, timeout=15) as waited:
                waiter_token.append(waited.token)
            waiter_done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await zk.wait_for_children("contended", 2)
            with pytest.raises(asynclock.LeaseLost, match="expired or was closed") as info:
                async with locks.lock("body", ttl=4) as lease:
                    old_session = grant_of(lease).session
                    assert old_session is not None
                    # Keep our client from reconnecting (and taking the session back) while
                    # the intruder closes it.
                    proxy.blackhole()
                    await expire_session(zk.server, grant_of(lease))
                    proxy.reset()
                    proxy.pass_through()
                    expired_at = anyio.current_time()
                    await anyio.sleep(30)
            assert anyio.current_time() - expired_at < 1.0
            assert info.value.name == "body"
            assert flagged.lost and "expired or was closed" in (flagged.lost_reason or "")
            assert old_session is not None and old_session.dead
            # The waiter queued again in a new session; it gets the lock once it is free.
            assert not waiter_done.is_set()
            await blocker.release()
            with anyio.fail_after(10):
                await waiter_done.wait()
        assert waiter_token[0] > blocker.token
        await flagged.release()  # nothing to do, and no error either
        with anyio.fail_after(3):
            async with locks.lock("body", ttl=4) as again:
                assert grant_of(again).session is not old_session
                assert again.token > lease.token


async def test_a_create_whose_reply_was_lost_is_found_and_reused(zk: Zk) -> None:
    async with zk.proxied(session_timeout=5, op_timeout=1) as (proxy, locks):
        result: list[asynclock.Lease] = []

        async def take() -> None:
            result.append(await locks.acquire("lost-reply", ttl=5))

        async with anyio.create_task_group() as tg:
            proxy.drop_replies()
            tg.start_soon(take)
            (created,) = await zk.wait_for_children("lost-reply", 1)
            # The create happened; its reply is gone. Let replies through again: the client
            # gives up on this connection, reconnects and looks for its node.
            proxy.pass_through()
        (lease,) = result
        parent = f"{zk.chroot}/lost-reply"
        assert grant_of(lease).path == f"{parent}/{created}"
        assert await zk.children("lost-reply") == [created]  # no duplicate
        _, stat = await zk.admin.get(f"{parent}/{created}")
        assert lease.token == stat.created_zxid
        await lease.release()


async def test_connections_reset_between_holds_keep_the_session_and_fail_nothing(zk: Zk) -> None:
    # The contract resets between holds; here also between a take and its release, and the
    # session (with a lease held throughout) survives every reset.
    async with zk.proxied(session_timeout=5, op_timeout=3) as (proxy, locks):
        kept = await locks.acquire("kept", ttl=5, on_lost="flag")
        session = grant_of(kept).session
        assert session is not None
        session_id = session.session_id
        for index in range(30):
            proxy.reset()  # RST on both sides, right before the next call
            if index % 3 == 1:
                await anyio.sleep(0.005)
            with anyio.fail_after(3):
                match index % 3:
                    case 0:
                        async with locks.lock("r", ttl=5) as lease:
                            assert lease.token > 0
                    case 1:
                        taken = await locks.try_acquire("r", ttl=5)
                        assert taken is not None
                        await taken.release()
                    case _:
                        async with locks.lock("r", ttl=5, timeout=2):
                            pass
        assert session.session_id == session_id and session.reconnects >= 30
        assert not kept.lost
        (outcome,) = await backend_of(locks).renew([grant_of(kept)])
        assert isinstance(outcome, asynclock.abc.Renewed)
        await kept.release()
        assert await zk.children("r") == []


async def test_inspect_gives_the_holders_owner_secret_to_the_core_which_shows_its_hash(
    zk: Zk,
) -> None:
    parent = f"{zk.chroot}/seen"
    async with zk.connect() as locks, zk.connect() as other:
        lease = await locks.acquire("seen", ttl=5)
        # Nodes that are not ours take no part (and are not taken for the holder).
        await zk.admin.create(f"{parent}/a-stranger-0000000000")

        async def wait_then_release() -> None:
            # No timeout: with one, a try_acquire's short-lived node would come first.
            async with other.lock("seen", ttl=5):
                pass

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait_then_release)
            await zk.wait_for_children("seen", 3)
            raw = await backend_of(other).inspect("seen")
            assert raw.owner == grant_of(lease).owner  # the secret, for the core to hash
            assert (raw.held, raw.token, raw.waiters) == (True, lease.token, 1)
            shown = await other.inspect("seen")
            assert shown.owner == lease.owner != grant_of(lease).owner
            await lease.release()
        await zk.admin.delete(f"{parent}/a-stranger-0000000000")
        # Readers before the first writer all hold the lock.
        async with anyio.create_task_group() as tg:
            async with (
                locks.lock("seen", ttl=5, shared=True) as first,
                other.lock("seen", ttl=5, shared=True),
            ):
                tg.start_soon(wait_then_release)
                await zk.wait_for_children("seen", 3)
                info = await locks.inspect("seen")
                assert (info.held, info.owner, info.waiters) == (True, first.owner, 1)
            # The readers leave: the writer's turn comes only once both have gone (the one
            # it watched leaving proves nothing about the other).


# -- cleanup ---------------------------------------------------------------------------------


async def test_a_client_closed_right_after_a_connection_reset_still_deletes_its_parents(
    zk: Zk,
) -> None:
    """aclose() deletes the lock parents this client used once its session is connected again,
    not only if it is at that moment (else they stay until the server's container check)."""

    async def reconnect_during_the_close(proxy: FaultProxy) -> None:
        await anyio.sleep(0.3)
        proxy.pass_through()

    async with anyio.create_task_group() as tg:
        async with zk.proxied() as (proxy, locks):
            await (await locks.acquire("p", ttl=5)).release()
            # Reconnects go into the blackhole until the close has begun: polled for, a
            # disconnection shorter than a poll (a quick reconnect on a busy loop) was missed.
            proxy.blackhole()
            proxy.reset()
            await until(lambda: backend_of(locks)._connected() is None, 2)
            tg.start_soon(reconnect_during_the_close, proxy)
    assert await zk.tree() == []


async def test_a_session_made_while_the_backend_closes_fails_as_unavailable_and_leaves_no_connection(
    zk: Zk, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session whose connection is made as ``aclose()`` begins (the task host takes no more
    tasks) gets ``BackendUnavailable`` and closes its connection, not left open to the server
    until its timeout."""
    async with zk.proxied() as (proxy, locks):
        await (await locks.acquire("open", ttl=5)).release()
        backend = backend_of(locks)
        before = proxy.connections
        with monkeypatch.context() as patch:
            # The host as its aclose() leaves it first (it then waits for deferred deletes).
            patch.setattr(backend._host, "_group", None)
            with pytest.raises(asynclock.BackendUnavailable, match="the backend is closed"):
                await backend._new_session(4000)
        await until(lambda: proxy.connections == before, 2)


async def test_the_parent_janitor_sleeps_while_the_client_has_no_parents(
    zk: Zk, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that locks nothing is not woken by its janitor (8 idle clients' janitors were a
    third of their CPU); a parent used wakes it, and it deletes that parent once unused."""
    linger = 0.4
    monkeypatch.setattr("asynclock.backends.zookeeper.backend._PARENT_LINGER", linger)
    async with zk.connect() as locks:
        tree = backend_of(locks)._tree
        passes = 0
        stale = tree.stale

        def counted(linger: float) -> list[str]:
            nonlocal passes
            passes += 1
            return stale(linger)

        monkeypatch.setattr(tree, "stale", counted)
        await anyio.sleep(linger * 2.5)  # two passes and more, were it on a timer
        assert passes == 0
        await (await locks.acquire("janitor", ttl=5)).release()
        await until(lambda: not tree.parents, linger * 5)

        async def tree_empty() -> bool:
            # Forgotten as its delete is sent; read here through another session, whose reads
            # ZooKeeper does not order after that delete.
            return not await zk.tree()

        await until(tree_empty, 2)
        done = passes
        assert done >= 1
        await anyio.sleep(linger * 2.5)
        assert passes == done, "no parents left: the janitor sleeps again"


async def test_parents_whose_delete_got_no_answer_are_deleted_once_the_server_answers(
    zk: Zk, caplog: pytest.LogCaptureFixture
) -> None:
    """The janitor's delete of an unused parent that gets no answer leaves the parent known to
    the client, which deletes it once the server answers again (here at the close): it used
    to forget it, and the parent stayed until the server's container check, a minute later
    (CI: a burst of 1,000 waiters held up the answers to another session's pings)."""
    caplog.set_level(logging.DEBUG, "asynclock.zookeeper")
    async with zk.proxied(session_timeout=10, op_timeout=0.5) as (proxy, locks):
        await (await locks.acquire("unanswered", ttl=5)).release()
        backend = backend_of(locks)
        session = backend._connected()
        proxy.blackhole()
        # The janitor's pass, made now: its own comes once the parent has been unused for a
        # while, and by then the session's read timeout (0.7 s here) dropped the connection.
        await backend._tree.delete_parents(session, list(backend._tree.parents))
        assert "deleting empty lock parents failed" in caplog.text
        assert backend.extra_info()["known_parents"] == 1
        proxy.reset()
        proxy.pass_through()
        assert session is not None
        await until(lambda: session.reconnects == 1 and session.state == "connected", 5)
    assert await zk.tree() == []


async def test_while_disconnected_nothing_waits_and_what_was_not_deleted_is_after_reconnect(
    zk: Zk,
) -> None:
    """What could not be deleted while disconnected (a cancelled waiter's node, a released
    one) is deleted once the session is back; meanwhile calls fail at once or in op_timeout."""
    async with (
        zk.connect() as holder,
        zk.proxied(session_timeout=5, op_timeout=0.5) as (proxy, flaky),
    ):
        first = await holder.acquire("orphan", ttl=5)
        with anyio.CancelScope() as waiting:

            async def cancel_when_disconnected() -> None:
                await zk.wait_for_children("orphan", 2)
                proxy.blackhole()
                waiting.cancel()

            async with anyio.create_task_group() as tg:
                tg.start_soon(cancel_when_disconnected)
                await flaky.acquire("orphan", ttl=5)
        session = next(iter(backend_of(flaky)._sessions.values()))
        session_id = session.session_id
        assert len(await zk.children("orphan")) == 2  # the waiter's node is still there
        proxy.reset()  # nothing of what was sent during the blackhole arrives
        proxy.pass_through()
        await until(lambda: zk.has_children("orphan", 1))
        assert session.session_id == session_id and session.state == "connected"
        await first.release()

        # Now a release that cannot reach the server. Meanwhile a renewal says Unknown at
        # once, and an acquire fails in op_timeout.
        lease = await flaky.acquire("orphan", ttl=5, on_lost="flag")
        proxy.blackhole()
        await until(lambda: session.state != "connected", 3)
        started = anyio.current_time()
        (outcome,) = await backend_of(flaky).renew([grant_of(lease)])
        assert isinstance(outcome, asynclock.abc.Unknown)
        # At once: it sends nothing, so it returns well before op_timeout (0.5 s), which is
        # what it must not wait for. (Bound 0.05 s before: a quiet fresh-clone run, 4 workers on
        # 2 cores, took 0.079 s, the process descheduled or collecting garbage meanwhile.)
        assert anyio.current_time() - started < 0.25
        started = anyio.current_time()
        with pytest.raises(asynclock.BackendTimeout, match="not connected"):
            await flaky.acquire("other", ttl=5)
        assert 0.4 < anyio.current_time() - started < 1.5
        await lease.release()  # logs a warning; the janitor finishes it
        proxy.reset()
        proxy.pass_through()
        await until(lambda: zk.has_children("orphan", 0))
        assert session.session_id == session_id
        assert await holder.try_acquire("orphan", ttl=5) is not None


async def test_state_does_not_grow_over_200_acquisitions(zk: Zk) -> None:
    async with zk.connect(session_timeout=5) as locks, zk.connect() as other:
        for index in range(200):
            match index % 4:
                case 0 | 1:
                    async with locks.lock("grow", ttl=5):
                        pass
                case 2:
                    blocker = await other.acquire("grow", ttl=5)
                    assert await locks.try_acquire("grow", ttl=5) is None
                    with anyio.move_on_after(0.005):
                        await locks.acquire("grow", ttl=5)  # cancelled while waiting
                    await blocker.release()
                case _:
                    lease = await locks.acquire(f"grow/{index}", ttl=5)
                    await lease.release()
        info = backend_of(locks).extra_info()
        assert len(info["sessions"]) == 1
        # Parents are remembered for a moment only (the janitor deletes them once unused).
        assert info["known_parents"] <= 52
        await until(lambda: not backend_of(locks).extra_info()["known_parents"], 6)

        # The janitor forgets the parents as it sends their deletes, a few dozen in one call,
        # whose replies are waited for (19 waiting calls, in a loaded run); a leak never drains.
        def waiting_calls() -> int:
            return sum(
                s["waiting_calls"] for s in backend_of(locks).extra_info()["sessions"].values()
            )

        await until(lambda: not waiting_calls(), 2)
        assert_session_state_clean(locks)

        async def tree_empty() -> bool:
            return not await zk.tree()

        await until(tree_empty, 2)
        # And the server holds no watch of ours any more.
        assert zk.chroot not in zk.server.four_letter_word("wchp")


# -- native cancellation (asyncio's Task.cancel(), which goes through anyio's shields) -------


@pytest.mark.parametrize("waiting", [True, False], ids=["waiter", "holder"])
async def test_native_cancels_landing_on_the_delete_of_the_tasks_node_leave_nothing(
    zk: Zk, waiting: bool
) -> None:
    """The first cancel starts the delete of the task's node (a waiter's; a holder's, as it
    ends the body); the later ones land while that delete is in flight (80 ms round trips).
    A waiter's node used to be left in a live session."""
    async with (
        zk.connect() as holder,
        zk.connect() as other,
        zk.proxied(op_timeout=3) as (proxy, victim),
    ):
        for cancels, use_with in itertools.product((1, 2, 3), (True, False)):
            first = await holder.acquire("n", ttl=10) if waiting else None
            entered = asyncio.Event()

            async def take(use_with: bool = use_with, entered: asyncio.Event = entered) -> None:
                if use_with:
                    async with victim.lock("n", ttl=10):
                        entered.set()
                        await asyncio.sleep(3600)
                lease = await victim.acquire("n", ttl=10)
                try:
                    entered.set()
                    await asyncio.sleep(3600)
                finally:
                    await lease.release()

            task = asyncio.create_task(take())
            if waiting:
                await zk.wait_for_children("n", 2)
            else:
                await entered.wait()
            proxy.delay(40)
            for index in range(cancels):
                if index:
                    await asyncio.sleep(0.03)
                task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # Deleted before the cancelled task ended, not later.
            assert len(await zk.children("n")) == (1 if waiting else 0)
            proxy.pass_through()
            if first is not None:
                await first.release()
            started = anyio.current_time()  # then free within 100 ms
            while (free := await other.try_acquire("n", ttl=10)) is None:
                assert anyio.current_time() - started < 0.1, "'n' still held after the task ended"
                await anyio.sleep(0.002)
            await free.release()
            assert not victim.held
            assert_session_state_clean(victim)


# -- order -----------------------------------------------------------------------------------


async def test_only_a_holders_release_hands_over_on_the_event_alone(
    zk: Zk, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exclusive holder's release writes its node's data in the transaction that deletes
    it: the waiter that watched the node gets *data changed* and takes the lock on that event,
    without listing the queue. A node that goes any other way (a cancelled waiter, another
    client's session closing) fires *deleted*, and the waiter behind it lists the queue and
    waits on for the nodes still ahead."""
    parent = f"{zk.chroot}/mark"
    served: list[str] = []
    listings: list[str] = []
    call = LockSession.call

    async def counting_call(self: LockSession, *requests: _proto.Request) -> list[Any]:
        for request in requests:
            if request.opcode == _proto.get_children("/").opcode:
                # The body starts with the path: its length, then its bytes.
                size = int.from_bytes(request.body[:4], "big")
                listings.append(request.body[4 : 4 + size].decode())
        return await call(self, *requests)

    monkeypatch.setattr(LockSession, "call", counting_call)
    async with zk.connect() as locks, zk.connect() as other:
        holder = await locks.acquire("mark", ttl=5)
        cancelled = anyio.CancelScope()

        async def waiter(label: str) -> None:
            async with other.lock("mark", ttl=5):
                served.append(label)

        async def cancelled_waiter() -> None:
            with cancelled:
                await waiter("cancelled")

        async with anyio.create_task_group() as tg:
            async with admin_client(zk.server.address) as foreign:
                # The queue: the holder, nodes of another session, then waiters that each
                # watch the node just before their own.
                for _ in range(3):
                    await foreign.create(
                        f"{parent}/_c_foreign-lock-", ephemeral=True, sequential=True
                    )
                tg.start_soon(waiter, "first")
                await zk.wait_for_children("mark", 5)
                tg.start_soon(cancelled_waiter)
                await zk.wait_for_children("mark", 6)
                tg.start_soon(waiter, "second")
                queue = await zk.wait_for_children("mark", 7)

                # No herd: nobody watches the queue (the parent's children); each waiter
                # watches the one node before its own, the holder its own node.
                def watched() -> set[str]:
                    return {path for path in watched_paths(zk.server) if path.startswith(parent)}

                ahead = {f"{parent}/{child}" for child in (queue[0], *queue[-4:-1])}
                await until(lambda: watched() == ahead, 5)
                listed = len(listings)
                cancelled.cancel()  # "second" watched its node: it lists, and waits on
                await until(lambda: zk.has_children("mark", 6))
                await until(
                    lambda: (
                        watched() == ahead - {f"{parent}/{queue[-2]}"} | {f"{parent}/{queue[-3]}"}
                    ),
                    5,
                )
                # The server keeps the cancelled waiter's watch on "first" until it fires, so
                # the watches above can match before "second" listed: wait for its listing.
                await until(lambda: len(listings) > listed, 5)
            # The foreign session closed and its nodes went with it: "first" watched the last.
            await until(lambda: zk.has_children("mark", 3))
            await anyio.sleep(0.3)
            assert served == [], "a waiter took the lock while the holder still held it"
            await until(lambda: watched() == {f"{parent}/{queue[0]}", f"{parent}/{queue[-3]}"}, 5)
            listed = len(listings)
            await holder.release()
            await until(lambda: served == ["first", "second"])
        # Two hand-overs, each on its watch's event alone: nobody listed the queue.
        assert listings[listed:] == []
        assert await zk.admin.get_data(parent) == b"mark"  # the parent is not written


async def test_acquires_queue_behind_a_session_being_made_in_their_order(zk: Zk) -> None:
    """While the session for a ttl is being made, a later acquire does not skip ahead of the
    ones waiting for it once it exists: their creates, hence their places in the lock's queue,
    keep the order the callers came in."""
    order: list[str] = []
    async with zk.connect(session_timeout=5) as locks:
        backend = backend_of(locks)
        holder = await locks.acquire("made", ttl=5)
        assert backend._session_lock is not None
        async with anyio.create_task_group() as tg:

            async def waiter(label: str) -> None:
                async with locks.lock("made", ttl=5):
                    order.append(label)

            async with backend._session_lock:  # as while a session is being made
                tg.start_soon(waiter, "first")
                await anyio.sleep(0.05)
                tg.start_soon(waiter, "second")
                await anyio.sleep(0.2)
                assert len(await zk.children("made")) == 1, "a create went ahead of the session"
            await zk.wait_for_children("made", 3)
            await holder.release()
        assert order == ["first", "second"]


@pytest.mark.expect_log(r"lease on 'written' lost: its znode \S+ was written")
# Releasing a lost hold waits 0.25 s before it goes on in the background; under load the
# delete can take longer, and the client's close still finishes it (the last assert).
@pytest.mark.allow_log(r"releasing 'written' on .* did not complete .*retrying in the background")
async def test_a_lock_nodes_data_written_by_someone_else_loses_the_hold(zk: Zk) -> None:
    """Only a holder's release writes a lock node's data, and the waiter behind it takes the
    lock on that event: a write by anyone else (an operator's ``set``) ends the hold too, as a
    delete does, within milliseconds."""
    async with zk.connect() as locks:
        lease = await locks.acquire("written", ttl=5)
        path = grant_of(lease).path
        await until(lambda: path in watched_paths(zk.server), 5)
        await zk.admin.set_data(path, b"operator")
        with anyio.fail_after(5):
            reason = await lease.wait_lost()
        assert "was written" in reason
        await lease.release()
    assert await zk.children("written") == []


# -- ensemble --------------------------------------------------------------------------------


async def test_a_leader_kill_keeps_holds_and_waits_and_locking_works_again_right_after(
    zookeeper_ensemble: ZooKeeperEnsemble, zk_chroot: str
) -> None:
    """Members refuse clients while they elect; the clients come back in their sessions, so a
    lock held across the kill is kept and a waiter queued before it gets the lock after it.
    Once a member leads, the reconnecting client locks again within about one reconnect pause
    (0.1 s at most) of a client opened at that moment, not half a second later (the old
    backoff's cap). The two lock at the same time, so the servers' own pace under load (a
    new leader's first writes) counts for both."""
    url = f"{zookeeper_ensemble.url}{zk_chroot}"
    lags: list[float] = []
    waited: list[int] = []

    async def lock_again(client: asynclock.LockClient, works: dict[str, float], key: str) -> None:
        with anyio.fail_after(10):
            async with client.lock(f"probe-{key}", ttl=10, timeout=10):
                works[key] = anyio.current_time()

    async def lock_fresh(works: dict[str, float]) -> None:
        async with asynclock.connect(url) as fresh:
            await lock_again(fresh, works, "fresh")

    try:
        async with asynclock.connect(url) as locks, asynclock.connect(url) as other:

            async def wait_behind(holder: asynclock.Lease) -> None:
                async with other.lock("held", ttl=10, timeout=30) as lease:
                    assert lease.token > holder.token
                    waited.append(lease.token)

            for _ in range(3):
                held = await locks.acquire("held", ttl=10, on_lost="flag")
                async with anyio.create_task_group() as tg:
                    tg.start_soon(wait_behind, held)
                    await anyio.sleep(0.3)  # queued behind the holder
                    leader = await anyio.to_thread.run_sync(zookeeper_ensemble.leader)
                    leader.kill()
                    works: dict[str, float] = {}
                    try:
                        await anyio.to_thread.run_sync(elected, zookeeper_ensemble, leader)
                        async with anyio.create_task_group() as probes:
                            probes.start_soon(lock_again, locks, works, "reconnected")
                            probes.start_soon(lock_fresh, works)
                        assert not held.lost
                        await held.release()
                    finally:
                        await anyio.to_thread.run_sync(leader.restart)
                lags.append(works["reconnected"] - works["fresh"])
            for client in (locks, other):
                for info in backend_of(client).extra_info()["sessions"].values():
                    assert info["reconnects"] >= 1 and info["state"] == "connected"
    finally:
        async with admin_client(zookeeper_ensemble.address) as client:
            await delete_tree(client, zk_chroot)
    assert len(waited) == 3
    assert max(lags) < 0.3, lags


def elected(ensemble: ZooKeeperEnsemble, killed: object) -> None:
    """Return once another member says it leads (polled every 10 ms)."""
    while True:
        for member in ensemble.members:
            if member is not killed:
                with contextlib.suppress(OSError, ValueError):
                    if member.mode(0.5) == "leader":
                        return
        time.sleep(0.01)


# -- ACLs ------------------------------------------------------------------------------------


async def test_credentials_protect_lock_nodes_from_other_clients(zk: Zk) -> None:
    url = f"zookeeper://app:s3cret@{zk.server.address}{zk.chroot}"
    parent = f"{zk.chroot}/guarded"
    anonymous = zk.admin
    async with asynclock.connect(url) as locks, asynclock.connect(url) as colleague:
        lease = await locks.acquire("guarded", ttl=5)
        with pytest.raises(exc.NoAuth):
            await anonymous.delete(grant_of(lease).path, force=True)
        with pytest.raises(exc.NoAuth):
            await anonymous.create(f"{parent}/_c_intruder-lock-", ephemeral=True, sequential=True)
        with pytest.raises(exc.NoAuth):
            await anonymous.get_children(parent)
        # The same credentials share the lock as usual; other ones cannot take part.
        assert await colleague.try_acquire("guarded", ttl=5) is None
        async with asynclock.connect(url.replace(":s3cret@", ":wrong@")) as stranger:
            with pytest.raises(asynclock.BackendUnavailable, match="refused access"):
                await stranger.try_acquire("guarded", ttl=5)
        await lease.release()
        again = await colleague.try_acquire("guarded", ttl=5)
        assert again is not None
        await again.release()
    # The fixture's client deletes the chroot afterwards: with the credentials.
    await anonymous.send(protocol.AuthRequest(type=0, scheme="digest", auth=b"app:s3cret"))


# -- shared holds, semaphores and elections in the tree, through the backend's own calls -----


def ask(name: str, *, ttl: float = 5.0, **fields: Any) -> LockRequest:
    """A request as the core makes it (a fresh owner secret each time)."""
    return LockRequest(name, ttl, uuid.uuid4().hex, on_lost=lambda reason: None, **fields)


def token(grant: ZooKeeperGrant | LockInfo) -> int:
    assert grant.token is not None
    return grant.token


async def test_the_three_kinds_of_one_name_are_three_parents(zk: Zk) -> None:
    async with zk.backend() as one:
        lock = await one.acquire(ask("a"))
        permit = await one.acquire(ask("a", kind="semaphore", permits=2))
        term = await one.acquire(ask("a", kind="election", value=b"me:8080"))
        assert token(lock) < token(permit) < token(term)
        tree = {path.rpartition("/")[0] for path in await zk.tree()}
        assert tree == {
            zk.chroot,
            f"{zk.chroot}/a",
            f"{zk.chroot}/%semaphore-a",
            f"{zk.chroot}/%election-a",
        }
        assert "-sem2-" in permit.path and "-lock-" in term.path
        assert await zk.admin.get_data(term.path) == b"me:8080"
        # A lock named like another kind's parent is still the lock of that name.
        odd = await one.try_acquire(ask("%semaphore-a"))
        assert odd is not None and odd.path.startswith(f"{zk.chroot}/%25semaphore-a/")
        for grant in (lock, permit, term, odd):
            await one.release(grant)
    assert await zk.tree() == []


async def test_semaphore_waiters_watch_the_n_nodes_ahead_and_enter_in_order(zk: Zk) -> None:
    parent = f"{zk.chroot}/%semaphore-pool"
    async with zk.backend() as one, zk.backend() as other:
        holders = [await one.acquire(ask("pool", kind="semaphore", permits=3)) for _ in range(3)]
        assert await other.try_acquire(ask("pool", kind="semaphore", permits=3)) is None
        entered: list[int] = []
        grants: dict[int, ZooKeeperGrant] = {}

        async def wait(index: int) -> None:
            grant = await (one, other)[index % 2].acquire(ask("pool", kind="semaphore", permits=3))
            grants[index] = grant
            entered.append(index)

        async with anyio.create_task_group() as tg:
            for index in range(6):
                tg.start_soon(wait, index)
                await zk.wait_for_children("%semaphore-pool", 4 + index)
            # Nobody watches the queue; each waiter watches the 3 nodes just ahead of it.
            queue = [f"{parent}/{child}" for child in await zk.children("%semaphore-pool")]
            watched = watched_paths(zk.server)
            assert parent not in watched
            for position in range(3, 9):
                for ahead in queue[position - 3 : position]:
                    assert ahead in watched
            assert queue[-1] not in watched
            info = await one.inspect("pool", "semaphore")
            assert (info.permits, info.waiters) == (3, 6)
            assert [h.token for h in info.holders] == [g.token for g in holders]
            # A holder in the middle leaves: the first waiter, and only it, gets in.
            await one.release(holders[1])
            await until(lambda: entered == [0])
            await anyio.sleep(0.1)
            assert entered == [0]
            # One at a time: two permits freed at once let both waiters in, in whichever order
            # their clients' watches fire ([0, 2, 1] in a fresh-clone run).
            await one.release(holders[0])
            await until(lambda: entered == [0, 1])
            await one.release(holders[2])
            await until(lambda: entered == [0, 1, 2])
            for index in (0, 1, 2):
                await (one, other)[index % 2].release(grants[index])
                await until(lambda index=index: entered == list(range(4 + index)))
        assert entered == list(range(6))
        for index in (3, 4, 5):
            await (one, other)[index % 2].release(grants[index])


async def test_an_election_feed_is_pushed_when_a_leader_comes_or_goes_not_when_one_queues(
    zk: Zk,
) -> None:
    """Pushed, not found by observe()'s look every second (what inspect() shows of a term, and
    its rising tokens, are the contract's)."""
    woke: list[float] = []
    async with zk.backend() as one, zk.backend() as other:

        async def watch(seen: LockInfo, timeout: float) -> None:
            started = anyio.current_time()
            await other.wait_for_change("boss", "election", seen, timeout)
            woke.append(anyio.current_time() - started)

        idle = await other.inspect("boss", "election")
        # Nothing there yet (no parent even): a candidate appearing is a change.
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch, idle, 5.0)
            await anyio.sleep(0.2)
            leader = await one.acquire(ask("boss", kind="election", value=b"a"))
        assert woke.pop() < 1.0
        info = await other.inspect("boss", "election")
        next_up: list[ZooKeeperGrant] = []

        async def campaign() -> None:
            next_up.append(await other.acquire(ask("boss", kind="election", value=b"b")))

        async with anyio.create_task_group() as tg:
            # A candidate joining the queue is not a change of leader: nobody wakes...
            async with anyio.create_task_group() as feed:
                feed.start_soon(watch, info, 0.5)
                await anyio.sleep(0.1)
                tg.start_soon(campaign)
                await zk.wait_for_children("%election-boss", 2)
            assert woke.pop() >= 0.45
            # ...the leader leaving is.
            async with anyio.create_task_group() as feed:
                feed.start_soon(watch, info, 5.0)
                await anyio.sleep(0.2)
                await one.release(leader)
            assert woke.pop() < 1.0
        now = await one.inspect("boss", "election")
        assert (now.value, now.token) == (b"b", next_up[0].token)
        # A stale view returns at once.
        started = anyio.current_time()
        await one.wait_for_change("boss", "election", info, 5.0)
        assert anyio.current_time() - started < 0.5
        await other.release(next_up[0])
        # The feed leaves no watch callbacks behind.
        for client in (one, other):
            assert all(s["watches"] == 0 for s in client.extra_info()["sessions"].values())


async def test_a_change_feed_on_a_semaphore_or_lock_watches_the_parents_children(zk: Zk) -> None:
    async with zk.backend() as one, zk.backend() as other:
        permit = await one.acquire(ask("pool", kind="semaphore", permits=2))
        seen = await other.inspect("pool", "semaphore")
        started = anyio.current_time()
        await other.wait_for_change("pool", "semaphore", seen, 0.3)  # nothing changes
        assert anyio.current_time() - started >= 0.25
        async with anyio.create_task_group() as tg:
            tg.start_soon(other.wait_for_change, "pool", "semaphore", seen, 5.0)
            await anyio.sleep(0.1)
            second = await one.acquire(ask("pool", kind="semaphore", permits=2))
        assert anyio.current_time() - started < 2.0
        # A stale view returns at once; so does one of a lock that is gone.
        with anyio.fail_after(1):
            await other.wait_for_change("pool", "semaphore", seen, 5.0)
            lock = await one.acquire(ask("rw", shared=True))
            held = await other.inspect("rw")
            await one.release(lock)
            await other.wait_for_change("rw", "lock", held, 5.0)
        for grant in (permit, second):
            await one.release(grant)
        assert all(s["watches"] == 0 for s in other.extra_info()["sessions"].values())


async def test_a_change_feed_ends_quietly_when_its_client_closes_during_a_request(zk: Zk) -> None:
    """The client closing under a watch's request (the session ends first) is the end of the
    feed, not an error: Election.observe() ends when its client closes."""
    async with zk.proxied() as (proxy, locks):
        one = backend_of(locks)
        seen = await one.inspect("boss", "election")
        proxy.delay(100)  # the watch's first request is on its way when the client closes
        async with anyio.create_task_group() as tg:
            tg.start_soon(one.wait_for_change, "boss", "election", seen, 10.0)
            await anyio.sleep(0.05)
            with anyio.fail_after(5):
                await locks.aclose()


async def test_the_wire_waits_only_while_the_peer_does_not_read_and_ends_when_it_closes() -> None:
    """A connection writes a request at once and waits only while the socket's and the
    transport's buffers are full (a server that stopped reading); a connection the server
    closes ends its pump, which breaks the connection (its session reconnects), and a send after
    that goes nowhere instead of raising (the session fails the replies it waits for). On a
    plain TCP server that accepts and never reads: no ZooKeeper needed."""
    accepted: list[asyncio.StreamWriter] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    _, conn = await asyncio.get_running_loop().create_connection(
        lambda: Connection("test"), "127.0.0.1", port
    )
    chunk = frame(b"x" * 65536)
    sent = 0
    with anyio.fail_after(10):
        while True:
            with anyio.move_on_after(0.2) as waited:
                await conn.send(chunk)
            if waited.cancelled_caught:
                break  # the buffers are full: the send waits for the peer
            sent += 1
    assert sent > 0
    dispatched: list[bytes] = []
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            conn.scope = tg.cancel_scope
            tg.start_soon(conn.pump, dispatched.append, lambda: None)
            await until(lambda: bool(accepted), 5)
            accepted[0].close()  # unread data: the peer resets the connection
            await anyio.sleep_forever()  # until the pump breaks the connection
    assert dispatched == []
    await conn.send(chunk)  # goes nowhere
    await conn.aclose()
    await conn.aclose()
    server.close()
    await server.wait_closed()
