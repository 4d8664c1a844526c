"""The Python example under a heading of a doc page, imported as a user's module of its own
(outside the package), as the pages' tests do."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

DOCS = Path(__file__).resolve().parents[1] / "docs"


def doc_example(page: str, heading: str) -> str:
    """The first python block after ``heading`` in ``docs/<page>``, as written."""
    text = (DOCS / page).read_text()
    return text.split(heading, 1)[1].split("```python\n", 1)[1].split("```")[0]


def import_doc_example(page: str, heading: str, directory: Path, name: str) -> ModuleType:
    """:func:`doc_example` written to ``directory/<name>.py`` and imported as ``name``
    (in ``sys.modules``, where the caller removes it)."""
    path = directory / f"{name}.py"
    path.write_text(doc_example(page, heading))
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
