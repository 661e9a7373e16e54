"""The backend's part of the znode tree: the chroot, and one parent node per name and kind.

A lock's parent ``<chroot>/<encoded name>`` (a semaphore's ``<chroot>/%semaphore-<encoded
name>``, an election's ``<chroot>/%election-<encoded name>``) is a container node, kept while
it is in use and deleted once it has been empty and unused for a while (the server deletes
empty containers too, should the client die first).
"""

from __future__ import annotations

import logging

import anyio
from aiozk import ACL as ZkACL
from aiozk import exc as zk_exc
from aiozk import protocol as zk

from .._kit import now, translate
from . import _proto
from ._errors import ConnectionLoss, SessionGone, zk_errors
from ._names import encode_name, namespace_prefix
from ._session import Session
from ._urls import Settings

__all__ = ("Tree",)

logger = logging.getLogger("asynclock.zookeeper")


class Tree:
    def __init__(self, settings: Settings, where: str) -> None:
        self.chroot = settings.chroot
        self.where = where
        #: Lock parent nodes this client created or used lately, and when it last did.
        self.parents: dict[str, float] = {}
        #: Set by the next ``touch`` (``wait_for_parents``).
        self._touched: anyio.Event | None = None
        if settings.user is None:
            acl = zk.UNRESTRICTED_ACCESS
        else:
            # "auth" with an empty id: the server puts in the digest of our credentials.
            acl = ZkACL.make("auth", "", True, True, True, True, True)
        #: Every node's ACL, encoded (``_proto.encode_acl``).
        self.acl = _proto.encode_acl([acl])

    def parent(self, name: str, kind: str = "lock") -> str:
        """The parent node of ``name`` of ``kind`` (``abc.Kind``: each kind its own namespace)."""
        return f"{self.chroot.rstrip('/')}/{namespace_prefix(kind)}{encode_name(name)}"

    def touch(self, parent: str) -> None:
        self.parents[parent] = now()
        if self._touched is not None:
            self._touched.set()
            self._touched = None

    async def wait_for_parents(self) -> None:
        """Until this client has a lock parent to look after: the janitor of a client that
        locks nothing does not wake (idle, 8 clients' janitors cost a third of their CPU)."""
        if not self.parents:
            self._touched = touched = anyio.Event()
            await touched.wait()

    def stale(self, linger: float) -> list[str]:
        """The parents nobody of this client used for ``linger`` seconds."""
        cutoff = now() - linger
        return [parent for parent, used in self.parents.items() if used < cutoff]

    async def ensure_chroot(self, session: Session) -> None:
        parts = self.chroot.strip("/").split("/")
        paths = ["/" + "/".join(parts[: index + 1]) for index in range(len(parts))]
        with translate(zk_errors, f"creating the chroot {self.chroot} on {self.where}"):
            replies = await session.call_retrying(
                *(_proto.create(path, b"", self.acl, _proto.PERSISTENT) for path in paths)
            )
            for reply in replies:
                if isinstance(reply, Exception) and not isinstance(reply, zk_exc.NodeExists):
                    raise reply

    async def delete_parents(self, session: Session | None, parents: list[str]) -> None:
        """Delete these lock parents if they are empty (one pipelined round trip).

        A parent in use again (not empty) is forgotten: whoever uses it touches it again. One
        whose delete got no answer (the connection broke, the session ended) is kept, with
        its old time, for the janitor's next pass and for ``aclose()``: forgotten, it stayed on
        the server until its container check, a minute later (the scale test's parents, once
        a burst of 1,000 waiters kept the server from answering this client's pings).
        """
        if session is None or not parents:
            return
        used = {parent: self.parents.pop(parent, now()) for parent in parents}
        try:
            await session.call_retrying(*(_proto.delete(parent) for parent in parents))
        except (ConnectionLoss, SessionGone) as exc:
            logger.debug("asynclock: deleting empty lock parents failed: %r", exc)
            for parent, when in used.items():
                # A touch meanwhile (a new acquisition) has the later time.
                self.parents.setdefault(parent, when)
