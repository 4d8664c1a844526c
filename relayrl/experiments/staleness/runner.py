"""Running the grid's cells as real ``relayrl train`` runs, with a per-cell result cache
(``<out>/cells/<cell>.json``, reused when a cell's settings are unchanged), and reading a
run's metrics back as a :class:`CellResult`.

Imports: relayrl.experiments.staleness.plan, the RL job.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from relayrl.errors import RelayError
from relayrl.experiments.staleness.plan import (
    Budget,
    Cell,
    cell_config,
    cell_settings,
)
from relayrl.metric_names import (
    BEHAV_KL,
    BEHAV_PROX_KL,
    DRIFT_KL,
    EVAL_PASS_AT_1,
    EVAL_PROBLEMS,
    FINAL,
    STALENESS_MEAN,
    STEP,
    STEP_TIME_S,
    TIME_EVAL_S,
    TRAIN_TOKENS,
)
from relayrl.report.logs import read_jsonl


@dataclass
class CellResult:
    """What one run measured. ``curve``: (generated samples, pass@1, problems) at each
    evaluation, step 0 and the final one included."""

    method: str
    eta: int
    seed: int
    final_pass: float
    curve: list[tuple[int, float, int]]
    staleness_mean: float
    train_seconds: float
    replayed_frac: float = 0.0
    # mean over steps of the trained samples' behaviour-vs-proximal k3 KL: how far the
    # policy moved between generating and training (None in cells saved before it existed)
    behav_kl: float | None = None
    # means over steps of the per-version drift KL(π_v ‖ π_v+1) and of KL(μ ‖ π_v), measured
    # alike for every method (relayrl.algo.losses.policy_drift; None: saved before they were)
    drift_kl: float | None = None
    behav_prox_kl: float | None = None
    settings: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CellResult:
        data = dict(data)
        data["curve"] = [tuple(p) for p in data["curve"]]
        return cls(**data)


def read_run(run_dir: Path, cell: Cell, samples_per_step: int) -> CellResult:
    """A cell's result from its ``metrics.jsonl``."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    steps = [r for r in rows if TRAIN_TOKENS in r]
    evals = [r for r in rows if EVAL_PASS_AT_1 in r]
    if not steps or not evals or not evals[-1].get(FINAL):
        raise RelayError(f"{run_dir}/metrics.jsonl has no finished run")
    curve = [
        (int(r[STEP]) * samples_per_step, float(r[EVAL_PASS_AT_1]), int(r[EVAL_PROBLEMS]))
        for r in evals
    ]
    train_s = sum(r[STEP_TIME_S] - r.get(TIME_EVAL_S, 0.0) for r in steps)
    trained = sum(r.get("replay_fresh", 0.0) + r.get("replay_replayed", 0.0) for r in steps)
    replayed = sum(r.get("replay_replayed", 0.0) for r in steps)
    return CellResult(
        method=cell.method,
        eta=cell.eta,
        seed=cell.seed,
        final_pass=curve[-1][1],
        curve=curve,
        staleness_mean=statistics.fmean(r[STALENESS_MEAN] for r in steps),
        train_seconds=train_s,
        replayed_frac=replayed / trained if trained else 0.0,
        behav_kl=statistics.fmean(r.get(BEHAV_KL, 0.0) for r in steps),
        drift_kl=_step_mean(steps, DRIFT_KL),
        behav_prox_kl=_step_mean(steps, BEHAV_PROX_KL),
    )


def _step_mean(steps: list[dict[str, Any]], key: str) -> float | None:
    values = [float(r[key]) for r in steps if key in r]
    return statistics.fmean(values) if values else None


def run_cell(cell: Cell, budget: Budget, model_dir: Path, out: Path) -> CellResult:
    from relayrl.train.run import run_train

    config = cell_config(cell, budget, model_dir, out / "runs")
    run_train(config, progress=False)
    return read_run(out / "runs" / cell.name, cell, budget.samples_per_step)


def load_cached(path: Path, settings: dict[str, Any]) -> CellResult | None:
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    return CellResult.from_dict(data) if data.get("settings") == settings else None


def run_grid(
    cells: Sequence[Cell],
    budget: Budget,
    model_dir: Path,
    out: Path,
    runner: Callable[[Cell, Budget, Path, Path], CellResult] = run_cell,
    log: Callable[[str], None] = print,
) -> list[CellResult]:
    """Run (or reuse) every cell, printing progress and an ETA after each."""
    (out / "cells").mkdir(parents=True, exist_ok=True)
    settings = {c: cell_settings(c, budget, model_dir) for c in cells}
    saved = {c: load_cached(out / "cells" / f"{c.name}.json", settings[c]) for c in cells}
    left = sum(r is None for r in saved.values())
    results: list[CellResult] = []
    spent: list[float] = []
    for i, cell in enumerate(cells, 1):
        head = f"[{i}/{len(cells)}] {cell.name}"
        result = saved[cell]
        if result is not None:
            log(f"{head}: saved result, final pass@1 {result.final_pass:.3f}")
            results.append(result)
            continue
        log(f"{head}: running")
        start = time.perf_counter()
        result = replace(runner(cell, budget, model_dir, out), settings=settings[cell])
        spent.append(time.perf_counter() - start)
        (out / "cells" / f"{cell.name}.json").write_text(json.dumps(asdict(result), indent=1))
        results.append(result)
        left -= 1
        log(
            f"{head}: final pass@1 {result.final_pass:.3f}, staleness "
            f"{result.staleness_mean:.2f}, {spent[-1]:.0f} s; {left} runs left, "
            f"ETA {statistics.fmean(spent) * left / 60:.1f} min"
        )
    return results
