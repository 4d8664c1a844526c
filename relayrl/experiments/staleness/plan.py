"""The staleness grid's plan: the methods and their presets, the run budgets (full and
--quick), the cells, and each cell's run config and identifying settings.

Imports: the config loader and run budget, errors, the staleness bound's ``auto``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from relayrl.config.budget import RunBudget
from relayrl.errors import RelayError
from relayrl.rollout.eta import is_auto

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


PRESETS = {
    "naive": "async_naive.yaml",
    "recompute": "async_recompute.yaml",
    "decoupled": "async_decoupled.yaml",
    "decoupled_tis": "async_decoupled_tis.yaml",
    "decoupled_mask": "async_decoupled_mask.yaml",
    "decoupled_seq": "async_decoupled_seq.yaml",
    "decoupled_geo": "async_decoupled_geo.yaml",
    "gspo": "async_gspo.yaml",
    "seq_mean_token_mean": "async_seq_mean.yaml",
    "cispo": "async_cispo.yaml",
    "reinforce_pp": "async_reinforce_pp.yaml",
    "darl": "darl.yaml",
    "darl_noreplay": "darl.yaml",
    "darl_uniform": "darl.yaml",
    "darl_noselect": "darl.yaml",
    "decoupled_matched": "async_decoupled.yaml",
}


# D-ARL with one part switched off (table 3): the preset plus these overrides
ABLATIONS = {
    "darl_noreplay": ["replay.batch_fraction=0"],
    "darl_uniform": ["replay.weighting=uniform"],
    "darl_noselect": ["replay.select=none"],
}


# Controls that are a preset plus overrides but not part of D-ARL's ablation. D-ARL trains
# up to 1.5 x the fresh samples per version (replay.batch_fraction 0.5), so the
# sample-matched control passes over each batch 3 times instead of 2.
CONTROLS = {
    "decoupled_matched": ["optim.ppo_epochs=3"],
}


LABELS = {
    "naive": "naive async",
    "recompute": "recompute (AReaL's baseline: clip around π_prox, no w)",
    "decoupled": "decoupled PPO",
    "decoupled_tis": "decoupled PPO + token TIS (C = 2)",
    "decoupled_mask": "decoupled PPO + mask w > 5",
    "decoupled_seq": "decoupled PPO + sequence TIS (C = 2)",
    "decoupled_geo": "decoupled PPO + geometric TIS (C = 2)",
    "gspo": "GSPO, geometric TIS (C = 2), per-sequence token means",
    "seq_mean_token_mean": "naive async, per-sequence token means (TRL's grpo loss)",
    "cispo": "CISPO (min(π_θ/μ, 5) as a stop-gradient weight, every token's gradient)",
    "reinforce_pp": "naive async, REINFORCE++ advantages (whitened token returns)",
    "darl": "D-ARL",
    "darl_noreplay": "D-ARL without replay (ESS weights over fresh samples only)",
    "darl_uniform": "D-ARL with uniform weights (replay + selection)",
    "darl_noselect": "D-ARL without variance selection",
    "decoupled_matched": "decoupled PPO, 3 epochs (D-ARL's sample-passes)",
}


SHORT = {
    "naive": "naive",
    "recompute": "recompute",
    "decoupled": "decoupled",
    "decoupled_mask": "mask",
    "decoupled_tis": "TIS",
    "decoupled_seq": "seq",
    "decoupled_geo": "geo",
    "gspo": "GSPO",
    "seq_mean_token_mean": "seq-mean",
    "cispo": "CISPO",
    "reinforce_pp": "REINFORCE++",
}


# the default methods over every η (table 1), and those of the D-ARL comparison (table 2), in
# order; a budget may choose others (``--methods``, ``--compared``)
OVER_ETA = ("naive", "decoupled", "decoupled_mask")


COMPARED = ("naive", "recompute", "decoupled", "decoupled_tis", "decoupled_mask", "darl")


# Budget fields that shape the grid or only some cells: not part of every cell's settings
GRID_FIELDS = (
    "etas",
    "darl_etas",
    "ablation_etas",
    "seeds",
    "darl_k_beyond_eta",
    "over_eta",
    "compared",
)


# a cell's staleness bound: an integer η or AUTO (rollout.eta=auto, docs/async.md)
Eta = int | str


def eta_key(eta: Eta) -> tuple[int, int]:
    """Sort key of η values: the integers in order, then ``auto``."""
    return (1, 0) if is_auto(eta) else (0, int(eta))


def fixed_etas(etas: Sequence[Eta]) -> list[int]:
    """The integer η values of ``etas``, sorted (``auto`` left out)."""
    return sorted(e for e in etas if isinstance(e, int))


@dataclass(frozen=True, kw_only=True)
class Budget(RunBudget):
    """What every cell of one grid shares: the run budget (lr set) and the grid's shape."""

    etas: tuple[Eta, ...]  # integers and "auto"
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
    over_eta: tuple[str, ...] = OVER_ETA  # table 1's methods, run at every η
    compared: tuple[str, ...] = COMPARED  # table 2's methods, run at every darl_etas η
    # rollout.lag of every run: async (staleness as the machine makes it) or lag emulation
    # (fixed / uniform: each batch generated by exactly the weights v − d; docs/async.md)
    lag: str = "async"
    # rollout.eta_budget / rollout.eta_max of the auto cells (None: the config's defaults)
    eta_budget: float | None = None
    eta_max: int | None = None

    def overrides(self) -> list[str]:
        return [
            *super().overrides(),
            f"optim.ppo_minibatches={self.ppo_minibatches}",
            f"optim.ppo_epochs={self.ppo_epochs}",
            f"rollout.lag={self.lag}",
            "train.drift_metrics=true",  # the study's own measurement, whatever it costs
            *([] if self.eta_budget is None else [f"rollout.eta_budget={self.eta_budget}"]),
            *([] if self.eta_max is None else [f"rollout.eta_max={self.eta_max}"]),
        ]

    def run_settings(self) -> dict[str, Any]:
        """The fields that change a single run (not the grid's shape); ``lag`` only when it
        is not ``async``, so cells saved before lag emulation existed stay valid."""
        settings = {k: v for k, v in asdict(self).items() if k not in GRID_FIELDS}
        if self.lag == "async":
            del settings["lag"]
        for key in ("eta_budget", "eta_max"):  # cells saved before these existed stay valid
            if settings[key] is None:
                del settings[key]
        return settings

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
    eta: Eta
    seed: int

    @property
    def name(self) -> str:
        return f"{self.method}-eta{self.eta}-seed{self.seed}"


def plan_cells(budget: Budget) -> list[Cell]:
    """Table 1 cells (every η × ``budget.over_eta``), then table 2's extra cells."""
    cells = [
        Cell(m, eta, s) for eta in budget.etas for m in budget.over_eta for s in range(budget.seeds)
    ]
    for eta in budget.darl_etas:
        for m in budget.compared:
            for s in range(budget.seeds):
                if Cell(m, eta, s) not in cells:
                    cells.append(Cell(m, eta, s))
    for eta in budget.ablation_etas:
        cells += [Cell(m, eta, s) for m in ABLATIONS for s in range(budget.seeds)]
    return cells


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
    if cell.method in CONTROLS:
        settings["control"] = CONTROLS[cell.method]
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
    overrides += ABLATIONS.get(cell.method, []) + CONTROLS.get(cell.method, [])
    return load_config(preset_path(cell.method), overrides)
