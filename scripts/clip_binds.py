"""When does each objective's clip bind? clip_frac of every policy loss at the defaults (one
AdamW step per batch) and with 4 PPO mini-batches x 2 epochs at lr 5e-4, at eta = 0 and 4.

Evidence for docs/darl.md's objectives guide. A tiny random model, a reward with varied
values (1 for an even-length completion), lag emulation (rollout.lag=fixed: staleness is
exactly eta, no rollout server), 4 prompts x 4 samples, 6 steps, seed 0. Prints one line per
run and writes OUT/results.json.

    .venv/bin/python scripts/clip_binds.py [OUT]   # default /tmp/clip_binds
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

LOSSES = {
    "ppo": ["algo.loss=ppo"],
    "decoupled": ["algo.loss=decoupled"],
    "recompute": ["algo.loss=recompute"],
    "gspo": ["algo.loss=gspo", "algo.is_level=geometric", "algo.aggregation=seq_mean_token_mean"],
    "cispo": ["algo.loss=cispo"],
}
SETTINGS = {
    "default": [],
    "mb4x2": ["optim.ppo_minibatches=4", "optim.ppo_epochs=2", "optim.lr=5e-4"],
}


def parity_grader(problem: object, completion: str) -> float:
    """1 for an even-length completion: rewards that vary on a random model."""
    return float(len(completion) % 2 == 0)


def run_one(out: Path, model: Path, name: str, overrides: list[str]) -> dict[str, float]:
    """Train one run; the mean and max clip_frac over its steps."""
    from relayrl.config.loader import load_config
    from relayrl.train.run import run_train

    base = [
        f"output_dir={out / 'runs'}", f"name={name}", f"model.path={model}",
        "model.max_context=128", "rollout.prompts_per_step=4", "rollout.n_samples=4",
        "rollout.max_new_tokens=16", "rollout.lag=fixed", "algo.dynamic_sampling=false",
        "train.total_steps=6", "train.eval_every=0", "train.progress=false",
        "eval.num_problems=4", "eval.max_new_tokens=16", "train.trainer_threads=1",
        "runtime.threads=1", "seed=0",
    ]  # fmt: skip
    run_train(load_config(None, base + overrides), grader=parity_grader)
    rows = [json.loads(line) for line in (out / "runs" / name / "metrics.jsonl").open()]
    clip = [r["clip_frac"] for r in rows if "clip_frac" in r]
    return {"clip_frac_mean": sum(clip) / len(clip), "clip_frac_max": max(clip)}


def main() -> None:
    from relayrl.models.build import create_model_dir
    from relayrl.tasks.registry import make_task

    out = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/clip_binds")
    model = out / "model"
    if not (model / "config.json").exists():
        create_model_dir(model, make_task("arithmetic"), "tiny", seed=0, corpus_size=500)
    results = {}
    for loss, loss_keys in LOSSES.items():
        for setting, keys in SETTINGS.items():
            for eta in (0, 4):
                name = f"{loss}_{setting}_eta{eta}"
                results[name] = run_one(out, model, name, [*loss_keys, *keys, f"rollout.eta={eta}"])
                print(name, results[name], flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
