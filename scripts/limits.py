"""Report what breaks the size rules of the package: files over 500 lines, classes over 350,
functions over 80 (docs/architecture.md says why). Exit 1 if anything does.

    .venv/bin/python scripts/limits.py [paths...]     (default: asynclock/)
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

LIMITS = {"file": 500, "class": 350, "function": 80}


def check(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    found = []
    lines = text.count("\n") + 1
    if lines > LIMITS["file"]:
        found.append(f"{path}: {lines} lines (file limit {LIMITS['file']})")
    for node in ast.walk(ast.parse(text)):
        kind = (
            "class"
            if isinstance(node, ast.ClassDef)
            else "function"
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            else None
        )
        if kind is None:
            continue
        length = (node.end_lineno or node.lineno) - node.lineno + 1
        if length > LIMITS[kind]:
            found.append(
                f"{path}:{node.lineno}: {kind} {node.name} is {length} lines (limit {LIMITS[kind]})"
            )
    return found


def main(argv: list[str]) -> int:
    roots = [Path(arg) for arg in argv] or [Path("asynclock")]
    found = [
        problem
        for root in roots
        for path in sorted(root.rglob("*.py") if root.is_dir() else [root])
        for problem in check(path)
    ]
    print("\n".join(found) or "within the limits")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
