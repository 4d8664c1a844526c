"""The report's summary table and per-step table.

Owns: :func:`read_config` (a run directory's ``config.yaml`` as a plain dict),
:func:`summary_rows` (config highlights, held-out pass@1, time, throughput) and
:func:`step_rows` (one row per training step, linked to the inspector). Imports: PyYAML, the
standard library, relayrl.metric_names and relayrl.report.logs (no config schema: a report
reads any run directory as data).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from relayrl.metric_names import (
    COMPLETED_CORRECT,
    ELAPSED_S,
    EVAL_PASS_AT_1,
    FINAL,
    GEN_TOKENS_PER_S,
    MISMATCH_KL,
    PASS_RATE,
    REWARD_MEAN,
    STALENESS_MAX,
    STALENESS_MEAN,
    STEP,
)
from relayrl.report.logs import RunLogs


def read_config(run_dir: Path) -> dict:
    """``config.yaml`` of the run (empty when missing or unreadable)."""
    path = run_dir / "config.yaml"
    try:
        data = yaml.safe_load(path.read_text()) if path.is_file() else None
    except yaml.YAMLError:
        return {}
    return data if isinstance(data, dict) else {}


def _get(config: dict, dotted: str):
    value = config
    for part in dotted.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def _model(config: dict) -> str | None:
    path, preset = _get(config, "model.path"), _get(config, "model.preset")
    return str(path) if path else (f"preset {preset}" if preset else None)


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes} min {secs:02d} s ({seconds:.0f} s)" if minutes else f"{seconds:.1f} s"


def _evaluations(logs: RunLogs) -> list[dict]:
    return [m for m in logs.metrics if EVAL_PASS_AT_1 in m and m[EVAL_PASS_AT_1] is not None]


def _pass_rows(logs: RunLogs) -> list[tuple[str, str]]:
    evals = _evaluations(logs)
    if not evals:
        return [("held-out pass@1", "not evaluated (train.eval_every = 0 and no final row)")]
    rows = []
    if evals[0].get(STEP) == 0:
        rows.append(("held-out pass@1 before training", f"{evals[0][EVAL_PASS_AT_1]:.3f}"))
    last = evals[-1]
    label = "final" if last.get(FINAL) else f"latest (step {last.get(STEP)})"
    rows.append((f"held-out pass@1, {label}", f"{last[EVAL_PASS_AT_1]:.3f}"))
    best = max(evals, key=lambda m: m[EVAL_PASS_AT_1])
    rows.append(("best held-out pass@1", f"{best[EVAL_PASS_AT_1]:.3f} at step {best.get(STEP)}"))
    return rows


def _time_rows(logs: RunLogs, steps: list[dict]) -> list[tuple[str, str]]:
    elapsed = max((float(m[ELAPSED_S]) for m in logs.metrics if ELAPSED_S in m), default=None)
    if not elapsed:
        return []
    rows = [("training wall time", _duration(elapsed))]
    trained = sum(1 for s in logs.samples if s.get("step", 0) < len(steps)) or len(logs.samples)
    rows.append(("samples trained per second", f"{trained / elapsed:.1f}"))
    gen = [float(m[GEN_TOKENS_PER_S]) for m in steps if m.get(GEN_TOKENS_PER_S)]
    if gen:
        rows.append(("tokens generated per second (mean)", f"{sum(gen) / len(gen):.0f}"))
    return rows


def _last_step_rows(steps: list[dict]) -> list[tuple[str, str]]:
    if not steps:
        return []
    last = steps[-1]
    rows = [
        (f"train reward / pass rate (step {last[STEP]})", _pair(last, REWARD_MEAN, PASS_RATE)),
    ]
    if COMPLETED_CORRECT in last:
        rows.append(
            ("completed correctness (finished and correct)", f"{last[COMPLETED_CORRECT]:.3f}")
        )
    if STALENESS_MEAN in steps[0]:
        mean = sum(float(m.get(STALENESS_MEAN, 0)) for m in steps) / len(steps)
        worst = max(float(m.get(STALENESS_MAX, 0)) for m in steps)
        rows.append(("staleness of trained samples", f"mean {mean:.2f}, max {worst:.0f}"))
    fresh = [float(m[f"{MISMATCH_KL}0"]) for m in steps if f"{MISMATCH_KL}0" in m]
    if fresh:
        rows.append(("fresh-token KL(μ ‖ π_v), max over steps", f"{max(fresh):.2e} nats/token"))
    return rows


def _pair(row: dict, a: str, b: str) -> str:
    return " / ".join(f"{row[k]:.3f}" if k in row else "—" for k in (a, b))


def summary_rows(logs: RunLogs, config: dict, steps: list[dict]) -> list[tuple[str, str]]:
    """``(label, value)`` rows of the summary table; rows whose value is unknown are left
    out. ``steps``: the metrics rows of the training steps."""
    replay = _get(config, "replay.enable")
    eta = _get(config, "rollout.eta")
    highlights = [
        ("model", _model(config)),
        ("task", _get(config, "task.name")),
        ("staleness bound η", None if eta is None else str(eta)),
        ("loss", _get(config, "algo.loss")),
        ("advantage", _get(config, "algo.advantage")),
        ("prompts × samples per step (B × n)", _per_step(config)),
        ("D-ARL replay window K", str(_get(config, "replay.k")) if replay else "off"),
        ("steps logged", f"{len(steps)} of {_get(config, 'train.total_steps') or '?'}"),
    ]
    rows = [(k, str(v)) for k, v in highlights if v is not None]
    return rows + _pass_rows(logs) + _time_rows(logs, steps) + _last_step_rows(steps)


def _per_step(config: dict) -> str | None:
    b, n = _get(config, "rollout.prompts_per_step"), _get(config, "rollout.n_samples")
    return f"{b} × {n}" if b and n else None


STEP_COLUMNS = (
    (REWARD_MEAN, "reward", "{:.3f}"),
    (COMPLETED_CORRECT, "completed correct", "{:.3f}"),
    (EVAL_PASS_AT_1, "held-out pass@1", "{:.3f}"),
    (STALENESS_MEAN, "staleness mean", "{:.2f}"),
    (f"{MISMATCH_KL}0", "fresh KL", "{:.1e}"),
    (f"{MISMATCH_KL}1", "KL, 1 version old", "{:.1e}"),
    (ELAPSED_S, "elapsed s", "{:.0f}"),
)


def step_rows(steps: list[dict]) -> tuple[list[str], list[tuple[int, list[str]]]]:
    """The per-step table: column titles and ``(step, cells)``, columns no step has left out."""
    present = [c for c in STEP_COLUMNS if any(c[0] in m for m in steps)]
    rows = []
    for m in steps:
        cells = [fmt.format(m[k]) if m.get(k) is not None else "" for k, _, fmt in present]
        rows.append((int(m[STEP]), cells))
    return [title for _, title, _ in present], rows
