"""The engine's attention: one-token decode steps as two batched matrix products, everything
else as PyTorch's ``scaled_dot_product_attention`` (transformers' ``sdpa``).

Why: on CPU, SDPA's flash kernel costs ~1.4 ms (fp32) to ~3.2 ms (bf16) per layer for a
decode step of 32 rows — 40-50 % of a SmolLM2-135M step — although the work is tiny (one
query per row over a few hundred keys). With one query token, the ``G`` query heads that
share a key/value head (grouped-query attention) can stand where query positions would be:
``[B, kv_heads, G, D] @ [B, kv_heads, D, L]`` is one batched product, with no copy of the
keys per query head (what ``repeat_kv`` would do). Scores and softmax run in fp32.

Registered with transformers under :data:`ATTENTION_NAME` (with SDPA's mask builder), so a
model selects it by ``model.set_attn_implementation(ATTENTION_NAME)``.

Imports: torch, transformers.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION_NAME = "relayrl_decode"


def decode_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """``query`` [B, H, Q, D], ``key``/``value`` [B, KVH, L, D]; returns [B, Q, H, D]."""
    batch, heads, q_len, head_dim = query.shape
    kv_heads = key.shape[1]
    if q_len != 1 or heads % kv_heads or dropout:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    group = heads // kv_heads
    scale = scaling if scaling is not None else head_dim**-0.5
    q = query.reshape(batch, kv_heads, group, head_dim)
    scores = torch.matmul(q, key.transpose(-1, -2)).float() * scale  # [B, KVH, G, L]
    if attention_mask is not None:  # [B, 1, 1, L]: bool (True = attend) or additive
        mask = attention_mask[:, :, 0, : key.shape[-2]].unsqueeze(2)  # [B, 1, 1, L]
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask.float()
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    out = torch.matmul(probs, value)  # [B, KVH, G, D]
    return out.reshape(batch, 1, heads, head_dim), None


AttentionInterface.register(ATTENTION_NAME, decode_attention)
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
