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


# keys of a run's config that decide what code runs, and their harmless values: a run
# directory is data (copied, shared, downloaded), so what it says there is not obeyed on
# --resume unless the command line says it again
CODE_KEYS: dict[str, Any] = {
    "plugins": [],
    "sandbox.allow_unisolated": False,
    "rollout.vllm.python": None,
}


def resume_config(run_dir: str | Path, overrides: list[str]) -> Any:
    """The config of the run in ``run_dir`` (its saved ``config.yaml``) plus ``overrides``,
    with ``output_dir``/``name`` pointing at ``run_dir`` wherever it now lives. A saved
    value of one of :data:`CODE_KEYS` (plugins to import, the sandbox switched off, the
    interpreter of the vLLM servers) is refused, naming its line, unless an override sets
    that key again: nothing in the file runs before that."""
    from relayrl.config.loader import load_config, parse_override, read_yaml

    run = Path(run_dir)
    saved = run / "config.yaml"
    if not saved.is_file():
        raise RelayError(f"--resume {run_dir}: no config.yaml there (not a relayrl run directory)")
    data, lines = read_yaml(saved)
    confirmed = {parse_override(text)[0] for text in overrides}
    for key, harmless in CODE_KEYS.items():
        value = _dotted(data, key)
        if value not in (None, harmless) and key not in confirmed:
            line = lines.get(key)
            raise RelayError(
                f"{saved}{f':{line}' if line else ''}: {key}: {value!r} decides what code the "
                f"run executes; a run directory's config is not trusted for that on --resume. "
                f"If you trust it, say it again: relayrl train --resume {run_dir} "
                f"'{key}={_yaml_flow(value)}'"
            )
    location = [f"output_dir={run.resolve().parent}", f"name={run.name}"]
    return load_config(str(saved), [*overrides, *location])


def _dotted(data: dict, key: str) -> Any:
    for part in key.split("."):
        if not isinstance(data, dict):
            return None
        data = data.get(part)
    return data


def _yaml_flow(value: Any) -> str:
    return json.dumps(value)
