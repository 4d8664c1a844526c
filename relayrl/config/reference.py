"""Generate the config reference (docs/config.md) from the schema, so the docs match the code."""

from __future__ import annotations

import json

from pydantic import BaseModel

from relayrl.config.loader import _describe, _section_class, section_fields
from relayrl.config.schema import RunConfig

HEADER = """# Config reference

Generated from `relayrl/config/schema.py` by `relayrl config --reference` (a test checks that
this file is current). Every key can be set in a YAML file or overridden on the command line
with a dotted path, e.g. `relayrl sft configs/sft.yaml sft.lr=1e-3 task.params.max_steps=6`.
Unknown keys are rejected with the nearest valid key suggested.
"""


def _default(field) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
        if isinstance(value, BaseModel):
            return "(section)"
    else:
        value = field.default
    return f"`{json.dumps(value)}`"


def _rows(schema: type[BaseModel], prefix: str) -> tuple[list[str], list[tuple[str, type]]]:
    rows, sections = [], []
    for name, field in section_fields(schema).items():
        section = _section_class(field.annotation)
        if section is not None:
            sections.append((f"{prefix}{name}", section))
            continue
        description = (field.description or "").replace("|", "\\|")
        kind = _describe(field.annotation).replace("|", "\\|")
        rows.append(f"| `{prefix}{name}` | {kind} | {_default(field)} | {description} |")
    return rows, sections


def config_reference() -> str:
    out = [HEADER]
    pending: list[tuple[str, type[BaseModel]]] = [("", RunConfig)]
    while pending:
        prefix, schema = pending.pop(0)
        rows, sections = _rows(schema, f"{prefix}." if prefix else "")
        title = f"`{prefix}`" if prefix else "top level"
        doc = " ".join((schema.__doc__ or "").strip().split("\n\n")[0].split())
        out.append(f"\n## {title}\n")
        if doc and prefix:
            out.append(f"{doc}\n")
        out.append("| key | type | default | description |\n| --- | --- | --- | --- |")
        out.extend(rows)
        pending.extend(sections)
    return "\n".join(out) + "\n"
