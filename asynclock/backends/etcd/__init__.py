"""``etcd://host:port[,host:port...]``: locks in etcd v3 (the recipe of Go's ``concurrency`` package).

How a lock works here:

* Every client keeps **one etcd lease per distinct ttl** (in whole seconds), granted on the first
  acquire with that ttl and revoked when the client closes. Every key the client creates rides on
  it, so renewing a thousand held locks costs one keepalive per lease (plus one batched read that
  checks the keys are still there), like Go's ``concurrency.Session``. A lease is kept alive on
  one schedule (the kit's ``RENEWAL``), by the client's supervisor while locks are held on it and
  by its waiters while only they ride on it.
* Taking ``name`` creates ``<prefix><percent-encoded name>/<lease id>-<owner id>`` on our lease,
  in a transaction guarded by ``create_revision == 0``. The key's create revision is the fencing
  token: etcd's revision is one counter for the whole cluster, so tokens strictly increase. The
  owner id (random per acquisition) makes the key unique, so two acquisitions of one name from one
  client (same lease) are two queue entries that exclude each other like any others.
* The holder is the key with the lowest create revision under the name. A waiter waits only for
  the key just before its own to be deleted (FIFO, no thundering herd), and before reporting
  success a linearizable read must have shown that its own key still exists with its create
  revision (so it is on a live lease: etcd#11456 granted locks on dead leases) and that no lower
  key is left. Every watch of a client rides on one gRPC watch stream. A waiter behind a key of
  its own client is woken by that client's delete, and the deleting transaction itself reads
  whether the waiter's key is now the lowest (a hand-over is the release alone); an outside
  delete reaches it through one watch per lock name shared by the client's waiters.
* Release deletes our key in a transaction guarded on its create revision. An acquire that is
  cancelled deletes the key it may have created, once its create request is done; both
  clean-ups go through the kit's ``finish``, so they finish whatever cancels the caller, a
  native ``Task.cancel()`` included (bounded by twice ``op_timeout``). A delete that fails is
  retried by the client's later acquires, renewals and waits (and, after a cancelled acquire,
  in the background by ``TaskHost.deferred``); the key dies with its lease in any case.
* Every request is safe to send twice, so a call is sent again within ``op_timeout`` when the
  connection broke or etcd had no leader, and at once when etcd elected a new leader since it
  was sent (after a leader kill, a forwarded write is otherwise never answered).

Shared holds are keys of the same queue (``r<lease id>-<owner id>``) that wait only for older
exclusive keys; semaphores and elections have key ranges of their own (see ``_names.py``).

It talks to etcd through aetcd's generated gRPC stubs (``aetcd.rpc``) on a ``grpc.aio`` channel
of its own: aetcd's ``Client`` has no TLS, no range limits or create-revision filters, no
keepalive stream, and its watcher returns errors instead of raising them.

The package, imported in one direction (each file only from those below it):

* ``backend.py``: :class:`EtcdBackend`, the contract's calls (and ``extend``: the key moves to
  the client's lease of the new ttl);
* ``_inspect.py``: ``inspect`` of every kind, and ``wait_for_change`` (elections' ``observe``)
  through a watch on the client's stream;
* ``_queue.py``: taking a hold of any kind, queueing and waiting for it, leaving the queue
  after a cancel: one loop for every kind, told apart by its rule (``_order.py``);
* ``_permits.py``: what only a semaphore does (its permit count, its keys granted in queue
  order, its wait on the N keys before its own);
* ``_order.py``: the queue's rules as pure functions (what a key waits for, whether it holds);
* ``_watch.py``: a waiter's wait for its turn (watches, the lease kept alive meanwhile);
* ``_hub.py``: the client's one watch stream, and the watch per lock name;
* ``_keys.py``: deletes of lock keys, the keys whose delete failed, the client's keys in the
  queues (and the waiters right behind them);
* ``_lease.py``: :class:`EtcdGrant`, the client's leases and their keepalive stream;
* ``_wire.py``: the gRPC channel, deadlines, re-authentication, the resend logic;
* ``_errors.py``: gRPC statuses into asynclock's errors (one translator);
* ``_names.py``: where each kind's keys live, what a key's name and value say;
* ``_proto.py``: request messages; ``_urls.py``: the URL and the settings.

``fenced_txn`` and ``fence_compare`` (they take a Lease) live in :mod:`asynclock.fencing`.
"""

from __future__ import annotations

from ._lease import EtcdGrant
from .backend import EtcdBackend

__all__ = ("EtcdBackend", "EtcdGrant")
