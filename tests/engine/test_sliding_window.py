"""Architectures and sliding-window models on the built-in engine: refused when the window can slide (the engine
implements full attention only), accepted, with logprobs equal to the HF forward, when the
window covers every sequence the engine serves. Small random-init Mistral, Phi3 and Qwen2
models built from their configs and saved locally (nothing downloaded)."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GPTNeoXConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

from relayrl.engine.engine import Engine
from relayrl.engine.types import EngineOptions, SamplingParams
from relayrl.errors import RelayError
from relayrl.models.loading import load_model
from tests.engine.conftest import recompute_logprobs

torch.set_num_threads(1)

SIZES = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
CONFIGS = {
    "llama": LlamaConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "gemma2": Gemma2Config,
    "gemma3": Gemma3TextConfig,
    "mistral": MistralConfig,
    "phi3": Phi3Config,
    "gpt_neox": GPTNeoXConfig,
}


def saved_model(tmp_path, kind: str, **config):
    torch.manual_seed(0)
    sizes = dict(SIZES, head_dim=8) if kind in ("qwen3", "gemma2", "gemma3") else dict(SIZES)
    if kind == "gpt_neox":
        sizes.pop("num_key_value_heads")
    model = AutoModelForCausalLM.from_config(CONFIGS[kind](**sizes, **config))
    out = tmp_path / kind
    model.save_pretrained(out)
    return load_model(out)  # as a run loads it


def hf_logprobs_of(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


@pytest.mark.parametrize("kind", ["mistral", "phi3", "gemma2"])
def test_a_window_that_slides_is_refused_naming_the_key(tmp_path, kind):
    model = saved_model(tmp_path, kind, sliding_window=16)
    # the window matters: the HF forward over 40 tokens differs from full attention's
    ids = list(range(3, 43))
    windowed = hf_logprobs_of(model, ids)
    model.config.sliding_window = 4096  # longer than the sequence: full attention
    full = hf_logprobs_of(model, ids)
    model.config.sliding_window = 16
    assert torch.allclose(windowed[:16], full[:16], atol=1e-5)
    assert (windowed[16:] - full[16:]).abs().max() > 1e-3
    with pytest.raises(RelayError) as err:
        Engine(model, None, EngineOptions(max_seq_len=64))
    message = str(err.value)
    assert "`sliding_window`: 16" in message and "config.json" in message
    assert "rollout.engine=vllm" in message and "model.max_context <= 16" in message


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_a_window_covering_the_context_is_accepted_and_exact(tmp_path, kind):
    """Engine logprobs equal the HF forward's (the trainer's) on 8 architectures; where the
    config has a window (Mistral, Phi3, Gemma 2/3, Qwen2/3 off) it covers the context."""
    model = saved_model(tmp_path, kind, sliding_window=64)
    engine = Engine(model, None, EngineOptions(max_seq_len=64, max_running_requests=2))
    try:
        prompts = [[5, 9, 2, 7], [11, 4]]
        params = [
            SamplingParams(max_new_tokens=30, temperature=1.0, seed=i, ignore_eos=True)
            for i in range(2)
        ]
        for prompt, result in zip(prompts, engine.generate_batch(prompts, params), strict=True):
            ref = recompute_logprobs(model, prompt, result.output_ids, 1.0)
            gap = max(abs(a - b) for a, b in zip(ref, result.output_logprobs, strict=True))
            assert len(result.output_ids) == 30 and gap < 1e-4
    finally:
        engine.shutdown()


def test_a_window_the_config_turns_off_is_not_refused(tmp_path):
    """Qwen2 keeps ``sliding_window`` in its config but uses it only with
    ``use_sliding_window``: full attention, accepted at any context."""
    model = saved_model(tmp_path, "qwen2", sliding_window=16, use_sliding_window=False)
    engine = Engine(model, None, EngineOptions(max_seq_len=128))
    engine.shutdown()
