"""A trainer-only run on fixed batches, at any ``train.world_size``, in its own process:
the data-parallel tests start it (rank 0 then starts the other ranks, as `relayrl train`
does) and compare what it writes.

``python -m tests.train.dp_harness SPEC.json``: SPEC has ``model_dir``, ``run_dir``,
``world_size``, ``steps``, ``out`` and optionally ``checkpoint_after`` (write a checkpoint
after that many steps and stop) and ``resume`` (continue from the run's newest checkpoint),
``overrides`` (more config overrides). ``out`` gets the final weights, the step statistics
and the trainer version (torch.save).
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import torch

from relayrl.bench.trainer import fixed_batch
from relayrl.models.loading import load_model, load_tokenizer
from relayrl.train.distributed import TrainerGroup, make_trainer
from relayrl.train.resume import RunCheckpoints
from tests.train.conftest import rl_config


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    run_dir = Path(spec["run_dir"])
    run_dir.mkdir(parents=True, exist_ok=True)
    config = rl_config(
        run_dir.parent,
        spec["model_dir"],
        f"name={run_dir.name}",
        f"train.world_size={spec['world_size']}",
        f"train.total_steps={spec['steps']}",
        "rollout.eta=0",
        "optim.lr=1e-3",
        "optim.warmup_steps=0",
        "optim.micro_batch_tokens=64",
        # one row per sample at every world size: the data-parallel split is what these
        # tests compare (shared prompts' own equivalence: tests/train/test_shared_prompts.py)
        "optim.share_prompts=false",
        *spec.get("overrides", []),
    )
    tokenizer = load_tokenizer(spec["model_dir"])
    torch.manual_seed(config.seed)
    model = load_model(spec["model_dir"])
    trainer = make_trainer(model, config, tokenizer.pad_token_id, Path(spec["model_dir"]), run_dir)
    checkpoints = RunCheckpoints(run_dir, 0, 2, trainer, tokenizer)
    try:
        first = 0
        if spec.get("resume"):
            first = checkpoints.restore(checkpoints.store.latest())
        stats = []
        last = spec.get("checkpoint_after") or spec["steps"]
        for step in range(first, last):
            stats.append(trainer.train_step(fixed_batch(step, model.config.vocab_size)))
        if spec.get("checkpoint_after"):
            asyncio.run(checkpoints.save(last))
        weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        torch.save({"weights": weights, "stats": stats, "version": trainer.version}, spec["out"])
    finally:
        if isinstance(trainer, TrainerGroup):
            trainer.close()


if __name__ == "__main__":
    main(sys.argv[1])
