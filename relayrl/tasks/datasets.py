"""Real benchmark and user datasets as lists of :class:`~relayrl.tasks.base.Problem`.

Sources, in the order :func:`load_problems` tries them:

1. a known name — ``gsm8k``, ``math500``, ``aime24``, ``aime25``, ``humaneval``,
   ``math_train`` (plus ``gsm8k_train``) — read from a local JSONL file under the data root:
   ``$RELAYRL_DATA`` if set, else ``../shared/data`` next to the repository;
2. a path to a ``.jsonl`` / ``.parquet`` file, or to a directory that
   ``datasets.Dataset.save_to_disk`` (or ``DatasetDict.save_to_disk``: the ``split`` asked
   for) wrote, whose fields are named by a :class:`FieldMap`; its grader is the one named,
   else recognised from its rows (:func:`detect_grader`);
3. ``hub:<name>`` — a Hugging Face hub dataset through ``datasets.load_dataset`` (imported
   only then; for users online).

Each known dataset has a prompt template (GSM8K asks for a final ``#### N`` line, MATH and
AIME for ``\\boxed{}``, HumanEval for the completed function) and math extraction settings
stored in ``Problem.meta['math']``; the chat template is applied later by
``relayrl.models.loading.encode_prompt``. A template names the row's columns as ``{column}``
(``{problem}``: the prompt field's text): :func:`render_template`. Every problem keeps its
whole row in ``meta['row']`` (``Problem.row``), so a grader can read the other columns.
Errors name the file, the line, the config key when one is given and what was expected.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relayrl.errors import RelayError
from relayrl.tasks.base import Problem

GSM8K_TEMPLATE = (
    "{problem}\n\nSolve the problem step by step. On the last line write the final answer "
    "as '#### N', where N is a number."
)
BOXED_TEMPLATE = (
    "{problem}\n\nPlease reason step by step, and put your final answer within \\boxed{}."
)
CODE_TEMPLATE = (
    "Complete the following Python function. Reply with the whole function in one "
    "```python code block.\n\n```python\n{problem}```"
)
PLAIN_TEMPLATE = "{problem}"


@dataclass(frozen=True)
class FieldMap:
    """Which row fields hold the id, the prompt and the gold answer (``id=None``: line ids;
    ``id_if_present``: the id column may be absent from every row, then line ids too)."""

    id: str | None = "id"
    prompt: str = "prompt"
    answer: str = "answer"
    id_if_present: bool = False


@dataclass(frozen=True)
class DatasetSpec:
    """A known dataset: its file under the data root and how to turn rows into problems."""

    path: str
    fields: FieldMap
    template: str
    grader: str = "math"
    math: dict[str, Any] = field(default_factory=dict)
    meta_fields: tuple[str, ...] = ()


_HASH_FIRST = {"modes": ["hash", "boxed", "answer_is"]}
_BOXED_FIRST = {"modes": ["boxed", "answer_is", "hash"]}

DATASETS: dict[str, DatasetSpec] = {
    "gsm8k": DatasetSpec(
        "gsm8k/test.jsonl", FieldMap(prompt="question"), GSM8K_TEMPLATE, math=_HASH_FIRST
    ),
    "gsm8k_train": DatasetSpec(
        "gsm8k/train.jsonl", FieldMap(prompt="question"), GSM8K_TEMPLATE, math=_HASH_FIRST
    ),
    "math500": DatasetSpec(
        "math500/test.jsonl",
        FieldMap(prompt="problem"),
        BOXED_TEMPLATE,
        math=_BOXED_FIRST,
        meta_fields=("subject", "level"),
    ),
    "aime24": DatasetSpec(
        "aime24/test.jsonl", FieldMap(prompt="problem"), BOXED_TEMPLATE, math=_BOXED_FIRST
    ),
    "aime25": DatasetSpec(
        "aime25/test.jsonl", FieldMap(prompt="problem"), BOXED_TEMPLATE, math=_BOXED_FIRST
    ),
    "math_train": DatasetSpec(
        "math_train/train.jsonl",
        FieldMap(prompt="problem"),
        BOXED_TEMPLATE,
        math=_BOXED_FIRST,
        meta_fields=("type", "difficulty"),
    ),
    "humaneval": DatasetSpec(
        "humaneval/test.jsonl",
        FieldMap(prompt="prompt", answer="canonical_solution"),
        CODE_TEMPLATE,
        grader="code",
        meta_fields=("prompt", "test", "entry_point"),
    ),
}


def default_data_root() -> Path:
    """``$RELAYRL_DATA`` if set, else ``../shared/data`` next to the repository."""
    env = os.environ.get("RELAYRL_DATA")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2].parent / "shared" / "data"


def dataset_path(name: str, data_root: str | Path | None = None) -> Path:
    """The local file of a known dataset."""
    return Path(data_root or default_data_root()) / _spec(name).path


def _spec(name: str) -> DatasetSpec:
    if name not in DATASETS:
        close = difflib.get_close_matches(name, DATASETS, n=1, cutoff=0.5)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise RelayError(
            f"unknown dataset {name!r}{hint}; expected one of {sorted(DATASETS)}, "
            "a path to a .jsonl/.parquet file, or hub:<name>"
        )
    return DATASETS[name]


def iter_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(1-based line number, row) for each non-blank line; bad JSON raises with the line."""
    try:
        handle = path.open("rb")
    except OSError as exc:
        raise RelayError(f"cannot read {path}: {exc.strerror or exc}") from exc
    with handle:
        for lineno, raw in enumerate(handle, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise RelayError(
                    f"{path}:{lineno}: not UTF-8 text (byte {raw[exc.start]:#x} at column "
                    f"{exc.start + 1}); expected one JSON object per line"
                ) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise RelayError(
                    f"{path}:{lineno}: bad JSON ({exc.msg}); expected one JSON object per line"
                ) from exc
            if not isinstance(row, dict):
                raise RelayError(
                    f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}"
                )
            yield lineno, row


def _iter_parquet(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise RelayError(f"reading {path} needs pyarrow: pip install pyarrow") from exc
    try:
        table = pq.read_table(path)
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise RelayError(f"{path}: not a readable parquet file ({exc})") from None
    yield from enumerate(table.to_pylist(), 1)


ROLE_KEYS = {"id": "id_field", "prompt": "prompt_field", "answer": "answer_field"}
FLAGS = "--"  # ``key`` of settings given as command-line flags (``relayrl eval``, ``grade``)


def setting_name(key: str | None, option: str) -> str:
    """How an error names the setting ``option`` (``answer_field``, ``template``, ...) of
    the dataset that ``key`` named: ``KEY.option`` for a config key (``rollout.dataset``),
    the flag ``--answer-field`` for :data:`FLAGS`, ``option`` alone for no key."""
    if key == FLAGS:
        return FLAGS + option.replace("_", "-")
    return f"{key}.{option}" if key else option


def _did_you_mean(name: str, columns: Iterable[Any]) -> str:
    close = difflib.get_close_matches(name, [str(c) for c in columns], n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _missing_column(row: dict[str, Any], name: str, where: str, key: str | None, role: str) -> str:
    """The error for a row without column ``name``; ``key`` (a config key such as
    ``rollout.dataset``, or :data:`FLAGS`) names the setting that chose it."""
    hint = _did_you_mean(name, row)
    if key is None:
        return f"{where}: row missing field {name!r} (fields present: {sorted(row)}){hint}"
    return (
        f"{where}: {setting_name(key, role)}={name!r}: no such column; "
        f"the row's columns: {sorted(row)}{hint}"
    )


def _text_field(
    row: dict[str, Any], name: str, where: str, key: str | None = None, role: str = ""
) -> str:
    if name not in row or row[name] is None:
        raise RelayError(_missing_column(row, name, where, key, role or name))
    value = row[name]
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise RelayError(f"{where}: field {name!r} should be text, got {type(value).__name__}")
    return str(value)


COLUMN_REF = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
PROBLEM_REF = "problem"  # {problem} in a template: the prompt field's text


def template_columns(template: str) -> list[str]:
    """The names a template refers to as ``{name}`` (other braces are plain text)."""
    return COLUMN_REF.findall(template)


def _cell_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def render_template(
    template: str, row: dict[str, Any], raw: str, where: str, key: str | None = None
) -> str:
    """``template`` with ``{problem}`` replaced by ``raw`` and every other ``{column}`` by the
    row's value (text as is, anything else as JSON); in one pass, so a value is never
    substituted into. A name the row lacks is an error naming it and the row's columns."""

    def value(match: re.Match[str]) -> str:
        name = match.group(1)
        if name == PROBLEM_REF:
            return raw
        if name not in row:
            raise RelayError(
                f"{where}: {setting_name(key, 'template')} names column {{{name}}}, which the "
                f"row lacks; the row's columns: {sorted(row)} ({{problem}} is the prompt "
                f"field's text){_did_you_mean(name, row)}"
            )
        return _cell_text(row[name])

    return COLUMN_REF.sub(value, template)


def rows_to_problems(
    rows: Iterable[tuple[int, dict[str, Any]]],
    source: str,
    *,
    fields: FieldMap,
    template: str,
    grader: str,
    math: dict[str, Any] | None = None,
    meta_fields: Iterable[str] = (),
    dataset: str = "",
    key: str | None = None,
) -> list[Problem]:
    """Problems from (line number, row) pairs; errors say ``source:line`` (and ``key``, the
    config key of the dataset, when given). The prompt field is needed only when the
    template uses ``{problem}``."""
    problems: list[Problem] = []
    seen: dict[str, int] = {}
    meta_fields = tuple(meta_fields)
    needs_prompt = PROBLEM_REF in template_columns(template)
    for lineno, row in rows:
        where = f"{source}:{lineno}"
        pid = _row_id(row, fields, where, key, f"{dataset or 'row'}-{lineno}")
        if pid in seen:
            raise RelayError(f"{where}: duplicate id {pid!r} (first on line {seen[pid]})")
        seen[pid] = lineno
        raw = _text_field(row, fields.prompt, where, key, "prompt_field") if needs_prompt else ""
        answer = _text_field(row, fields.answer, where, key, "answer_field")
        prompt = render_template(template, row, raw, where, key)
        meta: dict[str, Any] = {"dataset": dataset, "raw_prompt": raw or prompt, "row": row}
        for name in meta_fields:
            if name not in row:
                raise RelayError(f"{where}: row missing field {name!r} needed by grader {grader!r}")
            meta[name] = row[name]
        if math:
            meta["math"] = dict(math)
        problems.append(Problem(pid, prompt, answer, grader, meta))
    return problems


def _row_id(
    row: dict[str, Any], fields: FieldMap, where: str, key: str | None, line_id: str
) -> str:
    """The row's id: its id column, else (``fields.id`` None) ``line_id``."""
    if fields.id is None:
        return line_id
    return _text_field(row, fields.id, where, key, "id_field")


def load_problems(
    source: str,
    *,
    data_root: str | Path | None = None,
    fields: FieldMap | None = None,
    template: str | None = None,
    grader: str | None = None,
    math: dict[str, Any] | None = None,
    split: str = "test",
    limit: int | None = None,
    key: str | None = None,
) -> list[Problem]:
    """Problems from a known dataset name, a local file, or ``hub:<name>``.

    ``template`` overrides the prompt template (``{problem}``: the prompt field's text,
    ``{column}``: the row's column, :func:`render_template`); ``fields`` names the
    id/prompt/answer fields of user files (default :data:`USER_FIELDS`: ``id`` when the rows
    have it, ``prompt``, ``answer``); ``math`` overrides extraction settings (see
    ``MathGradeConfig``); ``limit`` keeps the first N problems; ``key``, the config key
    that named the dataset (:data:`FLAGS`: command-line flags), goes into the errors about
    its columns (:func:`setting_name`).
    """
    user = RowFormat(fields or USER_FIELDS, template, grader, math, key)  # a user file's rows
    if source.startswith("hub:"):
        problems = _load_hub(source[4:], split, user)
    elif source in DATASETS:
        spec = DATASETS[source]
        path = dataset_path(source, data_root)
        if not path.is_file():
            raise RelayError(
                f"dataset {source!r} expects its file at {path}; set RELAYRL_DATA or --data-root "
                f"to the folder holding the benchmark files ({spec.path} under it; samples of "
                "each in the repository's tests/fixtures/data)"
            )
        problems = rows_to_problems(
            iter_jsonl(path),
            str(path),
            fields=fields or spec.fields,
            template=template if template is not None else spec.template,
            grader=grader or spec.grader,
            math=spec.math if math is None else math,
            meta_fields=spec.meta_fields,
            dataset=source,
            key=key,
        )
    elif Path(source).is_dir():
        problems = _load_saved(Path(source), split, user)
    elif Path(source).suffix in (".jsonl", ".json", ".parquet") or Path(source).exists():
        problems = _load_file(Path(source), user)
    else:
        _spec(source)  # raises with a suggestion
        raise AssertionError("unreachable")
    return problems[:limit] if limit is not None else problems


# Row schemas a user file is recognised by when no grader is named (first match wins).
GRADER_SCHEMAS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("code", ("prompt", "test", "entry_point")),  # HumanEval / MBPP-style rows
    ("countdown", ("numbers", "target")),
)
META_FIELDS = {"code": ("prompt", "test", "entry_point"), "countdown": ("numbers", "target")}


def detect_grader(
    row: dict[str, Any], fields: FieldMap, source: str, key: str | None = None
) -> str:
    """The grader a user file's rows call for, from the fields of its first row: a
    recognised schema (:data:`GRADER_SCHEMAS`), else ``math`` when the row has the answer
    field. Anything else is an error asking for an explicit grader: a file is never graded
    by the math grader just because nothing else was said."""
    for grader, required in GRADER_SCHEMAS:
        if all(key in row for key in required):
            return grader
    if fields.answer in row or fields.answer != FieldMap.answer:
        return "math"  # a named answer column the row lacks: the error names it
    grader, answer = setting_name(key, "grader"), setting_name(key, "answer_field")
    raise RelayError(
        f"{source}: cannot tell which grader its rows need (no column {fields.answer!r}; "
        f"columns {sorted(row)}); name one ({grader}: math|exact|code|countdown|a plugin's) "
        f"or the answer column ({answer})"
    )


@dataclass(frozen=True)
class RowFormat:
    """How a user's rows become problems: the field names, the prompt template and the
    grader (None: detected from the rows), math settings (None: the grader's default) and
    the config key that named the rows (for errors, :func:`setting_name`; :data:`FLAGS`:
    command-line flags; None: neither)."""

    fields: FieldMap
    template: str | None = None
    grader: str | None = None
    math: dict[str, Any] | None = None
    key: str | None = None


USER_FIELDS = FieldMap(id_if_present=True)
# graders that read the final answer with the math extraction rules (boxed first)
EXTRACTING_GRADERS = ("math", "exact")


def _user_rows(
    rows: Iterable[tuple[int, dict[str, Any]]], source: str, fmt: RowFormat
) -> tuple[list[tuple[int, dict[str, Any]]], str, FieldMap]:
    """The rows of a user file, its grader (``fmt.grader`` if given, else detected) and its
    fields (an optional id column the first row lacks: line ids)."""
    rows = list(rows)
    grader, fields = fmt.grader, fmt.fields
    if grader is None:
        if not rows:
            raise RelayError(f"{source} has no rows")
        grader = detect_grader(rows[0][1], fields, f"{source}:{rows[0][0]}", fmt.key)
    if fields.id_if_present and rows and fields.id not in rows[0][1]:
        fields = FieldMap(None, fields.prompt, fields.answer)
    return rows, grader, fields


def _load_user_rows(
    rows: Iterable[tuple[int, dict[str, Any]]], source: str, dataset: str, fmt: RowFormat
) -> list[Problem]:
    rows, grader, fields = _user_rows(rows, source, fmt)
    math = fmt.math
    if math is None and grader in EXTRACTING_GRADERS:
        math = _BOXED_FIRST
    return rows_to_problems(
        rows,
        source,
        fields=fields,
        template=fmt.template or PLAIN_TEMPLATE,
        grader=grader,
        math=math,
        meta_fields=META_FIELDS.get(grader, ()),
        dataset=dataset,
        key=fmt.key,
    )


def _load_file(path: Path, fmt: RowFormat) -> list[Problem]:
    if not path.is_file():
        raise RelayError(f"dataset file {path} does not exist")
    rows = _iter_parquet(path) if path.suffix == ".parquet" else iter_jsonl(path)
    return _load_user_rows(rows, str(path), path.stem, fmt)


def _datasets_package(what: str) -> Any:
    """The optional ``datasets`` package, or an error saying ``what`` needs it."""
    try:
        import datasets
    except ImportError as exc:
        raise RelayError(f"{what} needs the 'datasets' package: pip install datasets") from exc
    return datasets


def _table_rows(table: Any) -> Iterator[tuple[int, dict[str, Any]]]:
    return ((i, dict(row)) for i, row in enumerate(table, 1))


def saved_splits(path: str | Path) -> list[str] | None:
    """The splits of a directory ``DatasetDict.save_to_disk`` wrote (its
    ``dataset_dict.json``), without importing ``datasets``; None for anything else."""
    index = Path(path) / "dataset_dict.json"
    try:
        splits = json.loads(index.read_text(encoding="utf-8")).get("splits")
    except (OSError, ValueError, AttributeError):
        return None
    return [str(s) for s in splits] if isinstance(splits, list) else None


def _load_saved(path: Path, split: str, fmt: RowFormat) -> list[Problem]:
    """A directory written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``
    (then its ``split``), read with ``datasets.load_from_disk``: no network."""
    datasets = _datasets_package(f"reading {path}")
    try:
        table = datasets.load_from_disk(str(path))
    except FileNotFoundError as exc:
        raise RelayError(
            f"{path} is a directory but not a saved dataset ({exc}); expected what "
            "datasets' save_to_disk writes, or a .jsonl / .parquet file"
        ) from None
    source = str(path)
    if isinstance(table, datasets.DatasetDict):
        if split not in table:
            raise RelayError(f"{path} has splits {sorted(table)}, not {split!r}")
        table, source = table[split], f"{path}[{split}]"
    return _load_user_rows(_table_rows(table), source, path.name, fmt)


def _load_hub(name: str, split: str, fmt: RowFormat) -> list[Problem]:
    datasets = _datasets_package(f"hub:{name}")  # for users online
    try:
        table = datasets.load_dataset(name, split=split)
    except Exception as exc:  # network, missing dataset, bad split: all user-facing
        raise RelayError(f"could not load hub dataset {name!r} split {split!r}: {exc}") from exc
    return _load_user_rows(_table_rows(table), f"hub:{name}[{split}]", name, fmt)
