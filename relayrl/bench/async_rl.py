"""``relayrl bench async``: synchronous (η = 0) vs asynchronous (η = 4) RL throughput.

Both sides train the same config (model, task, B, n, budget, steps) for the same number of
samples with real rollout server processes, each with its own best thread setting: the
synchronous side alternates generation and training, so each phase may use every core; it
runs with 1 thread, with every core and with the asynchronous side's thread counts per
phase, and the fastest run is its baseline. The asynchronous side runs both phases at once
on a split of the cores (``--async-threads SERVER,TRAINER``; default half each, so one each
on 2 cores). Throughput = trained completion tokens / wall time of the training loop.

``overlap_limit`` is the speed-up that perfect overlap of the synchronous run's measured
stage times would give over the run's N steps. A perfect two-stage pipeline still starts
with one generation that nothing overlaps and ends with one training step, so it takes
``T_gen + T_train + (N − 1)·max(T_gen, T_train)`` against the synchronous
``N·(T_gen + T_train)``; ``steady_overlap_limit`` is the N → ∞ value
``(T_gen + T_train) / max(T_gen, T_train)``. Both assume each stage keeps its synchronous
speed while they overlap, but the asynchronous side gives each stage only its share of the
cores: ``core_split_limit`` is ``(T_gen + T_train) / max(T_gen(S), T_train(T))`` with the
stage times the synchronous runs measured at the split's S server and T trainer threads.
The last line is ``async_speedup=X.XX``.

Imports: the config loader, model building and the RL job (``relayrl.train.run``).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from relayrl.config.budget import RunBudget
from relayrl.errors import RelayError
from relayrl.metric_names import (
    BEHAV_KL,
    ELAPSED_S,
    FINAL,
    PUBLISH_LATENCY_S,
    STALENESS_MEAN,
    TIME_PROX_S,
    TIME_SYNC_S,
    TIME_UPDATE_S,
    TIME_WAIT_S,
    TRAIN_TOKENS,
)
from relayrl.report.logs import read_jsonl

HELP = "synchronous vs asynchronous RL training throughput (prints async_speedup)"

OWN_MODEL_CONTEXT = 160


def split_threads(spec: str | None, cores: int) -> dict[str, int]:
    """The asynchronous side's ``{"server": S, "trainer": T}`` from ``"S,T"``, or by default
    the cores split in half (the server gets the smaller half; one each on 2 cores)."""
    if spec is None:
        server = max(1, cores // 2)
        return {"server": server, "trainer": max(1, cores - server)}
    parts = spec.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise RelayError(
            f"--async-threads {spec!r}: expected SERVER,TRAINER, two positive integers (e.g. 8,8)"
        )
    return {"server": int(parts[0]), "trainer": int(parts[1])}


def sync_thread_candidates(requested: int | None, split: dict[str, int], cores: int) -> list[int]:
    """Thread counts to run the synchronous side at, whose phases never overlap and so may
    each use every core: 1, every core and the split's two counts (the fastest run is the
    baseline: on a small model or a busy machine more threads can be slower; the split's
    counts give the stage times of ``core_split_limit``). ``requested`` replaces 1 and every
    core."""
    tried = {requested} if requested is not None else {1, cores}
    return sorted(tried | set(split.values()))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick", action="store_true", help="a smoke test (< 1 minute), not a measurement"
    )
    parser.add_argument("--preset", default=None, help="model size preset (tiny quick, small)")
    parser.add_argument("--steps", type=int, default=None, help="training steps per side")
    parser.add_argument("--model", default=None, help="an existing model directory")
    parser.add_argument(
        "--sync-threads",
        type=int,
        default=None,
        help="threads of each synchronous phase (default: run with 1 and with every core, "
        "keep the faster; the --async-threads counts are always run too)",
    )
    parser.add_argument(
        "--async-threads",
        default=None,
        metavar="SERVER,TRAINER",
        help="threads of the asynchronous side's server and trainer, which run at once "
        "(default: the cores split in half; 1,1 on 2 cores)",
    )
    parser.add_argument(
        "--device", default="cpu", help="torch device of the servers and the trainer (cpu, cuda)"
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="config overrides for both sides, after the benchmark's own (e.g. "
        "train.publish_every=2; the η = 0 side caps it at 1)",
    )


def budget(args) -> RunBudget:
    """The demo's embedded B, n and token budget (``--quick``: halved B, 48 tokens), no
    evaluation: only the training loop is timed."""
    from relayrl.config.schema import RolloutConfig

    demo = RolloutConfig()
    return RunBudget(
        steps=args.steps or (6 if args.quick else 20),
        prompts_per_step=8 if args.quick else demo.prompts_per_step,
        n_samples=demo.n_samples,
        max_new_tokens=48 if args.quick else demo.max_new_tokens,
        eval_every=0,
        eval_problems=1,
        eval_max_new_tokens=8,
    )


def _overrides(
    args, out: Path, model_dir: Path, eta: int, threads: dict[str, int], name: str
) -> list[str]:
    """The demo's config at ``eta`` with the benchmark's budget and threads, decoupled PPO,
    then the user's ``KEY=VALUE`` overrides."""
    own_model = [] if args.model else [f"model.max_context={OWN_MODEL_CONTEXT}"]
    return [
        f"output_dir={out}",
        f"name={name}",
        f"model.path={model_dir}",
        f"model.device={args.device}",
        *own_model,
        f"rollout.eta={eta}",
        f"rollout.server_threads={threads['server']}",
        f"train.trainer_threads={threads['trainer']}",
        "runtime.threads=1",
        "algo.loss=decoupled",
        *budget(args).overrides(),
        *args.overrides,
    ]


def measure(run_dir: Path) -> dict[str, float]:
    """Trained tokens, loop seconds and mean stage times from a run's logs."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    steps = [r for r in rows if TRAIN_TOKENS in r]
    samples = read_jsonl(run_dir / "samples.jsonl")
    tokens = sum(s["completion_tokens"] for s in samples)
    seconds = steps[-1][ELAPSED_S]
    n = len(steps)
    train = sum(r[TIME_PROX_S] + r[TIME_UPDATE_S] for r in steps) / n
    sync = sum(r[TIME_SYNC_S] for r in steps) / n
    wait = sum(r[TIME_WAIT_S] for r in steps) / n
    # the first step also waits for the servers' warm-up; count steps 2.. for stage times
    later = steps[1:] or steps
    final = next((r for r in rows if r.get(FINAL)), {})
    gen = sum(r[TIME_WAIT_S] for r in later) / len(later)
    return {
        "tokens": float(tokens),
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "t_train": train + sync,
        "t_gen": gen,
        # at η = 0 the trainer waits exactly while the servers generate its batch: the
        # servers' generation speed (compare rollout.engine=builtin and =vllm with it)
        "gen_tokens_per_s": tokens / n / max(gen, 1e-9),
        "t_wait": wait,
        STALENESS_MEAN: sum(r[STALENESS_MEAN] for r in steps) / n,
        "publish_latency": sum(r.get(PUBLISH_LATENCY_S, 0.0) for r in later) / len(later),
        "resubmissions": steps[-1].get("resubmissions", 0.0),
        # KV the servers recomputed after weight updates (retracted requests), per step
        "reprefill_tokens": final.get("server_reprefill_tokens", 0.0) / n,
        "retracted": final.get("server_retracted", 0.0) / n,
        # running requests that kept their KV across an update (train.publish_mode=inflight)
        "kept_kv": final.get("server_kept_kv", 0.0) / n,
        # at η = 0 this is the engine-vs-trainer logprob mismatch alone
        BEHAV_KL: sum(r.get(BEHAV_KL, 0.0) for r in steps) / n,
    }


def overlap_limit(t_gen: float, t_train: float, steps: int | None) -> float:
    """Speed-up of a perfect two-stage pipeline over ``steps`` steps (``None``: unbounded)
    against running the stages one after the other."""
    slow = max(t_gen, t_train, 1e-9)
    if steps is None:
        return (t_gen + t_train) / slow
    return steps * (t_gen + t_train) / (t_gen + t_train + (steps - 1) * slow)


def core_split_limit(
    sync_best: dict[str, float], at_server_threads: dict[str, float], at_trainer_threads=None
) -> float:
    """The speed-up perfect overlap could give when each stage gets only its share of the
    cores: generation at the server's thread count, training at the trainer's (the stage
    times of the synchronous runs at those counts; one run when they are equal), against
    the synchronous baseline's per-step time (N → ∞)."""
    at_trainer_threads = at_trainer_threads or at_server_threads
    slow = max(at_server_threads["t_gen"], at_trainer_threads["t_train"], 1e-9)
    return (sync_best["t_gen"] + sync_best["t_train"]) / slow


def _run(args, out: Path, model_dir: Path, eta: int, threads: dict[str, int]) -> dict[str, Any]:
    from relayrl.config.loader import load_config
    from relayrl.train.run import run_train

    name = f"eta{eta}-threads{threads['server']}-{threads['trainer']}"
    config = load_config(None, _overrides(args, out, model_dir, eta, threads, name))
    run_train(config, progress=False)
    return measure(out / name)


def _model_dir(args, out: Path) -> Path:
    if args.model:
        return Path(args.model)
    from relayrl.models.build import create_model_dir
    from relayrl.tasks.registry import make_task

    preset = args.preset or ("tiny" if args.quick else "small")
    model_dir = out / f"{preset}_model"
    create_model_dir(
        model_dir,
        make_task("arithmetic"),
        preset,
        seed=0,
        max_position_embeddings=OWN_MODEL_CONTEXT,
    )
    return model_dir


def run(args: argparse.Namespace) -> int:
    import os

    import torch

    torch.set_num_threads(1)
    cores = os.cpu_count() or 1
    split = split_threads(args.async_threads, cores)
    with tempfile.TemporaryDirectory(prefix="relayrl-bench-async-") as tmp:
        out = Path(tmp)
        model_dir = _model_dir(args, out)
        tried = {
            n: _run(args, out, model_dir, 0, {"server": n, "trainer": n})
            for n in sync_thread_candidates(args.sync_threads, split, cores)
        }
        asyn = _run(args, out, model_dir, 4, split)
    for n, result in tried.items():
        print(
            f"sync with {n} thread(s) per phase: {result['tokens_per_s']:.1f} tokens/s "
            f"(t_gen_per_step={result['t_gen']:.2f} t_train_per_step={result['t_train']:.2f})"
        )
    best = max(tried, key=lambda n: tried[n]["tokens_per_s"])
    sync, sync_t = tried[best], {"server": best, "trainer": best}
    steps = budget(args).steps
    limit = overlap_limit(sync["t_gen"], sync["t_train"], steps)
    steady = overlap_limit(sync["t_gen"], sync["t_train"], None)
    print(
        f"device={args.device} sync: eta=0 server_threads={sync_t['server']} "
        f"trainer_threads={sync_t['trainer']} seconds={sync['seconds']:.1f} "
        f"t_gen_per_step={sync['t_gen']:.2f} t_train_per_step={sync['t_train']:.2f} "
        f"generation_tokens_per_s={sync['gen_tokens_per_s']:.1f} "
        f"engine_trainer_kl_k3={sync[BEHAV_KL]:.2e}"
    )
    print(
        f"async: eta=4 server_threads={split['server']} "
        f"trainer_threads={split['trainer']} seconds={asyn['seconds']:.1f} "
        f"wait_per_step={asyn['t_wait']:.2f} t_train_per_step={asyn['t_train']:.2f} "
        f"staleness_mean={asyn[STALENESS_MEAN]:.2f} "
        f"publish_latency_per_step={asyn['publish_latency']:.2f} "
        f"resubmissions={asyn['resubmissions']:.0f} "
        f"retracted_per_step={asyn['retracted']:.0f} "
        f"reprefill_tokens_per_step={asyn['reprefill_tokens']:.0f} "
        f"kept_kv_per_step={asyn['kept_kv']:.0f}"
    )
    print(f"sync_tokens_per_s={sync['tokens_per_s']:.1f}")
    print(f"async_tokens_per_s={asyn['tokens_per_s']:.1f}")
    speedup = asyn["tokens_per_s"] / sync["tokens_per_s"]
    limit_split = core_split_limit(sync, tried[split["server"]], tried[split["trainer"]])
    print(f"core_split_limit={limit_split:.2f}")
    print(f"fraction_of_core_split_limit={speedup / limit_split:.2f}")
    print(f"steady_overlap_limit={steady:.2f}")
    print(f"overlap_limit={limit:.2f}")
    print(f"fraction_of_limit={speedup / limit:.2f}")
    if args.quick:
        print(
            "note: --quick is a smoke test (tiny model, 6 steps): two consecutive runs on a "
            "2-core machine have differed by 0.6; use the full run for figures"
        )
    print(f"async_speedup={speedup:.2f}")
    return 0
