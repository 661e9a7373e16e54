"""Znode names: lock names encoded as one znode name, the namespaces of the kinds, and the
parts of a lock node's name.

A lock node is ``_c_<owner>-<kind>-<sequence>``: Curator's "protected" marker, the lease's
owner id (so that a create whose reply was lost is found again), the node's kind and the
sequence number the server appends. The kinds:

* ``lock``: an exclusive hold (a lock's writer, a plain lock, an election's candidate);
* ``read``: a shared hold of a lock;
* ``sem<N>``: a hold of a semaphore of ``N`` permits (``sem3``). The number is in the name, so
  that one listing of the queue shows it for every node: a request with another number is
  refused without reading any node's data.
"""

from __future__ import annotations

import re
from typing import Final

__all__ = (
    "EXCLUSIVE",
    "PROTECTED",
    "SEMAPHORE",
    "SHARED",
    "encode_name",
    "forbidden",
    "namespace_prefix",
    "permits_of",
    "semaphore_kind",
)

#: Prefix of every lock node: Curator's "protected" marker, then the lease owner id.
PROTECTED = "_c_"
EXCLUSIVE: Final = "lock"
SHARED: Final = "read"
SEMAPHORE: Final = "sem"

#: What precedes the encoded name of a semaphore's or an election's parent node (a lock's
#: parent is the encoded name alone, as before there were other kinds). An encoded name has a
#: ``%`` only before two upper-case hex digits, so ``%s`` and ``%e`` never start one: the
#: three namespaces cannot meet, whatever the names.
_NAMESPACES: Final = {"lock": "", "semaphore": "%semaphore-", "election": "%election-"}


def namespace_prefix(kind: str) -> str:
    """What precedes the encoded name of a parent node of ``kind`` (``abc.Kind``)."""
    return _NAMESPACES[kind]


def semaphore_kind(permits: int) -> str:
    """The kind part of a node of a semaphore of ``permits`` permits."""
    return f"{SEMAPHORE}{permits}"


def permits_of(kind: str) -> int | None:
    """The permits of a semaphore node's kind part (``sem3``: 3); None for any other kind."""
    digits = kind.removeprefix(SEMAPHORE)
    if digits == kind or not digits.isdigit() or digits.startswith("0"):
        return None
    return int(digits)


#: What ZooKeeper refuses in a znode name, and ``%`` and ``/``: its PathUtils.validatePath
#: works on UTF-16 code units, so characters outside the BMP are surrogate pairs there, which
#: it refuses too.
_FORBIDDEN = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\uf8ff\ufff0-\U0010ffff%/]")


def forbidden(char: str) -> bool:
    """Whether ZooKeeper refuses ``char`` in a znode name (or it is ``%`` or ``/``)."""
    return _FORBIDDEN.fullmatch(char) is not None


def _escape(match: re.Match[str]) -> str:
    return "".join(f"%{byte:02X}" for byte in match[0].encode("utf-8"))


def encode_name(name: str) -> str:
    """Encode a lock name as one znode name, injectively.

    ``%``, ``/`` and every character ZooKeeper refuses in a path become ``%XX`` escapes of
    their UTF-8 bytes; everything else stays as it is. The reserved names ``.``, ``..`` and
    ``zookeeper`` get their first character escaped. Decoding is plain percent-decoding, so
    distinct names always give distinct znodes.
    """
    # The common case, a name with nothing to escape, is only searched.
    encoded = name if _FORBIDDEN.search(name) is None else _FORBIDDEN.sub(_escape, name)
    if encoded in (".", "..", "zookeeper"):
        encoded = f"%{ord(encoded[0]):02X}{encoded[1:]}"
    return encoded
