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
``relayrl.models.loading.encode_prompt``. Errors name the file, the line and what was expected.
"""

from __future__ import annotations

import difflib
import json
import os
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
    """Which row fields hold the id, the prompt and the gold answer (``id=None``: line ids)."""

    id: str | None = "id"
    prompt: str = "prompt"
    answer: str = "answer"


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
        handle = path.open(encoding="utf-8")
    except OSError as exc:
        raise RelayError(f"cannot read {path}: {exc.strerror or exc}") from exc
    with handle:
        for lineno, line in enumerate(handle, 1):
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
    yield from enumerate(pq.read_table(path).to_pylist(), 1)


def _text_field(row: dict[str, Any], name: str, where: str) -> str:
    if name not in row or row[name] is None:
        raise RelayError(f"{where}: row missing field {name!r} (fields present: {sorted(row)})")
    value = row[name]
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise RelayError(f"{where}: field {name!r} should be text, got {type(value).__name__}")
    return str(value)


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
) -> list[Problem]:
    """Problems from (line number, row) pairs; errors say ``source:line``."""
    problems: list[Problem] = []
    seen: dict[str, int] = {}
    meta_fields = tuple(meta_fields)
    for lineno, row in rows:
        where = f"{source}:{lineno}"
        pid = _text_field(row, fields.id, where) if fields.id else f"{dataset or 'row'}-{lineno}"
        if pid in seen:
            raise RelayError(f"{where}: duplicate id {pid!r} (first on line {seen[pid]})")
        seen[pid] = lineno
        raw = _text_field(row, fields.prompt, where)
        answer = _text_field(row, fields.answer, where)
        meta: dict[str, Any] = {"dataset": dataset, "raw_prompt": raw}
        for key in meta_fields:
            if key not in row:
                raise RelayError(f"{where}: row missing field {key!r} needed by grader {grader!r}")
            meta[key] = row[key]
        if math:
            meta["math"] = dict(math)
        problems.append(Problem(pid, template.replace("{problem}", raw), answer, grader, meta))
    return problems


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
) -> list[Problem]:
    """Problems from a known dataset name, a local file, or ``hub:<name>``.

    ``template`` overrides the prompt template (``{problem}`` is replaced by the raw text);
    ``fields`` names the id/prompt/answer fields of user files (default ``id``, ``prompt``,
    ``answer``); ``math`` overrides extraction settings (see ``MathGradeConfig``);
    ``limit`` keeps the first N problems.
    """
    user = RowFormat(fields or FieldMap(), template, grader, math)  # a user file's rows
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


def detect_grader(row: dict[str, Any], fields: FieldMap, source: str) -> str:
    """The grader a user file's rows call for, from the fields of its first row: a
    recognised schema (:data:`GRADER_SCHEMAS`), else ``math`` when the row has the answer
    field. Anything else is an error asking for an explicit grader: a file is never graded
    by the math grader just because nothing else was said."""
    for grader, required in GRADER_SCHEMAS:
        if all(key in row for key in required):
            return grader
    if fields.answer in row:
        return "math"
    raise RelayError(
        f"{source}: cannot tell which grader its rows need (fields {sorted(row)}); name one "
        f"(--grader math|code|countdown) or the answer field (--answer-field)"
    )


def _user_rows(
    rows: Iterable[tuple[int, dict[str, Any]]], source: str, fields: FieldMap, grader: str | None
) -> tuple[list[tuple[int, dict[str, Any]]], str]:
    """The rows of a user file and its grader (``grader`` if given, else detected)."""
    rows = list(rows)
    if grader is None:
        if not rows:
            raise RelayError(f"{source} has no rows")
        grader = detect_grader(rows[0][1], fields, f"{source}:{rows[0][0]}")
    return rows, grader


@dataclass(frozen=True)
class RowFormat:
    """How a user's rows become problems: the field names, the prompt template and the
    grader (None: detected from the rows) and math settings (None: the grader's default)."""

    fields: FieldMap
    template: str | None = None
    grader: str | None = None
    math: dict[str, Any] | None = None


def _load_user_rows(
    rows: Iterable[tuple[int, dict[str, Any]]], source: str, dataset: str, fmt: RowFormat
) -> list[Problem]:
    rows, grader = _user_rows(rows, source, fmt.fields, fmt.grader)
    math = fmt.math if fmt.math is not None else (_BOXED_FIRST if grader == "math" else None)
    return rows_to_problems(
        rows,
        source,
        fields=fmt.fields,
        template=fmt.template or PLAIN_TEMPLATE,
        grader=grader,
        math=math,
        meta_fields=META_FIELDS.get(grader, ()),
        dataset=dataset,
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
