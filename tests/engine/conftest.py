"""Fixtures of the engine tests: the tiny model loaded once per test, and engines over it."""

from __future__ import annotations

import pytest
import torch

from relayrl.engine.engine import Engine
from relayrl.engine.types import EngineOptions
from relayrl.models.loading import load_model, load_tokenizer

torch.set_num_threads(1)


@pytest.fixture
def tiny_model(tiny_model_dir):
    return load_model(tiny_model_dir)


@pytest.fixture
def tiny_tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture
def make_engine(tiny_model, tiny_tokenizer, tiny_model_dir):
    engines: list[Engine] = []

    def make(**options) -> Engine:
        engine = Engine(
            tiny_model, tiny_tokenizer, EngineOptions(**options), model_path=str(tiny_model_dir)
        )
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()


def recompute_logprobs(
    model, prompt: list[int], output: list[int], temperature: float
) -> list[float]:
    """Trainer-side logprobs: one full forward over prompt + output, log_softmax(logits / T)."""
    t = temperature if temperature > 0 else 1.0
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    logprobs = torch.log_softmax(logits / t, dim=-1)[len(prompt) - 1 : -1]
    return logprobs.gather(-1, torch.tensor(output)[:, None]).squeeze(-1).tolist()


def kept_kv_logprobs(
    old_model, new_model, prompt: list[int], output: list[int], n_old: int, temperature: float
) -> list[float]:
    """Logprobs of ``output[n_old:]`` as an in-flight update (``keep_kv``) produces them: the
    KV of ``prompt + output[:n_old - 1]`` from the old model (the last old token was sampled
    but not yet fed), everything after it fed through the new model on top of that cache."""
    t = temperature if temperature > 0 else 1.0
    prefix = prompt + output[: n_old - 1]
    with torch.no_grad():
        past = old_model(torch.tensor([prefix]), use_cache=True).past_key_values
        rest = torch.tensor([output[n_old - 1 : -1]])
        logits = new_model(rest, past_key_values=past, use_cache=True).logits[0].float()
    logprobs = torch.log_softmax(logits / t, dim=-1)
    return logprobs.gather(-1, torch.tensor(output[n_old:])[:, None]).squeeze(-1).tolist()


def perturbed_state(model, seed: int = 1, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """A different but same-shaped set of weights."""
    g = torch.Generator().manual_seed(seed)
    return {
        name: p.detach() + scale * torch.randn(p.shape, generator=g)
        for name, p in model.named_parameters()
    }
