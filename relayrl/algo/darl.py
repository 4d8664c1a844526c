"""D-ARL mathematics, as relayrl defines it (see docs/darl.md; the paper's code is not
public, so these definitions are ours).

Owns:

- ``variance_scores``: per-candidate score ``s = mean_t (w_t − 1)²``, ``w_t = π_prox/μ``.
- ``selection_cutoff``: the score bound of a stale candidate, a reference set's q-quantile
  (or an absolute threshold); ``relayrl.train.replay_step`` applies it with the step's fresh
  samples as the reference.
- ``effective_sample_size`` / ``policy_weights``: ``ESS = (Σw)²/Σw²`` and
  ``α_k = ESS_k / Σ_j ESS_j``.
- ``behaviour_plan``: ``L = Σ_k α_k L_k`` with ``L_k`` the decoupled loss token-mean over
  the tokens of behaviour version k, written as per-token coefficients ``α_k / N_k`` that
  ``relayrl.algo.losses.policy_loss`` takes as ``token_coef`` (normaliser 1), so it can be
  accumulated over micro-batches.
- ``balance_heuristic_logweights``: the multiple-importance-sampling balance heuristic.

All importance weights are stop-gradient. Imports: torch and ``relayrl.algo.losses``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from relayrl.algo.losses import (
    per_sequence_sum,
    sequence_index,
)

Weighting = Literal["ess", "uniform", "balance"]


# ----------------------------------------------------------------------------- selection


def variance_scores(
    prox_logprobs: Tensor, behav_logprobs: Tensor, mask: Tensor, seq_ids: Tensor | None = None
) -> Tensor:
    """``s = mean_t (w_t − 1)²`` per sequence, ``w_t = π_prox/μ`` over its masked tokens.

    Equal to ``Var_t(w) + (mean_t(w) − 1)²`` (population variance): an estimate of the χ²
    divergence that sets the variance of importance sampling; 0 for a sample drawn from
    π_prox itself. Padded ``[B, L]`` inputs give ``[B]``; flat inputs need ``seq_ids``.
    A sequence without tokens scores 0. Returned in float64, detached.
    """
    if not (prox_logprobs.shape == behav_logprobs.shape == mask.shape):
        raise ValueError("prox_logprobs, behav_logprobs and mask must have one shape")
    m = mask.to(torch.float64)
    log_w = prox_logprobs.detach().double() - behav_logprobs.detach().double()
    sq_dev = torch.where(m > 0, torch.expm1(torch.where(m > 0, log_w, 0.0)), 0.0).square()
    if seq_ids is None and mask.dim() == 2:
        num, count = sq_dev.sum(dim=-1), m.sum(dim=-1)
    else:
        seq = sequence_index(mask.shape, seq_ids, m.device)
        num = per_sequence_sum(sq_dev.reshape(-1), seq)
        count = per_sequence_sum(m.reshape(-1), seq)
    return num / count.clamp(min=1.0)


def _quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default, ``torch.quantile``'s ``linear``)."""
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def selection_cutoff(
    reference: Sequence[float], quantile: float | None, threshold: float | None
) -> float:
    """The score bound of variance-guided selection: the reference scores' ``quantile``
    (linear interpolation), else ``threshold``, else ``inf`` (no selection). An empty
    reference with a quantile gives ``-inf``: nothing stale is kept."""
    if quantile is not None and threshold is not None:
        raise ValueError("give quantile or threshold, not both")
    if quantile is not None:
        if not 0.0 <= quantile <= 1.0:
            raise ValueError("quantile must be in [0, 1]")
        return _quantile(reference, quantile) if reference else -math.inf
    return threshold if threshold is not None else math.inf


# ------------------------------------------------------------------- policy-level weights


def effective_sample_size(w: Tensor, mask: Tensor | None = None) -> float:
    """Kish's effective sample size ``(Σw)² / Σw²`` of non-negative weights (0 if empty)."""
    w = w.detach().double().reshape(-1)
    if mask is not None:
        w = w[mask.reshape(-1) > 0]
    den = w.square().sum()
    return float((w.sum().square() / den).item()) if den > 0 else 0.0


def effective_sample_size_from_log(log_w: Tensor, mask: Tensor | None = None) -> float:
    """The same ESS from log-weights, shifted by their max first so it never overflows."""
    lw = log_w.detach().double().reshape(-1)
    if mask is not None:
        lw = lw[mask.reshape(-1) > 0]
    if lw.numel() == 0:
        return 0.0
    return effective_sample_size(torch.exp(lw - lw.max()))


def policy_weights(ess_by_version: Mapping[int, float]) -> dict[int, float]:
    """``α_k = ESS_k / Σ_j ESS_j``; uniform when every ESS is 0."""
    if not ess_by_version:
        return {}
    total = sum(ess_by_version.values())
    if total <= 0:
        return {k: 1.0 / len(ess_by_version) for k in ess_by_version}
    return {k: e / total for k, e in ess_by_version.items()}


# ----------------------------------------------------------------- multi-behaviour loss


@dataclass
class BehaviourPlan:
    """Per-version weights of the multi-behaviour loss for one whole training step.

    ``coef_by_version[k] = α_k / N_k`` with ``N_k`` the masked token count of version k over
    the step; ``token_coef`` turns it into the per-token ``token_coef`` of
    ``relayrl.algo.losses.policy_loss`` (with ``normalizer=1``). Summed over any split of
    the step into micro-batches, ``Σ_t (α_k/N_k) ℓ_t = Σ_k α_k L_k``.
    """

    alphas: dict[int, float]
    ess: dict[int, float]
    token_counts: dict[int, int]
    coef_by_version: dict[int, float]

    def token_coef(self, version_ids: Tensor, mask: Tensor) -> Tensor:
        """Per-token coefficient (0 on masked-out tokens), same shape as ``mask``."""
        coef = torch.zeros(mask.shape, dtype=torch.float64, device=mask.device)
        for k, c in self.coef_by_version.items():
            coef = torch.where((version_ids == k) & (mask > 0), torch.full_like(coef, c), coef)
        return coef


def behaviour_plan(
    prox_logprobs: Tensor,
    behav_logprobs: Tensor,
    mask: Tensor,
    version_ids: Tensor,
    weighting: Weighting = "ess",
) -> BehaviourPlan:
    """Compute ``α_k`` and ``α_k / N_k`` over every token of the step (pass all of them,
    e.g. flat concatenations, before splitting into micro-batches).

    Tokens are grouped by ``version_ids`` (the version of the weights that produced each
    token, ``Trajectory.versions``; pass the trajectory's ``oldest_version`` broadcast to
    group by sample instead). ``weighting``:

    - ``"ess"``: ``α_k = ESS_k / Σ_j ESS_j``, ``ESS_k`` over group k's raw token weights
      ``w_t = π_prox/μ`` (before any truncation).
    - ``"uniform"``: every token alike, ``α_k = N_k / N`` so ``c_t = 1/N``: exactly the
      token-mean decoupled loss, whatever the versions (no policy-level reweighting).
    - ``"balance"``: the same pooled ``α_k = N_k / N``; use it with ``log_is_weight`` from
      ``balance_heuristic_logweights``, which replaces each token's weight instead.
    """
    if not (prox_logprobs.shape == behav_logprobs.shape == mask.shape == version_ids.shape):
        raise ValueError("prox_logprobs, behav_logprobs, mask and version_ids need one shape")
    on = mask.reshape(-1) > 0
    vids = version_ids.reshape(-1)[on]
    log_w = (prox_logprobs.detach().double() - behav_logprobs.detach().double()).reshape(-1)[on]
    versions = sorted(int(v) for v in torch.unique(vids).tolist())
    counts = {k: int((vids == k).sum().item()) for k in versions}
    ess = {k: effective_sample_size_from_log(log_w[vids == k]) for k in versions}
    if weighting == "ess":
        alphas = policy_weights(ess)
    elif weighting in ("uniform", "balance"):
        total = sum(counts.values())
        alphas = {k: counts[k] / total for k in versions}
    else:
        raise ValueError(f"unknown weighting {weighting!r}")
    coef = {k: alphas[k] / counts[k] for k in versions}
    return BehaviourPlan(alphas=alphas, ess=ess, token_counts=counts, coef_by_version=coef)


# -------------------------------------------------------------------- balance heuristic


def balance_heuristic_logweights(
    prox_seq_logprob: Tensor, behav_seq_logprobs: Tensor, counts: Sequence[int] | Tensor
) -> Tensor:
    """``log w_i = log π_prox(y_i) − log Σ_k (n_k/N) μ_k(y_i)``, in log space (logsumexp).

    ``prox_seq_logprob``: ``[N]`` sequence log-probabilities under π_prox;
    ``behav_seq_logprobs``: ``[K, N]``, every sample scored under each of the last K
    behaviour policies; ``counts``: ``n_k``, how many of the N samples version k produced
    (``N = Σ n_k``). A version with ``n_k = 0`` drops out. Detached.
    """
    behav = behav_seq_logprobs.detach().double()
    if behav.dim() != 2 or behav.shape[1] != prox_seq_logprob.shape[-1]:
        raise ValueError("behav_seq_logprobs must be [K, N] with N = len(prox_seq_logprob)")
    n = torch.as_tensor(counts, dtype=torch.float64, device=behav.device).reshape(-1)
    if n.numel() != behav.shape[0] or bool((n < 0).any()) or float(n.sum()) <= 0:
        raise ValueError("counts must be K non-negative numbers with a positive sum")
    log_mix = torch.logsumexp(torch.log(n / n.sum())[:, None] + behav, dim=0)
    return prox_seq_logprob.detach().double() - log_mix
