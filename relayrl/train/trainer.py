"""The RL trainer: one optimizer step on a batch of complete groups.

Owns: :class:`RLTrainer` (model, AdamW, warm-up + schedule, the no-grad proximal pass,
dynamic micro-batching with the global normaliser, gradient clipping, the weight version
and publication of weights as safetensors) and :func:`lr_factor`.

Per step (advantages are already on the samples: the rollout controller computes them per
batch): assert every trajectory's staleness ≤ η → pack sequences into micro-batches under ``optim.micro_batch_tokens``
(``relayrl.algo.microbatch``) → no-grad pass for π_prox (decoupled loss; also the source of
the behaviour-vs-proximal statistics; skipped when one AdamW step covers the batch, whose own
forward pass then gives π_prox, :meth:`RLTrainer._fuses_prox`) → for each PPO mini-batch (``optim.ppo_minibatches``
contiguous slices of the groups, ``optim.ppo_epochs`` passes; one by default): per
micro-batch ``policy_loss`` with the mini-batch's normaliser, backward → clip → AdamW step;
then version + 1 (one version per batch, whatever the number of AdamW steps). With
``train.drift_metrics`` a no-grad pass after the update gives the per-version drift
``drift_kl_k3`` = KL(π_v ‖ π_v+1) and ``behav_prox_kl_k3`` = KL(μ ‖ π_v) on the batch's tokens
(``relayrl.algo.losses.policy_drift``; a loss without π_prox takes log π_v from its first
AdamW step's forward pass when that covers the whole batch, else one more pass before). With
``rollout.eta=auto`` the same log π_v gives ``stale_kl_per_version`` (Σ KL(μ ‖ π_v) / Σ
staleness over the stale tokens, ``relayrl.algo.losses.stale_kl_per_version``), the drift
the staleness bound's rule reads (``relayrl.rollout.eta``). Logprobs are
``log_softmax(logits / T)`` as in the engine (docs/engine.md).

With ``replay.enable`` (D-ARL, ``relayrl.train.replay_step``): the proximal pass runs over
the fresh samples and the replay buffer's candidates, selection picks the replayed samples,
and the loss becomes the multi-behaviour loss (per-token coefficients ``α_k/N_k`` with
normaliser 1, or balance-heuristic weights); the buffer is updated after the step and is
part of ``state_dict``.

The data-parallel trainer (``relayrl.train.fsdp.ShardedRLTrainer``) subclasses this one and
overrides the per-rank pieces only: ``_micro_batches``, ``traj_logprobs``, ``_count_tokens``,
``_backward``, ``_clip_gradients``, ``_reduce_stat_sums``, ``_reference_copy`` and the
weights/state methods; at world size 1 this class runs alone, unchanged.

The trainer reads nothing of the run's configuration but its
:class:`relayrl.train.options.TrainerOptions` (``TrainerOptions.from_config(config)``).

Imports: torch, relayrl.algo (losses, micro-batching), the Trajectory record,
relayrl.train.options, relayrl.train.replay_step.
"""

from __future__ import annotations

import copy
import inspect
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from relayrl.algo.losses import (
    engine_trainer_kl,
    entropy_from_logits,
    loss_normalizer,
    mismatch_by_staleness,
    policy_drift,
    policy_loss,
    stale_kl_per_version,
)
from relayrl.algo.microbatch import pack_micro_batches
from relayrl.engine.adapter import Adapter
from relayrl.metric_names import (
    ESS_FRAC,
    STALE_KL_PER_VERSION,
    STALENESS_MAX,
    STALENESS_MEAN,
    STALENESS_MIN,
    TIME_DRIFT_S,
    TIME_PROX_S,
    TIME_UPDATE_S,
    TRAIN_TOKENS,
)
from relayrl.rollout.trajectory import StalenessError, Trajectory, check_staleness
from relayrl.train.lora import (
    adapter_snapshot,
    is_lora,
    save_adapter_snapshot,
    trainable_parameters,
)
from relayrl.train.options import TrainerOptions
from relayrl.train.replay_step import LossTerms, ReplayBatch, ReplayStep
from relayrl.train.shared_prompts import (
    PackedPrompts,
    Sharing,
    pack_by_prompt,
    packed_logits,
    plan_prompt_units,
    sharing_for,
    unit_length,
)

MAX_STATS = ("is_weight_max",)


def lr_factor(step: int, warmup: int, total: int, schedule: str) -> float:
    """Multiplier of the peak learning rate at optimizer step ``step`` (0-based)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "cosine":
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
    if schedule == "linear":
        return 1.0 - 0.9 * progress
    return 1.0


@dataclass
class _MicroBatch:
    """Right-padded tensors of some sequences; per-token tensors are ``[b, L-1]``;
    ``spans[row]`` is where row's completion tokens sit in them."""

    index: list[int]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor
    behav: torch.Tensor
    adv: torch.Tensor
    spans: list[slice]
    packed: PackedPrompts | None = None  # its shared prompts, computed once (shared_prompts)

    def scatter(self, per_traj: Sequence[torch.Tensor]) -> torch.Tensor:
        """``[b, L-1]`` tensor of per-trajectory completion values (``per_traj`` is indexed
        like the step's trajectories), zero elsewhere."""
        dtype = per_traj[self.index[0]].dtype if self.index else torch.float32
        out = torch.zeros(self.mask.shape, dtype=dtype)
        for row, (i, span) in enumerate(zip(self.index, self.spans, strict=True)):
            out[row, span] = per_traj[i]
        return out.to(self.mask.device)

    def gather(self, padded: torch.Tensor) -> list[torch.Tensor]:
        """The inverse of ``scatter``: one CPU tensor per row, over its completion tokens."""
        padded = padded.cpu()
        return [padded[row, span] for row, span in enumerate(self.spans)]


def _takes_logits_to_keep(model: torch.nn.Module) -> bool:
    """Whether the model's forward can compute the output head on the last positions only
    (Hugging Face causal LMs; a peft model forwards it to its base)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "logits_to_keep" in inspect.signature(base.forward).parameters


def _collate(
    trajs: Sequence[Trajectory],
    index: list[int],
    pad_id: int,
    device: torch.device,
    sharing: Sharing | None = None,
) -> _MicroBatch:
    """Trajectories ``index`` right-padded, one row each; with ``sharing``, also packed by
    prompt for the forward pass (rows that share a prompt compute it once)."""
    seqs = [trajs[i] for i in index]
    width = max(t.num_tokens for t in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    mask = torch.zeros((len(seqs), width - 1), dtype=torch.float32)
    behav = torch.zeros((len(seqs), width - 1), dtype=torch.float32)
    adv = torch.zeros((len(seqs), width - 1), dtype=torch.float32)
    spans = []
    for row, t in enumerate(seqs):
        n, p, c = t.num_tokens, len(t.prompt_ids), len(t.completion_ids)
        ids[row, :n] = torch.tensor(t.prompt_ids + t.completion_ids)
        attn[row, :n] = 1
        span = slice(p - 1, p - 1 + c)  # logits at position i predict token i + 1
        spans.append(span)
        # only model tokens are trained: environment tokens (tool output) get no gradient
        mask[row, span] = torch.tensor(t.model_mask, dtype=torch.float32) if t.origins else 1.0
        behav[row, span] = torch.tensor(t.behav_logprobs, dtype=torch.float32)
        adv[row, span] = torch.tensor(t.token_advantages) if t.token_advantages else t.advantage
    ids, attn, mask, behav, adv = (x.to(device) for x in (ids, attn, mask, behav, adv))
    packed = None
    if sharing is not None:
        start = min(span.start for span in spans)
        packed = pack_by_prompt(trajs, index, pad_id, sharing, start, width)
        packed = packed.to(device) if packed is not None else None
    return _MicroBatch(index, ids, attn, ids[:, 1:], mask, behav, adv, spans, packed)


def minibatch_slices(
    groups: Sequence[Sequence[Trajectory]], num_trajs: int, minibatches: int
) -> list[list[int]]:
    """Trajectory indices of each PPO mini-batch: the batch's groups (its first trajectories,
    in order) cut into ``minibatches`` contiguous runs of whole groups, as even as possible;
    trajectories past the groups (D-ARL replays) are dealt round-robin. Never an empty one."""
    bounds, start = [], 0
    for g in groups:
        bounds.append((start, start + len(g)))
        start += len(g)
    m = max(1, min(minibatches, len(groups)))
    parts: list[list[int]] = []
    for k in range(m):
        lo, hi = k * len(groups) // m, (k + 1) * len(groups) // m
        parts.append([i for a, b in bounds[lo:hi] for i in range(a, b)])
    for j, i in enumerate(range(start, num_trajs)):
        parts[j % m].append(i)
    return parts


def combine_update_stats(updates: Sequence[tuple[dict[str, float], int]]) -> dict[str, float]:
    """Statistics of several AdamW steps: token-weighted means (maxima for ``MAX_STATS``);
    ``grad_norm`` is the mean over steps."""
    total = max(sum(n for _, n in updates), 1)
    out: dict[str, float] = {}
    for key in updates[0][0]:
        values = [(s[key], n) for s, n in updates if key in s]
        if key in MAX_STATS:
            out[key] = max(v for v, _ in values)
        elif key in ("grad_norm", "micro_batches"):
            out[key] = sum(v for v, _ in values) / len(values)
        else:
            out[key] = sum(v * n for v, n in values) / total
    return out


class RLTrainer:
    """Owns the policy being optimised; ``version`` = optimizer steps taken."""

    world_size = 1  # processes sharing the step (a data-parallel rank sets its own)

    def __init__(self, model: torch.nn.Module, options: TrainerOptions, pad_id: int) -> None:
        self.model = model.train()
        self.options = options
        self.pad_id = pad_id
        self.eta = options.eta
        self.temperature = options.temperature
        self.loss_cfg = options.loss
        o = options  # the schedule's lambda keeps these (frozen) options
        self.optimizer = torch.optim.AdamW(
            trainable_parameters(model), lr=o.lr, betas=o.betas, weight_decay=o.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, o.warmup_steps, o.total_steps, o.schedule)
        )
        self.ref_model = self._reference_copy(model) if self.loss_cfg.kl_coef > 0 else None
        # a group's prompt computed once per micro-batch, where the model can take it
        self.sharing = (
            sharing_for(model) if options.share_prompts and _takes_logits_to_keep(model) else None
        )
        self.version = 0
        # the last step's trained samples (fresh, then D-ARL's replayed) and their log π_v
        # per completion token (None when the step computed none): RunLogger.log_inspect
        self.last_trained: list[Trajectory] = []
        self.last_prox: list[torch.Tensor] | None = None
        self.replay: ReplayStep | None = None
        if options.replay is not None:
            self.replay = ReplayStep(options.replay, self.eta, model)

    def _reference_copy(self, model: torch.nn.Module) -> torch.nn.Module:
        """The frozen reference policy of the KL term: a copy of the initial weights."""
        return copy.deepcopy(model).eval().requires_grad_(False)

    # ------------------------------------------------------------------ logprobs
    def _logprobs(
        self, model: torch.nn.Module, mb: _MicroBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[b, L-1]`` logprobs of the targets, ``log_softmax(logits / T)``, and the
        logits they come from (``[b, L-1-start, V]``), computed from the first completion
        column ``start`` on: a prompt's positions need no output head, whose matrix product
        and log_softmax over a 49k vocabulary are a large part of a real model's step.
        Columns before ``start`` are 0 (no token there is trained)."""
        width = mb.input_ids.shape[1]
        start = min((span.start for span in mb.spans), default=0)
        kwargs = {"logits_to_keep": width - start} if _takes_logits_to_keep(model) else {}
        device = mb.input_ids.device.type
        with torch.autocast(device, dtype=torch.bfloat16, enabled=self.options.autocast_bf16):
            if mb.packed is not None:
                logits = packed_logits(model, mb.packed)
            else:
                logits = model(
                    input_ids=mb.input_ids, attention_mask=mb.attention_mask, **kwargs
                ).logits
                logits = logits[:, -(width - start) : -1]
        logits = logits.float() / self.temperature
        logp = torch.log_softmax(logits, dim=-1)
        logp = logp.gather(-1, mb.targets[:, start:].unsqueeze(-1)).squeeze(-1)
        head = logp.new_zeros(logp.shape[0], start)
        return torch.cat([head, logp], dim=1), logits

    @torch.no_grad()
    def _no_grad_logprobs(self, model: torch.nn.Module, mb: _MicroBatch) -> torch.Tensor:
        return self._logprobs(model, mb)[0]

    def _micro_batches(self, trajs: Sequence[Trajectory]) -> list[_MicroBatch]:
        """First-fit-decreasing packs under ``optim.micro_batch_tokens`` (padded cost: each
        micro-batch is collated right-padded to its longest row), collated. With shared
        prompts a row is one prompt and its samples' completions (``shared_prompts``), so
        the samples of a group stay in one micro-batch."""
        budget = self.options.micro_batch_tokens
        device = next(self.model.parameters()).device
        if self.sharing is None:
            plan = pack_micro_batches([t.num_tokens for t in trajs], budget)
            return [_collate(trajs, idx, self.pad_id, device) for idx in plan]
        units = plan_prompt_units(trajs, range(len(trajs)), self.sharing.limit)
        lengths = [unit_length(trajs, u) for u in units]
        plan = [
            [i for u in sorted(idx) for i in units[u]]
            for idx in pack_micro_batches(lengths, budget)
        ]
        return [_collate(trajs, idx, self.pad_id, device, self.sharing) for idx in plan]

    def micro_batch_positions(self, trajs: Sequence[Trajectory]) -> list[int]:
        """The token positions each micro-batch's forward pass computes, padding included
        (a packed row once per prompt): what its activations grow with."""
        return [
            (mb.packed.input_ids if mb.packed is not None else mb.input_ids).numel()
            for mb in self._micro_batches(trajs)
        ]

    def traj_logprobs(
        self,
        model: torch.nn.Module,
        trajs: Sequence[Trajectory],
        mbs: list[_MicroBatch] | None = None,
    ) -> list[torch.Tensor]:
        """No-grad logprobs of each trajectory's completion tokens under ``model``."""
        out: list[torch.Tensor] = [torch.zeros(0)] * len(trajs)
        for mb in mbs if mbs is not None else self._micro_batches(trajs):
            for i, values in zip(
                mb.index, mb.gather(self._no_grad_logprobs(model, mb)), strict=True
            ):
                out[i] = values
        return out

    # ------------------------------------------------------------------ the step
    def check_staleness(self, trajs: Sequence[Trajectory]) -> list[int]:
        """Staleness of every trajectory; raises if any exceeds η (a controller bug)."""
        try:
            return check_staleness(trajs, self.version, self.eta)
        except StalenessError as exc:
            raise AssertionError(
                f"staleness bound violated: a sample of staleness {exc.worst} reached trainer "
                f"version {self.version} with eta={self.eta}"
            ) from exc

    def train_step(self, groups: Sequence[Sequence[Trajectory]]) -> dict[str, float]:
        """One PPO update on ``groups`` (lists of trajectories); returns statistics.

        ``optim.ppo_minibatches`` × ``optim.ppo_epochs`` AdamW steps on contiguous slices of
        the batch's groups (one step by default); the proximal logprobs are computed once,
        before the first, so π_prox is the policy that the batch started from. The version
        advances by one per call. With ``replay.enable`` the step trains these fresh samples
        plus selected replayed ones, with the multi-behaviour loss
        (``relayrl.train.replay_step``)."""
        fresh = [t for g in groups for t in g]
        stale = self.check_staleness(fresh)
        t0 = time.perf_counter()
        parts = minibatch_slices(groups, len(fresh), self.options.ppo_minibatches)
        whole = self._micro_batches(fresh) if len(parts) == 1 and self.replay is None else None
        fused_prox = self._fuses_prox(parts)
        if self.replay is None:
            trajs = fresh
            separate = self._needs_prox() and not fused_prox
            prox = self.traj_logprobs(self.model, trajs, whole) if separate else None
            per_token, normalizer, extra = {}, None, {}
        else:
            batch, terms = self._replay_batch(fresh)
            trajs, prox = batch.trajs, batch.prox
            per_token, normalizer = terms.per_token, terms.normalizer
            extra = {**batch.stats, **terms.stats}
        t1 = time.perf_counter()
        behav, vers = [t.behav_logprobs for t in trajs], [t.versions for t in trajs]
        extra.update(engine_trainer_kl(behav, vers, prox, self.version))
        before, first_logprobs = prox, None
        if fused_prox:  # π_prox = the update's own forward pass (detached), kept for stats
            first_logprobs = {}
        elif self._measures_drift() and before is None:  # a loss without π_prox:
            if self._one_local_update(parts):  # π_v from the update's own forward pass
                first_logprobs = {}
            else:
                before = self.traj_logprobs(self.model, trajs, whole)
        t_before = time.perf_counter() - t1
        if len(trajs) > len(fresh):  # D-ARL replays join the mini-batches
            parts = minibatch_slices(groups, len(trajs), self.options.ppo_minibatches)
        updates = self._updates(
            trajs, prox, per_token, normalizer, parts, whole, first_logprobs, fused_prox
        )
        if fused_prox:
            prox = [first_logprobs[i] for i in range(len(trajs))]
            extra.update(engine_trainer_kl(behav, vers, prox, self.version))
        self.scheduler.step()
        self.version += 1
        if self.replay is not None:
            self.replay.finish(batch, self.version, self.model)
        t2 = time.perf_counter()
        if first_logprobs is not None:
            before = [first_logprobs[i] for i in range(len(trajs))]
        if self.options.drift_metrics:
            after = self.traj_logprobs(self.model, trajs, whole)
            extra.update(policy_drift(behav, [t.model_mask for t in trajs], before, after))
        if before is not None:  # the mismatch doctor: KL(μ ‖ π_v) per staleness level
            masks = [t.model_mask for t in trajs]
            extra.update(mismatch_by_staleness(behav, vers, masks, before, self.version - 1))
        self.last_trained, self.last_prox = trajs, before  # for the run log's inspector rows
        if self.options.stale_kl and before is not None:
            masks = [t.model_mask for t in trajs]
            k = stale_kl_per_version(behav, vers, masks, before, self.version - 1)
            if k is not None:
                extra[STALE_KL_PER_VERSION] = k
        stats = combine_update_stats(updates)
        stats.update(extra)
        stats.update(
            {
                "lr": self.scheduler.get_last_lr()[0],
                "optimizer_steps": float(len(updates)),
                TRAIN_TOKENS: float(sum(t.num_tokens for t in trajs)),
                STALENESS_MIN: float(min(stale)),
                STALENESS_MEAN: sum(stale) / len(stale),
                STALENESS_MAX: float(max(stale)),
                TIME_PROX_S: t1 - t0,
                TIME_UPDATE_S: t2 - t1 - t_before,
                TIME_DRIFT_S: t_before + time.perf_counter() - t2,
            }
        )
        return stats

    def _updates(
        self,
        trajs: list[Trajectory],
        prox: list[torch.Tensor] | None,
        per_token: dict[str, list[torch.Tensor]],
        normalizer: float | None,
        parts: list[list[int]],
        whole: list[_MicroBatch] | None,
        first_logprobs: dict[int, torch.Tensor] | None,
        fused_prox: bool,
    ) -> list[tuple[dict[str, float], int]]:
        """The step's AdamW steps: ``optim.ppo_epochs`` passes over the mini-batch slices
        ``parts``; the first step fills ``first_logprobs`` (when a dict) with each
        trajectory's logprobs from its own forward pass."""
        total_tokens = sum(len(t.completion_ids) for t in trajs)
        updates: list[tuple[dict[str, float], int]] = []
        for _ in range(self.options.ppo_epochs):
            for part in parts:
                # a batch-level normaliser (D-ARL) is shared out by the slice's token share
                share = sum(len(trajs[i].completion_ids) for i in part) / max(total_tokens, 1)
                updates.append(
                    self._update(
                        [trajs[i] for i in part],
                        [prox[i] for i in part] if prox is not None else None,
                        {k: [v[i] for i in part] for k, v in per_token.items()},
                        None if normalizer is None else normalizer * share,
                        whole,
                        first_logprobs if not updates else None,
                        fused_prox,
                    )
                )
        return updates

    def _update(
        self,
        trajs: list[Trajectory],
        prox: list[torch.Tensor] | None,
        per_token: dict[str, list[torch.Tensor]],
        normalizer: float | None,
        mbs: list[_MicroBatch] | None = None,
        keep_logprobs: dict[int, torch.Tensor] | None = None,
        fused_prox: bool = False,
    ) -> tuple[dict[str, float], int]:
        """One AdamW step on ``trajs``: micro-batches, backward, clip, step. ``keep_logprobs``
        receives each trajectory's (detached) logprobs under the weights before the step;
        ``fused_prox``: those logprobs are also π_prox (see :meth:`_fuses_prox`)."""
        mbs = mbs if mbs is not None else self._micro_batches(trajs)
        if normalizer is None:
            n_tokens = self._count_tokens(trajs, mbs)
            normalizer = loss_normalizer(
                self.loss_cfg.aggregation, n_tokens, len(trajs), self.options.max_new_tokens
            )
        inputs = [
            {
                **({"prox_logprobs": mb.scatter(prox)} if prox is not None else {}),
                **{key: mb.scatter(values) for key, values in per_token.items()},
            }
            for mb in mbs
        ]
        ref = [self._no_grad_logprobs(self.ref_model, mb) for mb in mbs] if self.ref_model else []
        stats = self._accumulate(mbs, inputs, ref, normalizer, keep_logprobs, fused_prox)
        grad_norm = self._clip_gradients()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        stats.update(grad_norm=float(grad_norm), micro_batches=float(len(mbs)))
        return stats, sum(len(t.completion_ids) for t in trajs)

    def _count_tokens(self, trajs: Sequence[Trajectory], mbs: list[_MicroBatch]) -> int:  # noqa: ARG002
        """Model-generated completion tokens of the optimizer step (the token-mean
        normaliser; environment tokens of multi-turn episodes take no loss)."""
        return sum(t.num_model_tokens for t in trajs)

    def _clip_gradients(self) -> float:
        """Clip the gradient to ``optim.grad_clip`` (global norm); returns the norm before."""
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.options.grad_clip)
        return float(norm)

    def _backward(self, loss: torch.Tensor, index: int, count: int) -> None:  # noqa: ARG002
        """Backward of micro-batch ``index`` of ``count`` (gradients accumulate)."""
        loss.backward()

    def _replay_batch(self, fresh: list[Trajectory]) -> tuple[ReplayBatch, LossTerms]:
        """Fresh + replay candidates → proximal pass → selection → loss terms."""
        assert self.replay is not None
        cands = self.replay.candidates(fresh, self.version)
        prox = self.traj_logprobs(self.model, cands)
        batch = self.replay.select(cands, prox, len(fresh), self.version)
        terms = self.replay.loss_terms(batch, self.version, self.model, self.traj_logprobs)
        return batch, terms

    def _one_local_update(self, parts: list[list[int]]) -> bool:
        """Whether the step's first AdamW step computes every trajectory's logprobs here,
        under the weights the step starts from (one mini-batch, one process)."""
        return len(parts) == 1 and self.replay is None and self.world_size == 1

    def _measures_drift(self) -> bool:
        """Whether the step needs log π_v of every trained token besides the loss's own:
        for the drift metrics or ``rollout.eta=auto``'s per-version drift."""
        return self.options.drift_metrics or self.options.stale_kl

    def _needs_prox(self) -> bool:
        return self.loss_cfg.objective.needs_prox

    def _fuses_prox(self, parts: list[list[int]]) -> bool:
        """Whether π_prox comes from the update's own forward pass instead of a no-grad pass.

        π_prox is the policy the batch starts from. With one AdamW step that covers the
        whole batch here, the update's forward pass runs on exactly those weights and
        micro-batches, so its detached logprobs are π_prox, and the separate pass (a
        quarter of a step's compute) would only repeat it. Several mini-batches or epochs
        need π_prox fixed across AdamW steps, so they keep the separate pass."""
        return self._needs_prox() and self._one_local_update(parts) and self.options.ppo_epochs == 1

    def _accumulate(
        self,
        mbs: list[_MicroBatch],
        inputs: list[dict[str, torch.Tensor]],
        ref: list[torch.Tensor],
        normalizer: float,
        keep_logprobs: dict[int, torch.Tensor] | None = None,
        fused_prox: bool = False,
    ) -> dict[str, float]:
        """Backward through every micro-batch; ``inputs[i]``: its ``prox_logprobs`` and
        any D-ARL ``token_coef`` / ``log_is_weight``, passed to ``policy_loss``; the detached
        logprobs of each trajectory go to ``keep_logprobs`` when given. ``fused_prox``: the
        micro-batch's own detached logprobs are its ``prox_logprobs``."""
        sums: dict[str, float] = {}
        maxes: dict[str, float] = {}
        total = 0
        weight_sums = {"ess_num": 0.0, "ess_den": 0.0}
        for i, mb in enumerate(mbs):
            logp, logits = self._logprobs(self.model, mb)
            if keep_logprobs is not None:
                keep_logprobs.update(zip(mb.index, mb.gather(logp.detach()), strict=True))
            with torch.no_grad():
                ent = entropy_from_logits(logits.detach())
                ent = torch.cat([ent.new_zeros(ent.shape[0], logp.shape[1] - ent.shape[1]), ent], 1)
            if fused_prox:
                inputs[i] = {**inputs[i], "prox_logprobs": logp.detach()}
            out = policy_loss(
                logp,
                mb.behav,
                mb.adv,
                mb.mask,
                self.loss_cfg,
                normalizer,
                ref_logprobs=ref[i] if ref else None,
                entropy=ent,
                **inputs[i],
            )
            self._backward(out.loss, i, len(mbs))
            if not out.num_tokens:  # a rank's padding micro-batch (data-parallel trainer)
                continue
            total += out.num_tokens
            for key, value in out.stats.items():
                if key in MAX_STATS:
                    maxes[key] = max(maxes.get(key, value), value)
                elif key != "n_tokens":
                    sums[key] = sums.get(key, 0.0) + value * out.num_tokens
            anchor = inputs[i].get("prox_logprobs", logp.detach())
            w = torch.exp(anchor - mb.behav)[mb.mask > 0]
            weight_sums["ess_num"] += float(w.sum())
            weight_sums["ess_den"] += float(w.square().sum())
        sums, maxes, total = self._reduce_stat_sums(sums, maxes, total, weight_sums)
        stats = {k: v / max(total, 1) for k, v in sums.items()}
        stats.update(maxes)
        n = max(total, 1)
        stats[ESS_FRAC] = weight_sums["ess_num"] ** 2 / max(weight_sums["ess_den"], 1e-12) / n
        return stats

    def _reduce_stat_sums(
        self,
        sums: dict[str, float],
        maxes: dict[str, float],
        total: int,
        weight_sums: dict[str, float],  # noqa: ARG002
    ) -> tuple[dict[str, float], dict[str, float], int]:
        """Token-weighted statistic sums of the step's micro-batches (the data-parallel
        trainer adds up every rank's, in place for ``weight_sums``)."""
        return sums, maxes, total

    # ------------------------------------------------------------------ weights and state
    def save_weights(self, directory: Path) -> Path:
        """Write the current weights as ``directory/model.safetensors`` (tied tensors once);
        under LoRA only the adapters (``relayrl.train.lora.save_adapter_snapshot``)."""
        from safetensors.torch import save_file

        if is_lora(self.model):
            return save_adapter_snapshot(self.model, directory)
        directory.mkdir(parents=True, exist_ok=True)
        # named_parameters() lists a tied tensor once, under its first name (the engine's
        # loader expects exactly that)
        state = {n: p.detach().contiguous() for n, p in self.model.named_parameters()}
        save_file(state, str(directory / "model.safetensors"))
        return directory

    def lora_adapter(self) -> Adapter | None:
        """Under LoRA, the adapters as one publication (their tensors, scale and the merged
        weights' checksum: what the broadcast transport sends); None for full fine-tuning."""
        return adapter_snapshot(self.model) if is_lora(self.model) else None

    def state_dict(self) -> dict[str, Any]:
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "version": self.version,
        }
        if self.replay is not None:
            state["replay"] = self.replay.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        if "optimizer" in state:  # absent when it came from sharded (DCP) files
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.version = int(state["version"])
        if self.replay is not None and "replay" in state:
            self.replay.load_state_dict(state["replay"])
