"""etcd's request messages as this backend builds them (``aetcd.rpc`` protobufs), and the
conversion of ``aetcd`` transaction operations into them (for fenced transactions)."""

from __future__ import annotations

from typing import Any, Final, Literal

from aetcd import rpc
from aetcd import transactions as aetcd_transactions

from .._kit import InvalidArgument

__all__ = (
    "create_is",
    "delete_op",
    "mod_below",
    "move_op",
    "prefix_end",
    "put_op",
    "range_op",
    "to_compare",
    "to_request_op",
    "values_within",
)


def put_op(key: bytes, value: bytes, lease_id: int) -> Any:
    return rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=value, lease=lease_id))


def move_op(key: bytes, lease_id: int) -> Any:
    """Attach the existing ``key`` to another lease, keeping its value and create revision."""
    return rpc.RequestOp(request_put=rpc.PutRequest(key=key, lease=lease_id, ignore_value=True))


def mod_below(key: bytes, revision: int, range_end: bytes = b"") -> Any:
    """A comparison: no key up to ``range_end`` was created or changed at ``revision`` or
    later (true for an empty range)."""
    return rpc.Compare(
        key=key,
        range_end=range_end,
        target=rpc.Compare.MOD,
        result=rpc.Compare.LESS,
        mod_revision=revision,
    )


def values_within(key: bytes, low: bytes, high: bytes, range_end: bytes = b"") -> list[Any]:
    """Comparisons: every key up to ``range_end`` has a value strictly between ``low`` and
    ``high`` (false for an empty range)."""
    return [
        rpc.Compare(
            key=key, range_end=range_end, target=rpc.Compare.VALUE, result=result, value=value
        )
        for result, value in ((rpc.Compare.GREATER, low), (rpc.Compare.LESS, high))
    ]


_FIRST: Final = {"oldest": rpc.RangeRequest.ASCEND, "newest": rpc.RangeRequest.DESCEND}


def range_op(
    key: bytes,
    range_end: bytes = b"",
    *,
    values: bool = False,
    first: Literal["oldest", "newest"] | None = None,
    **fields: Any,
) -> Any:
    """A read of ``key`` (of [key, range_end) with ``range_end``): keys only, or with their
    ``values``; with ``first``, sorted by create revision, oldest or newest first."""
    if first is not None:
        fields["sort_target"] = rpc.RangeRequest.CREATE
        fields["sort_order"] = _FIRST[first]
    return rpc.RequestOp(
        request_range=rpc.RangeRequest(key=key, range_end=range_end, keys_only=not values, **fields)
    )


def delete_op(key: bytes) -> Any:
    return rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key))


def create_is(key: bytes, revision: int, range_end: bytes = b"") -> Any:
    """A comparison: the create revision of ``key`` (every key up to ``range_end``) is
    ``revision`` (0: it does not exist)."""
    return rpc.Compare(
        key=key,
        range_end=range_end,
        target=rpc.Compare.CREATE,
        result=rpc.Compare.EQUAL,
        create_revision=revision,
    )


def prefix_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with ``prefix`` (it ends with '/' here)."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


def to_compare(item: Any) -> Any:
    if isinstance(item, rpc.Compare):
        return item
    if isinstance(item, aetcd_transactions.BaseCompare):
        return item.build_message()
    raise InvalidArgument(
        f"compare takes aetcd comparisons or aetcd.rpc.Compare, not {type(item).__name__}"
    )


_WRAPPERS: tuple[tuple[Any, str], ...] = (
    (rpc.PutRequest, "request_put"),
    (rpc.RangeRequest, "request_range"),
    (rpc.DeleteRangeRequest, "request_delete_range"),
    (rpc.TxnRequest, "request_txn"),
)


def to_request_op(item: Any) -> Any:
    if isinstance(item, rpc.RequestOp):
        return item
    for message, field_name in _WRAPPERS:
        if isinstance(item, message):
            return rpc.RequestOp(**{field_name: item})
    if isinstance(item, aetcd_transactions.Put):
        lease = item.lease
        return rpc.RequestOp(
            request_put=rpc.PutRequest(
                key=_bytes(item.key),
                value=_bytes(item.value),
                lease=int(getattr(lease, "id", lease) or 0),
                prev_kv=bool(item.prev_kv),
            )
        )
    if isinstance(item, aetcd_transactions.Get):
        return rpc.RequestOp(
            request_range=rpc.RangeRequest(key=_bytes(item.key), range_end=_end(item.range_end))
        )
    if isinstance(item, aetcd_transactions.Delete):
        return rpc.RequestOp(
            request_delete_range=rpc.DeleteRangeRequest(
                key=_bytes(item.key), range_end=_end(item.range_end), prev_kv=bool(item.prev_kv)
            )
        )
    if isinstance(item, aetcd_transactions.Txn):
        return rpc.RequestOp(
            request_txn=rpc.TxnRequest(
                compare=[to_compare(each) for each in item.compare],
                success=[to_request_op(each) for each in item.success or ()],
                failure=[to_request_op(each) for each in item.failure or ()],
            )
        )
    raise InvalidArgument(
        f"transaction operations are aetcd operations or aetcd.rpc requests, not "
        f"{type(item).__name__}"
    )


def _end(range_end: bytes | str | None) -> bytes:
    return _bytes(range_end) if range_end is not None else b""


def _bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode("utf-8")
