"""Reading a run directory's logs: ``metrics.jsonl`` and ``samples.jsonl``.

Owns: :class:`RunLogs`, :func:`numbered_jsonl`, :func:`read_jsonl`, :func:`load_run`. A torn
last line (a run killed mid-write) is ignored; any other bad line is an error naming the file
and line. Imports: the standard library and relayrl.errors only, so the trainer's replay
(``relayrl.train.run.recorded``) reads dumps with the same code.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from relayrl.errors import RelayError
from relayrl.metric_names import STEP


@dataclass
class RunLogs:
    """The rows of ``metrics.jsonl`` (one per step) and ``samples.jsonl`` (one per sample)."""

    metrics: list[dict]
    samples: list[dict]

    def series(self, key: str, x: str = STEP) -> tuple[list[float], list[float]]:
        rows = [m for m in self.metrics if key in m and x in m and m[key] is not None]
        return [r[x] for r in rows], [r[key] for r in rows]

    def has(self, key: str) -> bool:
        return any(key in m and m[key] is not None for m in self.metrics)


def numbered_jsonl(path: Path) -> Iterator[tuple[int, dict]]:
    """``(line number, row)`` of a JSONL file; a torn last line is ignored."""
    lines = path.read_text().splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(lines):
                return
            raise RelayError(f"{path}:{number}: not valid JSON ({exc.msg})") from exc
        if not isinstance(row, dict):
            raise RelayError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
        yield number, row


def read_jsonl(path: Path) -> list[dict]:
    """Rows of a JSONL file (none when it does not exist); a torn last line is ignored."""
    return [row for _, row in numbered_jsonl(path)] if path.is_file() else []


def load_run(run_dir: Path) -> RunLogs:
    """The logs of ``run_dir``; raises when it holds neither file."""
    if not run_dir.is_dir():
        raise RelayError(f"run directory {str(run_dir)!r} does not exist")
    logs = RunLogs(read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(run_dir / "samples.jsonl"))
    if not logs.metrics and not logs.samples:
        raise RelayError(f"{run_dir} has neither metrics.jsonl nor samples.jsonl to report on")
    return logs
