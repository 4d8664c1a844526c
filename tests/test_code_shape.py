"""The code-shape rules the project holds itself to, checked on relayrl/'s source with ast:
no function over :data:`MAX_LINES` lines unless its docstring says why (a line starting
with :data:`WHY`), and no parameter named ``config``/``cfg`` annotated ``Any`` (use
``RunConfig`` or the section's type)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "relayrl"
MAX_LINES = 80
WHY = "Why over 80 lines:"

Function = ast.FunctionDef | ast.AsyncFunctionDef


def functions(root: Path) -> list[tuple[str, Function]]:
    """Every function and method under ``root``, with ``path:line name``."""
    out = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, Function):
                out.append((f"{path.relative_to(root.parent)}:{node.lineno} {node.name}", node))
    return out


def long_functions(root: Path) -> list[str]:
    """Functions over :data:`MAX_LINES` lines whose docstring has no :data:`WHY` line."""
    found = []
    for where, node in functions(root):
        lines = node.end_lineno - node.lineno + 1
        doc = ast.get_docstring(node) or ""
        if lines > MAX_LINES and not any(x.strip().startswith(WHY) for x in doc.splitlines()):
            found.append(f"{where}: {lines} lines")
    return found


def config_any(root: Path) -> list[str]:
    """Parameters named ``config``/``cfg`` annotated ``Any``."""
    found = []
    for where, node in functions(root):
        args = node.args
        for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
            annotation = ast.unparse(arg.annotation) if arg.annotation is not None else ""
            if arg.arg in ("config", "cfg") and annotation in ("Any", "typing.Any"):
                found.append(f"{where}: {arg.arg}: {annotation}")
    return found


def test_no_function_over_80_lines_without_a_reason():
    long = long_functions(ROOT)
    assert not long, f"over {MAX_LINES} lines with no '{WHY} ...' docstring line:\n" + "\n".join(
        long
    )


def test_no_config_annotated_any():
    found = config_any(ROOT)
    assert not found, "config parameters annotated Any:\n" + "\n".join(found)


def test_the_checks_fire_on_a_sample(tmp_path):
    """An 81-line function is reported until its docstring says why; ``config: Any`` is
    reported, ``config: RunConfig`` is not."""
    package = tmp_path / "pkg"
    package.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(79))
    sample = package / "sample.py"
    sample.write_text(f'def f(config: Any, cfg: RunConfig):\n    """Short."""\n{body}\n')
    assert long_functions(package) == ["pkg/sample.py:1 f: 81 lines"]
    assert config_any(package) == ["pkg/sample.py:1 f: config: Any"]
    sample.write_text(f'def f():\n    """Short.\n\n    {WHY} a sample."""\n{body}\n')
    assert long_functions(package) == []


# packages whose code runs on the run's asyncio loop: a blocking sleep there stalls admission,
# the servers' clients and the watchdog together (issue 46: live.py slept 0.5 s in the loop)
EVENT_LOOP_PACKAGES = ("train/run", "rollout")


def blocking_sleeps(root: Path) -> list[str]:
    """``time.sleep(...)`` calls under ``root``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "time.sleep":
                found.append(f"{path.relative_to(root.parent)}:{node.lineno}")
    return found


def test_no_blocking_sleep_on_the_event_loop(tmp_path):
    found = [hit for pkg in EVENT_LOOP_PACKAGES for hit in blocking_sleeps(ROOT / pkg)]
    assert not found, "time.sleep in event-loop code (use await asyncio.sleep):\n" + "\n".join(
        found
    )
    sample = tmp_path / "loop"
    sample.mkdir()
    (sample / "m.py").write_text("import time\nasync def f():\n    time.sleep(1)\n")
    assert blocking_sleeps(sample) == ["loop/m.py:3"]
