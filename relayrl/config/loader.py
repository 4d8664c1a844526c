"""Load a run config: YAML file + dotted overrides (``optim.lr=1e-4``) -> validated RunConfig.

Errors name the file (and line), the key, the value and what was expected; unknown keys get
the nearest valid key as a suggestion. YAML anchors and aliases are refused (a few hundred
bytes of aliases expand to 10^9 nodes), and so is a file over 1 MiB: :class:`ConfigLoader`.
The plugins a config names are imported before its keys are checked: a plugin's loss or
advantage declares ``algo`` keys.
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from relayrl.config.schema import RunConfig, Section
from relayrl.errors import RelayError
from relayrl.models.gguf import is_gguf_spec, resolve_model_path
from relayrl.plugins import load_plugins


def _section_class(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _is_free_mapping(annotation: Any) -> bool:
    return annotation is dict or typing.get_origin(annotation) is dict


def section_fields(schema: type[BaseModel]) -> dict[str, FieldInfo]:
    """The keys ``schema`` accepts: a section's :meth:`Section.accepted_fields` (its fields;
    for ``algo``, with the keys the registered objectives declare), else the model's fields."""
    if issubclass(schema, Section):
        return schema.accepted_fields()
    return dict(schema.model_fields)


def valid_keys(schema: type[BaseModel] = RunConfig, prefix: str = "") -> list[str]:
    """Every dotted key the schema accepts (sections and leaves)."""
    keys = []
    for name, field in section_fields(schema).items():
        dotted = f"{prefix}{name}"
        keys.append(dotted)
        section = _section_class(field.annotation)
        if section is not None:
            keys.extend(valid_keys(section, dotted + "."))
    return keys


def _suggest(key: str) -> str:
    close = difflib.get_close_matches(key, valid_keys(), n=1, cutoff=0.5)
    if not close:  # compare the last segment within the same section
        parent, _, leaf = key.rpartition(".")
        siblings = [k for k in valid_keys() if k.rpartition(".")[0] == parent]
        leaf_match = difflib.get_close_matches(
            leaf, [s.rpartition(".")[2] for s in siblings], n=1, cutoff=0.5
        )
        close = [f"{parent}.{leaf_match[0]}" if parent else leaf_match[0]] if leaf_match else []
    return f"; did you mean '{close[0]}'?" if close else ""


# keys that no longer exist -> where their meaning went
REMOVED_KEYS = {
    "task.test_size": "it never set anything; the held-out problems are eval.num_problems "
    "(the final evaluation) and the first train.eval_problems of them (each periodic one)",
}


def _check_keys(data: dict, schema: type[BaseModel], prefix: str, where) -> None:
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if dotted in REMOVED_KEYS:
            raise RelayError(
                f"{where(dotted)}config key '{dotted}' was removed: {REMOVED_KEYS[dotted]}"
            )
        field = section_fields(schema).get(key) if isinstance(key, str) else None
        if field is None:
            raise RelayError(f"{where(dotted)}unknown config key '{dotted}'{_suggest(dotted)}")
        section = _section_class(field.annotation)
        if section is not None:
            if not isinstance(value, dict):
                raise RelayError(
                    f"{where(dotted)}config key '{dotted}' must be a mapping of "
                    f"{section.__name__} fields, got {value!r}"
                )
            _check_keys(value, section, dotted + ".", where)


def _key_lines(text: str) -> dict[str, int]:
    """1-based line of every dotted key in a YAML document."""
    lines: dict[str, int] = {}

    def walk(node: yaml.Node, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                dotted = f"{prefix}{key_node.value}"
                lines[dotted] = key_node.start_mark.line + 1
                walk(value_node, dotted + ".")

    root = yaml.compose(text, Loader=ConfigLoader)
    if root is not None:
        walk(root, "")
    return lines


MAX_CONFIG_BYTES = 1 << 20  # a run config is a few KiB


class NoAliasError(yaml.MarkedYAMLError):
    """A YAML anchor or alias (``&name`` / ``*name``, ``<<`` merges): refused."""


class ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader without anchors and aliases: a config never needs them, and an
    alias map ("billion laughs": nine levels of ten aliases each) expands to 10^9 nodes
    while the file stays a few hundred bytes. The first anchor or alias is an error at its
    line, before anything is expanded."""

    def compose_node(self, parent, index):  # type: ignore[override]
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
            raise NoAliasError(
                problem="YAML anchors and aliases (&name, *name, <<) are not supported in a "
                "config; write the values out",
                problem_mark=event.start_mark,
            )
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):  # type: ignore[override]
        """A key given twice in one mapping is an error at its second line: YAML keeps the
        last silently, so a harmless-looking ``plugins: []`` near the top could be
        overridden further down."""
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, str | int | float | bool) and key in seen:
                raise yaml.constructor.ConstructorError(
                    problem=f"key {key!r} appears twice (first at line {seen[key]}); "
                    "give each key once",
                    problem_mark=key_node.start_mark,
                )
            if isinstance(key, str | int | float | bool):
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str) -> Any:
    """``text`` parsed by :class:`ConfigLoader` (``yaml.YAMLError`` on bad input)."""
    return yaml.load(text, Loader=ConfigLoader)  # noqa: S506 - a SafeLoader subclass


def _config_text(p: Path) -> str:
    """The file's text: one error line for a file that cannot be read or is not UTF-8."""
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        line = p.read_bytes()[: exc.start].count(b"\n") + 1
        raise RelayError(
            f"{p}:{line}: config file is not UTF-8 text (byte {exc.object[exc.start]:#x}); "
            "expected a YAML file"
        ) from None
    except OSError as exc:
        raise RelayError(f"cannot read config file '{p}': {exc.strerror or exc}") from None


def read_yaml(path: str | Path) -> tuple[dict, dict[str, int]]:
    p = Path(path)
    if not p.is_file():
        hint = " (a KEY=VALUE override must come after the config file)" if "=" in str(p) else ""
        raise RelayError(f"config file '{p}' not found; expected a YAML file (see configs/){hint}")
    if p.stat().st_size > MAX_CONFIG_BYTES:
        raise RelayError(
            f"config file '{p}' is {p.stat().st_size} bytes; a run config is at most "
            f"{MAX_CONFIG_BYTES} (is it the right file?)"
        )
    text = _config_text(p)
    try:
        data = load_yaml(text)
        lines = _key_lines(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise RelayError(f"{p}{where}: config file is not valid YAML{at}: {problem}") from exc
    except RecursionError:
        raise RelayError(f"config file '{p}': nested too deeply to be a run config") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RelayError(
            f"config file '{p}' must hold a mapping of keys, got {type(data).__name__}"
        )
    return data, lines


LIST_INDEX = re.compile(r"\[(\d+)\]")  # eval.datasets[0].grader = eval.datasets.0.grader


def parse_override(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` as (dotted key, YAML value); ``[N]`` in the key is the part ``N``."""
    key, sep, raw = text.partition("=")
    key = LIST_INDEX.sub(r".\1", key.strip())
    if not sep or not key:
        hint = ""
        if text.endswith((".yaml", ".yml")):
            hint = f" (a config file: --config {text}, or first after `relayrl train`)"
        raise RelayError(f"bad override {text!r}; expected KEY=VALUE, e.g. sft.lr=1e-3{hint}")
    try:
        value = load_yaml(raw) if raw.strip() else ""
    except NoAliasError:
        raise RelayError(
            f"override {text!r}: YAML anchors and aliases are not supported; write the value out"
        ) from None
    except (yaml.YAMLError, RecursionError):
        value = raw
    return key, value


def _set_dotted(data: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The section class ``annotation`` holds: ``X`` or ``X | None``."""
    if _section_class(annotation) is not None:
        return annotation
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        models = [a for a in typing.get_args(annotation) if _section_class(a) is not None]
        return models[0] if len(models) == 1 else None
    return None


def _is_list(annotation: Any) -> bool:
    return typing.get_origin(annotation) is list


def _part_annotation(annotation: Any, part: str) -> Any:
    """The annotation of ``part`` inside a value of ``annotation``: a list's item, a
    section's field; None where the schema does not say (a free mapping's keys)."""
    if _is_list(annotation):
        return typing.get_args(annotation)[0]
    model = _model_of(annotation)
    field = section_fields(model).get(part) if model is not None else None
    return field.annotation if field is not None else None


def _as_mapping(value: Any, annotation: Any) -> dict:
    """``value``, found where a sub-key is set, as a mapping: a section's shorthand (a
    dataset's plain path) is what the section reads it as (``{data: PATH}``); anything else
    is replaced, and validation reports a wrong replacement."""
    model = _model_of(annotation)
    if value is None or model is None:
        return {}
    try:
        return model.model_validate(value).model_dump(exclude_unset=True)
    except ValidationError:
        return {}


def _list_index(items: list, part: str, key: str, dotted: str) -> int:
    """``part`` as an index of ``items`` (the list at ``dotted``); else an error."""
    if part.isdigit() and int(part) < len(items):
        return int(part)
    which = f"0 to {len(items) - 1}" if items else "none: it is empty"
    raise RelayError(
        f"override '{key}': '{dotted}' is a list; name an entry by its index ({which}), "
        f"e.g. {dotted}.0.KEY or {dotted}[0].KEY"
    )


def _apply_override(data: dict, key: str, value: Any) -> None:
    """Set the dotted ``key`` of one override in ``data`` (the config read so far). A part
    ``N`` under a list picks its entry (``eval.datasets.0.grader``); a section given by
    its shorthand (``rollout.dataset: FILE``) becomes its mapping before a sub-key is set,
    so ``rollout.dataset.prompt_field=q`` keeps the path."""
    parts = key.split(".")
    node: Any = data
    annotation: Any = RunConfig
    for depth, part in enumerate(parts):
        above = ".".join(parts[:depth])
        slot = _list_index(node, part, key, above) if isinstance(node, list) else part
        annotation = _part_annotation(annotation, part)
        if depth == len(parts) - 1:
            node[slot] = value
            return
        child = node[slot] if isinstance(node, list) else node.get(slot)
        if _is_list(annotation) and not isinstance(child, list):
            here = f"{above}.{part}" if above else part
            raise RelayError(
                f"override '{key}': '{here}' has no entries to set a key of; give the whole "
                f"list, e.g. {here}='[...]'"
            )
        if not isinstance(child, dict | list):
            child = node[slot] = _as_mapping(child, annotation)
        node = child


def _describe(annotation: Any) -> str:
    if typing.get_origin(annotation) is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(annotation))
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return " or ".join(_describe(a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def _field_annotation(loc: tuple) -> Any:
    schema: type[BaseModel] | None = RunConfig
    annotation = None
    for part in loc:
        fields = section_fields(schema) if schema is not None else {}
        if not isinstance(part, str) or part not in fields:
            break
        annotation = fields[part].annotation
        schema = _section_class(annotation)
    return annotation


def _error_text(err: dict, where) -> str:
    """One validation error: the key, its value and what was expected; a check across
    keys (a validator of a section or of the whole config) is its own message, which
    names the keys."""
    loc = tuple(p for p in err["loc"] if isinstance(p, str))
    dotted = ".".join(loc)
    annotation = _field_annotation(loc)
    if err["type"] == "value_error" and (not loc or _section_class(annotation) is not None):
        error = (err.get("ctx") or {}).get("error")
        return f"{where(dotted)}{error if error is not None else err['msg']}"
    return (
        f"{where(dotted)}config key '{dotted}' = {err.get('input')!r} is invalid: "
        f"{err['msg']} (expected {_describe(annotation)})"
    )


def _validation_message(exc: ValidationError, where) -> str:
    return "\n".join(_error_text(err, where) for err in exc.errors())


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    plugins: list[str] | None = None,
    resolve_model: bool = True,
) -> RunConfig:
    """Read ``path`` (or the defaults), apply ``overrides``, add ``plugins`` (``--plugin``)
    to the config's own and validate (the plugins are imported first: relayrl.plugins).
    ``resolve_model=False`` leaves a ``.gguf``/``pkg:`` ``model.path`` as written (no
    conversion, the package need not be installed): the schema alone is checked."""
    data, lines = read_yaml(path) if path is not None else ({}, {})
    override_keys: set[str] = set()

    def where(dotted: str) -> str:
        if dotted in override_keys:
            return f"override '{dotted}': "
        if not dotted and override_keys and path is None:
            return "overrides: "
        if path is not None:
            line = lines.get(dotted)
            return f"{path}:{line}: " if line else f"{path}: "
        return ""

    parsed = [parse_override(text) for text in overrides or []]
    _import_plugins_first(data, parsed, plugins)
    _check_keys(data, RunConfig, "", where)
    for key, value in parsed:
        override_keys.add(key)
        _check_keys(_nest(key, value), RunConfig, "", lambda _, k=key: f"override '{k}': ")
        _apply_override(data, key, value)
    if plugins:
        own = data.get("plugins") or []
        data["plugins"] = [*(own if isinstance(own, list) else [own]), *plugins]
    try:
        config = RunConfig.model_validate(data)
    except ValidationError as exc:
        raise RelayError(_validation_message(exc, where)) from None
    # a .gguf or pkg:NAME: its cached model directory
    if resolve_model and is_gguf_spec(config.model.path):
        key = f"{where('model.path')}model.path"
        config.model.path = resolve_model_path(config.model.path, key=key)
    return config


def _import_plugins_first(
    data: dict, overrides: list[tuple[str, Any]], plugins: list[str] | None
) -> None:
    """Import the plugins the file, a ``plugins=[...]`` override and ``--plugin`` name
    before any key is checked: a plugin's loss or advantage declares ``algo`` keys
    (relayrl.config.objectives). A list that is not one of names is left to validation."""
    named = [data.get("plugins"), *(v for k, v in overrides if k == "plugins"), plugins]
    lists = [group for group in named if isinstance(group, list)]
    specs = [spec for group in lists for spec in group]
    if specs and all(isinstance(spec, str) for spec in specs):
        load_plugins(specs)


def _nest(key: str, value: Any) -> dict:
    nested: dict = {}
    _set_dotted(nested, key, value)
    return nested


def save_config(config: RunConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))


# what a run leaves in its directory: one of these there means a run (started or done)
RUN_FILES = (
    "config.yaml",
    "metrics.jsonl",
    "train_summary.json",
    "sft_summary.json",
    "checkpoints",
)


def run_dir_of(config: RunConfig) -> Path:
    """``<output_dir>/<name>``."""
    return Path(config.output_dir) / config.name


def claim_run_dir(run_dir: Path, resume: bool = False, overwrite: bool = False) -> None:
    """Refuse to start a fresh run in ``run_dir`` when an earlier run is there, unless
    ``overwrite`` (``--overwrite``) or ``resume`` (``--resume``, which continues it).
    Touches nothing: call it after the new run's inputs validated, before anything is
    written into the directory."""
    if resume or overwrite or not run_dir.is_dir():
        return
    found = [name for name in RUN_FILES if (run_dir / name).exists()]
    if found:
        raise RelayError(
            f"run directory {str(run_dir)!r} already holds a run ({', '.join(found)}); "
            "nothing in it was changed. Continue it with --resume, replace it with "
            "--overwrite, or choose another name= / output_dir="
        )


def prepare_run_dir(config: RunConfig) -> Path:
    """Create ``<output_dir>/<name>/`` and write the resolved config into it."""
    run_dir = Path(config.output_dir) / config.name
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(config, run_dir / "config.yaml")
    except OSError as exc:
        raise RelayError(f"cannot write the run directory {str(run_dir)!r}: {exc}") from exc
    return run_dir
