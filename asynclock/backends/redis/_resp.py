"""RESP2, the Redis protocol: commands written, replies read (for both wires)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

import anyio


def pack(args: Sequence[str | int | float | bytes]) -> bytes:
    """One command in RESP, the way redis-py's ``pack_command`` writes it but without its
    per-argument encoder calls (a third of a call's client-side time)."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


class ErrorReply(str):
    """A RESP error reply (``-ERR ...``)."""

    __slots__ = ()


class ProtocolError(Exception):
    """The server sent something that is not a reply to what was asked."""


async def read_reply(reader: asyncio.StreamReader) -> Any:
    """One RESP2 reply. An error reply comes back as an :class:`ErrorReply` value."""
    line = await reader.readuntil(b"\r\n")
    kind, rest = line[:1], line[1:-2]
    if kind == b":":
        return int(rest)
    if kind == b"$":
        size = int(rest)
        if size < 0:
            return None
        return (await reader.readexactly(size + 2))[:-2]
    if kind == b"*":
        count = int(rest)
        if count < 0:
            return None
        return [await read_reply(reader) for _ in range(count)]
    if kind == b"+":
        return rest
    if kind == b"-":
        return ErrorReply(rest.decode("utf-8", "replace"))
    raise ProtocolError(f"unexpected reply line {line[:40]!r}")


async def finish_closing(writers: Sequence[asyncio.StreamWriter], within: float) -> None:
    """Wait, shielded and for at most ``within`` seconds, until ``writers`` (closed already)
    have closed their sockets, and abort those that have not by then. A TLS connection's close
    sends its close_notify and closes the socket only when the peer has answered: a client whose
    event loop ends first leaves the socket open ("unclosed transport" when it is collected)."""
    left = list(writers)
    with anyio.CancelScope(shield=True), anyio.move_on_after(within):
        while left:
            with contextlib.suppress(Exception):  # how it ended is no matter here: it did
                await left[0].wait_closed()
            left.pop(0)
    for writer in left:
        writer.transport.abort()
