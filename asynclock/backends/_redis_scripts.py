"""Kept for compatibility: the Redis backends' scripts, keys and wire now live in
:mod:`asynclock.backends.redis` (``_scripts``, ``_settings``, ``_lane``)."""

from .redis._lane import Lane, Undo
from .redis._resp import pack
from .redis._scripts import (
    HOLDS_TAG,
    KIND_SPACE,
    LOCK_TAG,
    QUEUE_TAG,
    QUEUE_TTL_TAG,
    TOKEN_TAG,
    WAITERS_KEY,
    WAITERS_TTL_KEY,
    WAKE_TAG,
    Script,
    fair_keys,
    holds_key,
    lock_key,
    queue_key,
    queue_ttl_key,
    token_key,
    wake_prefix,
)
from .redis._settings import ERRORS, Settings

__all__ = (
    "ERRORS",
    "HOLDS_TAG",
    "KIND_SPACE",
    "LOCK_TAG",
    "QUEUE_TAG",
    "QUEUE_TTL_TAG",
    "TOKEN_TAG",
    "WAITERS_KEY",
    "WAITERS_TTL_KEY",
    "WAKE_TAG",
    "Lane",
    "Script",
    "Settings",
    "Undo",
    "fair_keys",
    "holds_key",
    "lock_key",
    "pack",
    "queue_key",
    "queue_ttl_key",
    "token_key",
    "wake_prefix",
)
