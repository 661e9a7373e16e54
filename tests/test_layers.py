"""The package's layering, checked from the source (every import, TYPE_CHECKING ones too).

- no import circle anywhere in asynclock, counting every import (inside functions too: a lazy
  import still ties the two modules together);
- a backend imports only the backend kit, its own package, its driver and the standard library:
  never the core (``_client``, ``_lease``, ``_registry``...) and never another backend; above
  the backends, a backend is imported by its package's names, never its files;
- no file over 500 lines, no class over 350, no function over 80 (scripts/limits.py);
- the role table in docs/architecture.md names every file of every backend package.
"""

from __future__ import annotations

import ast
import re
import runpy
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "asynclock"


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(module: str) -> set[str]:
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                name = ".".join([*base, *([node.module] if node.module else [])])
            else:
                name = node.module or ""
            for alias in node.names:
                target = f"{name}.{alias.name}"
                found.add(target if target in MODULES else name)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name in MODULES and name != module}


GRAPH = {module: _imports(module) for module in MODULES}


def test_there_is_no_import_circle() -> None:
    circles: list[list[str]] = []
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(GRAPH[module]):
            if state.get(target) == "open":
                circles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target, [*path, target])
        state[module] = "done"

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])
    assert circles == []


def test_backends_import_only_the_kit_and_their_own_package() -> None:
    upward = []
    for module, targets in GRAPH.items():
        parts = module.split(".")
        if len(parts) < 3 or parts[1] != "backends" or parts[2] == "_kit":
            continue
        own = "asynclock.backends." + parts[2]
        for target in targets:
            if target == "asynclock.backends" or target.startswith(
                ("asynclock.backends._kit", own)
            ):
                continue
            upward.append(f"{module} imports {target}")
    assert upward == []


def test_above_the_backends_only_a_backend_packages_own_names_are_imported() -> None:
    # transaction_lock and etcd's fenced_txn call their backend through its package's names.
    reaching = [
        f"{module} imports {target}"
        for module, targets in GRAPH.items()
        if not module.startswith("asynclock.backends")
        for target in targets
        if target.startswith("asynclock.backends.") and target.count(".") > 2
    ]
    assert reaching == []


def test_files_classes_and_functions_are_within_the_size_limits() -> None:
    limits = runpy.run_path(str(PACKAGE.parent / "scripts" / "limits.py"))
    problems = [
        problem for path in sorted(PACKAGE.rglob("*.py")) for problem in limits["check"](path)
    ]
    assert problems == []


def test_the_role_table_names_every_file_of_every_backend_package() -> None:
    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    table = doc.split("## The role of each file in a backend package", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[2:-1] for line in table.splitlines() if line.startswith("| ")]
    packages = [cell.strip(" `/") for cell in rows[0]]
    for column, package in enumerate(packages):
        named = {name for row in rows[1:] for name in re.findall(r"`(\w+\.py)`", row[column])}
        files = {p.name for p in (PACKAGE / "backends" / package).glob("*.py")} - {"__init__.py"}
        assert (package, named) == (package, files)
