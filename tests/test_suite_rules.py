"""Rules of the test suite itself (docs/architecture.md, "Tests")."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).parent


def _imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, anywhere in it, relative imports made absolute."""
    package = ".".join(path.relative_to(TESTS.parent).with_suffix("").parts[:-1])
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(part for part in (base, node.module or "") if part)
            found.add(module)
            # `from tests.backends import test_redis` imports a module by its name.
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def test_no_test_module_imports_another() -> None:
    """Shared helpers live in fixtures and helper modules, never in a test module: a test
    module imported by another runs its module-level code twice and couples two files' tests."""
    offenders = [
        f"{path.relative_to(TESTS.parent)} imports {module}"
        for path in sorted(TESTS.rglob("*.py"))
        for module in sorted(_imported_modules(path))
        if module.startswith("tests.") and module.rsplit(".", 1)[-1].startswith("test_")
    ]
    assert offenders == []
