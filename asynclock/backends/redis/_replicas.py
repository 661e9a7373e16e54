"""``wait_replicas`` / ``wait_timeout``: a take or renewal counts only once replicas have it.

Redis replicates asynchronously, so a master that fails right after granting a lock can take
the grant with it, and the replica promoted in its place hands the lock out again. ``WAIT n t``
behind the take, on the same connection, blocks until ``n`` replicas acknowledged that write
(or ``t`` ms passed). A take that fewer replicas acknowledged is undone and fails with
``BackendUnavailable``; a renewal that fewer acknowledged proves nothing (``Unknown``: the
local deadline stays). It narrows the window, it does not close it: ``WAIT`` is not a
consensus (a replica that acknowledged may still lose the election to one that did not, and
the acknowledged write lives only in its memory). Fencing tokens remain what makes a double
grant safe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from .._kit import InvalidArgument, Options
from . import _queue
from . import _scripts as lua
from ._urls import COMMON_OPTIONS
from ._wire import Lane, Wait
from .backend import _DEFAULT_WAITER_TTL as DEFAULT_WAITER_TTL

#: Options of the backends that offer WAIT.
WAIT_OPTIONS: Final = ("wait_replicas", "wait_timeout")
_DEFAULT_WAIT_TIMEOUT: Final = 0.5


@dataclass(frozen=True, slots=True)
class ReplicaWait:
    """How many replicas must have a take or a renewal, and how long to wait for them."""

    replicas: int = 0
    timeout_ms: int = 0

    @classmethod
    def from_options(cls, opts: Options, source: str, op_timeout: float) -> ReplicaWait:
        replicas = opts.whole("wait_replicas", 0, minimum=0)
        seconds = opts.number("wait_timeout", _DEFAULT_WAIT_TIMEOUT, minimum=0.001)
        if not replicas:
            return cls()
        if seconds >= op_timeout:
            raise InvalidArgument(
                f"option 'wait_timeout' of {source} ({seconds:g} s) must be shorter than "
                f"'op_timeout' ({op_timeout:g} s): a take waits for both"
            )
        # WAIT's timeout 0 means "for ever": never send it.
        return cls(replicas, max(1, lua.ttl_ms(seconds)))

    def install(self, lane: Lane) -> None:
        """Make ``lane`` send ``WAIT`` behind every take and renewal (in place: a cluster's
        lanes share its dict)."""
        if not self.replicas:
            return
        lane.wait_for[_queue.TAKE.sha] = Wait(self.replicas, self.timeout_ms, _took)
        lane.wait_for[lua.RENEW.sha] = Wait(self.replicas, self.timeout_ms, _renewed)

    def info(self) -> dict[str, Any]:
        return {"wait_replicas": self.replicas, "wait_timeout": self.timeout_ms / 1000}


def topology_options(
    opts: Options, source: str, op_timeout: float, own: tuple[str, ...] = ()
) -> dict[str, Any]:
    """What ``redis+sentinel://`` and ``redis+cluster://`` read beyond the common options, as
    keyword arguments of the backend; ``opts.finish()`` too (``own``: options read already)."""
    replica_wait = ReplicaWait.from_options(opts, source, op_timeout)
    waiter_ttl = opts.number("waiter_ttl", DEFAULT_WAITER_TTL, minimum=0.05)
    durability_warning = opts.flag("durability_warning", True)
    opts.finish((*COMMON_OPTIONS, *WAIT_OPTIONS, *own, "waiter_ttl", "durability_warning"))
    return {
        "replica_wait": replica_wait,
        "waiter_ttl": waiter_ttl,
        "durability_warning": durability_warning,
    }


def _took(reply: Any) -> bool:
    """A take's reply ``{1, token}``: the lock is ours, and must be on the replicas."""
    return isinstance(reply, list) and bool(reply) and int(reply[0]) == 1


def _renewed(reply: Any) -> bool:
    """A renewal that extended (or, with ttl 0, found) at least one of our locks."""
    return isinstance(reply, list) and any(int(code) == 1 for code in reply)
