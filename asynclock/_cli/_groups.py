"""Process groups, as ``run`` and its guard see them: which processes are left in one."""

from __future__ import annotations

import os


def group_exists(pgid: int) -> bool:
    """Whether process group ``pgid`` has live members (zombies an init is slow to reap not)."""
    members = group_members(pgid)
    if members is not None:
        return bool(members)
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # the number was reused by someone else's group: not ours
        return False
    return True


def group_members(pgid: int) -> list[int] | None:
    """The live processes of group ``pgid`` other than this one (from /proc; None without it)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    me = os.getpid()
    members: list[int] = []
    for entry in entries:
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as file:
                stat = file.read()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...; comm may contain anything, ")" included.
        fields = stat.rsplit(b")", 1)[-1].split()
        if len(fields) > 2 and fields[0] != b"Z" and int(fields[2]) == pgid:
            members.append(int(entry))
    return members
