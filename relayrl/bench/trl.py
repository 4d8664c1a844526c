"""``relayrl bench trl``: TRL's ``GRPOTrainer`` against relayrl (async η = 4, ``--eta``, and sync η = 0).

Owns the side-by-side benchmark: one SFT base model directory, one workload's task, reward
function, B (prompts per step), n (group size), completion budget, AdamW (same lr, betas,
weight decay, the same warm-up schedule object) and clip ranges; each side trains in its own
spawned process, one after the other, while this process samples the RSS of that process
tree (psutil; rollout servers and grading workers included) for the peak memory.

Workloads (``--workload``): ``demo``, the demo's task and budget (short completions), and
``longtail``, arithmetic chains whose lengths have a long tail (up to 512 completion tokens)
so that generation dominates and a padded ``model.generate`` batch waits for its longest
member. Without ``--model`` the benchmark builds the workload's own SFT base once (seed 0)
under ``--out`` and reuses it for every seed and later runs with the same settings.

Held-out pass@1 is measured the same way on every side: relayrl's evaluator
(``relayrl.train.loop.evaluate_model``, T = 1) on the same held-out problems every
``--eval-every`` steps (relayrl's own periodic evaluation; a ``TrainerCallback`` for TRL).
**Evaluation time is excluded** from every side's wall clock; relayrl's clock starts when its
rollout servers are up, TRL's at ``on_train_begin``. Every side runs once per ``--seeds``
seed; the target rule and the mean ± std over seeds are :mod:`relayrl.bench.trl_target`'s.
Outputs (``--out``, default ``runs/bench_trl``): ``trl_bench.csv`` (side, seed, step,
elapsed_s, pass@1), ``trl_bench.json`` (figures, settings, target rule and what differs) and
``trl_pass_vs_time.png``. The last printed line is ``relayrl_vs_trl_time_to_target=X.XX``:
TRL's mean time to target over the seeds / relayrl async's mean.

TRL is the ``bench`` extra (``pip install -e .[bench]``), imported only inside the TRL
side's process. Imports: config loader, tasks, rewards, model loading, the engine (for the
base model's completion lengths), the staleness bound's ``auto``, the SFT job and the RL job
(``relayrl.train``), matplotlib for the plot.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from relayrl.bench.trl_target import (
    SideSummary,
    Target,
    common_target,
    crossing_midpoint,
    fixed_target,
    percentiles,
    ratio_of_means,
    summarize,
    time_to_target,
)
from relayrl.config.budget import RunBudget
from relayrl.errors import RelayError
from relayrl.metric_names import (
    ELAPSED_S,
    EVAL_PASS_AT_1,
    FINAL,
    REWARD_MEAN,
    STEP,
    TIME_EVAL_S,
)
from relayrl.report.logs import read_jsonl
from relayrl.rollout.eta import AUTO

HELP = "TRL GRPOTrainer vs relayrl (async and sync) on the same work: time to a held-out pass@1"

TRL_VERSION = "1.16.0"
TRL_THREADS = 2  # TRL runs alone on the machine, so it gets both cores
ASYNC_THREADS = {"server": 1, "trainer": 1}  # generation and training overlap
DEFAULT_ETA = "default"  # the async side keeps relayrl's default rollout.eta; --eta sets it
SYNC_THREADS = {"server": 2, "trainer": 2}  # η = 0: the phases alternate, each may use both
SIDES = ("relayrl_async", "relayrl_sync", "trl")
RSS_POLL_S = 0.2
# a side told to stop (the benchmark interrupted) gets this long to finish: relayrl's sides
# end their step, checkpoint and stop their rollout servers on SIGTERM
SIDE_STOP_GRACE_S = 120.0
SFT_SEED = 0  # the benchmark's own SFT base is built once and shared by every seed
DEFAULT_TARGET_FRACTION = 0.8
SMOKE = "smoke test: not a measurement"
NOISE_NOTE = (
    "the worst run's best beat the base by no more than one standard error of the "
    "evaluation: every side reaches this target by noise, so the ratio is that of the times "
    "to the first evaluations (of step times), not of learning; read pass@1 per step"
)
PROMPTS_CHECKED = 256  # longest train prompts (by characters) checked against the context

# What cannot be matched exactly; printed and written to trl_bench.json (docs/trl.md).
DIFFERENCES = [
    "loss: relayrl decoupled PPO (eps 0.2/0.28 on pi/pi_prox) vs TRL loss_type='dapo' "
    "(epsilon=0.2, epsilon_high=0.28 on pi/pi_old, token level); with one update per batch "
    "both ratios are 1 on fresh data, so the sync sides compute the same token-mean gradient",
    "staleness: relayrl async trains samples up to eta versions old (corrected by pi_prox/mu); "
    "TRL and relayrl sync are on-policy",
    "advantages: (r - mean) / (std + eps), unbiased std in both; eps 1e-6 (relayrl) vs 1e-4 (TRL)",
    "KL: none on either side (relayrl algo.kl_coef=0, TRL beta=0)",
    "dynamic sampling: off in relayrl for this benchmark (TRL has none), so both train "
    "B*n samples per step including all-equal groups",
    "prompt order: relayrl's PromptLoader and TRL's RepeatSampler shuffle the same train "
    "split with different generators",
    "generation: relayrl's continuous-batching engine in rollout-server processes vs TRL's "
    "transformers model.generate (padded batch) in the trainer process",
    "training batch: relayrl packs micro-batches of similar length (optim.micro_batch_tokens); "
    "TRL computes the step on one batch padded to its longest prompt + completion",
    "threads: relayrl async 1 server + 1 trainer thread, relayrl sync 2 + 2 (phases "
    "alternate), TRL torch.set_num_threads(2); relayrl also runs 1 grading process",
    "clock: relayrl's starts after its rollout servers are healthy (startup excluded), "
    "TRL's at on_train_begin; evaluation time is excluded on all sides",
]


@dataclass(frozen=True, kw_only=True)
class Settings(RunBudget):
    """One benchmark's shared settings (every side reads these). ``target`` None: the
    common rule (``target_fraction`` of the way from base to the worst run's best)."""

    workload: str = "demo"
    target: float | None = None
    target_fraction: float = DEFAULT_TARGET_FRACTION
    async_eta: int | str = DEFAULT_ETA  # an integer ≥ 1, 'auto' or relayrl's default
    seed: int = 0
    extra_overrides: tuple[str, ...] = ()  # the workload's task and model settings
    config_file: str | None = None  # a run config the sides start from (None: the defaults)
    # the user's KEY=VALUE: relayrl's sides, and what TRL reads from the same config
    user_overrides: tuple[str, ...] = ()


@dataclass(frozen=True)
class Workload:
    """A benchmark workload: its budget (full and ``--quick``), the task and model settings
    every side and the SFT base read, and the settings of its own SFT warm start."""

    name: str
    full: Settings
    quick: Settings
    sft: tuple[str, ...] = ()
    quick_sft: tuple[str, ...] = ("sft.steps=40", "sft.batch_size=32", "eval.num_problems=16")
    about: str = ""


DEMO = Workload(
    "demo",
    full=Settings(
        steps=80,
        prompts_per_step=16,
        n_samples=8,
        max_new_tokens=80,
        eval_every=5,
        eval_problems=200,
        eval_max_new_tokens=160,
    ),
    quick=Settings(
        steps=2,
        prompts_per_step=4,
        n_samples=4,
        max_new_tokens=48,
        eval_every=2,
        eval_problems=16,
        eval_max_new_tokens=48,
    ),
    about="the demo's arithmetic task (2-6 steps, ~35 completion tokens) and budget",
)

# Arithmetic chains of 2 + Geometric(0.85) steps, capped at 24 (single-letter labels a-x):
# about 9 tokens per step, so a median completion of ~55 tokens and a tail to ~230 (and to the
# 512 budget when the model loses its way); the 768-token context fits the longest prompt +
# 512 new tokens. Values ≤ 20 and operands ≤ 3 keep the arithmetic small enough for a short
# SFT of the tiny model to learn. Chains up to 40 (labels past z) left a base whose failures
# were mostly lookups of the step in the prompt, which RL did not improve (docs/trl.md).
LONGTAIL_CONFIG = (
    "task.params.min_steps=2",
    "task.params.max_steps=24",
    "task.params.tail=0.85",
    "task.params.max_value=20",
    "task.params.max_operand=3",
    "model.preset=tiny",
    "model.max_context=768",
)
LONGTAIL = Workload(
    "longtail",
    full=replace(
        DEMO.full,
        workload="longtail",
        steps=60,
        prompts_per_step=8,
        max_new_tokens=512,
        eval_max_new_tokens=512,
        extra_overrides=LONGTAIL_CONFIG,
    ),
    quick=replace(
        DEMO.quick,
        workload="longtail",
        max_new_tokens=128,
        eval_max_new_tokens=128,
        extra_overrides=LONGTAIL_CONFIG,
    ),
    sft=("sft.steps=1500", "sft.batch_size=32", "sft.wrong_fraction=0.5"),
    quick_sft=("sft.steps=20", "sft.batch_size=16", "eval.num_problems=16"),
    about="arithmetic chains of 2 + Geometric(0.85) steps up to 24, values ≤ 20, operands "
    "≤ 3 (long-tail completion lengths, budget 512 tokens), tiny preset, 768-token context",
)
# The SmolLM2-135M-Instruct recipe (docs/real-model.md): its config gives the model (the
# PyPI package's GGUF, converted once), task, chat template, learning rate and precision
# (bf16 on both sides where the CPU has fast bf16, float32 where it emulates it) and the
# optimizer (lr 2e-5, cosine, 2 warm-up steps; both sides decay over the benchmark's 20 steps,
# TRL's through relayrl's own schedule function); the benchmark sets the budget. Both sides
# evaluate with relayrl's evaluator on the trainer's fp32 weights (eval.backend=trainer), as
# TRL's side can only do. Figures before 2026-12-07 evening ran at lr 1e-5, constant.
SMOLLM2_CONFIG = "configs/smollm2.yaml"
SMOLLM2_SETTINGS = ("eval.backend=trainer",)
SMOLLM2_FULL = Settings(
    workload="smollm2",
    steps=20,
    prompts_per_step=8,
    n_samples=8,
    max_new_tokens=40,
    eval_every=10,
    eval_problems=200,
    eval_max_new_tokens=40,
    config_file=SMOLLM2_CONFIG,
    extra_overrides=SMOLLM2_SETTINGS,
)
SMOLLM2 = Workload(
    "smollm2",
    full=SMOLLM2_FULL,
    quick=replace(
        SMOLLM2_FULL,
        steps=2,
        prompts_per_step=2,
        n_samples=4,
        max_new_tokens=16,
        eval_every=2,
        eval_problems=8,
        eval_max_new_tokens=16,
    ),
    about="SmolLM2-135M-Instruct's recipe (configs/smollm2.yaml: reasoning-gym chain_sum, the "
    "model's chat template, bf16 compute on both sides where bf16 is fast), no warm start",
)
WORKLOADS = {w.name: w for w in (DEMO, LONGTAIL, SMOLLM2)}


@dataclass
class SideResult:
    """What one side measured at one seed. ``curve``: (step, elapsed_s without eval, pass@1);
    ``train_reward``: (step, mean reward of the samples that step trained on)."""

    side: str
    curve: list[tuple[int, float, float]]
    train_seconds: float
    samples: int
    peak_rss_mb: float = 0.0
    process_seconds: float = 0.0
    seed: int = 0
    train_reward: list[tuple[int, float]] = field(default_factory=list)

    @property
    def samples_per_s(self) -> float:
        return self.samples / max(self.train_seconds, 1e-9)

    def time_to_target(self, target: float) -> tuple[float, bool]:
        """(seconds until pass@1 first ≥ target after training began, reached); else
        (total time, False). The base model's evaluation (step 0) does not count."""
        return time_to_target(self.curve, self.train_seconds, target)

    def late_train_reward(self) -> float | None:
        """Mean training reward over the second half of the steps (None: not recorded).

        Learning per step, read from the training samples: 64 per step here against one
        held-out evaluation of a few hundred problems, so less noisy than pass@1 at a step.
        On the async side a step's samples come from policies up to eta versions older."""
        if not self.train_reward:
            return None
        last = max(step for step, _ in self.train_reward)
        late = [r for step, r in self.train_reward if step > last / 2]
        return statistics.fmean(late)


# --------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick", action="store_true", help="smoke test, < 1 minute idle (not a measurement)"
    )
    parser.add_argument(
        "--workload",
        default="demo",
        choices=sorted(WORKLOADS),
        help="demo: the demo's task and budget; longtail: long-tail completion lengths "
        "(budget 512 tokens) where generation dominates; smollm2: the SmolLM2-135M recipe "
        "(`make smollm2` first; its model unless --model) (default: demo)",
    )
    parser.add_argument("--model", default=None, help="SFT base model directory (default: SFT)")
    parser.add_argument(
        "--seeds", default="0", help="comma-separated seeds; every side runs once per seed"
    )
    parser.add_argument(
        "--target",
        type=float,
        default=None,
        help="a fixed held-out pass@1 target (default: the common rule, --target-fraction)",
    )
    parser.add_argument(
        "--target-fraction",
        type=float,
        default=DEFAULT_TARGET_FRACTION,
        help="target = base + this fraction of the way to the worst run's best pass@1, "
        f"reached by every run (default {DEFAULT_TARGET_FRACTION})",
    )
    parser.add_argument("--steps", type=int, default=None, help="training steps per side")
    parser.add_argument("--eval-every", type=int, default=None, help="steps between evals")
    parser.add_argument("--eval-problems", type=int, default=None, help="held-out problems")
    parser.add_argument(
        "--eta",
        default=None,
        help="staleness bound of the relayrl async side: an integer ≥ 1 or auto (default: "
        "relayrl's default rollout.eta)",
    )
    parser.add_argument("--out", default="runs/bench_trl", help="output directory")
    parser.add_argument(
        "--sides",
        default=",".join(SIDES),
        help=f"comma-separated subset of {', '.join(SIDES)} (default: all)",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="config overrides after the benchmark's own, for relayrl's sides (e.g. "
        "algo.loss=ppo) and for what TRL reads from the same config (task, evaluation, "
        "optimizer, algo.eps_*, algo.kl_coef, rollout sampling)",
    )


def workload_of(args: argparse.Namespace) -> Workload:
    name = getattr(args, "workload", "demo")
    if name not in WORKLOADS:
        raise RelayError(f"--workload: unknown {name!r}; choose from {', '.join(WORKLOADS)}")
    return WORKLOADS[name]


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The workload's budget (its tiny one for ``--quick``) with the given overrides."""
    w = workload_of(args)
    s = w.quick if args.quick else w.full
    given = {
        "steps": args.steps,
        "eval_every": args.eval_every,
        "eval_problems": args.eval_problems,
        "target": args.target,
        "target_fraction": getattr(args, "target_fraction", None),
        "async_eta": getattr(args, "eta", None),
        "user_overrides": tuple(getattr(args, "overrides", None) or ()) or None,
    }
    s = replace(s, **{k: v for k, v in given.items() if v is not None})
    for name, value in (("steps", s.steps), ("eval_every", s.eval_every)):
        if value < 1:
            raise RelayError(f"--{name.replace('_', '-')} must be ≥ 1 (got {value})")
    if s.eval_problems < 1:
        raise RelayError(f"--eval-problems must be ≥ 1 (got {s.eval_problems})")
    if s.target is not None and not 0 < s.target <= 1:
        raise RelayError(f"--target must be in (0, 1] (got {s.target})")
    if not 0 < s.target_fraction <= 1:
        raise RelayError(f"--target-fraction must be in (0, 1] (got {s.target_fraction})")
    return replace(s, async_eta=parse_eta(s.async_eta))


def parse_eta(value: int | str) -> int | str:
    """``--eta``: ``auto``, an integer ≥ 1, or the default (relayrl's ``rollout.eta``)."""
    if value in (AUTO, DEFAULT_ETA):
        return value
    try:
        eta = int(value)
    except (TypeError, ValueError):
        raise RelayError(f"--eta must be an integer ≥ 1 or auto (got {value!r})") from None
    if eta < 1:
        raise RelayError(f"--eta must be ≥ 1 for the async side (got {eta})")
    return eta


def async_eta_label(s: Settings) -> str:
    """The async side's bound as run: ``4``, ``auto`` or the default's value."""
    if s.async_eta != DEFAULT_ETA:
        return str(s.async_eta)
    from relayrl.config.schema import RolloutConfig

    return f"{RolloutConfig().eta} (default)"


def parse_sides(text: str) -> list[str]:
    sides = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in sides if x not in SIDES]
    if unknown or not sides:
        raise RelayError(f"--sides: unknown {unknown or text!r}; choose from {', '.join(SIDES)}")
    return sides


def check_trl() -> None:
    """Fail early, with the install command, when TRL (the bench extra) is missing."""
    try:
        import trl
    except ImportError as exc:
        raise RelayError(
            f"relayrl bench trl needs TRL: pip install -e '.[bench]' (trl=={TRL_VERSION})"
        ) from exc
    if trl.__version__ != TRL_VERSION:
        print(f"warning: trl {trl.__version__} installed; the benchmark pins {TRL_VERSION}")


# --------------------------------------------------------------------------- config


def run_name(side: str, seed: int) -> str:
    return f"{side}_seed{seed}"


def run_config(
    s: Settings,
    out: Path,
    model_dir: Path | None,
    side: str = "relayrl_async",
    extra: tuple[str, ...] = (),
):
    """The demo's embedded config with the workload's settings and the benchmark's budget for
    one relayrl side at ``s.seed`` (also the source of task, eval and optimizer settings for
    the TRL side, and of the SFT base's config with ``extra`` = the SFT settings)."""
    from relayrl.config.loader import load_config

    async_side = side == "relayrl_async"
    eta, threads = (s.async_eta, ASYNC_THREADS) if async_side else (0, SYNC_THREADS)
    eta_override = [] if eta == DEFAULT_ETA else [f"rollout.eta={eta}"]
    overrides = [
        f"output_dir={out / 'runs'}",
        f"name={run_name(side, s.seed)}",
        f"seed={s.seed}",
        *([f"model.path={model_dir}"] if model_dir else []),
        *eta_override,
        f"rollout.server_threads={threads['server']}",
        f"train.trainer_threads={threads['trainer']}",
        *s.overrides(),
        *s.extra_overrides,
        *s.user_overrides,
        *extra,
    ]
    return load_config(config_path(s.config_file), overrides)


def config_path(name: str | None) -> Path | None:
    """A workload's run config: as given (from the working directory), else in this
    checkout's root; a RelayError naming it when neither exists."""
    if name is None:
        return None
    for candidate in (Path(name), Path(__file__).resolve().parents[2] / name):
        if candidate.is_file():
            return candidate
    raise RelayError(f"bench trl: the workload's config {name!r} is not here (run from a checkout)")


def sft_fingerprint(config) -> str:
    """What decides an SFT base: the task, model and SFT sections and the seed."""
    return json.dumps(
        config.model_dump(mode="json", include={"seed", "task", "model", "sft"}), sort_keys=True
    )


def base_model(args: argparse.Namespace, s: Settings, out: Path) -> Path:
    """``--model``, else the workload's SFT warm start (a short one for ``--quick``), built
    once under ``--out`` and reused while its task, model and SFT settings are unchanged."""
    if args.model:
        from relayrl.models.loading import check_model_dir

        return Path(check_model_dir(args.model))
    from relayrl.train.sft import run_sft

    w = workload_of(args)
    if s.config_file is not None:  # a real model: the config's, no warm start
        return Path(run_config(s, out, None).model.path)
    sft = w.quick_sft if args.quick else w.sft
    name = f"sft_{w.name}{'_quick' if args.quick else ''}"
    config = run_config(replace(s, seed=SFT_SEED), out, None, "sft", sft).model_copy(
        update={"name": name}
    )
    run_dir = out / "runs" / name
    model_dir, key_file = run_dir / "sft_model", run_dir / "sft_fingerprint.json"
    key = sft_fingerprint(config)
    if (model_dir / "config.json").is_file() and key_file.is_file():
        if key_file.read_text() == key:
            base = json.loads((run_dir / "sft_summary.json").read_text())["base_pass@1"]
            print(f"sft warm start: reusing {model_dir} (base_pass@1={base:.2f})")
            return model_dir
    key_file.unlink(missing_ok=True)
    start = time.perf_counter()
    base = run_sft(config, progress=False)
    key_file.write_text(key)
    print(f"sft warm start: base_pass@1={base:.2f} ({time.perf_counter() - start:.0f} s)")
    return model_dir


def check_prompts_fit(tokenizer, problems, max_context: int, max_new_tokens: int) -> None:
    """relayrl skips a train prompt whose tokens + ``max_new_tokens`` exceed
    ``model.max_context`` and TRL would not: fail instead of comparing different prompts.
    Only the ``PROMPTS_CHECKED`` longest prompts by characters are tokenized (fast)."""
    from relayrl.models.loading import encode_prompt

    candidates = sorted(problems, key=lambda p: len(p.prompt))[-PROMPTS_CHECKED:]
    longest = max(len(encode_prompt(tokenizer, p.prompt)) for p in candidates)
    if longest + max_new_tokens > max_context:
        raise RelayError(
            f"model.max_context {max_context} is too small: the longest train prompt has "
            f"{longest} tokens + {max_new_tokens} new tokens; relayrl would skip it, TRL not"
        )


def base_lengths(model_dir: Path, s: Settings, out: Path) -> dict[str, float]:
    """Completion lengths (tokens generated, EOS included) of the base model on the first
    ``eval_problems`` train prompts at the RL budget (T = 1, ``max_new_tokens``): what the
    sides generate at step 0. Percentiles, the mean and the fraction truncated."""
    import statistics

    import torch

    from relayrl.engine.engine import Engine
    from relayrl.engine.types import SamplingParams
    from relayrl.eval.evaluate import generate_all, request_seed
    from relayrl.models.loading import encode_prompt, load_model, load_tokenizer
    from relayrl.tasks.registry import make_task

    torch.set_num_threads(TRL_THREADS)
    config = run_config(s, out, model_dir)
    tokenizer = load_tokenizer(model_dir)
    model = load_model(model_dir, config.model.device, config.model.dtype).eval()
    task = make_task(config.task.name, config.task.params)
    check_prompts_fit(
        tokenizer,
        task.problems("train", config.task.train_size, config.task.seed),
        config.model.max_context,
        s.max_new_tokens,
    )
    problems = task.problems("train", s.eval_problems, config.task.seed)
    prompts = [encode_prompt(tokenizer, p.prompt) for p in problems]
    params = [
        SamplingParams(max_new_tokens=s.max_new_tokens, seed=request_seed(s.seed, i, 0))
        for i in range(len(prompts))
    ]
    with Engine(model, tokenizer) as engine:
        results = generate_all(engine, prompts, params, progress=False)
    lengths = [len(r.output_ids) for r in results if r is not None]
    if not lengths:
        raise RelayError(f"no train prompt fits model.max_context {config.model.max_context}")
    truncated = sum(r.finish_reason == "length" for r in results if r is not None)
    return {
        **percentiles(lengths),
        "mean": statistics.fmean(lengths),
        "truncated": truncated / len(lengths),
        "prompts": len(lengths),
    }


# --------------------------------------------------------------------------- sides (child)


def _relayrl_side(s: Settings, out: Path, model_dir: Path, side: str) -> SideResult:
    from relayrl.train.run import run_train

    config = run_config(s, out, model_dir, side)
    result = run_train(config, progress=False)
    rows = read_jsonl(result.run_dir / "metrics.jsonl")
    return replace(relayrl_curve(side, rows, s.samples_per_step), seed=s.seed)


def relayrl_curve(side: str, rows: list[dict[str, Any]], samples_per_step: int) -> SideResult:
    """Pass@1 against eval-free wall clock from a relayrl run's metrics rows: a step's
    ``elapsed_s`` includes every evaluation up to and including its own, so those are
    subtracted. The final evaluation (``final``, after the last step) is the last point."""
    curve: list[tuple[int, float, float]] = []
    rewards: list[tuple[int, float]] = []
    eval_s = 0.0
    train_s = 0.0
    steps = 0
    for row in rows:
        if REWARD_MEAN in row:
            rewards.append((int(row[STEP]), float(row[REWARD_MEAN])))
        if row.get(FINAL):  # after the last step, on the same problems
            curve.append((int(row[STEP]), train_s, float(row[EVAL_PASS_AT_1])))
            continue
        eval_s += row.get(TIME_EVAL_S, 0.0)
        elapsed = row.get(ELAPSED_S, 0.0) - eval_s
        if ELAPSED_S in row:
            train_s, steps = elapsed, row["step"]
        if EVAL_PASS_AT_1 in row:
            curve.append((int(row[STEP]), max(elapsed, 0.0), float(row[EVAL_PASS_AT_1])))
    return SideResult(side, curve, train_s, steps * samples_per_step, train_reward=rewards)


def _trl_side(s: Settings, out: Path, model_dir: Path) -> SideResult:
    """TRL's side of the comparison: its GRPOTrainer on the same task, model, prompts,
    sampling and evaluation as relayrl's sides (``DIFFERENCES`` lists what differs).

    Why over 80 lines: it sets every "matched" TRL setting the headline figure depends on,
    with its callbacks over the same locals (tokenizer, held-out split, clock); one place
    to read them all side by side with ``run_config``'s."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    from relayrl.models.loading import encode_prompt, load_model, load_tokenizer, prompt_text
    from relayrl.rewards.dispatch import score
    from relayrl.tasks.registry import make_task

    torch.set_num_threads(TRL_THREADS)
    config = run_config(s, out, model_dir)
    torch.manual_seed(config.seed)
    tokenizer = load_tokenizer(model_dir)
    model = load_model(model_dir, config.model.device, config.model.dtype).train()
    task = make_task(config.task.name, config.task.params)
    train = task.problems("train", config.task.train_size, config.task.seed)
    test = task.problems("test", s.eval_problems, config.task.seed)
    chat = bool(getattr(tokenizer, "chat_template", None))
    system = config.model.system_prompt
    prompts = [
        ([{"role": "system", "content": system}] if system else [])
        + [{"role": "user", "content": p.prompt}]
        if chat
        else prompt_text(tokenizer, p.prompt, system)
        for p in train
    ]
    if chat:  # TRL renders a conversation with the template; relayrl renders the same text
        rendered = tokenizer.apply_chat_template(
            prompts[0], add_generation_prompt=True, tokenize=False
        )
        if rendered != prompt_text(tokenizer, train[0].prompt, system):
            raise RelayError("TRL would render prompts differently from relayrl (chat template)")
    elif tokenizer(text=prompts[0])["input_ids"] != encode_prompt(
        tokenizer, train[0].prompt, system
    ):
        raise RelayError("TRL would tokenize prompts differently from relayrl (special tokens)")
    dataset = Dataset.from_dict({"prompt": prompts, "index": list(range(len(train)))})

    def arithmetic_reward(completions: list[Any], index: list[int], **_: Any) -> list[float]:
        # conversational prompts (a chat template) give [{"role": "assistant", ...}] each
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [score(train[i], c) for i, c in zip(index, texts, strict=True)]

    curve: list[tuple[int, float, float]] = []
    rewards: list[tuple[int, float]] = []
    clock = {"start": 0.0, "eval": 0.0, "train": 0.0}
    # with bf16 the trainer's model runs its forward under autocast (accelerate patches it
    # in): evaluate a plain copy of its fp32 weights, as relayrl's trainer-side evaluation
    mixed = config.train.mixed_precision == "bf16"
    eval_model = load_model(model_dir, config.model.device, config.model.dtype) if mixed else model

    def evaluate(step: int) -> None:
        t0 = time.perf_counter()
        elapsed = t0 - clock["start"] - clock["eval"]
        pass_at_1 = held_out_pass_at_1(model, eval_model, tokenizer, test, config)
        curve.append((step, elapsed, pass_at_1))
        clock["eval"] += time.perf_counter() - t0

    class HeldOutEval(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            clock["start"] = time.perf_counter()
            evaluate(0)

        def on_step_end(self, args, state, control, **kwargs):
            step = state.global_step
            clock["train"] = time.perf_counter() - clock["start"] - clock["eval"]
            if step % s.eval_every == 0 and step < s.steps:
                evaluate(step)

        def on_log(self, args, state, control, logs=None, **kwargs):
            # logging_steps=1: each log holds one step's mean reward over its samples
            if logs and "reward" in logs:
                rewards.append((state.global_step, float(logs["reward"])))

    optimizer, scheduler = trl_optimizers(model, config, s.steps)
    args = trl_grpo_config(s, config, out / "runs" / run_name("trl", s.seed), bf16=mixed)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=arithmetic_reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[HeldOutEval()],
        optimizers=(optimizer, scheduler),
    )
    trainer.train()
    evaluate(s.steps)
    train_s = curve[-1][1]
    return SideResult(
        "trl", curve, train_s, s.steps * s.samples_per_step, seed=s.seed, train_reward=rewards
    )


def trl_optimizers(model, config, steps: int):
    """The optimizer and schedule handed to TRL: relayrl's AdamW settings and its own
    ``lr_factor`` over ``steps``, so every step's learning rate is relayrl's."""
    import torch

    from relayrl.train.trainer import lr_factor

    o = config.optim
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda k: lr_factor(k, o.warmup_steps, steps, o.schedule)
    )
    return optimizer, scheduler


def held_out_pass_at_1(model, eval_model, tokenizer, test, config) -> float:
    """pass@1 of ``model``'s weights on the held-out problems with relayrl's evaluator, run
    on ``eval_model`` (a plain float32 copy when the trainer's forward runs under autocast;
    ``model`` itself otherwise)."""
    from relayrl.train.loop import evaluate_model

    if eval_model is not model:
        eval_model.load_state_dict(model.state_dict())
    report = evaluate_model(
        eval_model,
        tokenizer,
        test,
        config.eval.model_copy(update={"num_problems": len(test)}),
        config.seed,
        system_prompt=config.model.system_prompt,
        max_seq_len=config.model.max_context,
    )
    return report.pass_at_1


def trl_grpo_config(s: Settings, config, output_dir: Path, bf16: bool):
    """TRL's ``GRPOConfig`` with relayrl's settings for everything the comparison calls
    matched (``DIFFERENCES`` lists the rest); ``bf16``: accelerate's autocast."""
    from trl import GRPOConfig

    algo, o = config.algo, config.optim
    return GRPOConfig(
        output_dir=str(output_dir),
        use_cpu=True,
        seed=config.seed,
        max_steps=s.steps,
        per_device_train_batch_size=s.samples_per_step,
        gradient_accumulation_steps=1,
        num_generations=s.n_samples,
        max_completion_length=s.max_new_tokens,
        temperature=config.rollout.temperature,
        top_p=config.rollout.top_p,
        top_k=0,
        learning_rate=o.lr,
        adam_beta1=o.betas[0],
        adam_beta2=o.betas[1],
        weight_decay=o.weight_decay,
        max_grad_norm=o.grad_clip,
        beta=algo.kl_coef,
        epsilon=algo.eps_low,
        epsilon_high=algo.eps_high,
        loss_type="dapo",  # token mean over the step's tokens = relayrl's token_mean
        scale_rewards="group",
        importance_sampling_level="token",
        num_iterations=1,
        mask_truncated_completions=False,
        # bf16 autocast with fp32 weights, as relayrl's train.mixed_precision=bf16 (the
        # SmolLM2 recipe); else float32 as relayrl's model.dtype
        bf16=bf16,
        gradient_checkpointing=False,  # as relayrl (TRL's default recomputes activations)
        logging_steps=1,  # every step's training reward (HeldOutEval.on_log)
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def _side_main(side: str, s: Settings, out: Path, model_dir: Path, result_path: Path) -> None:
    """Entry point of a side's spawned process: run it, write its result (or error)."""
    import traceback

    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        start = time.perf_counter()
        if side == "trl":
            result = _trl_side(s, out, model_dir)
        else:
            result = _relayrl_side(s, out, model_dir, side)
        result.process_seconds = time.perf_counter() - start
        payload: dict[str, Any] = {"result": asdict(result)}
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        payload = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    result_path.write_text(json.dumps(payload))


# --------------------------------------------------------------------------- parent


def run_side(side: str, s: Settings, out: Path, model_dir: Path) -> SideResult:
    """Run one side in a fresh spawned process; its peak RSS is the largest sum of RSS
    over the process and its descendants, sampled every ``RSS_POLL_S`` seconds."""
    import multiprocessing

    try:
        import psutil
    except ImportError as exc:
        raise RelayError("relayrl bench trl needs psutil: pip install -e '.[bench]'") from exc

    result_path = out / f"{run_name(side, s.seed)}_result.json"
    result_path.unlink(missing_ok=True)
    proc = multiprocessing.get_context("spawn").Process(
        target=_side_main, args=(side, s, out, model_dir, result_path), name=f"bench-{side}"
    )
    proc.start()
    try:
        peak = _peak_rss_until_exit(proc.pid, psutil, proc.is_alive)
        proc.join()
    finally:  # interrupted (Ctrl-C, SIGTERM): no side keeps training once the bench is gone
        stop_process(proc, SIDE_STOP_GRACE_S)
    if not result_path.is_file():
        raise RelayError(f"{side}: the benchmark process exited ({proc.exitcode}) without a result")
    payload = json.loads(result_path.read_text())
    if "error" in payload:
        raise RelayError(f"{side} failed: {payload['error']}\n{payload['traceback']}")
    r = payload["result"]
    result = SideResult(
        r["side"],
        [tuple(x) for x in r["curve"]],
        r["train_seconds"],
        r["samples"],
        peak / 2**20,
        r["process_seconds"],
        r["seed"],
        [tuple(x) for x in r.get("train_reward", [])],
    )
    return result


def _peak_rss_until_exit(pid: int, psutil, alive) -> int:
    """Largest sum of RSS over ``pid`` and its descendants while ``alive()``."""
    peak = 0
    root = psutil.Process(pid)
    while alive():
        try:
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        total = 0
        for p in tree:
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        peak = max(peak, total)
        time.sleep(RSS_POLL_S)
    return peak


def stop_process(proc, grace_s: float) -> None:
    """SIGTERM a still-running ``proc``, then SIGKILL it if it has not exited in
    ``grace_s`` seconds (a no-op once it has exited)."""
    if not proc.is_alive():
        return
    proc.terminate()
    proc.join(grace_s)
    if proc.is_alive():
        print(f"error: {proc.name} did not stop within {grace_s:.0f} s of SIGTERM: killed")
        proc.kill()
        proc.join()


def _exit_on_sigterm(signum, frame) -> None:  # noqa: ARG001
    raise SystemExit(128 + signum)


def choose_target(results: list[SideResult], s: Settings) -> Target:
    """``--target`` if given, else the common rule over every run of every side."""
    if s.target is not None:
        return fixed_target(s.target)
    return common_target([r.curve for r in results], s.target_fraction, s.eval_problems)


def side_summaries(
    results: list[SideResult], target: float, sides: list[str]
) -> dict[str, SideSummary]:
    """Each side's mean ± std over its seeds of time to ``target`` and samples/s."""
    return {
        side: summarize(
            side,
            [
                (r.seed, *r.time_to_target(target), r.samples_per_s)
                for r in results
                if r.side == side
            ],
        )
        for side in sides
    }


def _run_figures(r: SideResult, target: float) -> dict[str, Any]:
    t, reached = r.time_to_target(target)
    return {
        "side": r.side,
        "seed": r.seed,
        "time_to_target_s": t,
        "reached": reached,
        "train_seconds": r.train_seconds,
        "samples": r.samples,
        "samples_per_s": r.samples_per_s,
        "peak_rss_mb": r.peak_rss_mb,
        "process_seconds": r.process_seconds,
        "curve": r.curve,
        "train_reward": r.train_reward,
        "late_train_reward": r.late_train_reward(),
    }


def write_outputs(
    results: list[SideResult],
    s: Settings,
    target: Target,
    summaries: dict[str, SideSummary],
    out: Path,
    extra: dict,
) -> Path:
    """CSV of every evaluation, JSON of the figures, PNG of pass@1 against wall clock."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with (out / "trl_bench.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["side", "seed", "step", "elapsed_s", "pass@1"])
        for r in results:
            for step, elapsed, p in r.curve:
                w.writerow([r.side, r.seed, step, f"{elapsed:.3f}", f"{p:.4f}"])
    doc = {
        "settings": asdict(s),
        "target": asdict(target) | {"within_noise": target.within_noise},
        "differences": DIFFERENCES,
        "runs": [_run_figures(r, target.value) for r in results],
        "sides": {side: asdict(summary) for side, summary in summaries.items()},
        **extra,
    }
    (out / "trl_bench.json").write_text(json.dumps(doc, indent=2))
    fig, ax = plt.subplots(figsize=(7, 4.2))
    labels = {
        "relayrl_async": f"relayrl async (η={async_eta_label(s)})",
        "relayrl_sync": "relayrl sync (η=0)",
    }
    colours = {"relayrl_async": "tab:blue", "relayrl_sync": "tab:orange", "trl": "tab:green"}
    labelled: set[str] = set()
    for r in results:
        xs, ys = [c[1] for c in r.curve], [c[2] for c in r.curve]
        label = None if r.side in labelled else labels.get(r.side, f"TRL {TRL_VERSION} GRPO")
        labelled.add(r.side)
        ax.plot(xs, ys, marker="o", ms=3, color=colours.get(r.side), alpha=0.8, label=label)
    ax.axhline(target.value, color="grey", ls="--", lw=0.8, label=f"target {target.value:.3f}")
    ax.set_xlabel("wall-clock seconds (evaluation excluded)")
    ax.set_ylabel("held-out pass@1 (T = 1)")
    seeds = sorted({r.seed for r in results})
    ax.set_title(
        f"{s.workload}: B={s.prompts_per_step}, n={s.n_samples}, {s.max_new_tokens} tokens, "
        f"seeds {','.join(map(str, seeds))}"
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png = out / "trl_pass_vs_time.png"
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


def _print_run(r: SideResult, steps: int) -> None:
    curve = " ".join(f"{step}:{p:.2f}" for step, _, p in r.curve)
    late = r.late_train_reward()
    print(
        f"{r.side} seed {r.seed}: train_seconds={r.train_seconds:.1f} "
        f"samples_per_s={r.samples_per_s:.1f} peak_rss_mb={r.peak_rss_mb:.0f} "
        f"process_seconds={r.process_seconds:.1f} ({steps} steps) pass@1 by step {curve}"
        + ("" if late is None else f"; training reward, second half of the steps {late:.3f}"),
        flush=True,
    )


def _print_target(results: list[SideResult], target: Target, summaries) -> None:
    print(f"target rule: {target.rule}")
    if not target.improved:
        print("warning: some run never beat the base model: time to target measures nothing")
    elif target.within_noise:
        print(f"warning: {NOISE_NOTE}")
    for r in results:
        t, reached = r.time_to_target(target.value)
        state = "reached" if reached else "not reached: total time, a lower bound"
        print(
            f"  {r.side} seed {r.seed}: time_to_target={'' if reached else '>'}{t:.1f}s ({state})"
        )
    for side, summary in summaries.items():
        print(
            f"{side}: time_to_target {summary.time_to_target} s"
            f"{'' if summary.reached_all else ' (some seed did not reach it: a lower bound)'}, "
            f"samples_per_s {summary.samples_per_s} (mean ± std over seeds "
            f"{','.join(map(str, summary.seeds))})"
        )
    midpoints = midpoint_means(results, target.value)
    if midpoints:
        print(
            "time to target at the midpoint of each run's crossing interval (the evaluation "
            "grid inflates the slower side more): "
            + ", ".join(f"{side} {t:.1f} s" for side, t in midpoints.items())
            + (
                f"; TRL / relayrl async {midpoints['trl'] / midpoints['relayrl_async']:.2f}"
                if {"trl", "relayrl_async"} <= midpoints.keys()
                else ""
            )
        )


def late_reward_by_side(results: list[SideResult]) -> dict[str, dict[str, float]]:
    """Each side's mean and std over seeds of :meth:`SideResult.late_train_reward`, for the
    sides whose every run recorded its training rewards."""
    by_side: dict[str, list[float]] = {}
    for r in results:
        by_side.setdefault(r.side, []).append(r.late_train_reward())
    return {
        side: {
            "mean": statistics.fmean(values),
            "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        }
        for side, values in by_side.items()
        if None not in values
    }


def _print_late_rewards(late: dict[str, dict[str, float]]) -> None:
    if late:
        print(
            "training reward over the second half of the steps (learning per step; mean ± "
            "std over seeds): "
            + ", ".join(f"{side} {v['mean']:.3f} ± {v['std']:.3f}" for side, v in late.items())
        )


def midpoint_means(results: list[SideResult], target: float) -> dict[str, float]:
    """Each side's mean over seeds of :func:`crossing_midpoint`; {} if some run never
    reached ``target``."""
    by_side: dict[str, list[float]] = {}
    for r in results:
        m = crossing_midpoint(r.curve, target)
        if m is None:
            return {}
        by_side.setdefault(r.side, []).append(m)
    return {side: statistics.fmean(values) for side, values in by_side.items()}


def run(args: argparse.Namespace) -> int:
    import os
    import signal

    from relayrl.bench.demo import parse_seeds

    # SIGTERM unwinds like Ctrl-C, so run_side stops the side it is waiting for
    signal.signal(signal.SIGTERM, _exit_on_sigterm)

    s = settings_from_args(args)
    sides = parse_sides(args.sides)
    seeds = parse_seeds(args.seeds)
    if "trl" in sides:
        check_trl()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.quick:
        print(f"bench trl --quick: {SMOKE} (tiny settings, a few steps)")
    load = os.getloadavg()[0]
    model_dir = base_model(args, s, out)
    lengths = base_lengths(model_dir, s, out)
    rule = (
        f"fixed target {s.target:g}"
        if s.target is not None
        else f"target {s.target_fraction:g} of the way from base to the worst run's best"
    )
    print(
        f"bench trl: workload={s.workload} ({workload_of(args).about}) model={model_dir} "
        f"steps={s.steps} B={s.prompts_per_step} n={s.n_samples} "
        f"max_new_tokens={s.max_new_tokens} async eta={async_eta_label(s)} eval every {s.eval_every} steps on "
        f"{s.eval_problems} held-out problems, {rule}, seeds {','.join(map(str, seeds))}, "
        f"load average {load:.2f} on {os.cpu_count()} cores"
    )
    print(
        f"base model completion tokens on {lengths['prompts']} train prompts (T = 1, budget "
        f"{s.max_new_tokens}): p50 {lengths['p50']} p90 {lengths['p90']} max {lengths['max']} "
        f"mean {lengths['mean']:.1f}, truncated {lengths['truncated']:.1%}"
    )
    for line in DIFFERENCES:
        print(f"  differs: {line}")
    results: list[SideResult] = []
    for seed in seeds:
        for side in sides:
            r = run_side(side, replace(s, seed=seed), out, model_dir)
            results.append(r)
            _print_run(r, s.steps)
    target = choose_target(results, s)
    summaries = side_summaries(results, target.value, sides)
    _print_target(results, target, summaries)
    late = late_reward_by_side(results)
    _print_late_rewards(late)
    extra: dict[str, Any] = {
        "model": str(model_dir),
        "load_average_start": load,
        "seeds": seeds,
        "base_completion_tokens": lengths,
        "quick": bool(args.quick),
        "midpoint_time_to_target_s": midpoint_means(results, target.value),
        "late_train_reward": late,
    }
    final: tuple[float, str, str] | None = None
    if "trl" in summaries:
        for side in ("relayrl_sync", "relayrl_async"):
            if side in summaries:
                ratio, sign, note = ratio_of_means(summaries["trl"], summaries[side])
                extra[f"{side}_vs_trl"] = {"ratio_of_means": ratio, "bound": sign, "note": note}
                print(
                    f"{side}_vs_trl_time_to_target {sign}{ratio:.2f}"
                    f"{' (' + note + ')' if note else ''}"
                )
                if side == "relayrl_async":
                    final = (ratio, sign, note)
    png = write_outputs(results, s, target, summaries, out, extra)
    print(f"written: {out / 'trl_bench.csv'}, {out / 'trl_bench.json'}")
    print(f"plot: {png}")
    if final is not None:
        _print_headline(final, seeds, target, bool(args.quick))
    return 0


def _print_headline(
    final: tuple[float, str, str], seeds: list[int], target: Target, quick: bool
) -> None:
    """The closing lines: relayrl async's time to target against TRL's, last."""
    ratio, bound, note = final
    if bound:
        print(f"note: relayrl_vs_trl_time_to_target is a bound ({bound}): {note}")
    print(f"seeds: {','.join(map(str, seeds))}")
    print(
        "relayrl_vs_trl_time_to_target is the ratio of means over the seeds: TRL's mean "
        "time to target / relayrl async's"
    )
    if not target.improved:
        print("note: some run never beat the base model: this ratio measures nothing")
    elif target.within_noise:
        print(f"note: {NOISE_NOTE}")
    if quick:
        print(SMOKE)
    print(f"relayrl_vs_trl_time_to_target={ratio:.2f}")
