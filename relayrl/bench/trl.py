"""``relayrl bench trl``: TRL's ``GRPOTrainer`` against relayrl (async η = 4 and sync η = 0).

Owns the side-by-side benchmark: one SFT base model directory, the demo's task, reward
function, B (prompts per step), n (group size), completion budget, AdamW (same lr, betas,
weight decay, the same warm-up schedule object) and clip ranges; each side trains in its own
spawned process, one after the other, while this process samples the RSS of that process
tree (psutil; rollout servers and grading workers included) for the peak memory.

Held-out pass@1 is measured the same way on every side: relayrl's evaluator
(``relayrl.train.loop.evaluate_model``, T = 1) on the same held-out problems every
``--eval-every`` steps (relayrl's own periodic evaluation; a ``TrainerCallback`` for TRL).
**Evaluation time is excluded** from every side's wall clock; relayrl's clock starts when its
rollout servers are up, TRL's at ``on_train_begin``. Outputs (``--out``, default
``runs/bench_trl``): ``trl_bench.csv`` (side, step, elapsed_s, pass@1), ``trl_bench.json``
(figures, settings and what differs) and ``trl_pass_vs_time.png``. The last printed line is
``relayrl_vs_trl_time_to_target=X.XX`` (TRL's time / relayrl async's time).

TRL is the ``bench`` extra (``pip install -e .[bench]``), imported only inside the TRL
side's process. Imports: config loader, tasks, rewards, model loading, the SFT job and the RL
job (``relayrl.train``), matplotlib for the plot.
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from relayrl.config.budget import RunBudget
from relayrl.errors import RelayError
from relayrl.report.logs import read_jsonl

HELP = "TRL GRPOTrainer vs relayrl (async and sync) on the same work: time to a held-out pass@1"

TRL_VERSION = "1.16.0"
TRL_THREADS = 2  # TRL runs alone on the machine, so it gets both cores
ASYNC_THREADS = {"server": 1, "trainer": 1}  # η = 4: generation and training overlap
SYNC_THREADS = {"server": 2, "trainer": 2}  # η = 0: the phases alternate, each may use both
SIDES = ("relayrl_async", "relayrl_sync", "trl")
RSS_POLL_S = 0.2

# What cannot be matched exactly; printed and written to trl_bench.json (docs/trl.md).
DIFFERENCES = [
    "loss: relayrl decoupled PPO (eps 0.2/0.28 on pi/pi_prox) vs TRL loss_type='dapo' "
    "(epsilon=0.2, epsilon_high=0.28 on pi/pi_old, token level); with one update per batch "
    "both ratios are 1 on fresh data, so the sync sides compute the same token-mean gradient",
    "staleness: relayrl async trains samples up to 4 versions old (corrected by pi_prox/mu); "
    "TRL and relayrl sync are on-policy",
    "advantages: (r - mean) / (std + eps), unbiased std in both; eps 1e-6 (relayrl) vs 1e-4 (TRL)",
    "KL: none on either side (relayrl algo.kl_coef=0, TRL beta=0)",
    "dynamic sampling: off in relayrl for this benchmark (TRL has none), so both train "
    "B*n samples per step including all-equal groups",
    "prompt order: relayrl's PromptLoader and TRL's RepeatSampler shuffle the same train "
    "split with different generators",
    "generation: relayrl's continuous-batching engine in rollout-server processes vs TRL's "
    "transformers model.generate (padded batch) in the trainer process",
    "threads: relayrl async 1 server + 1 trainer thread, relayrl sync 2 + 2 (phases "
    "alternate), TRL torch.set_num_threads(2); relayrl also runs 1 grading process",
    "clock: relayrl's starts after its rollout servers are healthy (startup excluded), "
    "TRL's at on_train_begin; evaluation time is excluded on all sides",
]


@dataclass(frozen=True, kw_only=True)
class Settings(RunBudget):
    """One benchmark's shared settings (every side reads these)."""

    target: float
    seed: int = 0
    extra_overrides: tuple[str, ...] = ()


@dataclass
class SideResult:
    """What one side measured. ``curve``: (step, elapsed_s without eval, pass@1)."""

    side: str
    curve: list[tuple[int, float, float]]
    train_seconds: float
    samples: int
    peak_rss_mb: float = 0.0
    process_seconds: float = 0.0

    @property
    def samples_per_s(self) -> float:
        return self.samples / max(self.train_seconds, 1e-9)

    def time_to_target(self, target: float) -> tuple[float, bool]:
        """(seconds until pass@1 first ≥ target after training began, reached); else
        (total time, False). The base model's evaluation (step 0) does not count."""
        for step, elapsed, p in self.curve:
            if step > 0 and p >= target:
                return elapsed, True
        return self.train_seconds, False


# --------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="a smoke run (< 1 minute)")
    parser.add_argument("--model", default=None, help="SFT base model directory (default: SFT)")
    parser.add_argument("--target", type=float, default=None, help="held-out pass@1 target")
    parser.add_argument("--steps", type=int, default=None, help="training steps per side")
    parser.add_argument("--eval-every", type=int, default=None, help="steps between evals")
    parser.add_argument("--eval-problems", type=int, default=None, help="held-out problems")
    parser.add_argument("--out", default="runs/bench_trl", help="output directory")
    parser.add_argument(
        "--sides",
        default=",".join(SIDES),
        help=f"comma-separated subset of {', '.join(SIDES)} (default: all)",
    )


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The demo's workload (B 16, n 8, 80 tokens, 80 steps), or a tiny one for --quick."""
    if args.quick:
        s = Settings(
            steps=2,
            prompts_per_step=4,
            n_samples=4,
            max_new_tokens=48,
            eval_every=2,
            eval_problems=16,
            eval_max_new_tokens=48,
            target=0.1,
        )
    else:
        s = Settings(
            steps=80,
            prompts_per_step=16,
            n_samples=8,
            max_new_tokens=80,
            eval_every=5,
            eval_problems=200,
            eval_max_new_tokens=160,
            target=0.8,
        )
    given = {
        "steps": args.steps,
        "eval_every": args.eval_every,
        "eval_problems": args.eval_problems,
        "target": args.target,
    }
    s = replace(s, **{k: v for k, v in given.items() if v is not None})
    for name, value in (("steps", s.steps), ("eval_every", s.eval_every)):
        if value < 1:
            raise RelayError(f"--{name.replace('_', '-')} must be ≥ 1 (got {value})")
    if s.eval_problems < 1:
        raise RelayError(f"--eval-problems must be ≥ 1 (got {s.eval_problems})")
    if not 0 < s.target <= 1:
        raise RelayError(f"--target must be in (0, 1] (got {s.target})")
    return s


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


def run_config(s: Settings, out: Path, model_dir: Path | None, side: str = "relayrl_async"):
    """The demo's embedded config at the benchmark's settings for one relayrl side (also the
    source of task, eval and optimizer settings for the TRL side)."""
    from relayrl.config.loader import load_config

    eta, threads = (4, ASYNC_THREADS) if side == "relayrl_async" else (0, SYNC_THREADS)
    overrides = [
        f"output_dir={out / 'runs'}",
        f"name={side}",
        f"seed={s.seed}",
        *([f"model.path={model_dir}"] if model_dir else []),
        f"rollout.eta={eta}",
        f"rollout.server_threads={threads['server']}",
        f"train.trainer_threads={threads['trainer']}",
        *s.overrides(),
        *s.extra_overrides,
    ]
    return load_config(None, overrides)


def base_model(args: argparse.Namespace, s: Settings, out: Path) -> Path:
    """``--model``, else an SFT warm start (the demo's; a short one for ``--quick``)."""
    if args.model:
        from relayrl.models.loading import check_model_dir

        return Path(check_model_dir(args.model))
    from relayrl.train.sft import run_sft

    quick = ["sft.steps=40", "sft.batch_size=32", "eval.num_problems=16"] if args.quick else []
    config = run_config(replace(s, extra_overrides=tuple(quick)), out, None, side="sft").model_copy(
        update={"name": "sft"}
    )
    start = time.perf_counter()
    base = run_sft(config, progress=False)
    print(f"sft warm start: base_pass@1={base:.2f} ({time.perf_counter() - start:.0f} s)")
    return out / "runs" / "sft" / "sft_model"


# --------------------------------------------------------------------------- sides (child)


def _relayrl_side(s: Settings, out: Path, model_dir: Path, side: str) -> SideResult:
    from relayrl.train.rl import run_train

    config = run_config(s, out, model_dir, side)
    result = run_train(config, progress=False)
    rows = read_jsonl(result.run_dir / "metrics.jsonl")
    return relayrl_curve(side, rows, s.samples_per_step)


def relayrl_curve(side: str, rows: list[dict[str, Any]], samples_per_step: int) -> SideResult:
    """Pass@1 against eval-free wall clock from a relayrl run's metrics rows: a step's
    ``elapsed_s`` includes every evaluation up to and including its own, so those are
    subtracted. The final evaluation (``final``, after the last step) is the last point."""
    curve: list[tuple[int, float, float]] = []
    eval_s = 0.0
    train_s = 0.0
    steps = 0
    for row in rows:
        if row.get("final"):  # after the last step, on the same problems
            curve.append((int(row["step"]), train_s, float(row["eval_pass@1"])))
            continue
        eval_s += row.get("time_eval_s", 0.0)
        elapsed = row.get("elapsed_s", 0.0) - eval_s
        if "elapsed_s" in row:
            train_s, steps = elapsed, row["step"]
        if "eval_pass@1" in row:
            curve.append((int(row["step"]), max(elapsed, 0.0), float(row["eval_pass@1"])))
    return SideResult(side, curve, train_s, steps * samples_per_step)


def _trl_side(s: Settings, out: Path, model_dir: Path) -> SideResult:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from relayrl.models.loading import PLAIN_TEMPLATE, encode_prompt, load_model, load_tokenizer
    from relayrl.rewards.dispatch import score
    from relayrl.tasks.registry import make_task
    from relayrl.train.loop import evaluate_model
    from relayrl.train.trainer import lr_factor

    torch.set_num_threads(TRL_THREADS)
    config = run_config(s, out, model_dir)
    torch.manual_seed(config.seed)
    tokenizer = load_tokenizer(model_dir)
    model = load_model(model_dir, config.model.device, config.model.dtype).train()
    task = make_task(config.task.name, config.task.params)
    train = task.problems("train", config.task.train_size, config.task.seed)
    test = task.problems("test", s.eval_problems, config.task.seed)
    chat = bool(getattr(tokenizer, "chat_template", None))
    prompts = [
        [{"role": "user", "content": p.prompt}] if chat else PLAIN_TEMPLATE.format(prompt=p.prompt)
        for p in train
    ]
    if not chat and tokenizer(text=prompts[0])["input_ids"] != encode_prompt(
        tokenizer, train[0].prompt
    ):
        raise RelayError("TRL would tokenize prompts differently from relayrl (special tokens)")
    dataset = Dataset.from_dict({"prompt": prompts, "index": list(range(len(train)))})

    def arithmetic_reward(completions: list[str], index: list[int], **_: Any) -> list[float]:
        return [score(train[i], c) for i, c in zip(index, completions, strict=True)]

    eval_cfg = config.eval.model_copy(update={"num_problems": len(test)})
    curve: list[tuple[int, float, float]] = []
    clock = {"start": 0.0, "eval": 0.0, "train": 0.0}

    def evaluate(step: int) -> None:
        t0 = time.perf_counter()
        elapsed = t0 - clock["start"] - clock["eval"]
        report = evaluate_model(model, tokenizer, test, eval_cfg, config.seed)
        curve.append((step, elapsed, report.pass_at_1))
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

    o = config.optim
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda k: lr_factor(k, o.warmup_steps, s.steps, o.schedule)
    )
    algo = config.algo
    args = GRPOConfig(
        output_dir=str(out / "runs" / "trl"),
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
        bf16=False,  # relayrl trains in float32 (model.dtype)
        gradient_checkpointing=False,  # as relayrl (TRL's default recomputes activations)
        logging_steps=max(1, s.steps),
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
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
    return SideResult("trl", curve, train_s, s.steps * s.samples_per_step)


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

    result_path = out / f"{side}_result.json"
    result_path.unlink(missing_ok=True)
    proc = multiprocessing.get_context("spawn").Process(
        target=_side_main, args=(side, s, out, model_dir, result_path), name=f"bench-{side}"
    )
    proc.start()
    peak = 0
    root = psutil.Process(proc.pid)
    while proc.is_alive():
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
    proc.join()
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
    )
    return result


def compare(trl: tuple[float, bool], relay: tuple[float, bool]) -> tuple[float, str, str]:
    """(TRL time / relayrl time, its bound sign, a note). A side that never reached the
    target contributes its total time, a lower bound of its time to target."""
    ratio = trl[0] / max(relay[0], 1e-9)
    if trl[1] and relay[1]:
        return ratio, "", ""
    if not trl[1] and relay[1]:
        return ratio, ">", "TRL did not reach the target: its total time is a lower bound"
    if trl[1] and not relay[1]:
        return ratio, "<", "relayrl did not reach the target: its total time is a lower bound"
    return ratio, "?", "neither side reached the target: the ratio of total times, no bound"


def write_outputs(results: list[SideResult], s: Settings, out: Path, extra: dict) -> Path:
    """CSV of every evaluation, JSON of the figures, PNG of pass@1 against wall clock."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with (out / "trl_bench.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["side", "step", "elapsed_s", "pass@1"])
        for r in results:
            for step, elapsed, p in r.curve:
                w.writerow([r.side, step, f"{elapsed:.3f}", f"{p:.4f}"])
    figures = {
        r.side: {
            "time_to_target_s": r.time_to_target(s.target)[0],
            "reached": r.time_to_target(s.target)[1],
            "train_seconds": r.train_seconds,
            "samples": r.samples,
            "samples_per_s": r.samples_per_s,
            "peak_rss_mb": r.peak_rss_mb,
            "process_seconds": r.process_seconds,
            "curve": r.curve,
        }
        for r in results
    }
    doc = {"settings": asdict(s), "differences": DIFFERENCES, "sides": figures, **extra}
    (out / "trl_bench.json").write_text(json.dumps(doc, indent=2))
    fig, ax = plt.subplots(figsize=(7, 4.2))
    labels = {"relayrl_async": "relayrl async (η=4)", "relayrl_sync": "relayrl sync (η=0)"}
    for r in results:
        xs, ys = [c[1] for c in r.curve], [c[2] for c in r.curve]
        ax.plot(xs, ys, marker="o", ms=3, label=labels.get(r.side, f"TRL {TRL_VERSION} GRPO"))
    ax.axhline(s.target, color="grey", ls="--", lw=0.8, label=f"target {s.target:g}")
    ax.set_xlabel("wall-clock seconds (evaluation excluded)")
    ax.set_ylabel("held-out pass@1 (T = 1)")
    ax.set_title(f"B={s.prompts_per_step}, n={s.n_samples}, {s.max_new_tokens} tokens")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png = out / "trl_pass_vs_time.png"
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


def run(args: argparse.Namespace) -> int:
    import os

    s = settings_from_args(args)
    sides = parse_sides(args.sides)
    if "trl" in sides:
        check_trl()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    model_dir = base_model(args, s, out)
    print(
        f"bench trl: model={model_dir} steps={s.steps} B={s.prompts_per_step} n={s.n_samples} "
        f"max_new_tokens={s.max_new_tokens} eval every {s.eval_every} steps on "
        f"{s.eval_problems} held-out problems, target pass@1 {s.target:g}, "
        f"load average {load:.2f} on {os.cpu_count()} cores"
    )
    for line in DIFFERENCES:
        print(f"  differs: {line}")
    results: list[SideResult] = []
    for side in sides:
        r = run_side(side, s, out, model_dir)
        results.append(r)
        if r.curve and r.curve[0][0] == 0 and r.curve[0][2] >= s.target:
            print(f"warning: the base model's pass@1 {r.curve[0][2]:.2f} is already ≥ the target")
        t, reached = r.time_to_target(s.target)
        curve = " ".join(f"{step}:{p:.2f}" for step, _, p in r.curve)
        print(
            f"{side}: time_to_target={'' if reached else '>'}{t:.1f}s "
            f"({'reached' if reached else 'not reached in ' + str(s.steps) + ' steps'}) "
            f"train_seconds={r.train_seconds:.1f} samples_per_s={r.samples_per_s:.1f} "
            f"peak_rss_mb={r.peak_rss_mb:.0f} process_seconds={r.process_seconds:.1f} "
            f"pass@1 by step {curve}",
            flush=True,
        )
    by = {r.side: r for r in results}
    extra: dict[str, Any] = {"model": str(model_dir), "load_average_start": load}
    final: tuple[float, str, str] | None = None
    if "trl" in by:
        trl_t = by["trl"].time_to_target(s.target)
        for side in ("relayrl_sync", "relayrl_async"):
            if side in by:
                ratio, sign, note = compare(trl_t, by[side].time_to_target(s.target))
                extra[f"{side}_vs_trl"] = {"ratio": ratio, "bound": sign, "note": note}
                print(
                    f"{side}_vs_trl_time_to_target {sign}{ratio:.2f}{' (' + note + ')' if note else ''}"
                )
                if side == "relayrl_async":
                    final = (ratio, sign, note)
    png = write_outputs(results, s, out, extra)
    print(f"written: {out / 'trl_bench.csv'}, {out / 'trl_bench.json'}")
    print(f"plot: {png}")
    if final is not None:
        if final[1]:
            print(f"note: relayrl_vs_trl_time_to_target is a bound ({final[1]}): {final[2]}")
        print(f"relayrl_vs_trl_time_to_target={final[0]:.2f}")
    return 0
