"""How a `relayrl train` run starts: fresh, or continued from its newest checkpoint.

Owns: :func:`begin_run` (a fresh start clears an earlier run's checkpoints and summary; a
resume finds the newest checkpoint that verifies, refuses a finished run or one with no step
left, and cuts the logs back to it), :func:`truncate_logs` and :func:`resume_config` (the
saved ``config.yaml`` of a run directory plus overrides).

Logs: on resume ``metrics.jsonl`` keeps rows with ``step <= k`` (minus the final
evaluation) and ``samples.jsonl`` rows with ``step < k`` (0-based step of training), so
both continue without gaps or duplicates; a torn last line is dropped.

Imports: relayrl.train.checkpoint, relayrl.config (loader), relayrl.errors.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from relayrl.config.schema import RunConfig
from relayrl.errors import RelayError
from relayrl.metric_names import FINAL, STEP
from relayrl.train.checkpoint import Checkpoint, CheckpointStore

SUMMARY = "train_summary.json"


def begin_run(run_dir: Path, config: RunConfig, resume: bool) -> Checkpoint | None:
    """Prepare ``run_dir`` for training; returns the checkpoint to continue from, if any.

    Fresh start: checkpoints and the summary of an earlier run under this name are removed
    (the logs are rewritten anyway). Resume: the newest checkpoint that verifies, with the
    logs cut back to it; none yet means starting from step 0.
    """
    store = CheckpointStore(run_dir / "checkpoints", config.train.keep_checkpoints)
    if not resume:
        removed = store.clear()
        (run_dir / SUMMARY).unlink(missing_ok=True)
        if removed:
            print(f"note: removed {removed} checkpoint(s) of an earlier run in {run_dir}")
        return None
    if (run_dir / SUMMARY).exists():
        raise RelayError(f"{run_dir} already finished ({SUMMARY} exists); nothing to resume")
    ckpt = store.latest()
    if ckpt is None:
        print(f"resume: no checkpoint in {run_dir} yet, starting from step 0", flush=True)
        return None
    if ckpt.step >= config.train.total_steps:
        raise RelayError(
            f"checkpoint {ckpt.path} is at step {ckpt.step}, train.total_steps is "
            f"{config.train.total_steps}: nothing left to train"
        )
    truncate_logs(run_dir, ckpt.step)
    return ckpt


def _rewrite_jsonl(path: Path, keep: Callable[[dict[str, Any]], bool]) -> None:
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line torn by a crash mid-write
        if isinstance(row, dict) and keep(row):
            kept.append(line + "\n")
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.writelines(kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def truncate_logs(run_dir: Path, step: int) -> None:
    """Cut ``metrics.jsonl`` and ``samples.jsonl`` back to a checkpoint after ``step`` steps."""
    _rewrite_jsonl(
        run_dir / "metrics.jsonl",
        lambda row: not row.get(FINAL) and int(row.get(STEP, 0)) <= step,
    )
    _rewrite_jsonl(run_dir / "samples.jsonl", lambda row: int(row.get("step", 0)) < step)


def resume_config(run_dir: str | Path, overrides: list[str]) -> Any:
    """The config of the run in ``run_dir`` (its saved ``config.yaml``) plus ``overrides``,
    with ``output_dir``/``name`` pointing at ``run_dir`` wherever it now lives."""
    from relayrl.config.loader import load_config

    run = Path(run_dir)
    saved = run / "config.yaml"
    if not saved.is_file():
        raise RelayError(f"--resume {run_dir}: no config.yaml there (not a relayrl run directory)")
    location = [f"output_dir={run.resolve().parent}", f"name={run.name}"]
    return load_config(str(saved), [*overrides, *location])
