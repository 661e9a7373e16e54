"""gRPC statuses into asynclock's errors: one translator (``etcd_errors``) and the retry
judgements the wire makes on the raw status."""

from __future__ import annotations

from collections.abc import Callable

import grpc

from .._kit import BackendUnavailable, LockError, MayHaveApplied, ProvenGone

__all__ = (
    "TRANSIENT_CODES",
    "Superseded",
    "etcd_errors",
    "retry_soon",
    "token_rejected",
    "transient",
    "unreachable",
)

#: Statuses after which a wait queues again (after a pause) instead of failing.
TRANSIENT_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.CANCELLED,
    }
)


class Superseded(Exception):
    """etcd elected a new leader while a call waited for its answer: send it again."""


def etcd_errors(
    *, op_timeout: float, prefix: str, default_port: int, closed: Callable[[], bool]
) -> Callable[[Exception, str], LockError | None]:
    """The translator (for :func:`asynclock.backends._kit.translate`) of one backend."""

    def translate(exc: Exception, context: str) -> LockError | None:
        if isinstance(exc, OSError):  # resolving a host name
            return BackendUnavailable(f"{context}: {type(exc).__name__}: {exc}")
        if not isinstance(exc, grpc.aio.AioRpcError):
            return None
        code = exc.code()
        details = str(exc.details() or "").removeprefix("etcdserver: ")
        if code == grpc.StatusCode.NOT_FOUND and "lease not found" in details:
            return ProvenGone(f"{context}: the lease is gone ({details})")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            # Sent, and not answered within the deadline: etcd may still apply it.
            return MayHaveApplied(
                f"{context}: no answer within {op_timeout:g} s (op_timeout); check that "
                "etcd runs and has a leader"
            )
        if "user name is empty" in details:
            return BackendUnavailable(
                f"{context}: etcd refused the request: it has authentication enabled; give the "
                "user and password options (or user:password@ in the URL)"
            )
        if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED) or (
            "authentication failed" in details
        ):
            return BackendUnavailable(
                f"{context}: etcd refused the request ({details}); check the user and password "
                f"options and that the user's role may read and write {prefix!r}"
            )
        if code == grpc.StatusCode.UNAVAILABLE:
            return BackendUnavailable(
                f"{context}: etcd is unreachable or has no leader ({details}); check that "
                "etcd runs and that the URL's hosts and ports are right (etcd's client port "
                f"is {default_port} by default)"
            )
        if code == grpc.StatusCode.CANCELLED and closed():
            return BackendUnavailable(f"{context}: the client was closed")
        return BackendUnavailable(f"{context}: {code.name}: {details}")

    return translate


def retry_soon(exc: grpc.aio.AioRpcError) -> bool:
    """A failure worth sending the same request again for, after a short pause."""
    code = exc.code()
    if code == grpc.StatusCode.UNAVAILABLE:
        return True  # connection reset or refused, no leader, leader changed, etcd timed out
    return code == grpc.StatusCode.UNKNOWN and "proposal dropped" in str(exc.details() or "")


def unreachable(exc: grpc.aio.AioRpcError) -> bool:
    return "failed to connect" in str(exc.details() or "").lower()


def token_rejected(exc: grpc.aio.AioRpcError) -> bool:
    return "invalid auth token" in str(exc.details() or "")


def transient(exc: BackendUnavailable) -> bool:
    """Whether a wait should queue again after ``exc`` (rather than fail)."""
    if isinstance(exc, ProvenGone):
        return False
    cause = exc.__cause__
    if isinstance(cause, grpc.aio.AioRpcError):
        return bool(cause.code() in TRANSIENT_CODES) and not token_rejected(cause)
    return True
