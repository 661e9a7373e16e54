"""Znode names: lock names encoded as one znode name, and the parts of a lock node's name.

A lock node is ``_c_<owner>-<kind>-<sequence>``: Curator's "protected" marker, the lease's
owner id (so that a create whose reply was lost is found again), the kind (``lock`` for an
exclusive hold, ``read`` for a shared one) and the sequence number the server appends.
"""

from __future__ import annotations

import contextvars
from typing import Final, Literal

__all__ = ("EXCLUSIVE", "KIND", "PROTECTED", "SHARED", "Kind", "encode_name", "forbidden")

#: Prefix of every lock node: Curator's "protected" marker, then the lease owner id.
PROTECTED = "_c_"
EXCLUSIVE: Final = "lock"
SHARED: Final = "read"
Kind = Literal["lock", "read"]

#: The lock kind the next acquire in this context takes (set by
#: :class:`asynclock.extras.zookeeper.ReadWriteLock`, read by the backend's acquire).
KIND: contextvars.ContextVar[Kind] = contextvars.ContextVar(
    "asynclock_zookeeper_kind", default=EXCLUSIVE
)


def forbidden(char: str) -> bool:
    """Whether ZooKeeper refuses ``char`` in a znode name (or it is ``%`` or ``/``)."""
    # ZooKeeper's PathUtils.validatePath, on UTF-16 code units: characters outside the BMP
    # are surrogate pairs there, which it refuses too.
    code = ord(char)
    return (
        code < 0x20
        or 0x7F <= code <= 0x9F
        or 0xD800 <= code <= 0xF8FF
        or code >= 0xFFF0
        or char in "%/"
    )


def encode_name(name: str) -> str:
    """Encode a lock name as one znode name, injectively.

    ``%``, ``/`` and every character ZooKeeper refuses in a path become ``%XX`` escapes of
    their UTF-8 bytes; everything else stays as it is. The reserved names ``.``, ``..`` and
    ``zookeeper`` get their first character escaped. Decoding is plain percent-decoding, so
    distinct names always give distinct znodes.
    """
    encoded = "".join(
        "".join(f"%{byte:02X}" for byte in char.encode("utf-8")) if forbidden(char) else char
        for char in name
    )
    if encoded in (".", "..", "zookeeper"):
        encoded = f"%{ord(encoded[0]):02X}{encoded[1:]}"
    return encoded
