"""The exit codes of ``asynclock run`` (the BSD sysexits and the shell's own)."""

from __future__ import annotations

EXIT_USAGE = 64
EXIT_UNAVAILABLE = 69
EXIT_TIMEOUT = 75
EXIT_LEASE_LOST = 79
EXIT_NOT_EXECUTABLE = 126
EXIT_NOT_FOUND = 127
