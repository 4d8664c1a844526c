"""Qwen3-architecture size presets built from a config (no weights are downloaded)."""

from __future__ import annotations

from dataclasses import dataclass

from relayrl.errors import RelayError


@dataclass(frozen=True)
class SizePreset:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int


# Parameter counts are for a ~200-token vocabulary with tied embeddings.
PRESETS: dict[str, SizePreset] = {
    # Wide and shallow: on CPUs bigger matmuls learn more per second than deeper stacks.
    "tiny": SizePreset(128, 384, 2, 4, 2, 32),  # ~0.4M
    "small": SizePreset(192, 512, 8, 6, 2, 32),  # ~3M
    "medium": SizePreset(512, 1408, 8, 8, 4, 64),  # ~25M
    # Qwen3-0.6B shape, for GPU engine benchmarks with random weights.
    "qwen3-0.6b": SizePreset(1024, 3072, 28, 16, 8, 128),
}


def build_config(
    preset: str,
    vocab_size: int,
    max_position_embeddings: int,
    bos_token_id: int | None,
    eos_token_id: int,
    pad_token_id: int,
):
    """A ``transformers.Qwen3Config`` for a named size preset."""
    from transformers import Qwen3Config

    if preset not in PRESETS:
        raise RelayError(f"unknown model preset {preset!r}; expected one of {sorted(PRESETS)}")
    p = PRESETS[preset]
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_hidden_layers,
        num_attention_heads=p.num_attention_heads,
        num_key_value_heads=p.num_key_value_heads,
        head_dim=p.head_dim,
        max_position_embeddings=max_position_embeddings,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        torch_dtype="float32",
    )


def build_model(preset: str, tokenizer, max_position_embeddings: int, seed: int):
    """A randomly initialised Qwen3ForCausalLM sized by ``preset`` for ``tokenizer``."""
    import torch
    from transformers import Qwen3ForCausalLM

    config = build_config(
        preset,
        vocab_size=len(tokenizer),
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config)


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())
