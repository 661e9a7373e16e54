"""``redlock://``: kept for compatibility; the backend lives in :mod:`asynclock.backends.redis`."""

from .redis.redlock import MIN_MASTERS, RedlockBackend, RedlockGrant

__all__ = ("MIN_MASTERS", "RedlockBackend", "RedlockGrant")
