"""The last K adapter versions served at once (``EngineOptions.max_adapters``,
relayrl.engine.versioned, docs/lora.md): adapter publications made while requests decode
interrupt none of them (no retraction, no KV recomputed); every token of a request carries
the version it was admitted under, and its logprob is that version's exactly (the trainer's
peft model of that version, teacher-forced); a publication that pushes a version out of the
K kept retracts only that version's requests, which resume under the newest; ``score`` runs
under any kept version; a full-weight load drops the adapters."""

from __future__ import annotations

import threading

import pytest
import torch

from relayrl.engine.adapter import read_adapter
from relayrl.engine.engine import Engine
from relayrl.engine.types import EngineOptions, PauseMode, SamplingParams
from relayrl.engine.weights import read_state_dict
from relayrl.models.loading import load_model, load_tokenizer
from tests.sync.test_adapter_publication import LoraSource

NEW_TOKENS = 150


class Started:
    """Set once every request of a batch has sampled ``at_least`` tokens."""

    def __init__(self, requests: int, at_least: int = 3) -> None:
        self.counts = [0] * requests
        self.at_least = at_least
        self.event = threading.Event()

    def listener(self, index: int):
        def on_token(*_):
            self.counts[index] += 1
            if min(self.counts) >= self.at_least:
                self.event.set()

        return on_token


def submit_batch(engine: Engine, prompts: list[list[int]], seed: int):
    started = Started(len(prompts))
    params = [
        SamplingParams(max_new_tokens=NEW_TOKENS, seed=seed + i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    futures = [
        engine.submit(p, sp, on_token=started.listener(i))
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
    ]
    assert started.event.wait(60), "the batch never started decoding"
    return futures


def teacher_forced_logprobs(model: torch.nn.Module, prompt: list[int], output: list[int]):
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(output)[:, None])[:, 0]


@pytest.fixture()
def sources(tiny_model_dir, tmp_path):
    """Versions 1..4: LoRA policies with different random adapters, published."""
    out = {}
    for version in (1, 2, 3, 4):
        source = LoraSource(tiny_model_dir, seed=version)
        out[version] = (source, source.save_weights(tmp_path / f"v{version}"))
    return out


def test_publications_interrupt_no_request_and_each_keeps_its_exact_version(
    tiny_model_dir, sources
):
    tokenizer = load_tokenizer(tiny_model_dir)
    prompts = [tokenizer.encode(f"{a} + {a} =") for a in range(4)]
    options = EngineOptions(max_seq_len=NEW_TOKENS + 16, max_adapters=3)
    with Engine(load_model(tiny_model_dir), tokenizer, options) as engine:
        engine.update_weights(sources[1][1], version=1)
        batches = {}
        for version in (1, 2, 3):
            if version > 1:  # published while the earlier batches decode (paused in place)
                engine.update_weights(sources[version][1], version=version)
                engine.continue_generation()
            batches[version] = submit_batch(engine, prompts, seed=100 * version)
            engine.pause(PauseMode.IN_PLACE)
        mid = engine.stats()
        engine.continue_generation()
        results = {v: [f.result(timeout=120) for f in fs] for v, fs in batches.items()}
        stats = engine.stats()
        assert engine.versions_served() == [0, 1, 2, 3]
    assert mid["num_running"] == 12, "a batch finished before the last publication"
    assert stats["retracted"] == 0 and stats["reprefill_tokens"] == 0
    assert stats["kept_version"] >= 4 + 8  # batch 1 kept at v2; batches 1, 2 at v3
    for version, batch in results.items():
        model = sources[version][0].model.eval()
        for result in batch:
            assert result.finish_reason == "length"
            assert result.output_versions == [version] * NEW_TOKENS
            expected = teacher_forced_logprobs(model, result.prompt_ids, result.output_ids)
            served = torch.tensor(result.output_logprobs)
            torch.testing.assert_close(served, expected, rtol=0, atol=2e-5)


def test_a_version_pushed_out_of_the_k_kept_resumes_under_the_newest(tiny_model_dir, sources):
    tokenizer = load_tokenizer(tiny_model_dir)
    prompts = [tokenizer.encode(f"{a} * 2 =") for a in range(3)]
    options = EngineOptions(max_seq_len=NEW_TOKENS + 16, max_adapters=2)
    with Engine(load_model(tiny_model_dir), tokenizer, options) as engine:
        engine.update_weights(sources[1][1], version=1)
        old = submit_batch(engine, prompts, seed=7)
        engine.pause(PauseMode.IN_PLACE)
        engine.update_weights(sources[2][1], version=2)  # kept: 1, 2
        engine.update_weights(sources[3][1], version=3)  # kept: 2, 3 (1 pushed out)
        engine.continue_generation()
        results = [f.result(timeout=120) for f in old]
        stats = engine.stats()
        assert engine.versions_served() == [0, 2, 3]
    assert stats["retracted"] == len(prompts)
    for result in results:
        versions = result.output_versions
        switch = versions.index(3)
        assert set(versions[:switch]) == {1} and set(versions[switch:]) == {3}
        expected = teacher_forced_logprobs(
            sources[3][0].model.eval(), result.prompt_ids, result.output_ids
        )[switch:]
        torch.testing.assert_close(
            torch.tensor(result.output_logprobs[switch:]), expected, rtol=0, atol=2e-5
        )


def test_score_runs_under_any_kept_version_and_a_full_load_drops_the_adapters(
    tiny_model_dir, sources
):
    tokenizer = load_tokenizer(tiny_model_dir)
    ids = tokenizer.encode("3 + 4 = 7")
    options = EngineOptions(max_seq_len=64, max_adapters=3)
    with Engine(load_model(tiny_model_dir), tokenizer, options) as engine:
        for version in (1, 2):
            engine.update_weights(sources[version][1], version=version)
        for version in (1, 2):
            expected = teacher_forced_logprobs(sources[version][0].model.eval(), ids[:1], ids[1:])
            got = torch.tensor(engine.score(ids, version=version))
            torch.testing.assert_close(got, expected, rtol=0, atol=2e-5)
        assert engine.weights_checksum() == read_adapter(sources[2][1]).checksum
        with pytest.raises(ValueError, match="weight version 9 is not served"):
            engine.score(ids, version=9)
        base = read_state_dict(tiny_model_dir)
        engine.update_weights(base, version=5)
        assert engine.versions_served() == [5]
        plain = teacher_forced_logprobs(load_model(tiny_model_dir), ids[:1], ids[1:])
        torch.testing.assert_close(torch.tensor(engine.score(ids)), plain, rtol=0, atol=2e-5)
