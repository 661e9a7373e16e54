"""Fixtures shared by the per-backend test files."""

from __future__ import annotations

import uuid

import pytest


@pytest.fixture
def prefix() -> str:
    """A key prefix of the test's own (Redis and Redlock), so tests never see each other's keys."""
    return f"test-{uuid.uuid4().hex[:10]}:"
