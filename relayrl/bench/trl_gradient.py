"""``relayrl bench trl-gradient``: relayrl's update against TRL's loss on the same samples.

Owns the gradient check behind ``relayrl bench trl``: the workload's model samples groups of
completions on its train prompts (relayrl's engine, T = 1, graded by the workload's reward),
and those same groups go through relayrl's ``RLTrainer.train_step`` and through TRL
``GRPOTrainer.compute_loss`` (the benchmark's ``GRPOConfig``), from the same weights. The
check compares the two gradients (cosine, relative L2 distance, norms) in the run's
precision, and, where that is bf16 autocast, each against a float32 reference, so a
difference between the trainers can be told from bf16 rounding. Groups whose rewards are
all equal give no gradient on either side, so sampling goes on until the step has
``prompts_per_step`` groups with mixed rewards (or ``--max-prompts`` are drawn).

relayrl's behaviour logprobs are its trainer's own here (the decoupled loss's weight
π_prox/μ is 1, as TRL's on-policy step has none); ``engine_behaviour`` adds relayrl's
gradient with the engine's logprobs, the weight a sync run really applies.

Imports: the benchmark's settings and config (``relayrl.bench.trl``), the engine, tasks,
rewards, advantages and the trainer; TRL inside the functions that use it. The last line
printed is ``trl_gradient_cosine=X``.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from relayrl.bench.trl import (
    base_model,
    check_trl,
    run_config,
    trl_grpo_config,
    trl_optimizers,
    workload_of,
)
from relayrl.errors import RelayError

HELP = "relayrl's update vs TRL GRPOTrainer's loss on the same sampled groups: gradient cosine"

DEFAULT_MAX_PROMPTS = 256
TRL_STD_EPS = 1e-4  # TRL's advantage (r - mean) / (std + 1e-4), hard-coded in GRPOTrainer


@dataclass(frozen=True)
class Sample:
    """One completion of a group: token ids, the engine's logprobs of them, its reward."""

    prompt_ids: list[int]
    completion_ids: list[int]
    engine_logprobs: list[float]
    reward: float


Groups = list[list[Sample]]
Gradient = dict[str, Any]  # parameter name -> gradient tensor


@dataclass(frozen=True)
class Comparison:
    """Two gradients side by side."""

    cosine: float
    relative_l2: float  # |a - b| / |b|
    norm_a: float
    norm_b: float


def compare(a: Gradient, b: Gradient) -> Comparison:
    """Cosine and relative L2 distance of two gradients over all their parameters."""
    import torch

    names = sorted(a)
    if names != sorted(b):
        raise RelayError("the two trainers' gradients cover different parameters")
    va = torch.cat([a[n].double().flatten() for n in names])
    vb = torch.cat([b[n].double().flatten() for n in names])
    na, nb = float(va.norm()), float(vb.norm())
    if na == 0.0 or nb == 0.0:
        raise RelayError("a gradient is zero: no group has mixed rewards")
    return Comparison(float(va @ vb) / (na * nb), float((va - vb).norm()) / nb, na, nb)


# --------------------------------------------------------------------------- samples


def sample_groups(config, model_dir: Path, max_prompts: int, progress: bool = True) -> Groups:
    """Groups of ``rollout.n_samples`` completions of the run's train prompts (in its
    ``PromptLoader`` order), graded; the first ``rollout.prompts_per_step`` groups with
    mixed rewards. Fewer if ``max_prompts`` prompts give fewer (none: a RelayError)."""
    import torch

    from relayrl.engine.engine import Engine
    from relayrl.engine.types import EngineOptions
    from relayrl.models.loading import load_model, load_tokenizer
    from relayrl.rollout.prompts import PromptLoader
    from relayrl.tasks.registry import make_task

    torch.manual_seed(config.seed)
    tokenizer = load_tokenizer(model_dir)
    task = make_task(config.task.name, config.task.params)
    train = task.problems("train", config.task.train_size, config.task.seed)
    loader = PromptLoader(train, config.seed)
    r = config.rollout
    options = EngineOptions(
        max_seq_len=config.model.max_context, max_running_requests=r.max_running_requests
    )
    groups: Groups = []
    drawn = 0
    model = load_model(model_dir, config.model.device, config.served_dtype)
    with Engine(model, tokenizer, options) as engine:
        while len(groups) < r.prompts_per_step and drawn < max_prompts:
            batch = [loader.next() for _ in range(min(r.prompts_per_step, max_prompts - drawn))]
            drawn += len(batch)
            for group in _sample(engine, tokenizer, config, batch):
                if len({s.reward for s in group}) > 1 and len(groups) < r.prompts_per_step:
                    groups.append(group)
            if progress:
                print(
                    f"  {len(groups)}/{r.prompts_per_step} groups with mixed rewards "
                    f"after {drawn} prompts"
                )
    if not groups:
        raise RelayError(
            f"no group with mixed rewards in {max_prompts} prompts: nothing to compare "
            "(raise --max-prompts)"
        )
    return groups


def _sample(engine, tokenizer, config, drawn) -> Groups:
    """One group of ``rollout.n_samples`` graded completions per drawn (index, problem),
    every request in one engine batch, each with the run's own request seed."""
    from relayrl.engine.types import SamplingParams
    from relayrl.models.loading import encode_prompt
    from relayrl.rewards.dispatch import score
    from relayrl.rollout.controller import request_seed

    r = config.rollout
    prompts, params = [], []
    for index, problem in drawn:
        ids = encode_prompt(tokenizer, problem.prompt, config.model.system_prompt)
        for j in range(r.n_samples):
            prompts.append(ids)
            params.append(
                SamplingParams(
                    r.max_new_tokens, r.temperature, seed=request_seed(config.seed, index, j)
                )
            )
    outs = engine.generate_batch(prompts, params)
    samples = [
        Sample(
            ids,
            list(o.output_ids),
            list(o.output_logprobs),
            score(problem, tokenizer.decode(o.output_ids, skip_special_tokens=True)),
        )
        for ids, o, (_, problem) in zip(
            prompts, outs, [d for d in drawn for _ in range(r.n_samples)], strict=True
        )
    ]
    return [samples[i : i + r.n_samples] for i in range(0, len(samples), r.n_samples)]


# --------------------------------------------------------------------------- relayrl


def relayrl_gradient(
    config, model_dir: Path, groups: Groups, autocast: bool, engine_behaviour: bool = False
) -> Gradient:
    """The gradient of relayrl's ``train_step`` on ``groups`` (before clipping), from the
    model's initial weights, with its trainer's own behaviour logprobs unless
    ``engine_behaviour`` (then the engine's)."""
    from relayrl.models.loading import load_model, load_tokenizer
    from relayrl.train.options import TrainerOptions
    from relayrl.train.trainer import RLTrainer

    options = replace(
        TrainerOptions.from_config(config), autocast_bf16=autocast, grad_clip=math.inf
    )
    pad_id = load_tokenizer(model_dir).pad_token_id
    model = load_model(model_dir, config.model.device, config.model.dtype)
    trainer = RLTrainer(model, options, pad_id=pad_id)
    trajs = trajectories(config, trainer, groups, engine_behaviour)
    grads: Gradient = {}

    def keep_gradient(optimizer, args, kwargs) -> None:  # noqa: ARG001
        grads.update({n: p.grad.detach().clone() for n, p in named_with_grad(model)})

    trainer.optimizer.register_step_pre_hook(keep_gradient)
    trainer.train_step(trajs)
    return grads


def relayrl_update(config, model_dir: Path, batches: list[Groups], autocast: bool) -> Gradient:
    """The change of every parameter over one relayrl ``train_step`` per batch (its AdamW,
    clipping and schedule), from the model's initial weights, on-policy logprobs."""
    from relayrl.models.loading import load_model, load_tokenizer
    from relayrl.train.options import TrainerOptions
    from relayrl.train.trainer import RLTrainer

    options = replace(TrainerOptions.from_config(config), autocast_bf16=autocast)
    model = load_model(model_dir, config.model.device, config.model.dtype)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = RLTrainer(model, options, pad_id=load_tokenizer(model_dir).pad_token_id)
    for groups in batches:
        trainer.train_step(trajectories(config, trainer, groups))
    return {n: p.detach() - start[n] for n, p in model.named_parameters()}


def trajectories(config, trainer, groups: Groups, engine_behaviour: bool = False):
    """``groups`` as relayrl's trajectories at the trainer's version, with the run's
    advantages; behaviour logprobs the trainer's own unless ``engine_behaviour``."""
    from relayrl.algo.advantages import compute_advantages
    from relayrl.rollout.trajectory import Trajectory

    advantages = compute_advantages([[s.reward for s in g] for g in groups], config.algo.advantage)
    v = trainer.version
    trajs = [
        [
            Trajectory(
                f"p{i}",
                f"g{v}-{i}",
                j,
                s.prompt_ids,
                s.completion_ids,
                s.engine_logprobs,
                [v] * len(s.completion_ids),
                v,
                "stop",
                s.reward,
                "ok",
                a,
            )
            for j, (s, a) in enumerate(zip(g, advs, strict=True))
        ]
        for i, (g, advs) in enumerate(zip(groups, advantages, strict=True))
    ]
    if not engine_behaviour:  # on-policy in the trainer's own numerics: π_prox/μ = 1
        flat = [t for g in trajs for t in g]
        for t, logp in zip(flat, trainer.traj_logprobs(trainer.model, flat), strict=True):
            t.behav_logprobs = logp.tolist()
    return trajs


def named_with_grad(model) -> list[tuple[str, Any]]:
    return [(n, p) for n, p in model.named_parameters() if p.grad is not None]


# --------------------------------------------------------------------------- TRL


def trl_advantages(rewards: Sequence[float], group_size: int):
    """TRL's group-scaled advantages: (r − mean_g) / (std_g + 1e-4), unbiased std."""
    import torch

    r = torch.tensor(rewards, dtype=torch.float32).view(-1, group_size)
    adv = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + TRL_STD_EPS)
    return adv.flatten()


def trl_inputs(groups: Groups, pad_id: int) -> dict[str, Any]:
    """The batch ``GRPOTrainer._compute_loss`` reads, as TRL builds it: prompts padded on
    the left, completions on the right, the mask over each completion's own tokens (its
    EOS included), advantages per sample, and the token count of the dapo normaliser."""
    import torch

    samples = [s for g in groups for s in g]
    width_p = max(len(s.prompt_ids) for s in samples)
    width_c = max(len(s.completion_ids) for s in samples)

    def padded(rows: list[list[int]], width: int, left: bool):
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            span = slice(width - len(row), width) if left else slice(0, len(row))
            ids[i, span] = torch.tensor(row, dtype=torch.long)
            mask[i, span] = 1
        return ids, mask

    prompt_ids, prompt_mask = padded([s.prompt_ids for s in samples], width_p, left=True)
    completion_ids, completion_mask = padded(
        [s.completion_ids for s in samples], width_c, left=False
    )
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": trl_advantages([s.reward for s in samples], len(groups[0])),
        "num_items_in_batch": completion_mask.sum(),
    }


def trl_gradient(s, config, model_dir: Path, out: Path, groups: Groups, bf16: bool) -> Gradient:
    """The gradient of TRL ``GRPOTrainer``'s loss on ``groups``, from the model's initial
    weights, with the benchmark's ``GRPOConfig`` (``bf16`` sets its autocast)."""
    from datasets import Dataset
    from trl import GRPOTrainer

    from relayrl.models.loading import load_model, load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    model = load_model(model_dir, config.model.device, config.model.dtype).train()
    samples = sum(len(g) for g in groups)
    args = trl_grpo_config(
        replace(s, prompts_per_step=len(groups)), config, out / "trl_gradient", bf16=bf16
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["unused"] * samples}),
        processing_class=tokenizer,
    )
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train's loop
    with trainer.compute_loss_context_manager():
        loss = trainer.compute_loss(trainer.model, trl_inputs(groups, tokenizer.pad_token_id))
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in named_with_grad(trainer.model)}


def trl_update(
    s, config, model_dir: Path, out: Path, batches: list[Groups], bf16: bool
) -> Gradient:
    """The change of every parameter over TRL's own training loop (``GRPOTrainer.train``:
    the transformers ``Trainer``'s AdamW step, clipping and the benchmark's schedule), one
    step per batch, its generation replaced by the batches, from the initial weights."""
    from datasets import Dataset
    from trl import GRPOTrainer

    from relayrl.models.loading import load_model, load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    model = load_model(model_dir, config.model.device, config.model.dtype).train()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    steps = len(batches)
    optimizer, scheduler = trl_optimizers(model, config, steps)
    queue = [trl_inputs(groups, tokenizer.pad_token_id) for groups in batches]

    class PreparedBatches(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):  # noqa: ARG002
            return queue.pop(0)

    samples = sum(len(g) for g in batches[0])
    shape = replace(s, steps=steps, prompts_per_step=len(batches[0]))
    trainer = PreparedBatches(
        model=model,
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=trl_grpo_config(shape, config, out / "trl_update", bf16=bf16),
        train_dataset=Dataset.from_dict({"prompt": ["unused"] * samples * steps}),
        processing_class=tokenizer,
        optimizers=(optimizer, scheduler),
    )
    trainer.train()
    if queue:
        raise RelayError(f"TRL's loop took {steps - len(queue)} of {steps} batches")
    return {n: p.detach() - start[n] for n, p in model.named_parameters()}


# --------------------------------------------------------------------------- the check


@dataclass(frozen=True)
class GradientReport:
    """relayrl against TRL in the run's precision; each against float32 where it is bf16."""

    bf16: bool
    relayrl_vs_trl: Comparison
    relayrl_vs_fp32: Comparison | None
    trl_vs_fp32: Comparison | None
    engine_behaviour: Comparison | None  # relayrl with the engine's logprobs vs TRL


def check_gradients(
    s,
    config,
    model_dir: Path,
    out: Path,
    groups: Groups,
    engine_behaviour: bool = True,
    log: Callable[[str], None] = print,
) -> GradientReport:
    """Every gradient the report compares, one after the other (each from fresh weights)."""
    bf16 = config.train.mixed_precision == "bf16"

    def timed(label: str, fn: Callable[[], Gradient]) -> Gradient:
        t0 = time.perf_counter()
        grad = fn()
        log(f"  {label}: {time.perf_counter() - t0:.1f} s")
        return grad

    ours = timed("relayrl", lambda: relayrl_gradient(config, model_dir, groups, bf16))
    theirs = timed("TRL", lambda: trl_gradient(s, config, model_dir, out, groups, bf16))
    ref = None
    if bf16:
        ref = timed("float32 reference", lambda: relayrl_gradient(config, model_dir, groups, False))
        trl_ref = timed(
            "TRL float32", lambda: trl_gradient(s, config, model_dir, out, groups, False)
        )
        log(f"  float32 references, relayrl vs TRL: {format_comparison(compare(ref, trl_ref))}")
    engine = None
    if engine_behaviour:
        grad = timed(
            "relayrl, engine behaviour",
            lambda: relayrl_gradient(config, model_dir, groups, bf16, engine_behaviour=True),
        )
        engine = compare(grad, theirs)
    return GradientReport(
        bf16,
        compare(ours, theirs),
        compare(ours, ref) if ref is not None else None,
        compare(theirs, ref) if ref is not None else None,
        engine,
    )


def format_comparison(c: Comparison) -> str:
    return (
        f"cosine {c.cosine:.6f}, relative L2 {c.relative_l2:.2e}, "
        f"norms {c.norm_a:.4g} / {c.norm_b:.4g}"
    )


# --------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="the workload's --quick budget")
    parser.add_argument(
        "--workload", default="smollm2", help="a bench trl workload (default: smollm2)"
    )
    parser.add_argument("--model", default=None, help="model directory (default: the workload's)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    parser.add_argument(
        "--max-prompts",
        type=int,
        default=DEFAULT_MAX_PROMPTS,
        help=f"train prompts drawn at most to find groups with mixed rewards "
        f"(default: {DEFAULT_MAX_PROMPTS})",
    )
    parser.add_argument("--out", default="runs/bench_trl_gradient", help="output directory")
    parser.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="relayrl config overrides"
    )


def run(args: argparse.Namespace) -> int:
    import torch

    check_trl()
    if args.max_prompts < 1:
        raise RelayError(f"--max-prompts must be ≥ 1 (got {args.max_prompts})")
    w = workload_of(args)
    s = replace(
        w.quick if args.quick else w.full, seed=args.seed, user_overrides=tuple(args.overrides)
    )
    out = Path(args.out)
    model_dir = base_model(args, s, out)
    config = run_config(s, out, model_dir, side="relayrl_sync")
    torch.set_num_threads(config.train.trainer_threads)
    print(
        f"{w.name}: groups of {config.rollout.n_samples}, {config.rollout.max_new_tokens} "
        f"tokens, precision {config.train.mixed_precision}, seed {s.seed}"
    )
    groups = sample_groups(config, model_dir, args.max_prompts)
    report = check_gradients(s, config, model_dir, out, groups)
    print(
        f"relayrl vs TRL ({'bf16 autocast' if report.bf16 else 'float32'}): "
        f"{format_comparison(report.relayrl_vs_trl)}"
    )
    if report.relayrl_vs_fp32 and report.trl_vs_fp32:
        print(f"relayrl vs its float32: {format_comparison(report.relayrl_vs_fp32)}")
        print(f"TRL vs relayrl's float32: {format_comparison(report.trl_vs_fp32)}")
    if report.engine_behaviour:
        print(
            "relayrl with the engine's behaviour logprobs vs TRL: "
            f"{format_comparison(report.engine_behaviour)}"
        )
    print(f"trl_gradient_cosine={report.relayrl_vs_trl.cosine:.6f}")
    return 0
