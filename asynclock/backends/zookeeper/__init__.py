"""``zookeeper://host:port[,host:port...]/chroot``: locks on a ZooKeeper ensemble.

The recipe is Curator's ``InterProcessMutex``:

* Taking a lock creates an *ephemeral sequential* znode ``<chroot>/<name>/_c_<owner>-lock-<seq>``.
  The lowest sequence number holds the lock; every other waiter watches only the node just
  before its own (FIFO, no herd). The node name carries the lease's owner id ("protected"
  mode), so a create whose reply was lost is found again after the reconnect and reused, never
  duplicated.
* The fencing token is the node's ``czxid`` (the zxid of the transaction that created it),
  returned by the same ``Create2`` round trip. It increases across every acquisition of a name,
  also when the parent node was deleted and recreated (the sequence suffix restarts then).
* The lease is the ZooKeeper *session*: the server deletes the node when it has not heard from
  the session for the negotiated session timeout, so a lock's ttl *is* a session timeout. The
  backend opens one session per distinct ttl (lazily) and refuses a ttl the server would
  negotiate to something else. Renewal asks the server whether each node still exists and is
  owned by the session (one pipelined round trip for all leases of a session).
* When the session expires (the server says so on reconnect, or the client has not heard from
  the server for a whole session timeout), every lease of that session is reported lost at
  once, and the next acquisition uses a new session: a new session never inherits a lock.
* The parent ``<chroot>/<name>`` is a container node, kept while it is in use and deleted once
  it has been empty and unused for ``_PARENT_LINGER`` seconds (the server deletes empty
  containers too, should the client die first).
* Shared holds (``locks.lock(name, shared=True)``) put ``-read-`` nodes in the same queue: a
  reader waits for the writers before it, a writer for everyone before it (so a waiting writer
  blocks the readers that come after it).
* A semaphore of N permits is a queue of ``-sem<N>-`` nodes under its own parent
  ``<chroot>/%semaphore-<name>``: a node holds when fewer than N nodes are ahead of it, and
  waits watching the N nodes just ahead of it (a release wakes at most N waiters). N is in
  every node's name; a request with another N than the first node's is refused.
* An election is an exclusive lock under ``<chroot>/%election-<name>`` whose nodes carry the
  candidates' values: the first node is the leader, and ``wait_for_change`` watches it.

The requests and replies are encoded here (``_proto.py``); aiozk supplies the handshake's
messages and the error classes. The session, connection and watch handling are our own,
because aiozk's ``ZKClient`` retries calls forever while disconnected, replaces an expired
session silently, cannot authenticate and starts tasks nobody owns. Everything here runs in tasks owned by the backend and every server
call is bounded by ``op_timeout``.

The package, imported in one direction (each file only from those below it):

* ``backend.py``: :class:`ZooKeeperBackend`, the contract's calls and sessions per ttl;
* ``_inspect.py``: ``inspect`` and ``wait_for_change`` (the holders of a name, its watches);
* ``_queue.py``: one attempt at a lock (the queue recipe, waiting, cleanup when cancelled);
* ``_order.py``: who holds and whom each waiter waits for, from a listing of the queue;
* ``_tree.py``: the chroot and the lock parent nodes;
* ``_lease.py``: :class:`ZooKeeperGrant` and the held nodes of a session (watched for loss);
* ``_session.py``: a session over reconnects, its calls, watches and pings;
* ``_wire.py``: one framed connection and the handshake;
* ``_proto.py``: the requests and replies, encoded;
* ``_urls.py``: the URL and the settings; ``_names.py``: znode names and namespaces;
* ``_errors.py``: the private exceptions and their translation (``zk_errors``).
"""

from __future__ import annotations

from ._lease import ZooKeeperGrant
from ._names import encode_name
from .backend import ZooKeeperBackend

__all__ = ("ZooKeeperBackend", "ZooKeeperGrant", "encode_name")
