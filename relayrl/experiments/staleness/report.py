"""The results page: the three tables, the findings in words, the settings as run, the
machine, and the plot.

Imports: the plan, results and statistics of this package; matplotlib (lazily).
"""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from relayrl.experiments.staleness.plan import (
    ABLATIONS,
    COMPARED,
    FULL,
    LABELS,
    OVER_ETA,
    SHORT,
    Budget,
    Cell,
    cell_config,
    eta_key,
)
from relayrl.experiments.staleness.runner import (
    CellResult,
)
from relayrl.experiments.staleness.stats import (
    _mean_pass,
    fmt,
    fmt_known,
    group,
    mean_curve,
    mean_std,
    samples_to_target,
)


def table_eta(cells, etas: Sequence[int], over_eta: Sequence[str] = OVER_ETA) -> list[str]:
    """One row per η with every ``over_eta`` method that has results."""
    methods = [m for m in over_eta if any((m, eta) in cells for eta in etas)]
    names = " / ".join(SHORT.get(m, m) for m in methods)
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


def table_darl(
    cells, etas: Sequence[int], target: float | None, compared: Sequence[str] = COMPARED
) -> list[str]:
    lines = [
        "| η | method | final pass@1 | samples to target (seed mean curve) | seeds reaching "
        "target | train wall time (s) | replayed share of trained samples |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for eta in etas:
        for method in compared:
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
    lo = min(budget.etas, key=eta_key)
    for method in budget.over_eta:
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
    b = budget
    updates = b.ppo_minibatches * b.ppo_epochs
    return [
        "- Why this lr and update: staleness only matters when the policy moves enough per "
        "version that a behaviour policy η versions old is far from π_θ, and when η is "
        f"actually realised. Each batch is cut into {b.ppo_minibatches} PPO mini-batches, "
        f"passed over {b.ppo_epochs} times ({updates} AdamW steps at lr {b.lr:g} per version, "
        "as AReaL updates), so π_θ leaves π_prox within a batch and decoupled PPO's clip "
        "acts; and training, now the slower side on a 2-core machine, lets finished samples "
        "wait for up to η versions. With one step per batch (docs/results/staleness_u1.md) "
        "the trainer waited for generation, realised staleness stayed near 2.5 whatever η, "
        "and naive async did not degrade.",
    ]


def staleness_setting(budget: Budget) -> str:
    """How the runs' staleness came about: the machine (async) or lag emulation."""
    if budget.lag == "async":
        return (
            "one rollout server process and one trainer thread, weights published every step "
            "(asynchronous: realised staleness depends on this machine's timing)."
        )
    how = "d = η" if budget.lag == "fixed" else "d drawn uniformly from {0, …, η} per step"
    return (
        f"one trainer thread; lag emulation (`rollout.lag={budget.lag}`): the batch trained at "
        f"version v is generated in-process by exactly the weights v − d, {how} (clipped to "
        "v), so staleness does not depend on the machine (docs/async.md)."
    )


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
        *_setting(budget, base, target_text),
        "## 1. Final pass@1 over the staleness bound η (AReaL Table 2 shape)",
        "",
        *table_eta(cells, budget.etas, budget.over_eta),
        "",
        "## 2. D-ARL against the baselines",
        "",
        *table_darl(cells, budget.darl_etas, target, budget.compared),
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
        f"![staleness]({path.with_suffix('.png').name})",
        "",
        "Per-cell numbers (curves, staleness, times) are in the experiment's `cells/*.json`.",
        "",
        "What these numbers mean (and do not): "
        "[docs/darl.md](../darl.md#results-of-the-staleness-experiment).",
        "",
    ]
    path.write_text("\n".join(lines))


def _setting(budget: Budget, base: dict[str, Any], target_text: str) -> list[str]:
    """The report's "Setting" section: the base, the budget, the methods, the measures."""
    return [
        "## Setting",
        "",
        f"- Base: SFT model `{base['model']}` (pass@1 {base.get('pass', 'n/a')} after SFT), "
        "default task (arithmetic chains), sampling temperature 1.",
        f"- Every run: B = {budget.prompts_per_step} prompts × n = {budget.n_samples} samples "
        f"per step ({budget.samples_per_step} samples), {budget.steps} steps, "
        f"{budget.max_new_tokens} new tokens, lr {budget.lr:g} (AdamW, 2 warm-up steps, "
        f"constant), {budget.ppo_minibatches} PPO mini-batches × {budget.ppo_epochs} "
        "epochs per batch (one version per batch), GRPO advantages, no dynamic sampling, "
        + staleness_setting(budget),
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
    ]


def write_plot(path: Path, results: Sequence[CellResult], budget: Budget) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = group(results)
    fig, grid = plt.subplots(
        1, 1 + len(budget.darl_etas), figsize=(5 * (1 + len(budget.darl_etas)), 4), squeeze=False
    )
    axes = grid[0]
    ax = axes[0]
    for method in budget.over_eta:
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
        for method in budget.compared:
            if (method, eta) in cells:
                xs, ys = zip(*mean_curve(cells[(method, eta)]), strict=True)
                ax.plot(xs, ys, marker="o", label=LABELS[method])
        ax.set(title=f"η = {eta}: pass@1 vs generated samples", xlabel="samples", ylabel="pass@1")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
