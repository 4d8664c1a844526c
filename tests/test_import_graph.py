"""No import cycle between relayrl's modules, read from the source with ast: every import
statement counts, wherever it is (module level, inside a function, under
``if TYPE_CHECKING:``), since a cycle hidden behind ``TYPE_CHECKING`` or a deferred import is
still two modules that each need the other (import-linter's layers see only one direction
per package pair, and not a cycle inside one package)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "relayrl"


def module_files(root: Path) -> dict[str, Path]:
    """Every module under ``root``: dotted name (a package by its own name) -> file."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imported(tree: ast.Module, name: str, is_package: bool, modules: set[str]) -> set[str]:
    """The relayrl modules the module ``name`` imports anywhere in its source: ``from P
    import x`` names ``P.x`` when that is a module, else ``P``."""
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                child = f"{base}.{alias.name}"
                found.add(child if child in modules else base)
    return {m for m in found if m in modules and m != name}


def import_graph(root: Path) -> dict[str, set[str]]:
    files = module_files(root)
    names = set(files)
    graph = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        graph[name] = imported(tree, name, path.name == "__init__.py", names)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_no_import_cycle_between_relayrl_modules():
    assert cycles(import_graph(ROOT)) == []


def test_the_cycle_check_finds_a_cycle_behind_type_checking_and_a_deferred_one(tmp_path):
    pkg = tmp_path / "relayrl"
    (pkg / "launch").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launch" / "__init__.py").write_text("")
    (pkg / "launch" / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from relayrl.launch.b import B\n"
    )
    (pkg / "launch" / "b.py").write_text("from relayrl.launch.a import A\n")
    (pkg / "launch" / "c.py").write_text("def f():\n    from . import d\n")
    (pkg / "launch" / "d.py").write_text("from .c import f\n")
    (pkg / "launch" / "e.py").write_text("from relayrl.launch import a\n")
    assert cycles(import_graph(pkg)) == [
        ["relayrl.launch.a", "relayrl.launch.b"],
        ["relayrl.launch.c", "relayrl.launch.d"],
    ]
