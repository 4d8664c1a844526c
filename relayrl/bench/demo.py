"""``relayrl bench demo --seeds 0,1,2``: the demo recipe (SFT warm start + asynchronous RL on
the embedded default config, what ``make demo`` runs) once per global seed.

The seed changes the model's initialisation and the order and errors of the SFT
demonstrations, hence the SFT base model: it stands in for another machine, whose CPU
numerics give another base from the same seed. A recipe is robust when every seed's final
held-out pass@1 (T = 1, 500 problems) reaches the target within the time budget (5 minutes
on the 2-core CPU the figures in docs/benchmarks.md come from); the last line is
``demo_min_final_pass@1=0.xx``, the worst seed. Seeds run one after the other, each with the
whole machine; wall time per seed is SFT + RL including the evaluations, split per stage:
SFT's optimizer steps, the RL loop (its periodic evaluations included) and the rest (model
build, the base and final evaluations, server start-up, saving).

``--quick`` is a smoke test of the pipeline (a few SFT and RL steps on a small evaluation):
its pass@1 figures measure nothing. Imports: the config loader and the RL job.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from relayrl.errors import RelayError

HELP = "the demo recipe per seed (SFT + async RL): base and final pass@1, wall time"

TIME_BUDGET_S = 300.0  # the demo's promise: ≤ 5 minutes wall per run on the 2-core CPU
# --quick: enough of every stage to exercise it, nothing more (< 1 minute for 3 seeds)
QUICK_OVERRIDES = (
    "runtime.threads=1",
    "sft.steps=20",
    "sft.batch_size=16",
    "sft.warmup_steps=2",
    "rollout.prompts_per_step=4",
    "rollout.n_samples=4",
    "rollout.max_new_tokens=48",
    "algo.dynamic_sampling=false",
    "train.total_steps=2",
    "train.eval_every=0",
    "train.eval_problems=16",
    "train.checkpoint_every=0",
    "eval.num_problems=16",
    "eval.max_new_tokens=48",
)


@dataclass(frozen=True)
class SeedResult:
    seed: int
    base_pass_at_1: float
    final_pass_at_1: float
    sft_seconds: float
    wall_seconds: float
    staleness_mean: float
    rl_seconds: float = 0.0  # the RL loop's elapsed time, periodic evaluations included
    eval_seconds: float = 0.0  # every held-out evaluation of the RL run (inside rl_seconds)


def parse_seeds(text: str) -> list[int]:
    """``"0,1,2"`` -> ``[0, 1, 2]``; distinct integers, at least one."""
    try:
        seeds = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise RelayError(
            f"--seeds must be comma-separated integers, e.g. 0,1,2; got {text!r}"
        ) from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise RelayError(f"--seeds must list at least one seed, each once; got {text!r}")
    return seeds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick", action="store_true", help="smoke test of the pipeline (< 1 minute)"
    )
    parser.add_argument(
        "--seeds", default="0,1,2", help="comma-separated global seeds (default 0,1,2)"
    )
    parser.add_argument(
        "--out", default=None, help="keep the runs under this directory (default: a temp dir)"
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="config overrides of the demo's recipe for every seed (e.g. train.total_steps=60)",
    )


def seed_overrides(args: argparse.Namespace, seed: int, out: Path) -> list[str]:
    """The demo's config for ``seed``: its own run directory, no console bar, then the
    ``--quick`` budget and the user's overrides."""
    quick = list(QUICK_OVERRIDES) if args.quick else []
    return [
        f"seed={seed}",
        f"output_dir={out}",
        f"name=demo-seed{seed}",
        "train.progress=false",
        *quick,
        *args.overrides,
    ]


def run_seed(args: argparse.Namespace, seed: int, out: Path) -> SeedResult:
    from relayrl.config.loader import load_config
    from relayrl.train.run import run_train

    config = load_config(None, seed_overrides(args, seed, out))
    start = time.perf_counter()
    result = run_train(config, progress=False)
    wall = time.perf_counter() - start
    sft = json.loads((out / config.name / "sft_summary.json").read_text())
    rl_seconds, eval_seconds = rl_stage_seconds(out / config.name / "metrics.jsonl")
    return SeedResult(
        seed=seed,
        base_pass_at_1=float(sft["base_pass@1"]),
        final_pass_at_1=float(result.final_pass_at_1 or 0.0),
        sft_seconds=float(sft["sft_seconds"]),
        wall_seconds=wall,
        staleness_mean=float(result.summary.get("staleness_mean", 0.0)),
        rl_seconds=rl_seconds,
        eval_seconds=eval_seconds,
    )


def rl_stage_seconds(metrics: Path) -> tuple[float, float]:
    """(the RL loop's last step's ``elapsed_s``, the sum of its evaluations'
    ``time_eval_s``); the final evaluation's row, which has its ``elapsed_s`` too (for the
    report's wall-clock chart), is not a step."""
    from relayrl.metric_names import ELAPSED_S, FINAL, TIME_EVAL_S
    from relayrl.report.logs import read_jsonl

    rows = read_jsonl(metrics)
    elapsed = [float(r[ELAPSED_S]) for r in rows if ELAPSED_S in r and not r.get(FINAL)]
    evals = sum(float(r[TIME_EVAL_S]) for r in rows if TIME_EVAL_S in r)
    return (elapsed[-1] if elapsed else 0.0), evals


def seed_line(r: SeedResult) -> str:
    within = "yes" if r.wall_seconds <= TIME_BUDGET_S else "no"
    return (
        f"seed={r.seed} base_pass@1={r.base_pass_at_1:.2f} final_pass@1={r.final_pass_at_1:.2f} "
        f"wall_s={r.wall_seconds:.0f} sft_s={r.sft_seconds:.0f} rl_s={r.rl_seconds:.0f} "
        f"other_s={r.wall_seconds - r.sft_seconds - r.rl_seconds:.0f} "
        f"evals_in_rl_s={r.eval_seconds:.0f} staleness_mean={r.staleness_mean:.2f} within_{TIME_BUDGET_S:.0f}s={within}"
    )


def summary_lines(results: list[SeedResult]) -> list[str]:
    """Spread over the seeds; the last line is the worst seed's final pass@1."""
    finals = [r.final_pass_at_1 for r in results]
    bases = [r.base_pass_at_1 for r in results]
    walls = [r.wall_seconds for r in results]
    std = statistics.stdev(finals) if len(finals) > 1 else 0.0
    return [
        f"seeds={','.join(str(r.seed) for r in results)}",
        f"demo_base_pass@1_range={min(bases):.2f}-{max(bases):.2f}",
        f"demo_mean_final_pass@1={statistics.fmean(finals):.3f} std={std:.3f}",
        f"demo_max_wall_s={max(walls):.0f}",
        f"demo_min_final_pass@1={min(finals):.2f}",
    ]


def run(args: argparse.Namespace) -> int:
    if args.quick:
        print("quick: a smoke test of the pipeline (tiny SFT and RL); its figures measure nothing")
    seeds = parse_seeds(args.seeds)
    results = []
    with tempfile.TemporaryDirectory(prefix="relayrl-bench-demo-") as tmp:
        out = Path(args.out) if args.out else Path(tmp)
        for seed in seeds:
            results.append(run_seed(args, seed, out))
            print(seed_line(results[-1]), flush=True)
    for line in summary_lines(results):
        print(line)
    return 0
