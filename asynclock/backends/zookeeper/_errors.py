"""ZooKeeper's errors, and their translation into asynclock's hierarchy in one place.

The session raises three private exceptions (the outcome of a call it cannot give as a
reply) and hands the server's error replies back as aiozk exceptions. Everything above the
session raises them as they are and translates them at the backend boundary with
``translate(zk_errors, context)``.
"""

from __future__ import annotations

from aiozk import exc as zk_exc

from .._kit import BackendTimeout, BackendUnavailable, LockError, MayHaveApplied, ProvenGone

__all__ = (
    "SERVER_ERRORS",
    "ConnectionLoss",
    "NotConnected",
    "SessionGone",
    "error_for",
    "zk_errors",
)


class UnknownCode(Exception):
    """A ZooKeeper error code aiozk does not know."""

    def __init__(self, code: int) -> None:
        super().__init__(f"ZooKeeper error code {code}")
        self.code = code


#: An error reply of the server.
SERVER_ERRORS = (zk_exc.ZKError, UnknownCode)
_REFUSED = (zk_exc.NoAuth, zk_exc.InvalidACL, zk_exc.AuthFailed)


def error_for(code: int) -> Exception:
    """The exception for an error code of a reply."""
    cls = zk_exc.response_error_xref.get(code)
    if cls is None or cls is zk_exc.UnknownError:
        return UnknownCode(code)
    error: Exception = cls()
    return error


class ConnectionLoss(Exception):
    """The request may or may not have been applied: the connection broke or did not answer."""


class NotConnected(ConnectionLoss):
    """No connection came up within ``op_timeout``: nothing was sent."""


class SessionGone(Exception):
    """The session expired or was closed; nothing it created survives."""


def zk_errors(error: Exception, context: str) -> LockError | None:
    """The translator of the ZooKeeper backend (see :func:`asynclock.backends._kit.translate`)."""
    if isinstance(error, NotConnected):
        return BackendTimeout(f"{context}: {error}")
    if isinstance(error, ConnectionLoss):
        return MayHaveApplied(f"{context}: {error}")
    if isinstance(error, SessionGone):
        return ProvenGone(f"{context}: {error}")
    if isinstance(error, _REFUSED):
        return BackendUnavailable(
            f"{context}: ZooKeeper refused access ({type(error).__name__}); the znodes belong "
            "to other credentials: give the right user:password in the URL"
        )
    if isinstance(error, SERVER_ERRORS):
        return BackendUnavailable(f"{context}: ZooKeeper error {error!r}")
    return None
