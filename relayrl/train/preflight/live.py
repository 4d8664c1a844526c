"""Preflight checks that run the real thing once: a server, one generation, one step.

Owns: :func:`check_server` (one rollout server of the run's backend starts on loopback,
or the first of ``rollout.server_urls`` answers; it passes the run's server check and
generates one group of ``rollout.n_samples`` completions of the first prompt with per-token
logprobs and versions; the trainer recomputes the logprobs and the k3 KL between them is
printed: an error above :data:`KL_TOLERANCE`), :func:`check_step` (the group graded,
its advantages set and one timed optimizer step; generation extrapolated to
``rollout.prompts_per_step`` groups through one group alone and a few at once) and :func:`check_memory` (the peak resident memory of the trainer, the server and a
grading worker, measured, with the KV cache a full server holds and the activations of a
full micro-batch added, against the memory this machine has).

Imports: config, engine (client types, KV size, available memory), launch (backends),
rollout (trajectories, advantages), algo (the k3 KL), relayrl.train (the trainer factory).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relayrl.train.preflight.context import CheckContext
from relayrl.train.preflight.runner import CheckFailed

if TYPE_CHECKING:
    from relayrl.config.schema import RunConfig

CONCURRENT_GROUPS = 4  # groups generated at once to see how generation scales with load
CHECK_TOKENS = 64  # the longest completion the check samples (rollout.max_new_tokens if less)
KL_TOLERANCE = 1e-2  # engine-vs-trainer k3 above this: something differs, not rounding
MiB = 2**20
# a run's steps peak above the activations one probe step shows, which a run's many steps of
# changing shapes leave fragmented in the C heap: SmolLM2's recipe (docs/real-model.md) rose
# about 4.8 GiB above its held memory by step 22 where the probe measured 3.3-3.6 GiB
ACTIVATION_ALLOWANCE = 1.5


def _one_server(config):
    """``config`` with one rollout server and a trainer of world size 1."""
    rollout = config.rollout.model_copy(update={"num_servers": 1})
    train = config.train.model_copy(update={"world_size": 1})
    return config.model_copy(update={"rollout": rollout, "train": train})


def start_server(ctx: CheckContext) -> None:
    """Start one server of the run's backend in the background (it boots while the other
    checks run); :func:`check_server` waits for it."""
    from relayrl.launch.backends import make_backend

    assert ctx.config is not None and ctx.model_dir is not None
    ctx.backend = make_backend(_one_server(ctx.config), ctx.model_dir)
    ctx.launcher = ctx.backend.launcher(ctx.tmp / "servers")
    ctx.server_start = Future()
    began = time.monotonic()

    def start() -> None:
        try:
            urls = ctx.launcher.start()[:1]
            ctx.measures["server_start_s"] = time.monotonic() - began
            ctx.server_start.set_result(urls)
        except BaseException as exc:  # noqa: BLE001 - the server check reports it
            ctx.server_start.set_exception(exc)

    threading.Thread(target=start, name="check-server-start", daemon=True).start()


def check_server(ctx: CheckContext) -> str:
    """Wait for the server, sample one group, compare its logprobs with the trainer's."""
    from relayrl.train.distributed import make_trainer

    assert ctx.config is not None and ctx.model_dir is not None
    if ctx.server_start is None:
        start_server(ctx)
    urls = ctx.server_start.result()
    config = _one_server(ctx.config)
    ctx.group = asyncio.run(_sample_group(ctx, ctx.backend, urls))
    pad = ctx.tokenizer.pad_token_id
    ctx.trainer = make_trainer(ctx.model, config, pad, ctx.model_dir, ctx.tmp)
    kl, tokens = _engine_trainer_kl(ctx)
    started = f"started in {ctx.measures['server_start_s']:.1f} s"
    where = "external" if config.rollout.server_urls else started
    return (
        f"rollout.engine={config.rollout.engine} {urls[0]} ({where}): {len(ctx.group)} samples, "
        f"{tokens} tokens in {ctx.generation_s:.1f} s; engine vs trainer logprobs k3 KL "
        f"{kl:.2e} (tolerance {KL_TOLERANCE:g})"
    )


async def _sample_group(ctx: CheckContext, backend: Any, urls: list[str]) -> list[Any]:
    from relayrl.engine.types import SamplingParams
    from relayrl.rollout.trajectory import Trajectory

    config = ctx.config
    assert config is not None
    rollout = config.rollout
    max_tokens = min(rollout.max_new_tokens, CHECK_TOKENS)
    params = [
        SamplingParams(
            max_new_tokens=max_tokens,
            temperature=rollout.temperature,
            top_p=rollout.top_p,
            seed=config.seed + j,
        )
        for j in range(rollout.n_samples)
    ]
    async with backend.client(urls) as client:
        await backend.check_servers(client)
        start = time.monotonic()
        gens = await client.generate_many([ctx.prompt_ids] * len(params), params)
        ctx.generation_s = time.monotonic() - start
        await _time_concurrent_groups(ctx, client, params)
    group = []
    for j, gen in enumerate(gens):
        _check_generation(gen, urls[0])
        group.append(
            Trajectory(
                ctx.problems[0].id,
                "check",
                j,
                list(ctx.prompt_ids),
                gen.output_ids,
                gen.output_logprobs,
                gen.output_versions,
                0,
                gen.finish_reason,
            )
        )
    return group


async def _time_concurrent_groups(ctx: CheckContext, client: Any, params: list[Any]) -> None:
    """Generate ``k = min(prompts_per_step, CONCURRENT_GROUPS)`` groups at once, so the step
    estimate scales by how the server's batching grows with load, not by ``k`` alone."""
    assert ctx.config is not None
    k = min(ctx.config.rollout.prompts_per_step, CONCURRENT_GROUPS)
    if k < 2:
        return
    many = [
        dataclasses.replace(p, seed=(p.seed or 0) + 1000 * (g + 1))
        for g in range(k)
        for p in params
    ]
    start = time.monotonic()
    await client.generate_many([ctx.prompt_ids] * len(many), many)
    ctx.measures.update(concurrent_groups=k, concurrent_generation_s=time.monotonic() - start)


def generation_estimate(one_s: float, k: int, k_s: float, groups: int) -> float:
    """Seconds to generate ``groups`` groups at once, from one group alone (``one_s``) and
    ``k`` at once (``k_s``): linear in the number of groups through those two points (a
    batched decode step costs a fixed part plus a part per sequence), never below ``one_s``."""
    if k < 2 or groups <= 1:
        return one_s * groups if k < 2 else one_s
    per_group = max(k_s - one_s, 0.0) / (k - 1)
    return one_s + per_group * (groups - 1)


def _check_generation(gen: Any, url: str) -> None:
    fix = "the server must return one logprob and one weight version per generated token"
    if not gen.output_ids:
        raise CheckFailed(f"{url} generated no token", "check the model and rollout.max_new_tokens")
    if len(gen.output_logprobs) != len(gen.output_ids):
        raise CheckFailed(
            f"{url} returned {len(gen.output_logprobs)} logprobs for {len(gen.output_ids)} tokens",
            fix,
        )
    if set(gen.output_versions) != {0}:
        raise CheckFailed(
            f"{url} tagged a fresh run's tokens with versions {sorted(set(gen.output_versions))}",
            fix,
        )


def _engine_trainer_kl(ctx: CheckContext) -> tuple[float, int]:
    from relayrl.algo.losses import engine_trainer_kl
    from relayrl.metric_names import ENGINE_TRAINER_KL

    group = ctx.group
    prox = ctx.trainer.traj_logprobs(ctx.trainer.model, group)
    behav = [t.behav_logprobs for t in group]
    stats = engine_trainer_kl(behav, [t.versions for t in group], prox, 0)
    kl, tokens = stats[ENGINE_TRAINER_KL], int(stats["engine_trainer_kl_tokens"])
    if not kl <= KL_TOLERANCE:
        raise CheckFailed(
            f"the engine's logprobs disagree with the trainer's: k3 KL {kl:.3g} over {tokens} "
            f"tokens (tolerance {KL_TOLERANCE:g})",
            "likely causes: rollout.dtype or model.dtype differ, the served model is not "
            "model.path, a temperature or chat-template mismatch (docs/engine.md)",
        )
    return kl, tokens


def check_step(ctx: CheckContext) -> str:
    """Grade the group, set its advantages, time one optimizer step; estimate a step."""
    from relayrl.rollout.controller import assign_advantages

    config = ctx.config
    assert config is not None
    texts = [ctx.tokenizer.decode(t.completion_ids, skip_special_tokens=True) for t in ctx.group]
    results = ctx.pool.grade_batch([(ctx.problems[0], text) for text in texts])
    for traj, result in zip(ctx.group, results, strict=True):
        traj.reward, traj.reward_status = result.reward, result.status
    algo = config.algo
    assign_advantages([ctx.group], algo.advantage, algo.gamma, algo.params_of("advantage"))
    start = time.monotonic()
    ctx.trainer.train_step([ctx.group])
    first_s = time.monotonic() - start
    ctx.trainer.version = 0  # the same group once more, warm (the first step pays set-up)
    start = time.monotonic()
    ctx.trainer.train_step([ctx.group])
    warm_s = time.monotonic() - start
    ctx.measures["train_s"] = warm_s
    _measure_step_memory(ctx)
    return _step_estimate(ctx, first_s, warm_s)


def _measure_step_memory(ctx: CheckContext) -> None:
    """One more step, on copies of the group as large as the run's largest micro-batch: its
    peak above what the trainer holds between steps (model, gradients, optimizer state) is
    the activations of such a micro-batch, measured alone where the peak can be reset."""
    config = ctx.config
    assert config is not None
    trainer = ctx.trainer
    shared = getattr(trainer, "sharing", None) is not None
    largest = largest_micro_batch(config, len(ctx.prompt_ids), shared)
    one_group = max(trainer.micro_batch_positions(ctx.group), default=1)
    groups = _distinct_copies(ctx.group, max(1, largest // one_group))
    held, peak_so_far = _rss_bytes(os.getpid()), _rss_bytes(os.getpid(), "VmHWM")
    reset = _reset_peak()
    trainer.version = 0
    trainer.train_step(groups)
    positions = max(trainer.micro_batch_positions([t for g in groups for t in g]), default=1)
    ctx.measures.update(
        trainer_held=held,
        trainer_peak_before_step=peak_so_far,
        step_activations=max(0, _rss_bytes(os.getpid(), "VmHWM") - held) if reset else 0,
        step_positions=positions,
    )


def _distinct_copies(group: list[Any], copies: int) -> list[list[Any]]:
    """``copies`` of ``group``, the k-th with its prompt's first token set to k so that a
    trainer sharing prompts packs each as a row of its own, as a step's distinct prompts
    are (memory, not numbers, is what the copies are for)."""
    out = [group]
    for k in range(1, copies):
        out.append(
            [
                dataclasses.replace(
                    t, group_id=f"{t.group_id}#{k}", prompt_ids=[k, *t.prompt_ids[1:]]
                )
                for t in group
            ]
        )
    return out


def _reset_peak() -> bool:
    """Reset this process's VmHWM to its current RSS (Linux's clear_refs); False where
    that is not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _step_estimate(ctx: CheckContext, first_s: float, warm_s: float) -> str:
    config = ctx.config
    assert config is not None
    groups = config.rollout.prompts_per_step
    capped = min(config.rollout.max_new_tokens, CHECK_TOKENS)
    longer = config.rollout.max_new_tokens / capped if _hit_cap(ctx.group, capped) else 1.0
    k = int(ctx.measures.get("concurrent_groups", 1))
    k_s = ctx.measures.get("concurrent_generation_s", 0.0)
    per_server = -(-groups // config.rollout.num_servers)  # the groups one server holds
    gen = generation_estimate(ctx.generation_s, k, k_s, per_server) * longer
    train = min(first_s, warm_s) * longer * groups  # the less disturbed of the two
    step = gen + train if config.rollout.eta == 0 else max(gen, train)
    how = "generation + update at eta=0" if config.rollout.eta == 0 else "overlapped at eta>0"
    batched = f", {k} groups at once {k_s:.2f} s" if k > 1 else ""
    return (
        f"one group of {len(ctx.group)}: generation {ctx.generation_s:.2f} s{batched}, "
        f"optimizer step {first_s:.2f} s (first), {warm_s:.2f} s (warm); a step of {groups} "
        f"groups ≈ {step:.1f} s (generation {gen:.1f} s, linear in the groups a server holds "
        f"through the two measured points; update {train:.1f} s; {how})"
    )


def _hit_cap(group: list[Any], capped: int) -> bool:
    return any(len(t.completion_ids) >= capped for t in group)


def _rss_bytes(pid: int, field: str = "VmRSS") -> int:
    """``field`` (VmRSS, VmHWM) of process ``pid`` from /proc, in bytes (0 if unreadable)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            out += [int(c) for c in task.read_text().split()]
        except (OSError, ValueError):
            continue
    return out


def _tree_peak(pid: int) -> int:
    """The peaks of process ``pid`` and its descendants, summed (vLLM's server forks an
    engine core and workers that hold the weights and the KV cache)."""
    return _rss_bytes(pid, "VmHWM") + sum(_tree_peak(child) for child in _children(pid))


def check_memory(ctx: CheckContext) -> str:
    """Peak memory per process, measured and extrapolated, against the machine's."""
    from relayrl.engine.model_runner import available_memory_bytes

    config = ctx.config
    assert config is not None
    trainer = _trainer_peak(ctx) + kernel_cache_bytes(config, trainer=True)
    servers = [p for p in getattr(ctx.launcher, "pids", [])]
    measured = max((_tree_peak(p) for p in servers), default=0)
    server = measured + _kv_bytes(ctx) + _weight_load_bytes(ctx)
    if config.rollout.engine == "builtin":
        server += kernel_cache_bytes(config, trainer=False)
    graders = [p for p in _children(os.getpid()) if p not in servers]
    grader = max((_rss_bytes(p, "VmHWM") for p in graders), default=0)
    n_servers = 0 if config.rollout.server_urls else config.rollout.num_servers
    total = trainer + n_servers * server + config.rollout.reward_workers * grader
    ours = _rss_bytes(os.getpid()) + sum(_rss_bytes(p) for p in servers + graders)
    available = available_memory_bytes()
    detail = (
        f"trainer ≈ {trainer / MiB:.0f} MiB{_trainer_breakdown(ctx)}, "
        f"server ≈ {server / MiB:.0f} MiB (KV at full load "
        f"and a weight load included) × {n_servers}, grader ≈ {grader / MiB:.0f} MiB × "
        f"{config.rollout.reward_workers}: ≈ {total / MiB:.0f} MiB"
    )
    if available is None:
        return f"{detail}; the machine's available memory cannot be read"
    room = available + ours
    if total > room:
        raise CheckFailed(
            f"{detail}, more than the {room / MiB:.0f} MiB this machine has free",
            "lower rollout.max_running_requests, optim.micro_batch_tokens, rollout.num_servers "
            "or model.max_context, or use a smaller model",
        )
    return f"{detail} of {room / MiB:.0f} MiB available"


def kernel_cache_bytes(config: RunConfig, trainer: bool) -> int:
    """The bf16 kernel caches a CPU process fills after the preflight's few shapes: at most
    ``relayrl.heap.KERNEL_CACHE_ENTRIES`` primitives each, about 1 MiB apiece on SmolLM2's
    products (``scripts/bf16_primitive_cache.py``: 120 MiB over 300 new shapes of a
    576 × 4096 bf16 product with both caches at 128 entries). 0 where the process computes in
    float32 or off the CPU."""
    from relayrl.heap import KERNEL_CACHE_ENTRIES

    if not str(config.model.device).startswith("cpu"):
        return 0
    if trainer:
        bf16 = config.train.mixed_precision == "bf16" or config.model.dtype == "bfloat16"
    else:
        bf16 = config.served_dtype == "bfloat16"
    return KERNEL_CACHE_ENTRIES * MiB if bf16 else 0


def _trainer_peak(ctx: CheckContext) -> int:
    """This process's peak: what it holds between steps (model, gradients, optimizer state)
    plus the probe step's activations scaled from the positions its micro-batch computed to
    those of the largest micro-batch a step of the run can build, times
    :data:`ACTIVATION_ALLOWANCE`; never less than the peak it has already reached (loading
    the model)."""
    config = ctx.config
    assert config is not None
    reached = max(
        int(ctx.measures.get("trainer_peak_before_step", 0)), _rss_bytes(os.getpid(), "VmHWM")
    )
    held = int(ctx.measures.get("trainer_held", reached))
    activations = int(ctx.measures.get("step_activations", 0))
    measured = max(1, int(ctx.measures.get("step_positions", 1)))
    largest = largest_micro_batch(
        config, len(ctx.prompt_ids), getattr(ctx.trainer, "sharing", None) is not None
    )
    ctx.measures["largest_micro_batch"] = largest
    scaled = held + int(activations * max(1.0, largest / measured) * ACTIVATION_ALLOWANCE)
    return max(reached, scaled) + _canary_bytes(ctx)


def _trainer_breakdown(ctx: CheckContext) -> str:
    measures = ctx.measures
    if not measures.get("step_activations"):
        return ""
    return (
        f" ({measures['trainer_held'] / MiB:.0f} held between steps + "
        f"{ACTIVATION_ALLOWANCE} × {measures['step_activations'] / MiB:.0f} of activations "
        f"over {measures['step_positions']:.0f} positions, scaled to a micro-batch of "
        f"{measures['largest_micro_batch']:.0f})"
    )


def largest_micro_batch(config: RunConfig, prompt_tokens: int, shared_prompts: bool) -> int:
    """Token positions of the largest micro-batch a step can pack: ``optim.micro_batch_tokens``,
    or the whole batch at ``rollout.max_new_tokens`` if that is less, and never less than
    one unit the packer cannot split (a sequence; with shared prompts a prompt and all its
    samples' completions)."""
    rollout = config.rollout
    if shared_prompts:
        unit = prompt_tokens + rollout.n_samples * rollout.max_new_tokens
        units = rollout.prompts_per_step
    else:
        unit = prompt_tokens + rollout.max_new_tokens
        units = rollout.prompts_per_step * rollout.n_samples
    return max(unit, min(config.optim.micro_batch_tokens, unit * units))


def _canary_bytes(ctx: CheckContext) -> int:
    """The publication canary's reference: a whole copy of the trainer's model, held while
    the trainer goes on with its next step (relayrl.sync.canary; off when the servers hold
    another dtype). The preflight publishes nothing, so its measured peak lacks it."""
    config = ctx.config
    assert config is not None
    if config.train.publish_canary_every <= 0 or config.served_dtype != config.model.dtype:
        return 0
    model = getattr(ctx.trainer, "model", None) or ctx.model
    return 0 if model is None else _tensor_bytes(model.parameters())


def _weight_load_bytes(ctx: CheckContext) -> int:
    """A weight load's transient on a server: it reads a whole publication (the trainer's
    trainable tensors as the trainer holds them; LoRA: the adapter) before copying it into
    its model. The preflight's server never loads one, so its measured peak lacks it."""
    model = getattr(ctx.trainer, "model", None) or ctx.model
    if model is None:
        return 0
    # parameters() yields a tied tensor once, as a publication carries it
    return _tensor_bytes(p for p in model.parameters() if p.requires_grad)


def _tensor_bytes(tensors: Iterable[Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _kv_bytes(ctx: CheckContext) -> int:
    """The KV cache a built-in server holds at full load (vLLM's is allocated at start)."""
    config = ctx.config
    assert config is not None
    if config.rollout.engine != "builtin" or config.rollout.server_urls:
        return 0
    import torch

    from relayrl.engine.kv import kv_bytes_per_token

    dtype = getattr(torch, config.served_dtype)
    from relayrl.engine.model_runner import available_memory_bytes
    from relayrl.engine.types import EngineOptions

    per_token = kv_bytes_per_token(ctx.model.config, dtype)
    full = per_token * config.rollout.max_running_requests * config.model.max_context
    available = available_memory_bytes()  # the engine caps its KV at a fraction of it
    if available is None:
        return full
    return min(full, int(available * EngineOptions().kv_memory_fraction))
