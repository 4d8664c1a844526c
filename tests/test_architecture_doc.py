"""docs/architecture.md names only what exists, and states the layers the build enforces.

Every ``relayrl/...py`` path and every ``relayrl.x.y`` dotted name the page writes in code
(a code span or a fenced block) must resolve in the source, read with ``ast`` (nothing is
imported): the longest prefix that is a module, then names bound at its top level, then
names bound in a class body (methods, class attributes, dataclass fields) or assigned to
``self`` in its methods; a ``from relayrl... import name`` re-export is followed to its
source. The page's layer block (the fenced block of ``relayrl.`` lines) must be
import-linter's layers contract in pyproject.toml, top layer first, and every package's
``__init__`` docstring must say what it may import (``Imports: ...``) naming no package of
its own layer or above.

The checks are functions of the text, so the last tests show that each fails on a made-up
name, path or layer order, and on a docstring that names an upward import."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
LAYERS_CONTRACT = "relayrl layers: no upward imports"

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
SPAN = re.compile(r"(`+)(.+?)\1", re.S)
PATH = re.compile(r"(?<![\w/.-])relayrl/[\w/]+\.py\b")
DOTTED = re.compile(r"(?<![\w./-])relayrl(?:\.\w+)+")


def code_texts(markdown: str) -> list[str]:
    """The text of every fenced block and every code span outside them."""
    prose = FENCE.sub("", markdown)
    return FENCE.findall(markdown) + [text for _, text in SPAN.findall(prose)]


def named(markdown: str) -> tuple[set[str], set[str]]:
    """The ``relayrl/...py`` paths and the ``relayrl.x.y`` dotted names written in code."""
    texts = code_texts(markdown)
    paths = {p for text in texts for p in PATH.findall(text)}
    dotted = {d for text in texts for d in DOTTED.findall(PATH.sub("", text))}
    return paths, dotted


@dataclass(frozen=True)
class Reexport:
    """``from <module> import <name>`` at a module's top level."""

    module: str
    name: str


def module_file(root: Path, parts: list[str]) -> Path | None:
    """The file of the module ``parts`` (``["relayrl", "sync", "clock"]``) under ``root``."""
    base = root.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    anchor = package[: len(package) - node.level + 1]
    return ".".join([*anchor, *([node.module] if node.module else [])])


def _statements(body: list[ast.stmt]) -> list[ast.stmt]:
    """``body`` with the statements of its ``if``/``try`` blocks (``TYPE_CHECKING``, say)."""
    out: list[ast.stmt] = []
    for stmt in body:
        out.append(stmt)
        if isinstance(stmt, ast.If):
            out += _statements(stmt.body) + _statements(stmt.orelse)
        elif isinstance(stmt, ast.Try):
            for block in (stmt.body, stmt.orelse, stmt.finalbody):
                out += _statements(block)
            for handler in stmt.handlers:
                out += _statements(handler.body)
    return out


def _targets(stmt: ast.stmt) -> list[ast.expr]:
    if isinstance(stmt, ast.Assign):
        return stmt.targets
    if isinstance(stmt, ast.AnnAssign | ast.AugAssign):
        return [stmt.target]
    return []


def bindings(body: list[ast.stmt], module: str, is_package: bool) -> dict[str, object]:
    """The names ``body`` binds: name -> its class, function, assignment or re-export."""
    found: dict[str, object] = {}
    for stmt in _statements(body):
        if isinstance(stmt, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            found[stmt.name] = stmt
        elif isinstance(stmt, ast.ImportFrom):
            source = _absolute(stmt, module, is_package)
            for alias in stmt.names:
                found[alias.asname or alias.name] = Reexport(source, alias.name)
        elif isinstance(stmt, ast.Import):
            for alias in stmt.names:
                found[alias.asname or alias.name.split(".")[0]] = stmt
        for target in _targets(stmt):
            for name in ast.walk(target):
                if isinstance(name, ast.Name):
                    found[name.id] = stmt
    return found


def self_attributes(cls: ast.ClassDef) -> set[str]:
    """The attributes a class's methods assign on ``self``."""
    return {
        node.attr
        for node in ast.walk(cls)
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    }


@cache
def _parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def resolves(root: Path, dotted: str) -> bool:
    """Whether ``dotted`` names a module under ``root``, or a name bound in one (see the
    module docstring)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        path = module_file(root, parts[:cut])
        if path is not None:
            return _names_exist(root, path, ".".join(parts[:cut]), parts[cut:])
    return False


def _names_exist(root: Path, path: Path, module: str, names: list[str]) -> bool:
    scope: ast.Module | ast.ClassDef = _parsed(path)
    for i, name in enumerate(names):
        last = i == len(names) - 1
        node = bindings(scope.body, module, path.name == "__init__.py").get(name)
        if isinstance(node, Reexport):
            if node.module.startswith("relayrl."):
                return resolves(root, ".".join([node.module, node.name, *names[i + 1 :]]))
            return last
        if node is None:
            return last and isinstance(scope, ast.ClassDef) and name in self_attributes(scope)
        if not isinstance(node, ast.ClassDef):
            return last
        scope = node
    return True


def missing_names(markdown: str, root: Path) -> list[str]:
    """The paths and dotted names written in code in ``markdown`` that do not exist."""
    paths, dotted = named(markdown)
    gone = [p for p in paths if not (root / p).is_file()]
    gone += [d for d in dotted if not resolves(root, d)]
    return sorted(gone)


def layer_block(markdown: str) -> list[str]:
    """The lines of the first fenced block made only of ``relayrl.`` lines."""
    for body in FENCE.findall(markdown):
        lines = [line.strip() for line in body.splitlines() if line.strip()]
        if lines and all(line.startswith("relayrl.") for line in lines):
            return lines
    return []


def contract_layers(pyproject: Path) -> list[str]:
    """The layers of import-linter's layers contract, top layer first (read as text:
    ``tomllib`` needs Python 3.11, the project supports 3.10)."""
    text = pyproject.read_text()
    contract = text[text.index(f'name = "{LAYERS_CONTRACT}"') :]
    match = re.search(r"^layers = \[(.*?)^\]", contract, re.S | re.M)
    assert match is not None, "the layers contract has no layers list"
    return re.findall(r'"([^"]+)"', match.group(1))


def layer_of(layers: list[str]) -> dict[str, int]:
    """Each package or top-level module of the layers -> its layer's index (0: the top)."""
    return {name.strip(): i for i, layer in enumerate(layers) for name in layer.split("|")}


def imports_clause(docstring: str) -> str:
    """What follows ``Imports:`` up to ``never``, ``nor``, ``nothing`` or ``imported by``
    (the packages it may import); empty when there is no such line."""
    _, found, rest = docstring.partition("Imports:")
    return re.split(r"\b(?:never|nor|nothing|imported by)\b", rest)[0] if found else ""


def upward_imports(package: str, docstring: str, layers: list[str]) -> list[str]:
    """The packages the ``Imports:`` clause of ``package``'s docstring names that are in
    its own layer or above it (a sibling of its layer is independent of it)."""
    layer = layer_of(layers)
    named_packages = {".".join(d.split(".")[:2]) for d in DOTTED.findall(imports_clause(docstring))}
    return sorted(
        p for p in named_packages - {package} if layer.get(p, len(layers)) <= layer[package]
    )


def package_docstrings(root: Path) -> dict[str, str]:
    """``relayrl.<package>`` -> its ``__init__.py`` docstring, for each package."""
    return {
        f"relayrl.{init.parent.name}": ast.get_docstring(_parsed(init)) or ""
        for init in sorted((root / "relayrl").glob("*/__init__.py"))
    }


def test_every_name_the_page_writes_exists():
    markdown = DOC.read_text()
    paths, dotted = named(markdown)
    assert len(paths) + len(dotted) > 50, "the page should name the code it describes"
    assert missing_names(markdown, ROOT) == []


def test_the_page_states_the_layers_contract():
    assert layer_block(DOC.read_text()) == contract_layers(ROOT / "pyproject.toml")


def test_the_checks_fail_on_a_made_up_name_path_or_layer_order():
    page = (
        "`relayrl.sync.weight_sync.WeightSync.maybe_publish` publishes, "
        "`relayrl.sync.weight_sync.WeightSync.publish_now` does not exist, "
        "`relayrl.sync.clock.VersionClock` and `relayrl/sync/clock.py` do, "
        "`relayrl/sync/clocks.py` does not, `relayrl.sync.transports.WeightPublisher` is "
        "re-exported, `relayrl.sync.transports.WeightPublisher.send` is not defined, "
        "`relayrl.rollout.controller.RolloutController.published_version` is set in "
        "`__init__`, `relayrl.rollout.staleness` is no module.\n"
        "```\nrelayrl.cli\nrelayrl.train\n```\n"
    )
    assert missing_names(page, ROOT) == [
        "relayrl.rollout.staleness",
        "relayrl.sync.transports.WeightPublisher.send",
        "relayrl.sync.weight_sync.WeightSync.publish_now",
        "relayrl/sync/clocks.py",
    ]
    assert layer_block(page) == ["relayrl.cli", "relayrl.train"]
    assert layer_block(page) != contract_layers(ROOT / "pyproject.toml")


def test_every_package_docstring_says_what_it_may_import_and_names_no_upward_import():
    layers = contract_layers(ROOT / "pyproject.toml")
    docstrings = package_docstrings(ROOT)
    assert set(docstrings) <= set(layer_of(layers)), "a package outside the layers contract"
    assert [p for p, doc in docstrings.items() if not imports_clause(doc).strip()] == []
    assert {p: upward_imports(p, d, layers) for p, d in docstrings.items()} == {
        p: [] for p in docstrings
    }


def test_the_docstring_check_fails_on_an_upward_import():
    layers = contract_layers(ROOT / "pyproject.toml")
    before = (
        "Rollout controller.\n\nImports: relayrl.engine (client), relayrl.rewards, relayrl.config."
    )
    assert upward_imports("relayrl.rollout", before, layers) == ["relayrl.config"]
    sibling = "Imports: relayrl.models, relayrl.rewards.dispatch; nothing of relayrl.train."
    assert upward_imports("relayrl.engine", sibling, layers) == ["relayrl.rewards"]
    assert imports_clause("Owns: a table.") == ""
