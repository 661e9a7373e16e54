"""The requests this backend sends and the replies it reads, in ZooKeeper's encoding (jute),
written out.

aiozk's classes build a request from a tree of parts and read a reply field by field, each
through a generic ``struct`` format made on the spot: the four requests of a contended
acquisition (create, list, watch, release) took 80 us to encode that way and their replies
70 us to read (6.5 and 7 us here), about a seventh of the client's CPU per acquisition. A
request here is its encoded body and the function that reads its reply. aiozk's classes remain for what runs once per connection (the handshake,
credentials, the ping's frame) and for the error classes (``_errors.py``).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from aiozk import ACL

from ._errors import error_for

__all__ = (
    "CONTAINER",
    "EPHEMERAL_SEQUENTIAL",
    "PERSISTENT",
    "Children",
    "Created",
    "Event",
    "Node",
    "Request",
    "Stat",
    "checked",
    "close",
    "create",
    "delete",
    "encode_acl",
    "exists",
    "get_children",
    "get_data",
    "read_event",
    "release",
)

PERSISTENT = 0
EPHEMERAL_SEQUENTIAL = 3
#: A parent node the server deletes once it is empty (``createContainer``, ZooKeeper 3.5+).
CONTAINER = 4

_INT = struct.Struct("!i")
_HEADER = struct.Struct("!ii")  # xid, opcode
_STAT = struct.Struct("!qqqqiiiqiiq")
_MULTI = struct.Struct("!i?i")  # an operation's type, done, error
_WATCH = struct.Struct("!ii")  # an event's type and state; its path follows
_WATCHING = (b"\x00", b"\x01")
_CREATE2, _CREATE_CONTAINER, _GET_CHILDREN, _GET_DATA, _EXISTS = 15, 19, 8, 4, 3
_DELETE, _SET_DATA, _MULTI_OP, _CLOSE = 2, 5, 14, -11


class Stat(NamedTuple):
    """A node's stat, with aiozk's field names."""

    created_zxid: int
    last_modified_zxid: int
    created: int
    modified: int
    version: int
    child_version: int
    acl_version: int
    ephemeral_owner: int
    data_length: int
    num_children: int
    last_modified_children: int


class Created(NamedTuple):
    path: str
    stat: Stat


class Node(NamedTuple):
    """A ``getData`` reply, or an ``exists`` one (no data)."""

    data: bytes | None
    stat: Stat


class Children(NamedTuple):
    children: list[str]


class Event(NamedTuple):
    type: int
    state: int
    path: str


class Request:
    """A request's body (what follows its header) and the reader of its reply's body."""

    __slots__ = ("body", "opcode", "read")

    def __init__(self, opcode: int, body: bytes, read: Callable[[bytes], Any]) -> None:
        self.opcode = opcode
        self.body = body
        self.read = read

    def serialize(self, xid: int) -> bytes:
        return _HEADER.pack(xid, self.opcode) + self.body


def _string(text: str) -> bytes:
    raw = text.encode()
    return _INT.pack(len(raw)) + raw


def _buffer(data: bytes) -> bytes:
    return _INT.pack(len(data)) + data


def _read_string(body: bytes, offset: int) -> tuple[str, int]:
    (size,) = _INT.unpack_from(body, offset)
    offset += 4
    if size < 0:  # null (a session event's path)
        return "", offset
    return body[offset : offset + size].decode(), offset + size


def _read_stat(body: bytes, offset: int) -> Stat:
    return Stat._make(_STAT.unpack_from(body, offset))


def _read_nothing(body: bytes) -> None:
    return None


def _read_created(body: bytes) -> Created:
    path, offset = _read_string(body, 0)
    return Created(path, _read_stat(body, offset))


def _read_children(body: bytes) -> Children:
    # One tight loop: every waiter reads a listing (a name per node of its queue) as it queues.
    (count,) = _INT.unpack_from(body)
    children: list[str] = []
    offset = 4
    for _ in range(count):
        (size,) = _INT.unpack_from(body, offset)
        offset += 4
        children.append(body[offset : offset + size].decode())
        offset += size
    return Children(children)


def _read_node(body: bytes) -> Node:
    (size,) = _INT.unpack_from(body)
    if size < 0:
        return Node(None, _read_stat(body, 4))
    return Node(body[4 : 4 + size], _read_stat(body, 4 + size))


def _read_exists(body: bytes) -> Node:
    return Node(None, _read_stat(body, 0))


def _read_multi(body: bytes) -> list[Any]:
    """Each operation's result: a ``Stat`` (set data), None (delete) or the error (an
    exception; when one fails, the others report ``RolledBack`` or ``RuntimeInconsistency``)."""
    results: list[Any] = []
    offset = 0
    while True:
        kind, done, _ = _MULTI.unpack_from(body, offset)
        offset += _MULTI.size
        if done:
            return results
        if kind == -1:
            (code,) = _INT.unpack_from(body, offset)
            offset += 4
            results.append(error_for(code))
        elif kind == _SET_DATA:
            results.append(_read_stat(body, offset))
            offset += _STAT.size
        elif kind == _DELETE:
            results.append(None)
        else:
            raise ValueError(f"a multi reply with an operation of type {kind}")


def encode_acl(acl: Sequence[ACL]) -> bytes:
    """An ACL list, encoded once per client (every create carries it)."""
    parts = [_INT.pack(len(acl))]
    for entry in acl:
        parts += [_INT.pack(entry.perms), _string(entry.id.scheme), _string(entry.id.id)]
    return b"".join(parts)


def create(path: str, data: bytes, acl: bytes, flags: int) -> Request:
    """``create2`` (the reply has the node's stat: its create zxid is the fencing token), or
    ``createContainer`` with ``flags=CONTAINER``."""
    opcode = _CREATE_CONTAINER if flags == CONTAINER else _CREATE2
    return Request(opcode, _string(path) + _buffer(data) + acl + _INT.pack(flags), _read_created)


def get_children(path: str, watch: bool = False) -> Request:
    return Request(_GET_CHILDREN, _string(path) + _WATCHING[watch], _read_children)


def get_data(path: str, watch: bool = False) -> Request:
    return Request(_GET_DATA, _string(path) + _WATCHING[watch], _read_node)


def exists(path: str, watch: bool = False) -> Request:
    return Request(_EXISTS, _string(path) + _WATCHING[watch], _read_exists)


def delete(path: str) -> Request:
    return Request(_DELETE, _string(path) + _INT.pack(-1), _read_nothing)


def release(path: str, data: bytes) -> Request:
    """One transaction (``multi``): set ``path``'s data to ``data``, then delete it."""
    encoded = _string(path)
    body = b"".join(
        (
            _MULTI.pack(_SET_DATA, False, -1),
            encoded + _buffer(data) + _INT.pack(-1),
            _MULTI.pack(_DELETE, False, -1),
            encoded + _INT.pack(-1),
            _MULTI.pack(-1, True, -1),
        )
    )
    return Request(_MULTI_OP, body, _read_multi)


def close() -> Request:
    return Request(_CLOSE, b"", _read_nothing)


def checked(reply: Any) -> Any:
    """``reply``; raised if it is an error reply (an exception)."""
    if isinstance(reply, Exception):
        raise reply
    return reply


def read_event(body: bytes) -> Event:
    kind, state = _WATCH.unpack_from(body)
    path, _ = _read_string(body, _WATCH.size)
    return Event(kind, state, path)
