"""Package boundaries, checked on every run (issue 16; the rules are in docs/architecture.md).

1. **The import-linter contracts** in pyproject.toml (``[tool.importlinter]``): routing speaks no
   HTTP and imports neither replica, gateway nor the CLI; serving code imports neither planning,
   bench nor the CLI; only tests import tests; the agent and the simulated replica run without the
   gateway, and the gateway does not import the simulated replica; adapters_registry works without
   aiohttp; planning imports neither bench nor the CLI; traces imports nothing of ours; serving
   code needs neither matplotlib nor tqdm. ``lint-imports`` runs them, and a broken contract fails
   this test with its report (which file, which line).

2. **No import cycle between two of our files.** Counted: every ``import`` statement in a file,
   at module level, under ``if TYPE_CHECKING:``, and inside functions. A cycle that a
   function-local import keeps from failing at runtime, or that hides under ``TYPE_CHECKING``, is
   still two files that each need the other to be read or changed; the fix is a small protocol or
   a third module that both import, not a deferred import. Not counted: the parent packages that
   Python runs on the way (``import a.b.c`` runs ``a/__init__`` and ``a/b/__init__``), or every
   package that re-exports its modules would be a cycle. ``from pkg import name`` is an import of
   the module ``pkg.name`` when there is one, else of ``pkg``.

Run just these: ``.venv/bin/pytest -q tests/unit/test_layering.py``; the contracts alone:
``.venv/bin/lint-imports``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
#: Our top-level packages (pyproject.toml ``[tool.setuptools.packages.find]``).
PACKAGES = (
    "fleetgate", "traces", "routing", "gateway", "adapters_registry", "replica", "planning",
    "bench",
)

#: Cycles tolerated for now, each with its reason (none today: keep it that way). An entry whose
#: cycle is gone is harmless; a cycle that grows beyond its entry fails.
KNOWN_CYCLES: Mapping[frozenset[str], str] = {}


# --------------------------------------------------------------------------- import-linter


def _lint_imports(cwd: Path) -> subprocess.CompletedProcess[str]:
    executable = Path(sys.executable).parent / "lint-imports"
    if not executable.exists():
        pytest.fail(f"{executable} not found: install the dev extra (pip install -e '.[dev]')")
    return subprocess.run(
        [str(executable), "--no-cache"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_import_contracts_are_kept() -> None:
    result = _lint_imports(REPO)
    assert result.returncode == 0, (
        f"an import-linter contract is broken (pyproject.toml [tool.importlinter]):\n"
        f"{result.stdout}\n{result.stderr}"
    )
    assert "0 broken" in result.stdout, result.stdout


def test_a_broken_contract_fails_with_the_offending_import(tmp_path: Path) -> None:
    """The runner above reports a violation (here one hidden inside a function)."""
    (tmp_path / "pyproject.toml").write_text(textwrap.dedent("""\
        [tool.importlinter]
        root_packages = ["low", "high"]

        [[tool.importlinter.contracts]]
        name = "low does not import high"
        type = "forbidden"
        source_modules = ["low"]
        forbidden_modules = ["high"]
        """))
    _write(tmp_path, {
        "low/__init__.py": "",
        "low/worker.py": "def run():\n    import high.api\n",
        "high/__init__.py": "",
        "high/api.py": "",
    })
    result = _lint_imports(tmp_path)
    assert result.returncode != 0
    assert "low.worker -> high.api" in result.stdout, result.stdout


# --------------------------------------------------------------------------- cycles


@dataclass(frozen=True)
class ImportEdge:
    """``importer`` imports ``imported`` at ``line`` of the importer's file."""

    importer: str
    imported: str
    line: int


def module_files(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file under ``packages``."""
    modules: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def import_edges(modules: Mapping[str, Path]) -> list[ImportEdge]:
    """Every import of one of ``modules`` by another, wherever the statement stands."""
    edges: list[ImportEdge] = []
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            for target in _imported_modules(node, name, is_package, modules):
                if target != name:
                    edges.append(ImportEdge(name, target, node.lineno))
    return edges


def _imported_modules(
    node: ast.AST, importer: str, is_package: bool, modules: Mapping[str, Path]
) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name in modules]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:  # relative: from .x import y
        base = importer.split(".") if is_package else importer.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    found = []
    for alias in node.names:
        submodule = f"{source}.{alias.name}"
        if submodule in modules:
            found.append(submodule)
        elif source in modules:
            found.append(source)
    return found


def import_cycles(edges: Iterable[ImportEdge]) -> list[list[ImportEdge]]:
    """Each group of files that import each other (a strongly connected component of two or
    more), as the edges inside it, sorted."""
    graph: dict[str, set[str]] = {}
    for edge in edges:
        graph.setdefault(edge.importer, set()).add(edge.imported)
        graph.setdefault(edge.imported, set())
    components = _strongly_connected(graph)
    cycles = []
    for component in components:
        if len(component) < 2:
            continue
        inside = sorted(
            {e for e in edges if e.importer in component and e.imported in component},
            key=lambda e: (e.importer, e.imported, e.line),
        )
        cycles.append(inside)
    return sorted(cycles, key=lambda c: c[0].importer)


def _strongly_connected(graph: Mapping[str, set[str]]) -> list[set[str]]:
    """Tarjan's algorithm, iterative (no recursion limit on deep import chains)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, list[str]]] = [(start, sorted(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, pending = work[-1]
            if pending:
                nxt = pending.pop()
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, sorted(graph[nxt])))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                components.append(component)
    return components


def _describe(cycle: list[ImportEdge], modules: Mapping[str, Path]) -> str:
    return "\n".join(
        f"    {e.importer} -> {e.imported}  ({modules[e.importer].relative_to(REPO)}:{e.line})"
        for e in cycle
    )


def test_no_import_cycle_between_our_files() -> None:
    modules = module_files(REPO, PACKAGES)
    found = import_cycles(import_edges(modules))
    unexpected = [
        cycle for cycle in found
        if frozenset({e.importer for e in cycle} | {e.imported for e in cycle}) not in KNOWN_CYCLES
    ]
    report = "\n\n".join(_describe(cycle, modules) for cycle in unexpected)
    assert not unexpected, (
        f"{len(unexpected)} import cycle(s) between files (every import statement counts, also "
        f"those inside functions and under TYPE_CHECKING; see this file's docstring):\n{report}"
    )


def test_the_cycle_finder_sees_deferred_and_type_only_imports(tmp_path: Path) -> None:
    _write(tmp_path, {
        "pkg/__init__.py": "from pkg.a import A\n",  # a parent package is not an edge
        "pkg/a.py": "from pkg import b\nA = 1\n",
        "pkg/b.py": "def f():\n    from pkg.a import A\n    return A\n",  # a -> b -> a
        "pkg/c.py": textwrap.dedent("""\
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from pkg.d import D
            """),
        "pkg/d.py": "from . import c\nD = 1\n",  # c -> d -> c, relative
        "pkg/e.py": "import pkg.a\n",  # one way only: no cycle
    })
    modules = module_files(tmp_path, ["pkg"])
    cycles = import_cycles(import_edges(modules))
    assert [[(e.importer, e.imported, e.line) for e in cycle] for cycle in cycles] == [
        [("pkg.a", "pkg.b", 1), ("pkg.b", "pkg.a", 2)],
        [("pkg.c", "pkg.d", 3), ("pkg.d", "pkg.c", 1)],
    ]


def _write(root: Path, files: Mapping[str, str]) -> None:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
