"""relayrl's trainer fed by TRL's sampler, in one process: splits `bench trl`'s gap.

    PYTHONPATH=$PWD python scripts/trainer_with_hf_sampler.py [--seed 3] [--steps 20]
        [--eval-every 10] [--threads 2] [--quick]

`relayrl bench trl --workload smollm2` found TRL ahead of relayrl's sync side (η = 0) at
step 20 on five seeds of five, while on the same samples the two compute the same gradient
(`relayrl bench trl-gradient`). This loop keeps relayrl's `RLTrainer` (its options from the
smollm2 workload's config: bf16 autocast, the decoupled loss, lr 2e-5 cosine over the
steps) and replaces everything between its updates with what TRL does: no rollout server,
no weight publication, samples from `model.generate` on the trainer's own model under bf16
autocast (a padded batch of B·n, T = 1, no top-k/top-p), graded in this process, behaviour
logprobs = the trainer's own (on-policy, as TRL). Evaluation as in `bench trl`: relayrl's
evaluator on a float32 copy, 200 held-out problems, at steps 0, 10 and 20. If this loop
learns like TRL, the gap is in relayrl's loop between updates (server, publication,
sampling streams); if like relayrl's sync side, it is in the trainer after all.

Prints per step: mean reward, truncated fraction, entropy; and pass@1 at each evaluation.
Last line ``hf_sampler_pass@1=X`` (the last evaluation).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

import torch

from relayrl.algo.advantages import compute_advantages
from relayrl.bench.trl import SMOLLM2, held_out_pass_at_1, run_config
from relayrl.models.loading import encode_prompt, load_model, load_tokenizer
from relayrl.rewards.dispatch import score
from relayrl.rollout.prompts import PromptLoader
from relayrl.rollout.trajectory import Trajectory
from relayrl.tasks.registry import make_task
from relayrl.train.options import TrainerOptions
from relayrl.train.trainer import RLTrainer


def generate(model, tokenizer, prompts: list[list[int]], n: int, max_new: int, bf16: bool):
    """TRL's sampler: one left-padded batch of every prompt n times, ``model.generate``."""
    rows = [p for p in prompts for _ in range(n)]
    width = max(len(p) for p in rows)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in rows])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=max_new,
            pad_token_id=pad,
            eos_token_id=tokenizer.eos_token_id,
        )
    completions = []
    for row in out[:, width:].tolist():
        if tokenizer.eos_token_id in row:
            row = row[: row.index(tokenizer.eos_token_id) + 1]
        completions.append(row)
    return rows, completions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="2 steps of the quick budget")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    s = SMOLLM2.quick if args.quick else replace(SMOLLM2.full, steps=args.steps)
    s = replace(s, seed=args.seed)
    out = Path("runs/trainer_with_hf_sampler")
    model_dir = Path(run_config(s, out, None).model.path)
    config = run_config(s, out, model_dir, side="relayrl_sync")
    torch.manual_seed(config.seed)
    tokenizer = load_tokenizer(model_dir)
    model = load_model(model_dir, config.model.device, config.model.dtype)
    trainer = RLTrainer(model, TrainerOptions.from_config(config), tokenizer.pad_token_id)
    eval_model = load_model(model_dir, config.model.device, config.model.dtype)
    task = make_task(config.task.name, config.task.params)
    train = task.problems("train", config.task.train_size, config.task.seed)
    test = task.problems("test", s.eval_problems, config.task.seed)
    loader = PromptLoader(train, config.seed)
    bf16 = config.train.mixed_precision == "bf16"
    system = config.model.system_prompt

    def evaluate(step: int) -> float:
        pass_at_1 = held_out_pass_at_1(model, eval_model, tokenizer, test, config)
        print(f"step {step}: pass@1 {pass_at_1:.3f}", flush=True)
        return pass_at_1

    last = evaluate(0)
    for step in range(1, s.steps + 1):
        t0 = time.perf_counter()
        drawn = [loader.next()[1] for _ in range(s.prompts_per_step)]
        prompts = [encode_prompt(tokenizer, p.prompt, system) for p in drawn]
        model.eval()
        rows, completions = generate(model, tokenizer, prompts, s.n_samples, s.max_new_tokens, bf16)
        model.train()
        problems = [p for p in drawn for _ in range(s.n_samples)]
        texts = [tokenizer.decode(c, skip_special_tokens=True) for c in completions]
        rewards = [score(p, t) for p, t in zip(problems, texts, strict=True)]
        n = s.n_samples
        advs = compute_advantages(
            [rewards[i : i + n] for i in range(0, len(rewards), n)], config.algo.advantage
        )
        trajs = [
            Trajectory(
                f"p{i // n}",
                f"g{step}-{i // n}",
                i % n,
                rows[i],
                c,
                [0.0] * len(c),
                [trainer.version] * len(c),
                trainer.version,
                "stop" if c and c[-1] == tokenizer.eos_token_id else "length",
                rewards[i],
                "ok",
                advs[i // n][i % n],
            )
            for i, c in enumerate(completions)
        ]
        for t, logp in zip(trajs, trainer.traj_logprobs(model, trajs), strict=True):
            t.behav_logprobs = logp.tolist()
        stats = trainer.train_step([trajs[i : i + n] for i in range(0, len(trajs), n)])
        truncated = sum(t.finish_reason == "length" for t in trajs) / len(trajs)
        print(
            f"step {step}: reward {sum(rewards) / len(rewards):.3f} truncated {truncated:.2f} "
            f"entropy {stats.get('entropy', float('nan')):.2f} "
            f"grad_norm {stats['grad_norm']:.3f} ({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
        if step % args.eval_every == 0 or step == s.steps:
            last = evaluate(step)
    print(f"hf_sampler_pass@1={last:.3f}")


if __name__ == "__main__":
    main()
