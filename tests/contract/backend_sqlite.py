from __future__ import annotations

import sqlite3
import time
from contextlib import closing
from pathlib import Path

import pytest

from tests.contract.harness import BackendUnderTest, sqlite_write_locked

#: Where holds and waiters of every kind live (exclusive locks keep their table of old).
_LIVE = """
SELECT name FROM asynclock_locks WHERE expires_at > :now
UNION ALL SELECT kind || ' ' || name FROM asynclock_holds WHERE expires_at > :now
UNION ALL SELECT kind || ' ' || name || ' (waiting)' FROM asynclock_queue WHERE expires_at > :now
"""


@pytest.fixture
def sqlite_backend(tmp_path: Path) -> BackendUnderTest:
    path = tmp_path / "locks.db"

    async def revoke(name: str) -> None:
        with closing(sqlite3.connect(path)) as db, db:
            db.execute("DELETE FROM asynclock_locks WHERE name = ?", (name,))
            db.execute("DELETE FROM asynclock_holds WHERE name = ?", (name,))

    async def leftovers() -> list[str]:
        if not path.exists():
            return []
        with closing(sqlite3.connect(path)) as db, db:
            tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master")}
            if "asynclock_holds" not in tables:
                return []
            rows = db.execute(_LIVE, {"now": time.monotonic()}).fetchall()
        return sorted(row[0] for row in rows)

    return BackendUnderTest(
        "sqlite",
        f"sqlite://{path}",
        1.0,
        revoke,
        leftovers,
        hang=lambda client: sqlite_write_locked(str(path)),
        between_writes=lambda: sqlite_write_locked(str(path)),
    )
