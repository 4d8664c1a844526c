"""Token-level policy losses: PPO (sync / naive async), decoupled PPO (AReaL), rollout
importance correction (verl/TRL style), dual clip, KL to a reference policy.

Owns: ``LossConfig``, the policy-loss seam (:class:`PolicyLoss`, :data:`LOSSES`,
:func:`register_loss`: a new objective is one subclass plus one registry line, its own
parameters a ``Params`` model on the class (``relayrl.algo.params``), see
docs/extending.md), ``policy_loss`` (the one loss entry point the trainer calls per
micro-batch: validation, KL, coefficients, masking and statistics shared by every
objective), ``loss_normalizer`` (the global normaliser for a whole training step), the KL
estimators and ``entropy_from_logits``.

Conventions. Every per-token tensor has the same shape: flat ``[T]`` (packed sequences, then
``seq_ids`` says which sequence each token belongs to) or padded ``[B, L]`` (rows are
sequences). ``mask`` marks the completion tokens that count. Log-probabilities are natural
logs of the sampled tokens, under the same temperature on both sides. All importance weights
are stop-gradient; only ``logprobs`` (π_θ) carries gradient.

Aggregation. ``policy_loss`` returns ``Σ_t c_t · ℓ_t / normalizer`` where the sum runs over
the masked tokens of the tensors it is given and ``normalizer`` is fixed for the whole
training step by the caller (``loss_normalizer``). Calling it on each micro-batch and
accumulating gradients therefore gives exactly the gradient of the whole step, however the
step was split. Masked-out importance weights (``is_mode="mask"``) zero a token's loss but do
not change the normaliser, for the same reason.

Imports: torch, relayrl.registry, relayrl.metric_names, relayrl.algo.params.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, get_args

import torch
from pydantic import Field
from torch import Tensor

from relayrl.algo.params import Objective, ObjectiveParams, validate_params
from relayrl.metric_names import (
    BEHAV_KL,
    BEHAV_PROX_KL,
    DRIFT_KL,
    ENGINE_TRAINER_KL,
    IS_WEIGHT_MEAN,
    MISMATCH_KL,
    MISMATCH_TOKENS,
)
from relayrl.registry import Registry

ISLevel = Literal["none", "token", "sequence", "geometric"]
ISMode = Literal["truncate", "mask"]
KLEstimator = Literal["k1", "k2", "k3"]
Aggregation = Literal["token_mean", "seq_sum", "seq_mean_token_mean"]


def _check_choice(name: str, value: str, literal: object) -> None:
    allowed = get_args(literal)
    if value not in allowed:
        raise ValueError(f"LossConfig.{name}={value!r}; expected one of {allowed}")


@dataclass(init=False)
class LossConfig:
    """Knobs of the policy loss.

    - ``loss``: the name of a registered :class:`PolicyLoss`: ``"ppo"`` (ratio π_θ/μ; sync
      PPO at η = 0, naive async "bypass" at η > 0), ``"decoupled"`` (AReaL:
      ``w = sg(π_prox/μ)``, ``u = π_θ/π_prox``), ``"recompute"`` (decoupled with ``w ≡ 1``:
      AReaL's non-decoupled baseline) or one added with :func:`register_loss`.
    - ``eps_low`` / ``eps_high``: clip range ``[1 − eps_low, 1 + eps_high]`` (DAPO
      clip-higher when ``eps_high > eps_low``).
    - ``dual_clip``: constant ``c > 1``; for ``A < 0`` the token loss is capped at ``−c·A``.
    - ``is_level``: how the behaviour weight ``w`` of the decoupled loss is formed:
      ``"none"`` (token ratio, no cap: AReaL as published), ``"token"``, ``"sequence"``
      (product of the sequence's token ratios) or ``"geometric"`` (exp of their mean log).
      Requires ``loss="decoupled"`` unless ``"none"``.
    - ``is_mode``: ``"truncate"`` (``min(w, is_cap)``) or ``"mask"`` (``w`` zeroed outside
      ``[is_floor, is_cap]``; ``is_floor=None`` means ``1/is_cap``).
    - ``kl_coef`` / ``kl_estimator``: KL penalty to a reference policy (off when 0).
    - ``aggregation``: how ``loss_normalizer`` picks the step's normaliser: ``"token_mean"``
      (total completion tokens in the step), ``"seq_sum"`` (Dr.GRPO: sequences × max_len)
      or ``"seq_mean_token_mean"`` (each sequence's token mean, averaged over the step's
      sequences: TRL's ``loss_type="grpo"``, verl's ``seq-mean-token-mean``).
    - ``params``: the selected objective's own parameters (its ``Params``: ``gspo_eps_low``
      / ``gspo_eps_high`` of ``"gspo"``, ``cispo_cap`` of ``"cispo"``, a plugin's), given as
      keyword arguments like the knobs above (or as ``params=``, one ``Params`` instance)
      and read as attributes too (``cfg.cispo_cap``). A parameter the selected objective
      does not declare is an error.
    """

    loss: str = "decoupled"
    eps_low: float = 0.2
    eps_high: float = 0.28
    dual_clip: float | None = None
    is_level: ISLevel = "none"
    is_mode: ISMode = "truncate"
    is_cap: float = 2.0
    is_floor: float | None = None
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"
    aggregation: Aggregation = "token_mean"
    params: ObjectiveParams = field(default_factory=ObjectiveParams)
    # the registered objective ``loss`` names, resolved once here (not per micro-batch)
    objective: PolicyLoss = field(init=False, repr=False, compare=False)

    def __init__(self, *, params: ObjectiveParams | None = None, **settings: Any) -> None:
        """The shared knobs by name (unset: the defaults above); every other keyword is a
        parameter of the objective ``loss`` names, validated by its ``Params`` (over
        ``params``, when given: ``dataclasses.replace`` passes it)."""
        for knob in self.shared_knobs():
            setattr(self, knob.name, settings.pop(knob.name, knob.default))
        cls = loss_class(self.loss)  # raises on an unknown name
        given = params.model_dump(exclude_unset=True) if params is not None else {}
        self.params = validate_params(cls.Params, {**given, **settings}, f"loss {self.loss!r}")
        self.objective = cls(self.params)
        self._check()

    @classmethod
    def shared_knobs(cls) -> list[dataclasses.Field]:
        """The knobs every objective reads (``loss``, ``eps_*``, ``is_*``, ``kl_*``,
        ``aggregation``, ``dual_clip``): this class's fields but ``params`` and ``objective``."""
        return [f for f in dataclasses.fields(cls) if f.name not in ("params", "objective")]

    def __getattr__(self, name: str) -> Any:
        """An objective's own parameter reads as an attribute: ``cfg.cispo_cap``."""
        params = self.__dict__.get("params")
        if params is not None and name in type(params).model_fields:
            return getattr(params, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _check(self) -> None:
        _check_choice("is_level", self.is_level, ISLevel)
        _check_choice("is_mode", self.is_mode, ISMode)
        _check_choice("kl_estimator", self.kl_estimator, KLEstimator)
        _check_choice("aggregation", self.aggregation, Aggregation)
        if not (0.0 <= self.eps_low < 1.0 and self.eps_high >= 0.0):
            raise ValueError("need 0 <= eps_low < 1 and eps_high >= 0")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError("dual_clip must be > 1 (or None)")
        if self.is_level != "none" and not self.objective.uses_behaviour_weight:
            raise ValueError(
                f"rollout importance correction (is_level) needs a loss that weights by "
                f"π_prox/μ (e.g. 'decoupled'), not {self.loss!r}"
            )
        if self.is_cap <= 0.0:
            raise ValueError("is_cap must be > 0")
        if self.kl_coef < 0.0:
            raise ValueError("kl_coef must be >= 0")

    @property
    def floor(self) -> float:
        """The lower bound of the mask interval."""
        return 1.0 / self.is_cap if self.is_floor is None else self.is_floor


@dataclass
class LossOutput:
    """``loss`` = ``loss_sum / normalizer`` (call ``.backward()`` on it per micro-batch);
    ``stats`` are detached means over this call's masked tokens (weight them by
    ``num_tokens`` when combining micro-batches; ``*_max`` combine by max)."""

    loss: Tensor
    loss_sum: Tensor
    num_tokens: int
    stats: dict[str, float] = field(default_factory=dict)


def loss_normalizer(
    aggregation: Aggregation, num_tokens: int, num_seqs: int, max_len: int | None = None
) -> float:
    """The global normaliser of a training step, computed once before micro-batching.

    ``token_mean``: the number of completion tokens in the whole step. ``seq_sum``
    (Dr.GRPO): ``num_seqs · max_len`` with ``max_len`` the generation budget, i.e. each
    sequence's token sum divided by a constant, averaged over the step's sequences.
    ``seq_mean_token_mean``: ``num_seqs``; ``policy_loss`` divides each token's loss by its
    own sequence's token count, so the step's loss is the mean over sequences of each
    sequence's token mean.
    """
    if aggregation == "token_mean":
        return float(max(num_tokens, 1))
    if aggregation == "seq_mean_token_mean":
        return float(max(num_seqs, 1))
    if aggregation == "seq_sum":
        if max_len is None or max_len <= 0:
            raise ValueError("seq_sum aggregation needs max_len > 0")
        return float(max(num_seqs, 1) * max_len)
    raise ValueError(f"unknown aggregation {aggregation!r}")


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: KLEstimator) -> Tensor:
    """Per-token estimate of KL(π_θ ‖ π_ref) from sampled tokens (Schulman's k1/k2/k3).

    With ``ρ = log π_ref − log π_θ``: k1 = −ρ, k2 = ρ²/2, k3 = e^ρ − 1 − ρ.
    """
    rho = ref_logprobs - logprobs
    if estimator == "k1":
        return -rho
    if estimator == "k2":
        return 0.5 * rho.square()
    if estimator == "k3":
        return torch.expm1(rho) - rho
    raise ValueError(f"unknown KL estimator {estimator!r}")


def engine_trainer_kl(
    behav_logprobs: Sequence[Sequence[float]],
    versions: Sequence[Sequence[int]],
    prox_logprobs: Sequence[Tensor] | None,
    version: int,
) -> dict[str, float]:
    """``{"engine_trainer_kl_k3": mean k3, "engine_trainer_kl_tokens": n}`` over the tokens
    that the rollout engine sampled with weight ``version``, the trainer's current weights:
    k3 = e^ρ − 1 − ρ with ρ = log π_trainer − log μ_engine estimates KL(μ ‖ π) from μ's samples,
    so it is the numerical mismatch between the engine's behaviour logprobs and the trainer's
    recompute on the same weights (zero for an exact engine). Empty when ``prox_logprobs`` is
    None or no token is of ``version``."""
    if prox_logprobs is None:
        return {}
    total, count = 0.0, 0
    for behav, vers, prox in zip(behav_logprobs, versions, prox_logprobs, strict=True):
        same = torch.tensor([v == version for v in vers], dtype=torch.bool)
        if not bool(same.any()):
            continue
        rho = prox.detach().float().cpu()[same] - torch.tensor(behav, dtype=torch.float32)[same]
        total += float((torch.expm1(rho) - rho).sum())
        count += int(same.sum())
    if count == 0:
        return {}
    return {ENGINE_TRAINER_KL: total / count, "engine_trainer_kl_tokens": float(count)}


def policy_drift(
    behav_logprobs: Sequence[Sequence[float]],
    model_masks: Sequence[Sequence[bool]],
    before: Sequence[Tensor],
    after: Sequence[Tensor] | None = None,
) -> dict[str, float]:
    """Per-version drift of one training step, measured alike for every loss: k3 means over
    the step's trained (model) tokens.

    - ``behav_prox_kl_k3`` estimates KL(μ ‖ π_v): ρ = log π_v − log μ, with ``before`` the
      logprobs under π_v, the weights the step starts from (π_prox);
    - ``drift_kl_k3`` (with ``after``, the logprobs under π_v+1 once the step is done)
      estimates KL(π_v ‖ π_v+1): ρ = log π_v+1 − log π_v.

    The tokens are the batch's, sampled from μ: at η = 0 (μ = π_v) both are the textbook
    estimators; on stale batches ``drift_kl_k3`` is the movement where the batch's tokens lie
    (no importance weight, so every loss and η is measured the same way). Empty when the
    step has no model token."""
    mask = torch.tensor([bool(x) for m in model_masks for x in m], dtype=torch.bool)
    if not bool(mask.any()):
        return {}
    # float64: at η = 0 the k3 terms are ~ρ²/2, far below float32's resolution of ρ
    behav = torch.tensor([x for b in behav_logprobs for x in b], dtype=torch.float64)[mask]
    prox = torch.cat([x.detach().double().cpu() for x in before])[mask]
    out = {BEHAV_PROX_KL: float(kl_estimate(behav, prox, "k3").mean())}
    if after is not None:
        new = torch.cat([x.detach().double().cpu() for x in after])[mask]
        out[DRIFT_KL] = float(kl_estimate(prox, new, "k3").mean())
    return out


def staleness_k3(
    behav_logprobs: Sequence[Sequence[float]],
    versions: Sequence[Sequence[int]],
    model_masks: Sequence[Sequence[bool]],
    before: Sequence[Tensor],
    version: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Flat over the batch's completion tokens: the model-token mask, each token's
    staleness ``version`` − its version (long), and the k3 estimate of KL(μ ‖ π_v) with
    ρ = log π_v − log μ (``before``: the logprobs under π_v; none: ρ = 0), in float64, where
    the fresh tokens' k3 ≈ ρ²/2 is still resolved."""
    mask = torch.tensor([bool(x) for m in model_masks for x in m], dtype=torch.bool)
    stale = torch.tensor([version - v for vs in versions for v in vs], dtype=torch.long)
    behav = torch.tensor([x for b in behav_logprobs for x in b], dtype=torch.float64)
    prox = torch.cat([x.detach().double().cpu().reshape(-1) for x in before]) if before else behav
    return mask, stale, kl_estimate(behav, prox, "k3")


def stale_kl_per_version(
    behav_logprobs: Sequence[Sequence[float]],
    versions: Sequence[Sequence[int]],
    model_masks: Sequence[Sequence[bool]],
    before: Sequence[Tensor],
    version: int,
) -> float | None:
    """The batch's per-version drift k = (Σ k3 − n·m) / Σ s over its stale model tokens
    (staleness s = ``version`` − the token's version > 0; k3 = e^ρ − 1 − ρ with
    ρ = log π_v − log μ, the behaviour-vs-proximal KL estimator of :func:`policy_drift`,
    ``before`` the logprobs under π_v), n their number and m the mean k3 of the batch's
    fresh tokens (s = 0: the engine-vs-trainer numerical mismatch, which staleness does not
    cause; 0 when there is none). None when no token is stale. What ``rollout.eta=auto``
    reads (``relayrl.rollout.eta``)."""
    mask, stale, k3 = staleness_k3(behav_logprobs, versions, model_masks, before, version)
    stale = stale.double()
    old, fresh = mask & (stale > 0), mask & (stale == 0)
    if not bool(old.any()):
        return None
    mismatch = float(k3[fresh].mean()) if bool(fresh.any()) else 0.0
    excess = float(k3[old].sum()) - mismatch * int(old.sum())
    return excess / float(stale[old].sum())


def mismatch_by_staleness(
    behav_logprobs: Sequence[Sequence[float]],
    versions: Sequence[Sequence[int]],
    model_masks: Sequence[Sequence[bool]],
    before: Sequence[Tensor],
    version: int,
) -> dict[str, float]:
    """The mismatch doctor's columns: the mean k3 estimate of KL(μ ‖ π_v) (ρ = log π_v −
    log μ, ``before`` the logprobs under π_v, the weights the step starts from) over the
    batch's model tokens of each staleness s = ``version`` − the token's version, as
    ``mismatch_kl_k3_s<s>`` with the token count ``mismatch_tokens_s<s>``. Level 0 is the
    engine-vs-trainer numerical mismatch on fresh tokens (no staleness to explain it);
    levels 1..η add the policy's drift over s versions. Levels without tokens are left out."""
    mask, stale, k3 = staleness_k3(behav_logprobs, versions, model_masks, before, version)
    if not bool(mask.any()):
        return {}
    stale, k3 = stale[mask], k3[mask]
    out: dict[str, float] = {}
    for s in sorted(set(stale.tolist())):
        level = stale == s
        out[f"{MISMATCH_KL}{s}"] = float(k3[level].mean())
        out[f"{MISMATCH_TOKENS}{s}"] = float(level.sum())
    return out


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the softmax over the last dimension, one value per position."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def sequence_index(shape: torch.Size, seq_ids: Tensor | None, device: torch.device) -> Tensor:
    """Flat ``[T]`` sequence index per token: ``seq_ids`` if given, else the row of a
    padded ``[B, L]`` tensor."""
    if seq_ids is not None:
        if seq_ids.shape != shape:
            raise ValueError(f"seq_ids shape {tuple(seq_ids.shape)} != {tuple(shape)}")
        return seq_ids.reshape(-1).long().to(device)
    if len(shape) == 2:
        rows = torch.arange(shape[0], device=device)
        return rows[:, None].expand(shape[0], shape[1]).reshape(-1)
    raise ValueError("flat tensors need seq_ids for sequence-level quantities")


def per_sequence_sum(values: Tensor, seq: Tensor) -> Tensor:
    """Sum of flat ``values`` per sequence index (``[num_seqs]``)."""
    n = int(seq.max().item()) + 1 if seq.numel() else 0
    return torch.zeros(n, dtype=values.dtype, device=values.device).index_add_(0, seq, values)


def _log_weights_at_level(log_w: Tensor, m: Tensor, level: ISLevel, seq: Tensor | None) -> Tensor:
    """Per-token log importance weight at the requested level (flat tensors)."""
    if level in ("none", "token"):
        return log_w
    assert seq is not None
    total = per_sequence_sum(log_w * m, seq)
    if level == "sequence":
        return total[seq]
    count = per_sequence_sum(m, seq).clamp(min=1.0)
    return (total / count)[seq]


def _behaviour_weights(
    log_w: Tensor, m: Tensor, cfg: LossConfig, seq: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """(weight used in the loss, raw weight, keep mask) — all detached, flat."""
    raw = torch.exp(_log_weights_at_level(log_w, m, cfg.is_level, seq))
    keep = torch.ones_like(m, dtype=torch.bool)
    if cfg.is_level == "none":
        return raw, raw, keep
    if cfg.is_mode == "truncate":
        return raw.clamp(max=cfg.is_cap), raw, keep
    keep = (raw >= cfg.floor) & (raw <= cfg.is_cap)
    return torch.where(keep, raw, torch.zeros_like(raw)), raw, keep


def _clipped_loss(
    ratio: Tensor, adv: Tensor, cfg: LossConfig, eps: tuple[float, float] | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """−min(r·A, clip(r)·A), dual-clipped for A < 0; with 'clip' and 'dual' indicators.
    ``eps`` = (low, high) overrides ``cfg.eps_low`` / ``cfg.eps_high``."""
    low, high = eps if eps is not None else (cfg.eps_low, cfg.eps_high)
    clipped = ratio.clamp(1.0 - low, 1.0 + high)
    unclipped_loss = -ratio * adv
    clipped_loss = -clipped * adv
    loss = torch.maximum(unclipped_loss, clipped_loss)
    clip_hit = clipped_loss > unclipped_loss
    dual_hit = torch.zeros_like(clip_hit)
    if cfg.dual_clip is not None:
        cap = -cfg.dual_clip * adv
        dual_hit = (adv < 0) & (loss > cap)
        loss = torch.where(dual_hit, cap, loss)
    return loss, clip_hit, dual_hit


def _masked_mean(x: Tensor, m: Tensor, n: int) -> float:
    return float((torch.where(m > 0, x, torch.zeros_like(x)).sum() / max(n, 1)).item())


def _masked_max(x: Tensor, m: Tensor) -> float:
    sel = x[m > 0]
    return float(sel.max().item()) if sel.numel() else 0.0


@dataclass
class TokenInputs:
    """What an objective sees of one (micro-)batch: flat ``[T]`` tensors, zero outside
    ``mask``; everything but ``logprobs`` (π_θ, with gradient) is detached. ``prox`` is
    present when the loss ``needs_prox``; ``seq`` (sequence index per token) when the
    importance level is per sequence."""

    logprobs: Tensor
    behav: Tensor
    advantages: Tensor
    mask: Tensor
    num_tokens: int
    prox: Tensor | None = None
    log_is_weight: Tensor | None = None
    seq: Tensor | None = None


@dataclass
class TokenLoss:
    """An objective's answer: the per-token loss ``ℓ_t`` (before KL, coefficients and
    masking, which ``policy_loss`` applies to every objective), the ratio it clipped, which
    tokens the clip and the dual clip hit, the policy the behaviour KL statistic is measured
    from (``anchor``: π_prox or π_θ) and any statistics of its own."""

    per_token: Tensor
    ratio: Tensor
    clip_hit: Tensor
    dual_hit: Tensor
    anchor: Tensor
    stats: dict[str, float] = field(default_factory=dict)


class PolicyLoss(Objective):
    """The seam for policy objectives: subclass, set ``name``, implement ``token_loss``, and
    add the class with :func:`register_loss`; ``algo.loss=<name>`` then selects it. Its own
    hyperparameters are a nested ``class Params(ObjectiveParams)`` (``relayrl.algo.params``):
    each field is the config key ``algo.<field>``, and ``token_loss`` reads ``self.params``.

    ``needs_prox``: the trainer runs the no-grad proximal pass and passes ``prox``.
    ``uses_behaviour_weight``: the objective weights tokens by ``π_prox/μ`` and so accepts
    the rollout importance corrections (``algo.is_level``). ``needs_seq``: ``seq`` (the
    sequence index per token) is always passed."""

    name: ClassVar[str]
    needs_prox: ClassVar[bool] = False
    uses_behaviour_weight: ClassVar[bool] = False
    needs_seq: ClassVar[bool] = False

    def token_loss(self, inputs: TokenInputs, cfg: LossConfig) -> TokenLoss:
        raise NotImplementedError


class PPOLoss(PolicyLoss):
    """``ℓ = −min(r·A, clip(r)·A)`` with ``r = π_θ/μ``: sync PPO at η = 0, naive async
    ("bypass") on stale μ."""

    name = "ppo"

    def token_loss(self, inputs: TokenInputs, cfg: LossConfig) -> TokenLoss:
        ratio = torch.exp(inputs.logprobs - inputs.behav)
        loss, clip_hit, dual_hit = _clipped_loss(ratio, inputs.advantages, cfg)
        return TokenLoss(loss, ratio, clip_hit, dual_hit, anchor=inputs.logprobs.detach())


class DecoupledLoss(PolicyLoss):
    """AReaL's decoupled PPO: ``ℓ = −w · min(u·A, clip(u)·A)``, ``u = π_θ/π_prox``,
    ``w = sg(π_prox/μ)`` formed at ``cfg.is_level`` and truncated or masked by
    ``cfg.is_mode`` (``log_is_weight`` replaces ``log(π_prox/μ)`` when given)."""

    name = "decoupled"
    needs_prox = True
    uses_behaviour_weight = True

    def token_loss(self, inputs: TokenInputs, cfg: LossConfig) -> TokenLoss:
        assert inputs.prox is not None
        ratio = torch.exp(inputs.logprobs - inputs.prox)
        weight, stats = _weight_and_stats(inputs, cfg)
        pg, clip_hit, dual_hit = _clipped_loss(ratio, inputs.advantages, cfg)
        return TokenLoss(weight * pg, ratio, clip_hit, dual_hit, anchor=inputs.prox, stats=stats)


def _weight_and_stats(inputs: TokenInputs, cfg: LossConfig) -> tuple[Tensor, dict[str, float]]:
    """The behaviour weight ``w`` (``sg(π_prox/μ)`` at ``cfg.is_level``, truncated or masked;
    ``log_is_weight`` replaces ``log(π_prox/μ)`` when given) and its statistics."""
    assert inputs.prox is not None
    m, n_tok = inputs.mask, inputs.num_tokens
    log_w = inputs.log_is_weight if inputs.log_is_weight is not None else inputs.prox - inputs.behav
    weight, raw, keep = _behaviour_weights(log_w, m, cfg, inputs.seq)
    stats = {IS_WEIGHT_MEAN: _masked_mean(raw, m, n_tok), "is_weight_max": _masked_max(raw, m)}
    if cfg.is_level != "none" and cfg.is_mode == "truncate":
        stats["is_truncated_frac"] = _masked_mean((raw > cfg.is_cap).to(m.dtype), m, n_tok)
    if cfg.is_level != "none" and cfg.is_mode == "mask":
        stats["is_masked_frac"] = _masked_mean((~keep).to(m.dtype), m, n_tok)
    return weight, stats


class RecomputeLoss(PolicyLoss):
    """AReaL's baseline without the decoupled loss but with recomputed logprobs
    (``use_decoupled_loss=false, recompute_logprob=true``): the trainer's π_prox replaces μ
    as the old policy, ``ℓ = −min(u·A, clip(u)·A)``, ``u = π_θ/π_prox``, and no behaviour
    weight. It is decoupled PPO with ``w ≡ 1``: the trust region moves to π_prox, the
    staleness of μ goes uncorrected (biased, but never high-variance)."""

    name = "recompute"
    needs_prox = True

    def token_loss(self, inputs: TokenInputs, cfg: LossConfig) -> TokenLoss:
        assert inputs.prox is not None
        ratio = torch.exp(inputs.logprobs - inputs.prox)
        loss, clip_hit, dual_hit = _clipped_loss(ratio, inputs.advantages, cfg)
        return TokenLoss(loss, ratio, clip_hit, dual_hit, anchor=inputs.prox)


class GSPOLoss(PolicyLoss):
    """GSPO (Qwen3's recipe) in its GSPO-token form, decoupled like ``"decoupled"``:
    ``ℓ_t = −w_t · min(s_t·A_t, clip(s_t)·A_t)`` with the clip range ``Params.gspo_eps_*`` and

        s_t = sg(s_i) · π_θ(y_t) / sg(π_θ(y_t)),   s_i = exp(mean_{t∈i} log(π_θ/π_prox)),

    so every token of sequence i carries the value ``s_i`` (one clip decision per sequence)
    and the gradient ``s_i·∇log π_θ(y_t)``: per-token advantages still work. The sequence
    ratio is taken to π_prox (the trust region moves with the step, as in decoupled PPO);
    the staleness of μ is the behaviour weight ``w = sg(π_prox/μ)`` at ``cfg.is_level``
    (``"geometric"`` makes ``w_i·s_i = exp(mean log(π_θ/μ))``, GSPO's ratio to μ)."""

    name = "gspo"
    needs_prox = True
    uses_behaviour_weight = True
    needs_seq = True

    class Params(ObjectiveParams):
        gspo_eps_low: float = Field(
            3e-4,
            ge=0,
            lt=1,
            description="lower clip range of gspo's sequence ratio (the GSPO paper's: a "
            "length-normalised ratio moves far less than a token's)",
        )
        gspo_eps_high: float = Field(
            4e-4, ge=0, description="upper clip range of gspo's sequence ratio (the GSPO paper's)"
        )

    params: Params

    def token_loss(self, inputs: TokenInputs, cfg: LossConfig) -> TokenLoss:
        assert inputs.prox is not None and inputs.seq is not None
        m, seq, logp = inputs.mask, inputs.seq, inputs.logprobs
        count = per_sequence_sum(m, seq).clamp(min=1.0)
        log_s = per_sequence_sum((logp.detach() - inputs.prox) * m, seq) / count
        ratio = torch.exp(log_s[seq] + logp - logp.detach())
        weight, stats = _weight_and_stats(inputs, cfg)
        eps = (self.params.gspo_eps_low, self.params.gspo_eps_high)
        pg, clip_hit, dual_hit = _clipped_loss(ratio, inputs.advantages, cfg, eps)
        return TokenLoss(weight * pg, ratio, clip_hit, dual_hit, anchor=inputs.prox, stats=stats)


class CISPOLoss(PolicyLoss):
    """CISPO (MiniMax-M1): ``ℓ_t = −sg(min(r_t, C)) · A_t · log π_θ(y_t)``, ``r = π_θ/μ``,
    ``C = cispo_cap``. The importance weight is clipped, never the gradient: every token
    keeps ``−min(r, C)·A·∇log π_θ``. Its weight is already the (truncated) importance
    weight from μ, so it takes no separate behaviour weight (``is_level`` must be none)."""

    name = "cispo"

    class Params(ObjectiveParams):
        cispo_cap: float = Field(
            5.0, gt=0, description="upper bound C of cispo's importance weight (no lower bound)"
        )

    params: Params

    def token_loss(self, inputs: TokenInputs, cfg: LossConfig) -> TokenLoss:
        cap = self.params.cispo_cap
        logp = inputs.logprobs
        ratio = torch.exp(logp.detach() - inputs.behav)
        loss = -ratio.clamp(max=cap) * inputs.advantages * logp
        clip_hit = ratio > cap
        return TokenLoss(loss, ratio, clip_hit, torch.zeros_like(clip_hit), anchor=logp.detach())


LOSSES: Registry[type[PolicyLoss]] = Registry("loss", PolicyLoss)


def register_loss(cls: type[PolicyLoss]) -> type[PolicyLoss]:
    """Make ``cls`` selectable as ``algo.loss=cls.name`` (usable as a class decorator)."""
    return LOSSES.add_class(cls)


def loss_class(name: str) -> type[PolicyLoss]:
    """The registered objective called ``name``; a ``ValueError`` lists the known ones."""
    return LOSSES.lookup(name)


register_loss(PPOLoss)
register_loss(DecoupledLoss)
register_loss(RecomputeLoss)
register_loss(GSPOLoss)
register_loss(CISPOLoss)


def _needs_sequence_index(cfg: LossConfig) -> bool:
    """Whether ``policy_loss`` needs each token's sequence (sequence-level weights, the
    per-sequence aggregation, or an objective that asks)."""
    return (
        cfg.is_level in ("sequence", "geometric")
        or cfg.aggregation == "seq_mean_token_mean"
        or loss_class(cfg.loss).needs_seq
    )


def policy_loss(
    logprobs: Tensor,
    behav_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: LossConfig,
    normalizer: float,
    *,
    prox_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    seq_ids: Tensor | None = None,
    token_coef: Tensor | None = None,
    log_is_weight: Tensor | None = None,
    entropy: Tensor | None = None,
) -> LossOutput:
    """The policy loss of one (micro-)batch, ``Σ_t c_t · ℓ_t / normalizer`` over masked tokens.

    Per token, with ``clip(x) = clip(x, 1 − eps_low, 1 + eps_high)``:

    - ``ppo``: ``ℓ = −min(r·A, clip(r)·A)``, ``r = π_θ/μ``.
    - ``decoupled``: ``ℓ = −w · min(u·A, clip(u)·A)``, ``u = π_θ/π_prox``,
      ``w = sg(π_prox/μ)`` formed at ``cfg.is_level`` and truncated or masked by
      ``cfg.is_mode``. ``log_is_weight`` (per token, detached) replaces ``log(π_prox/μ)``,
      e.g. with the balance-heuristic weight of ``relayrl.algo.darl``.
    - ``gspo``: ``ℓ = −w · min(s·A, clip_gspo(s)·A)`` with the GSPO-token ratio ``s``
      (value ``exp(mean_{seq} log(π_θ/π_prox))``, gradient ``s·∇log π_θ``), see
      :class:`GSPOLoss`.
    - ``cispo``: ``ℓ = −sg(min(π_θ/μ, cispo_cap)) · A · log π_θ``.
    - dual clip: for ``A < 0`` the clipped term ``−min(·)`` is capped at ``−c·A``.
    - KL: ``+ kl_coef · k(π_θ, π_ref)`` when ``kl_coef > 0`` (needs ``ref_logprobs``).

    ``advantages`` is per token (broadcast each sequence's advantage over its tokens).
    ``token_coef`` (detached, default 1) multiplies each token's loss: the D-ARL
    multi-behaviour coefficient ``α_k/N_k`` (then ``normalizer=1``). With
    ``aggregation="seq_mean_token_mean"`` each token's loss is also divided by its
    sequence's token count (sequences are never split across calls).
    ``entropy`` is optional, for stats only: token entropies of ``mask``'s shape, or logits
    with an extra vocabulary dimension.

    Why over 80 lines: the checks of the inputs, then one pass that every objective shares
    (KL, coefficients, masking, the normaliser, the statistics), in the order the maths
    applies them; split, each part would take and return most of the same tensors.
    """
    shape = mask.shape
    for name, t in (
        ("logprobs", logprobs),
        ("behav_logprobs", behav_logprobs),
        ("advantages", advantages),
    ):
        if t.shape != shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != mask shape {tuple(shape)}")
    if cfg.objective.needs_prox and prox_logprobs is None:
        raise ValueError(f"the {cfg.loss!r} loss needs prox_logprobs")
    if cfg.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    if normalizer <= 0:
        raise ValueError("normalizer must be > 0")

    m = mask.reshape(-1).to(logprobs.dtype)
    on = m > 0

    def flat(t: Tensor) -> Tensor:  # zero padding so garbage there never leaks (NaN·0)
        t = t.reshape(-1).to(logprobs.dtype)
        return torch.where(on, t, torch.zeros_like(t))

    logp, behav, adv = flat(logprobs), flat(behav_logprobs).detach(), flat(advantages).detach()
    n_tok = int(on.sum().item())
    stats: dict[str, float] = {"n_tokens": float(n_tok)}

    inputs = TokenInputs(
        logprobs=logp,
        behav=behav,
        advantages=adv,
        mask=m,
        num_tokens=n_tok,
        prox=flat(prox_logprobs).detach() if prox_logprobs is not None else None,
        log_is_weight=flat(log_is_weight).detach() if log_is_weight is not None else None,
        seq=sequence_index(shape, seq_ids, m.device) if _needs_sequence_index(cfg) else None,
    )
    token = cfg.objective.token_loss(inputs, cfg)
    stats.update(token.stats)
    per_token = token.per_token
    if cfg.kl_coef > 0:
        assert ref_logprobs is not None
        kl = kl_estimate(logp, flat(ref_logprobs).detach(), cfg.kl_estimator)
        per_token = per_token + cfg.kl_coef * kl
        stats["kl_ref"] = _masked_mean(kl.detach(), m, n_tok)
    if token_coef is not None:
        per_token = per_token * flat(token_coef).detach()
    if cfg.aggregation == "seq_mean_token_mean":  # each sequence's token mean
        assert inputs.seq is not None
        per_token = per_token / per_sequence_sum(m, inputs.seq).clamp(min=1.0)[inputs.seq]
    per_token = torch.where(on, per_token, torch.zeros_like(per_token))
    loss_sum = per_token.sum()

    log_rho = token.anchor - behav
    stats[BEHAV_KL] = _masked_mean(torch.expm1(log_rho) - log_rho, m, n_tok)
    stats["ratio_mean"] = _masked_mean(token.ratio.detach(), m, n_tok)
    stats["clip_frac"] = _masked_mean(token.clip_hit.to(m.dtype), m, n_tok)
    if cfg.dual_clip is not None:
        stats["dual_clip_frac"] = _masked_mean(token.dual_hit.to(m.dtype), m, n_tok)
    if entropy is not None:
        ent = entropy_from_logits(entropy) if entropy.dim() == len(shape) + 1 else entropy
        stats["entropy"] = _masked_mean(flat(ent.detach()), m, n_tok)
    return LossOutput(loss=loss_sum / normalizer, loss_sum=loss_sum, num_tokens=n_tok, stats=stats)
