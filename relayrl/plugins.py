"""User code that registers tasks, graders, losses, advantages or workflows: plugins.

A plugin is a dotted module name (``my_pkg.rewards``, importable from ``sys.path``) or the
path of a ``.py`` file (``path/to/file.py``). ``plugins: [...]`` in a run config,
``--plugin`` on any ``relayrl`` command or the ``RELAYRL_PLUGINS`` environment variable (a
JSON list) name them; :func:`load_plugins` imports each once per process, before the run
config is validated, so the names they register are checked at load like the built-in ones.

Every process that looks a registered name up imports the same plugins: loading records the
resolved list in ``RELAYRL_PLUGINS``, which child processes inherit (rollout servers, grading
workers, trainer ranks, and the processes Ray actors start, which are passed it explicitly),
and their entry points call :func:`load_plugins_from_env`. A file plugin is imported under
its file name's stem (so objects it defines pickle by that name) and recorded by absolute
path, so children with another working directory find it.

Imports: the standard library and relayrl.errors only (every layer may use it).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
import traceback
from pathlib import Path
from types import ModuleType

ENV = "RELAYRL_PLUGINS"
_LOADED: dict[str, ModuleType] = {}  # resolved spec -> module


def resolve(spec: str) -> str:
    """A file plugin as an absolute path; a module name as is."""
    spec = str(spec).strip()
    if not spec:
        raise _error(spec, "a plugin needs a module name or a .py file path")
    if spec.endswith(".py") or os.sep in spec or "/" in spec:
        return str(Path(spec).expanduser().resolve())
    return spec


def _error(spec: str, message: str) -> Exception:
    from relayrl.errors import RelayError

    return RelayError(f"plugin {spec!r}: {message}")


def _import_file(path: str) -> ModuleType:
    file = Path(path)
    if not file.is_file():
        raise _error(path, "no such file (expected a .py file or an importable module name)")
    name = file.stem
    existing = sys.modules.get(name)
    if existing is not None:
        if Path(getattr(existing, "__file__", "") or "").resolve() == file:
            return existing
        raise _error(path, f"a module named {name!r} is already imported; rename the file")
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise _error(path, "cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _import(resolved: str) -> ModuleType:
    try:
        if resolved.endswith(".py") or os.sep in resolved:
            return _import_file(resolved)
        return importlib.import_module(resolved)
    except ModuleNotFoundError as exc:
        if exc.name and resolved.startswith(exc.name):
            raise _error(
                resolved, "no such module (expected an importable module name or a .py path)"
            ) from None
        raise _error(resolved, f"import failed: {exc}{_where(exc)}") from exc
    except SyntaxError as exc:
        at = f"{exc.filename}:{exc.lineno}: " if exc.filename and exc.lineno else ""
        raise _error(resolved, f"{at}syntax error: {exc.msg}") from exc
    except Exception as exc:
        if type(exc).__name__ == "RelayError":
            raise
        raise _error(resolved, f"import failed: {exc}{_where(exc)}") from exc


def _where(exc: BaseException) -> str:
    """`` (TYPE at FILE:LINE in FUNCTION)`` of the innermost frame that raised (the
    last frame outside Python's import machinery), so that one line names the place; the
    whole traceback is ``--debug``'s."""
    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if not f.filename.startswith("<frozen") and f.filename != __file__
    ]
    if not frames:
        return ""
    last = frames[-1]
    return f" ({type(exc).__name__} at {last.filename}:{last.lineno} in {last.name})"


def load_plugins(specs: list[str] | tuple[str, ...] | None) -> list[str]:
    """Import each plugin once in this process and add it to ``RELAYRL_PLUGINS`` (for child
    processes); returns the resolved specs (absolute paths for files), in order."""
    resolved = [resolve(spec) for spec in specs or []]
    for spec in resolved:
        if spec not in _LOADED:
            _LOADED[spec] = _import(spec)
    if resolved:
        known = env_plugins()
        os.environ[ENV] = json.dumps(known + [s for s in resolved if s not in known])
    return resolved


def env_plugins() -> list[str]:
    """The plugins ``RELAYRL_PLUGINS`` names (a JSON list of strings)."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return []
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        from relayrl.errors import RelayError

        raise RelayError(f"{ENV}={raw!r} must be a JSON list of module names or .py paths")
    return value


def load_plugins_from_env() -> list[str]:
    """The entry point of a child process: import the plugins its parent loaded."""
    return load_plugins(env_plugins())


def plugin_environment() -> dict[str, str]:
    """``{RELAYRL_PLUGINS: ...}`` when plugins are loaded: for processes started with an
    explicit environment (Ray actors' children)."""
    return {ENV: os.environ[ENV]} if os.environ.get(ENV) else {}
