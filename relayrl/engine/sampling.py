"""Batched token sampling with per-request temperature, top-k, top-p and seed.

Convention (shared with the trainer): the reported logprob of a token is
``log_softmax(logits / T)`` over the full vocabulary, before top-k/top-p filtering, with
``T = 1`` for greedy requests (``temperature == 0``). With ``top_p = 1, top_k = -1`` this is
exactly the distribution the token was sampled from.

Randomness: each request owns a ``torch.Generator``; a sampled request draws exactly one
uniform number per token from it and picks the token by inverse-CDF over its own
(filtered) probabilities. The draw therefore never depends on the other rows of the batch;
only the probabilities can, in their last float bits (see docs/engine.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingBatch:
    """Per-row sampling settings of one decode step, as tensors on the logits device."""

    temperature: torch.Tensor  # [B] float; 0 rows are greedy
    top_p: torch.Tensor  # [B] float
    top_k: torch.Tensor  # [B] long; -1 = off
    generators: list[torch.Generator | None]  # CPU generators; None for greedy rows
    any_filter: bool


def make_batch(
    temperatures: list[float],
    top_ps: list[float],
    top_ks: list[int],
    generators: list[torch.Generator | None],
    device: torch.device,
) -> SamplingBatch:
    any_filter = any(p < 1.0 for p in top_ps) or any(k > 0 for k in top_ks)
    return SamplingBatch(
        temperature=torch.tensor(temperatures, dtype=torch.float32, device=device),
        top_p=torch.tensor(top_ps, dtype=torch.float32, device=device),
        top_k=torch.tensor(top_ks, dtype=torch.long, device=device),
        generators=generators,
        any_filter=any_filter,
    )


def _filtered_sorted(probs: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor):
    """Sorted probabilities with top-k/top-p applied (not renormalised) and the sort order."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    k = torch.where(top_k > 0, top_k, probs.shape[-1])[:, None]
    keep = rank < k
    # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    keep &= mass_before < top_p[:, None]
    return sorted_probs * keep, order


def _uniforms(generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """One U[0,1) draw per sampled row from that row's own generator (0 for greedy rows)."""
    draws = [torch.rand((), generator=g).item() if g is not None else 0.0 for g in generators]
    return torch.tensor(draws, dtype=torch.float32).to(device)


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index ``i`` with ``cdf[i-1] <= u * total < cdf[i]`` per row (weights unnormalised)."""
    cdf = weights.double().cumsum(-1)
    target = (u.double() * cdf[:, -1])[:, None]
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return idx.clamp(max=weights.shape[-1] - 1)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (token ids [B], logprobs [B]) for ``logits`` [B, V] (any float dtype)."""
    logits = logits.float()
    greedy = batch.temperature == 0
    temp = torch.where(greedy, torch.ones_like(batch.temperature), batch.temperature)
    logprobs = torch.log_softmax(logits / temp[:, None], dim=-1)
    tokens = logits.argmax(dim=-1)
    if not bool(greedy.all()):
        u = _uniforms(batch.generators, logits.device)
        probs = logprobs.exp()
        if batch.any_filter:
            weights, order = _filtered_sorted(probs, batch.top_p, batch.top_k)
            picked = order.gather(-1, _inverse_cdf(weights, u)[:, None]).squeeze(-1)
        else:
            picked = _inverse_cdf(probs, u)
        tokens = torch.where(greedy, tokens, picked)
    chosen = logprobs.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, chosen


def top_logprobs(
    logits: torch.Tensor, batch: SamplingBatch, ks: list[int]
) -> list[list[tuple[int, float]]]:
    """The ``ks[i]`` most likely (token, logprob) of row ``i``'s sampling distribution
    (``log_softmax(logits / T)``, the distribution ``sample`` reports logprobs under)."""
    k = max(ks)
    if k <= 0:
        return [[] for _ in ks]
    temp = torch.where(batch.temperature == 0, 1.0, batch.temperature)
    logprobs = torch.log_softmax(logits.float() / temp[:, None], dim=-1)
    values, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    rows = zip(ids.tolist(), values.tolist(), ks, strict=True)
    return [list(zip(i[:n], v[:n], strict=True)) for i, v, n in rows]
