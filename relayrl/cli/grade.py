"""``relayrl grade``: grade a predictions file against a dataset.

Predictions are JSONL rows ``{"id": ..., "completion": ...}`` (several rows may share an id,
e.g. K samples). Each valid row is graded in the grading pool; per-row verdicts go to
``--out`` as JSONL. Malformed rows and unknown ids are reported with their line numbers and
skipped; dataset ids with no prediction are reported. The last line printed is
``accuracy=0.xxxx``: the mean reward over the graded rows (missing ids are not counted).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from relayrl.cli.common import add_data_source_arguments, data_source
from relayrl.errors import RelayError

HELP = "grade a predictions JSONL file ({id, completion} rows) against a dataset"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", required=True, help="dataset name (gsm8k, math500, ...) or file")
    parser.add_argument("--predictions", required=True, type=Path, help="JSONL of {id, completion}")
    parser.add_argument("--out", type=Path, help="write per-row verdicts here (JSONL)")
    parser.add_argument("--data-root", type=Path, help="folder with the benchmark files")
    parser.add_argument("--workers", type=int, default=2, help="grading processes (default 2)")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per item")
    add_data_source_arguments(parser)


def read_predictions(path: Path, known: set[str]) -> tuple[list[tuple[int, str, str]], list[str]]:
    """Valid (line, id, completion) rows and one message per malformed row or unknown id."""
    rows: list[tuple[int, str, str]] = []
    problems: list[str] = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise RelayError(f"cannot read predictions {path}: {exc.strerror or exc}") from exc
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            problems.append(f"{path}:{lineno}: malformed row (bad JSON: {exc.msg})")
            continue
        if (
            not isinstance(row, dict)
            or "id" not in row
            or not isinstance(row.get("completion"), str)
        ):
            problems.append(
                f'{path}:{lineno}: malformed row (expected {{"id", "completion": str}})'
            )
            continue
        pid = str(row["id"])
        if pid not in known:
            problems.append(f"{path}:{lineno}: unknown id {pid!r}")
            continue
        rows.append((lineno, pid, row["completion"]))
    return rows, problems


def run(args: argparse.Namespace) -> int:
    from relayrl.eval.sets import load_source
    from relayrl.rewards.pool import GradingPool
    from relayrl.tasks.datasets import FLAGS

    problems = load_source(data_source(args), FLAGS, "test", data_root=args.data_root)
    by_id = {p.id: p for p in problems}
    graders = sorted({p.grader for p in problems})
    how = "as given" if args.grader else "recognised from the dataset"
    print(f"grading {args.data} with grader {', '.join(graders)} ({how})", file=sys.stderr)
    rows, issues = read_predictions(args.predictions, set(by_id))
    for message in issues:
        print(message, file=sys.stderr)
    missing = sorted(set(by_id) - {pid for _, pid, _ in rows})
    if missing:
        shown = ", ".join(missing[:10]) + (" ..." if len(missing) > 10 else "")
        print(
            f"missing predictions for {len(missing)} of {len(by_id)} ids: {shown}", file=sys.stderr
        )
    if not rows:
        raise RelayError(f"{args.predictions} has no gradable rows")
    probe = "code" in graders  # a sandbox that cannot isolate stops here, loudly
    with GradingPool(workers=args.workers, timeout_s=args.timeout, probe_sandbox=probe) as pool:
        results = pool.grade_batch([(by_id[pid], completion) for _, pid, completion in rows])
        stats = pool.stats()
    _write_verdicts(args.out, rows, results)
    accuracy = sum(r.reward for r in results) / len(results)
    print(
        f"graded={len(results)} correct={int(sum(r.reward for r in results))} "
        f"malformed_or_unknown={len(issues)} missing={len(missing)} "
        f"errors={stats['error']} timeouts={stats['timeout']} crashes={stats['crash']}"
    )
    print(f"accuracy={accuracy:.4f}")
    return 0


def _write_verdicts(out: Path | None, rows: list[tuple[int, str, str]], results: list[Any]) -> None:
    if out is None:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as handle:
        for (lineno, pid, _), result in zip(rows, results, strict=True):
            record = {
                "id": pid,
                "line": lineno,
                "correct": result.reward > 0,
                "reward": result.reward,
                "status": result.status,
                "detail": result.detail,
                **{k: v for k, v in result.info.items() if k in ("extracted", "method", "status")},
            }
            handle.write(json.dumps(record) + "\n")
