"""FSDP2 with NCCL at world size 1 against the single-process trainer, on one GPU.

``python scripts/fsdp_cuda_check.py MODEL_DIR [--steps 4] [--bf16]``

`relayrl train` uses the sharded trainer only at ``train.world_size`` > 1, which NCCL cannot
run on one GPU; this script drives the same classes directly. Both sides start from the same
weights and train the same fixed batches (``relayrl.bench.trainer.fixed_batch``); it prints
each step's statistics side by side, the tokens/s of each and the largest difference between
the two sets of trained weights. Last line: ``fsdp_nccl_max_param_diff=X``.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from relayrl.bench.trainer import fixed_batch
from relayrl.config.loader import load_config
from relayrl.models.loading import load_model, load_tokenizer
from relayrl.train.fsdp import ShardedRLTrainer
from relayrl.train.options import ShardingOptions, TrainerOptions
from relayrl.train.trainer import RLTrainer

SHOWN = ("grad_norm", "entropy", "ratio_mean", "clip_frac", "train_tokens")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def train(trainer: RLTrainer, vocab: int, steps: int, groups: int) -> tuple[list[dict], float]:
    """The fixed batches 0..steps-1; per-step statistics and tokens/s after step 0."""
    rows, tokens, seconds = [], 0.0, 0.0
    for step in range(steps):
        batch = fixed_batch(step, vocab, groups, samples=8, max_len=40)
        sync()
        start = time.perf_counter()
        stats = trainer.train_step(batch)
        sync()
        if step:
            tokens, seconds = tokens + stats["train_tokens"], seconds + time.perf_counter() - start
        rows.append(stats)
    return rows, tokens / max(seconds, 1e-9)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--bf16", action="store_true", help="train.mixed_precision=bf16")
    parser.add_argument("--device", default="cuda", help="cuda (NCCL) or cpu (gloo, a dry run)")
    args = parser.parse_args()
    overrides = [
        f"model.path={args.model_dir}",
        f"model.device={args.device}",
        "optim.lr=1e-5",
        "optim.warmup_steps=0",
        f"train.mixed_precision={'bf16' if args.bf16 else 'none'}",
        "train.drift_metrics=false",
    ]
    config = load_config(None, overrides)
    options = TrainerOptions.from_config(config)
    pad_id = load_tokenizer(args.model_dir).pad_token_id

    torch.manual_seed(0)
    single_model = load_model(args.model_dir, device=args.device)
    vocab = single_model.config.vocab_size
    single_rows, single_tps = train(
        RLTrainer(single_model, options, pad_id), vocab, args.steps, args.groups
    )

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    on_cuda = args.device.startswith("cuda")
    dist.init_process_group("nccl" if on_cuda else "gloo", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        sharded_model = load_model(args.model_dir, device=args.device)
        sharded = ShardedRLTrainer(
            sharded_model,
            options,
            ShardingOptions.from_config(config),
            pad_id,
            "cuda" if on_cuda else "cpu",
        )
        sharded_rows, sharded_tps = train(sharded, vocab, args.steps, args.groups)
        full = get_model_state_dict(
            sharded_model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
    finally:
        dist.destroy_process_group()

    for step, (a, b) in enumerate(zip(single_rows, sharded_rows, strict=True)):
        cells = "  ".join(
            f"{k} {a.get(k, float('nan')):.6g} / {b.get(k, float('nan')):.6g}" for k in SHOWN
        )
        print(f"step {step} single / fsdp-nccl: {cells}")
    single_state = {k: v.detach().cpu() for k, v in single_model.state_dict().items()}
    diffs = {k: (single_state[k].float() - v.float()).abs().max().item() for k, v in full.items()}
    worst = max(diffs, key=diffs.get)
    print(
        f"tokens/s: single {single_tps:.0f}, fsdp-nccl {sharded_tps:.0f} ({sharded_tps / single_tps:.2f}x)"
    )
    print(f"largest weight difference after {args.steps} steps: {diffs[worst]:.3g} ({worst})")
    print(f"fsdp_nccl_max_param_diff={diffs[worst]:.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
