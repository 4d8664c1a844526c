"""``relayrl experiment staleness``: how staleness η hurts naive asynchronous RL, how much
decoupled PPO (AReaL) recovers, and what D-ARL's replay adds (docs/darl.md).

Two tables, every cell a real ``relayrl train`` run (rollout server processes, controller,
grading pool, trainer) from one SFT base on the default task, ``--seeds`` seeds each:

1. AReaL Table 2 shape: η ∈ {0, 1, 2, 4, 8, 16} × {naive async (PPO ratio against the stale
   μ, ``configs/async_naive.yaml``), decoupled PPO (``configs/async_decoupled.yaml``),
   decoupled PPO with AReaL's behaviour-weight cap (``configs/async_decoupled_mask.yaml``)}:
   final held-out pass@1, mean ± std over seeds, and the realised mean staleness.
2. At η ∈ {4, 8}: those three, decoupled with token-level truncated importance sampling
   (``configs/async_decoupled_tis.yaml``) and D-ARL (``configs/darl.yaml``, its window K
   widened to η + ``darl_k_beyond_eta`` so that something can be replayed): final pass@1,
   the generated samples needed to reach a target pass@1 (sample efficiency, from the
   periodic evaluations) and the training wall time (evaluation excluded).
3. At η = 8: D-ARL with one part switched off (no replay, uniform weights, no variance
   selection; the preset plus one override each), to see which part carries its result.

Each finished cell is saved as ``<out>/cells/<cell>.json`` with its settings and reused
when the command is run again with the same settings, so an interrupted grid resumes.
Writes ``<results>/staleness.md`` and ``<results>/staleness.png``.

Imports: the config loader, the RL job, SFT, matplotlib (lazily).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from relayrl.config.budget import RunBudget
from relayrl.errors import RelayError

HELP = "staleness ablation: naive async vs decoupled PPO over η, and D-ARL at η = 4, 8"

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PRESETS = {
    "naive": "async_naive.yaml",
    "decoupled": "async_decoupled.yaml",
    "decoupled_tis": "async_decoupled_tis.yaml",
    "decoupled_mask": "async_decoupled_mask.yaml",
    "darl": "darl.yaml",
    "darl_noreplay": "darl.yaml",
    "darl_uniform": "darl.yaml",
    "darl_noselect": "darl.yaml",
}
# D-ARL with one part switched off (table 3): the preset plus these overrides
ABLATIONS = {
    "darl_noreplay": ["replay.batch_fraction=0"],
    "darl_uniform": ["replay.weighting=uniform"],
    "darl_noselect": ["replay.select=none"],
}
LABELS = {
    "naive": "naive async",
    "decoupled": "decoupled PPO",
    "decoupled_tis": "decoupled PPO + token TIS (C = 2)",
    "decoupled_mask": "decoupled PPO + mask w > 5",
    "darl": "D-ARL",
    "darl_noreplay": "D-ARL without replay (ESS weights over fresh samples only)",
    "darl_uniform": "D-ARL with uniform weights (replay + selection)",
    "darl_noselect": "D-ARL without variance selection",
}
SHORT = {"naive": "naive", "decoupled": "decoupled", "decoupled_mask": "mask"}
# the methods over every η (table 1), and those of the D-ARL comparison (table 2), in order
OVER_ETA = ("naive", "decoupled", "decoupled_mask")
COMPARED = ("naive", "decoupled", "decoupled_tis", "decoupled_mask", "darl")
# Budget fields that shape the grid or only some cells: not part of every cell's settings
GRID_FIELDS = ("etas", "darl_etas", "ablation_etas", "seeds", "darl_k_beyond_eta")


@dataclass(frozen=True, kw_only=True)
class Budget(RunBudget):
    """What every cell of one grid shares: the run budget (lr set) and the grid's shape."""

    etas: tuple[int, ...]
    darl_etas: tuple[int, ...]
    seeds: int
    darl_warmup: int | None = None  # None: the preset's replay.warmup
    ppo_minibatches: int = 1  # AdamW steps per batch (optim.ppo_minibatches)
    ppo_epochs: int = 1  # passes over them (optim.ppo_epochs)
    # D-ARL's window at η: replay.k = η + this (None: the preset's k). The buffer keeps
    # versions ≥ v − k + 1 and fresh samples arrive up to η versions old, so k ≤ η leaves
    # almost nothing to replay.
    darl_k_beyond_eta: int | None = 4
    ablation_etas: tuple[int, ...] = ()  # η values of table 3 (D-ARL's parts switched off)

    def overrides(self) -> list[str]:
        return [
            *super().overrides(),
            f"optim.ppo_minibatches={self.ppo_minibatches}",
            f"optim.ppo_epochs={self.ppo_epochs}",
        ]

    def run_settings(self) -> dict[str, Any]:
        """The fields that change a single run (not the grid's shape)."""
        return {k: v for k, v in asdict(self).items() if k not in GRID_FIELDS}

    def darl_k(self, eta: int) -> int | None:
        """D-ARL's replay.k at ``eta`` (None: the preset's)."""
        return None if self.darl_k_beyond_eta is None else eta + self.darl_k_beyond_eta


# Full grid. B = 16 prompts × 8 samples, 30 steps, and AReaL's update: each batch is cut
# into 4 PPO mini-batches and passed over twice (8 AdamW steps at lr 5e-4 per version).
# Two reasons. (1) With one AdamW step per batch π_prox = π_θ at the step, so decoupled
# PPO's clip never acts (the first 3-seed grid, docs/results/staleness_u1.md). (2) On the
# 2-core machine one step per batch trains faster than the server generates, so the trainer
# waits and realised staleness stays near 2.5 whatever η; two epochs make training the
# slower side and the buffer then fills up to the bound (realised ≈ 6 at η = 8). In one-seed
# pilots naive async went from 0.80 (η = 0) to 0.61 (η = 16) here.
FULL = Budget(
    etas=(0, 1, 2, 4, 8, 16),
    darl_etas=(4, 8),
    seeds=3,
    steps=30,
    prompts_per_step=16,
    n_samples=8,
    ablation_etas=(8,),
    max_new_tokens=80,  # the longest default chains (6 steps) need ~65 tokens
    lr=5e-4,
    ppo_minibatches=4,
    ppo_epochs=2,
    eval_every=10,
    eval_problems=200,
    final_problems=500,
)
# Smoke test: 1 seed, 2 η values, a few steps, tiny evaluations, replay from step 1.
QUICK = replace(
    FULL,
    etas=(0, 4),
    darl_etas=(4,),
    ablation_etas=(),
    seeds=1,
    steps=4,
    prompts_per_step=4,
    n_samples=4,
    max_new_tokens=32,
    eval_every=2,
    eval_problems=16,
    final_problems=32,
    darl_warmup=1,
)
# the quick base only has to produce the answer format now and then: the smoke test checks
# the machinery, not learning
QUICK_SFT = [
    "sft.steps=100",
    "sft.batch_size=32",
    "eval.num_problems=30",
    "eval.max_new_tokens=64",
    "runtime.threads=1",
]


@dataclass(frozen=True)
class Cell:
    method: str
    eta: int
    seed: int

    @property
    def name(self) -> str:
        return f"{self.method}-eta{self.eta}-seed{self.seed}"


def plan_cells(budget: Budget) -> list[Cell]:
    """Table 1 cells (every η × :data:`OVER_ETA`), then D-ARL's extra cells."""
    cells = [Cell(m, eta, s) for eta in budget.etas for m in OVER_ETA for s in range(budget.seeds)]
    for eta in budget.darl_etas:
        for m in COMPARED:
            for s in range(budget.seeds):
                if Cell(m, eta, s) not in cells:
                    cells.append(Cell(m, eta, s))
    for eta in budget.ablation_etas:
        cells += [Cell(m, eta, s) for m in ABLATIONS for s in range(budget.seeds)]
    return cells


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
    settings: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CellResult:
        data = dict(data)
        data["curve"] = [tuple(p) for p in data["curve"]]
        return cls(**data)


# ----------------------------------------------------------------------------- running


def preset_path(method: str) -> Path:
    path = CONFIGS / PRESETS[method]
    if not path.is_file():
        raise RelayError(f"preset {path} not found; run the experiment from a relayrl checkout")
    return path


def cell_settings(cell: Cell, budget: Budget, model_dir: Path) -> dict[str, Any]:
    """Everything that determines a cell's run (compared when reusing a saved cell)."""
    preset = preset_path(cell.method).read_text()
    settings = {"budget": budget.run_settings(), "model": str(model_dir), "preset": preset}
    if is_darl(cell.method) and budget.darl_k(cell.eta) is not None:
        settings["replay_k"] = budget.darl_k(cell.eta)
    if cell.method in ABLATIONS:
        settings["ablation"] = ABLATIONS[cell.method]
    return settings


def is_darl(method: str) -> bool:
    return PRESETS[method] == PRESETS["darl"]


def cell_config(cell: Cell, budget: Budget, model_dir: Path, runs_dir: Path):
    from relayrl.config.loader import load_config

    overrides = [
        f"output_dir={runs_dir}",
        f"name={cell.name}",
        f"seed={cell.seed}",
        f"model.path={model_dir}",
        f"rollout.eta={cell.eta}",
        *budget.overrides(),
    ]
    if is_darl(cell.method) and budget.darl_warmup is not None:
        overrides.append(f"replay.warmup={budget.darl_warmup}")
    if is_darl(cell.method) and budget.darl_k(cell.eta) is not None:
        overrides.append(f"replay.k={budget.darl_k(cell.eta)}")
    overrides += ABLATIONS.get(cell.method, [])
    return load_config(preset_path(cell.method), overrides)


def read_run(run_dir: Path, cell: Cell, samples_per_step: int) -> CellResult:
    """A cell's result from its ``metrics.jsonl``."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    steps = [r for r in rows if "train_tokens" in r]
    evals = [r for r in rows if "eval_pass@1" in r]
    if not steps or not evals or not evals[-1].get("final"):
        raise RelayError(f"{run_dir}/metrics.jsonl has no finished run")
    curve = [
        (int(r["step"]) * samples_per_step, float(r["eval_pass@1"]), int(r["eval_problems"]))
        for r in evals
    ]
    train_s = sum(r["step_time_s"] - r.get("time_eval_s", 0.0) for r in steps)
    trained = sum(r.get("replay_fresh", 0.0) + r.get("replay_replayed", 0.0) for r in steps)
    replayed = sum(r.get("replay_replayed", 0.0) for r in steps)
    return CellResult(
        method=cell.method,
        eta=cell.eta,
        seed=cell.seed,
        final_pass=curve[-1][1],
        curve=curve,
        staleness_mean=statistics.fmean(r["staleness_mean"] for r in steps),
        train_seconds=train_s,
        replayed_frac=replayed / trained if trained else 0.0,
        behav_kl=statistics.fmean(r.get("behav_kl_k3", 0.0) for r in steps),
    )


def run_cell(cell: Cell, budget: Budget, model_dir: Path, out: Path) -> CellResult:
    from relayrl.train.rl import run_train

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


# ----------------------------------------------------------------------------- summary


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    return mean, statistics.stdev(values) if len(values) > 1 else 0.0


def fmt(values: Sequence[float], digits: int = 3) -> str:
    mean, std = mean_std(values)
    return f"{mean:.{digits}f} ± {std:.{digits}f}" if len(values) > 1 else f"{mean:.{digits}f}"


def fmt_known(values: Sequence[float | None], digits: int = 3) -> str:
    known = [v for v in values if v is not None]
    return fmt(known, digits) if known else "n/a"


def group(results: Sequence[CellResult]) -> dict[tuple[str, int], list[CellResult]]:
    out: dict[tuple[str, int], list[CellResult]] = {}
    for r in sorted(results, key=lambda r: r.seed):
        out.setdefault((r.method, r.eta), []).append(r)
    return out


def mean_curve(runs: Sequence[CellResult]) -> list[tuple[int, float]]:
    """Seed-mean pass@1 at each evaluation point the runs share."""
    points: dict[int, list[float]] = {}
    for r in runs:
        for samples, p, _ in r.curve:
            points.setdefault(samples, []).append(p)
    return [(s, statistics.fmean(v)) for s, v in sorted(points.items()) if len(v) == len(runs)]


def samples_to_target(curve: Sequence[tuple[int, float]], target: float) -> int | None:
    """Generated samples at the first evaluation with pass@1 ≥ target (None if never)."""
    return next((s for s, p in curve if p >= target), None)


def default_target(
    cells: dict[tuple[str, int], list[CellResult]], etas: Sequence[int]
) -> float | None:
    """Halfway from the base (step-0 pass@1) to the best seed-mean final pass@1 of the D-ARL
    comparison; None when nothing improved on the base."""
    runs = [r for (m, eta), rs in cells.items() if eta in etas for r in rs]
    if not runs:
        return None
    base = statistics.fmean(r.curve[0][1] for r in runs)
    best = max(
        statistics.fmean(r.final_pass for r in rs) for (m, eta), rs in cells.items() if eta in etas
    )
    return base + 0.5 * (best - base) if best > base + 0.01 else None


def table_eta(cells, etas: Sequence[int]) -> list[str]:
    """One row per η with every :data:`OVER_ETA` method that has results."""
    methods = [m for m in OVER_ETA if any((m, eta) in cells for eta in etas)]
    names = " / ".join(SHORT[m] for m in methods)
    lines = [
        "| η | "
        + " | ".join(f"{LABELS[m]} pass@1" for m in methods)
        + f" | realised staleness ({names}) |",
        "| --- | " + " | ".join("---" for _ in methods) + " | --- |",
    ]
    for eta in etas:
        runs = [cells.get((m, eta), []) for m in methods]
        if not all(runs):
            continue
        passes = " | ".join(fmt([r.final_pass for r in rs]) for rs in runs)
        stale = " / ".join(f"{mean_std([r.staleness_mean for r in rs])[0]:.2f}" for rs in runs)
        lines.append(f"| {eta} | {passes} | {stale} |")
    return lines


def table_darl(cells, etas: Sequence[int], target: float | None) -> list[str]:
    lines = [
        "| η | method | final pass@1 | samples to target (seed mean curve) | seeds reaching "
        "target | train wall time (s) | replayed share of trained samples |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for eta in etas:
        for method in COMPARED:
            runs = cells.get((method, eta), [])
            if not runs:
                continue
            reach, seeds = "n/a", "n/a"
            if target is not None:
                hit = samples_to_target(mean_curve(runs), target)
                reach = str(hit) if hit is not None else "not reached"
                per_seed = [
                    samples_to_target([(s, p) for s, p, _ in r.curve], target) for r in runs
                ]
                seeds = f"{sum(h is not None for h in per_seed)}/{len(runs)}"
            lines.append(
                f"| {eta} | {LABELS[method]} | {fmt([r.final_pass for r in runs])} | {reach} | "
                f"{seeds} | {fmt([r.train_seconds for r in runs], 0)} | "
                f"{fmt([r.replayed_frac for r in runs], 2)} |"
            )
    return lines


def table_ablation(cells, etas: Sequence[int]) -> list[str]:
    """D-ARL against itself with one part switched off, and decoupled PPO (all parts off)."""
    lines = [
        "| η | method | final pass@1 | behaviour-vs-proximal KL (k3) | replayed share | "
        "train wall time (s) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for eta in etas:
        for method in ("darl", *ABLATIONS, "decoupled"):
            runs = cells.get((method, eta), [])
            if not runs:
                continue
            lines.append(
                f"| {eta} | {LABELS[method]} | {fmt([r.final_pass for r in runs])} | "
                f"{fmt_known([r.behav_kl for r in runs], 4)} | "
                f"{fmt([r.replayed_frac for r in runs], 2)} | "
                f"{fmt([r.train_seconds for r in runs], 0)} |"
            )
    return lines


def findings(cells, budget: Budget) -> list[str]:
    """Plain statements read off the numbers (no interpretation beyond the comparison)."""
    out = []
    lo = min(budget.etas)
    for method in OVER_ETA:
        by_eta = {eta: cells[(method, eta)] for eta in budget.etas if (method, eta) in cells}
        if lo not in by_eta or len(by_eta) < 2:
            continue
        base, base_std = mean_std([r.final_pass for r in by_eta[lo]])
        worst = min((eta for eta in by_eta if eta != lo), key=lambda e: _mean_pass(by_eta[e]))
        low, low_std = mean_std([r.final_pass for r in by_eta[worst]])
        verdict = (
            "degrades visibly (the drop exceeds the larger seed std)"
            if base - low > max(base_std, low_std, 0.005)
            else "does NOT visibly degrade at this budget (a null result for the setting)"
        )
        trend = ", ".join(f"η {eta}: {_mean_pass(rs):.3f}" for eta, rs in by_eta.items())
        out.append(
            f"- {LABELS[method]}: {base:.3f} at η = {lo}, lowest {low:.3f} at η = {worst}; "
            f"it {verdict} ({trend})."
        )
    for eta in budget.darl_etas:
        darl, dec = cells.get(("darl", eta)), cells.get(("decoupled", eta))
        if darl and dec:
            a, sa = mean_std([r.final_pass for r in dec])
            b, sb = mean_std([r.final_pass for r in darl])
            sign = "above" if b > a else "below"
            within = (
                " (within one seed std: not a significant difference)"
                if abs(b - a) <= max(sa, sb)
                else ""
            )
            out.append(f"- η = {eta}: D-ARL {b:.3f} vs decoupled {a:.3f}, {sign}{within}.")
    return out


def _mean_pass(runs: Sequence[CellResult]) -> float:
    return statistics.fmean(r.final_pass for r in runs)


def darl_summary(budget: Budget) -> str:
    """The D-ARL preset's replay settings as the cells ran them."""
    r = cell_config(Cell("darl", 4, 0), budget, Path("model"), Path("runs")).replay
    select = "no selection"
    if r.select == "variance":
        bound = f"q = {r.quantile}" if r.quantile is not None else f"threshold {r.threshold}"
        select = f"variance selection, {bound} of the fresh samples' scores"
    window = (
        f"K = η + {budget.darl_k_beyond_eta}"
        if budget.darl_k_beyond_eta is not None
        else f"K = {r.k}"
    )
    return (
        f"{window}, {select}, max_reuse {r.max_reuse}, up to {r.batch_fraction} × fresh "
        f"replayed per step, {r.weighting} weights, warm-up {r.warmup} steps"
    )


def why_budget(budget: Budget) -> list[str]:
    if replace(budget, seeds=FULL.seeds) != FULL:
        return [
            "- Budget: not the default grid (`--quick` or overrides); the default's "
            "rationale below does not apply to these numbers."
        ]
    return [
        "- Why this lr and update: staleness only matters when the policy moves enough per "
        "version that a behaviour policy η versions old is far from π_θ, and when η is "
        "actually realised. Each batch is cut into 4 PPO mini-batches, passed over twice "
        "(8 AdamW steps at lr 5e-4 per version, as AReaL updates), so π_θ leaves π_prox "
        "within a batch and decoupled PPO's clip acts; and training, now the slower side on "
        "this 2-core machine, lets finished samples wait for up to η versions. With one "
        "step per batch (docs/results/staleness_u1.md) the trainer waited for generation, "
        "realised staleness stayed near 2.5 whatever η, and naive async did not degrade.",
    ]


def machine() -> str:
    load = os.getloadavg()
    return (
        f"{platform.platform()}, {os.cpu_count()} CPU cores ({platform.processor() or 'cpu'}), "
        f"python {platform.python_version()}, load average at the end "
        f"{load[0]:.2f}/{load[1]:.2f}/{load[2]:.2f}"
    )


def write_markdown(
    path: Path,
    results: Sequence[CellResult],
    budget: Budget,
    command: str,
    base: dict[str, Any],
    target: float | None,
    wall_s: float,
) -> None:
    import torch

    cells = group(results)
    target_text = f"{target:.3f}" if target is not None else "n/a (no method improved on the base)"
    lines = [
        "# Staleness ablation: naive async vs decoupled PPO vs D-ARL",
        "",
        f"Generated by `{command}` on {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC.",
        f"Machine: {machine()}, torch {torch.__version__}. Wall time of this invocation: "
        f"{wall_s / 60:.1f} min (cells reused from earlier runs count 0); training time of "
        f"all {len(results)} runs, evaluations excluded: "
        f"{sum(r.train_seconds for r in results) / 60:.1f} min.",
        "",
        "D-ARL here is relayrl's reading of the paper (docs/darl.md), not the authors' code.",
        "",
        "## Setting",
        "",
        f"- Base: SFT model `{base['model']}` (pass@1 {base.get('pass', 'n/a')} after SFT), "
        "default task (arithmetic chains), sampling temperature 1.",
        f"- Every run: B = {budget.prompts_per_step} prompts × n = {budget.n_samples} samples "
        f"per step ({budget.samples_per_step} samples), {budget.steps} steps, "
        f"{budget.max_new_tokens} new tokens, lr {budget.lr:g} (AdamW, 2 warm-up steps, "
        f"constant), {budget.ppo_minibatches} PPO mini-batches × {budget.ppo_epochs} "
        "epochs per batch (one version per batch), GRPO advantages, no dynamic sampling, one rollout server process and "
        "one trainer thread, weights published every step.",
        f"- Evaluation: held-out pass@1 on {budget.eval_problems} problems every "
        f"{budget.eval_every} steps and at step 0, the final one on {budget.final_problems}.",
        f"- Seeds: {budget.seeds} per cell (the seed sets the prompt order and the sampling "
        "seeds; every run starts from the same base).",
        "- Methods: naive async = `configs/async_naive.yaml` (PPO ratio π_θ/μ against the "
        "stale behaviour policy), decoupled PPO = `configs/async_decoupled.yaml` (behaviour "
        "weight w = π_prox/μ not truncated), decoupled PPO + token TIS = "
        "`configs/async_decoupled_tis.yaml` (w truncated at 2 per token), decoupled PPO + "
        "mask = `configs/async_decoupled_mask.yaml` (tokens with w > 5 masked out of the "
        "loss, AReaL's `behav_imp_weight_cap`), D-ARL = "
        f"`configs/darl.yaml` ({darl_summary(budget)}), each at the row's η. D-ARL replays "
        "only samples whose oldest version is within the last K of the trainer's; fresh "
        "samples already arrive up to η versions old, hence K beyond η (last column of "
        "table 2: the replayed share).",
        *why_budget(budget),
        f"- Sample efficiency: generated samples (B·n per step) until the seed-mean "
        f"pass@1 curve reaches the target {target_text} (halfway from the step-0 pass@1 to "
        "the best final mean of the D-ARL table, unless `--target` was given); evaluation "
        f"points are every {budget.eval_every} steps, so the figure is a step function.",
        "- Realised staleness is the mean over steps of the trained samples' mean staleness: "
        "η is only a bound; how far generation runs ahead of training sets the actual value.",
        "",
        "## 1. Final pass@1 over the staleness bound η (AReaL Table 2 shape)",
        "",
        *table_eta(cells, budget.etas),
        "",
        "## 2. D-ARL against the baselines",
        "",
        *table_darl(cells, budget.darl_etas, target),
        "",
        *(
            [
                "## 3. Which part of D-ARL does it (one part switched off)",
                "",
                *table_ablation(cells, budget.ablation_etas),
                "",
            ]
            if budget.ablation_etas
            else []
        ),
        "## What the numbers say",
        "",
        *(findings(cells, budget) or ["- Not enough cells to compare."]),
        "",
        "![staleness](staleness.png)",
        "",
        "Per-cell numbers (curves, staleness, times) are in the experiment's `cells/*.json`.",
        "",
        "What these numbers mean (and do not): "
        "[docs/darl.md](../darl.md#results-of-the-staleness-experiment).",
        "",
    ]
    path.write_text("\n".join(lines))


def write_plot(path: Path, results: Sequence[CellResult], budget: Budget) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = group(results)
    fig, axes = plt.subplots(
        1, 1 + len(budget.darl_etas), figsize=(5 * (1 + len(budget.darl_etas)), 4)
    )
    ax = axes[0]
    for method in OVER_ETA:
        etas = [e for e in budget.etas if (method, e) in cells]
        if not etas:
            continue
        stats = [mean_std([r.final_pass for r in cells[(method, e)]]) for e in etas]
        ax.errorbar(
            [str(e) for e in etas],
            [m for m, _ in stats],
            yerr=[s for _, s in stats],
            marker="o",
            capsize=3,
            label=LABELS[method],
        )
    ax.set(title="final pass@1 vs staleness bound η", xlabel="η", ylabel="held-out pass@1")
    ax.legend()
    for ax, eta in zip(axes[1:], budget.darl_etas, strict=True):
        for method in COMPARED:
            if (method, eta) in cells:
                xs, ys = zip(*mean_curve(cells[(method, eta)]), strict=True)
                ax.plot(xs, ys, marker="o", label=LABELS[method])
        ax.set(title=f"η = {eta}: pass@1 vs generated samples", xlabel="samples", ylabel="pass@1")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick", action="store_true", help="smoke test: 1 seed, η ∈ {0, 4}, 4 steps (~1 min)"
    )
    parser.add_argument("--seeds", type=int, default=None, help="seeds per cell (default 3)")
    parser.add_argument(
        "--model-path",
        default=None,
        help="SFT base model directory (default: train one with `relayrl sft` defaults into "
        "the output directory once, and reuse it)",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="runs, cells and the SFT base (default runs/staleness, quick runs/staleness_quick)",
    )
    parser.add_argument(
        "--results",
        default=None,
        help="where staleness.md and staleness.png go (default docs/results; quick: --out)",
    )
    parser.add_argument("--steps", type=int, default=None, help="training steps per run")
    parser.add_argument("--lr", type=float, default=None, help="learning rate of every run")
    parser.add_argument(
        "--target", type=float, default=None, help="pass@1 target for sample efficiency"
    )


def budget_from(args: argparse.Namespace) -> Budget:
    budget = QUICK if args.quick else FULL
    updates: dict[str, Any] = {}
    if args.seeds is not None:
        if args.seeds < 1:
            raise RelayError("--seeds must be >= 1")
        updates["seeds"] = args.seeds
    if args.steps is not None:
        if args.steps < 1:
            raise RelayError("--steps must be >= 1")
        updates["steps"] = args.steps
        updates["eval_every"] = min(budget.eval_every, args.steps)
    if args.lr is not None:
        if args.lr <= 0:
            raise RelayError("--lr must be > 0")
        updates["lr"] = args.lr
    return replace(budget, **updates)


def sft_base(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """The SFT base: ``--model-path``, the one saved in ``out/sft``, or a new one."""
    if args.model_path:
        from relayrl.models.loading import check_model_dir

        return {"model": str(check_model_dir(args.model_path))}
    summary = out / "sft" / "sft_summary.json"
    if not summary.is_file():
        from relayrl.config.loader import load_config
        from relayrl.train.sft import run_sft

        print(f"training the SFT base into {out / 'sft'} (once; reused afterwards)", flush=True)
        overrides = [f"output_dir={out}", "name=sft", *(QUICK_SFT if args.quick else [])]
        run_sft(load_config(None, overrides), progress=False)
    data = json.loads(summary.read_text())
    return {"model": data["model_dir"], "pass": f"{data['base_pass@1']:.3f}"}


def command_line(argv: Sequence[str]) -> str:
    """``relayrl experiment staleness ARGS`` as it was typed (for the results page)."""
    rest = list(argv[argv.index("staleness") + 1 :]) if "staleness" in argv else []
    return " ".join(["relayrl experiment staleness", *rest])


def run(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(1)
    budget = budget_from(args)
    out = Path(args.out or ("runs/staleness_quick" if args.quick else "runs/staleness"))
    results_dir = Path(args.results or (out if args.quick else "docs/results"))
    command = command_line(sys.argv)
    start = time.perf_counter()
    base = sft_base(args, out)
    cells = plan_cells(budget)
    print(f"{len(cells)} runs: {', '.join(c.name for c in cells)}", flush=True)
    results = run_grid(cells, budget, Path(base["model"]), out, log=lambda m: print(m, flush=True))
    grouped = group(results)
    target = args.target if args.target is not None else default_target(grouped, budget.darl_etas)
    results_dir.mkdir(parents=True, exist_ok=True)
    md = results_dir / "staleness.md"
    write_markdown(md, results, budget, command, base, target, time.perf_counter() - start)
    write_plot(results_dir / "staleness.png", results, budget)
    print(f"wrote {md} and {results_dir / 'staleness.png'}")
    return 0
