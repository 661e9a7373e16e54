"""Where the keys of each kind live, and what a key's name says about its hold.

* a lock ``name``: ``<prefix><quoted name>/<lease hex>-<owner>`` (exclusive) and
  ``<prefix><quoted name>/r<lease hex>-<owner>`` (shared), value the owner id;
* a semaphore: ``<prefix>!semaphore/<quoted name>/<lease hex>-<owner>``, value the number of
  permits and whether the key still waits (``b"3;"``: granted, ``b"3;w"``: waiting; see
  :mod:`._permits`);
* an election: ``<prefix>!election/<quoted name>/<lease hex>-<owner>``, value the candidate's.

The name is percent-encoded with no safe characters, which never yields "/" or "!", so the
three kinds and every name of a kind have disjoint key ranges (a lock's prefix never starts
with "!"). Exclusive keys start with a lowercase hex digit and shared ones with "r", so the
exclusive keys of a lock form one range of their own, [``<name prefix>0``, ``<name prefix>g``):
a reader reads (and waits for) only the writers, as etcd's ``recipes.RWMutex`` does with its
``/read`` and ``/write`` prefixes, while every key of the name stays one range in one
create-revision order.
"""

from __future__ import annotations

from typing import Final
from urllib.parse import quote

from .._kit import Kind
from ._proto import prefix_end

__all__ = (
    "SHARED_MARK",
    "blockers",
    "is_shared",
    "key_base",
    "lease_of",
    "name_of",
    "name_prefix",
    "owner_of",
    "permit_value",
    "permit_values",
    "permits_of",
    "waiting_permit",
    "writers",
)

#: The first byte of a shared hold's key suffix (never a hex digit).
SHARED_MARK: Final = b"r"
_NAMESPACES: Final[dict[str, bytes]] = {
    "lock": b"",
    "semaphore": b"!semaphore/",
    "election": b"!election/",
}


def name_prefix(prefix: bytes, name: str, kind: Kind) -> bytes:
    """The prefix of every key of ``name`` of ``kind``, ending in "/"."""
    return prefix + _NAMESPACES[kind] + quote(name, safe="").encode("ascii") + b"/"


def name_of(key: bytes) -> bytes:
    """The name prefix of ``key``: up to its last "/" (the quoted name and the
    "<lease>-<owner>" part have none)."""
    return key[: key.rindex(b"/") + 1]


def _suffix(key: bytes) -> bytes:
    return key[key.rindex(b"/") + 1 :]


def is_shared(key: bytes) -> bool:
    return _suffix(key)[:1] == SHARED_MARK


def key_base(key: bytes) -> bytes:
    """``key`` up to its owner id: its name prefix, kind mark and lease (``Keys.reuse``)."""
    return key[: key.index(b"-", key.rindex(b"/")) + 1]


def lease_of(key: bytes) -> int:
    suffix = _suffix(key)
    return int(suffix.removeprefix(SHARED_MARK)[:16], 16)


def owner_of(key: bytes) -> str | None:
    return _suffix(key).decode("ascii").partition("-")[2] or None


def writers(name: bytes) -> tuple[bytes, bytes]:
    """The range of the exclusive keys of the lock whose name prefix is ``name``."""
    return name + b"0", name + b"g"


def blockers(key: bytes) -> tuple[bytes, bytes]:
    """The range of the keys that a hold by ``key`` waits for, when they are older: every
    key of the name, or only the writers for a shared hold."""
    name = name_of(key)
    return writers(name) if is_shared(key) else (name, prefix_end(name))


def permit_value(permits: int, *, waiting: bool) -> bytes:
    """A semaphore key's value."""
    return f"{permits};{'w' if waiting else ''}".encode("ascii")


def permit_values(permits: int) -> tuple[bytes, bytes]:
    """Bounds strictly around both values of ``permits`` and no value of another number
    (``"3;"`` and ``"3;w"`` lie between ``"3:"`` and ``"3<"``; ``"30;"`` and ``"4;"`` do not)."""
    digits = str(permits).encode("ascii")
    return digits + b":", digits + b"<"


def permits_of(value: bytes) -> int:
    """The number of permits a semaphore key was created with (0: not a number)."""
    digits = value.partition(b";")[0]
    return int(digits) if digits.isdigit() else 0


def waiting_permit(value: bytes) -> bool:
    return value.endswith(b";w")
