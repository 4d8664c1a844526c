"""``relayrl experiment staleness``: arguments, the SFT base, the grid run and the results
page (see the package docstring).

Imports: this package's modules, SFT, the config loader.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from relayrl.errors import RelayError
from relayrl.experiments.staleness.plan import (
    FULL,
    QUICK,
    QUICK_SFT,
    Budget,
    plan_cells,
)
from relayrl.experiments.staleness.report import (
    write_markdown,
    write_plot,
)
from relayrl.experiments.staleness.runner import (
    run_grid,
)
from relayrl.experiments.staleness.stats import (
    default_target,
    group,
)

HELP = "staleness ablation: naive async vs decoupled PPO over η, and D-ARL at η = 4, 8"


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
