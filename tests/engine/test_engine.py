"""Engine correctness: greedy parity with model.generate, logprob parity with a trainer-side
recompute, per-request seeds, continuous batching, weight versions, pausing, bad updates."""

from __future__ import annotations

import copy
import time

import pytest
import torch

from relayrl.engine.types import SamplingParams
from relayrl.errors import RelayError
from tests.engine.conftest import kept_kv_logprobs, perturbed_state, recompute_logprobs

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16], list(range(20, 37)), [30], [31, 32, 33]]


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """``model.generate`` greedy for exactly ``n`` tokens.

    EOS must neither stop generation nor be suppressed (``min_new_tokens`` would mask its
    logit, changing the argmax), matching the engine's ``ignore_eos``: so the model's EOS is
    unset for the call.
    """
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    try:
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    finally:
        model.generation_config.eos_token_id = saved
    assert out.shape[1] == len(prompt) + n
    return out[0, len(prompt) :].tolist()


def wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.005)


def test_greedy_matches_hf_generate_in_one_batch(make_engine, tiny_model):
    engine = make_engine(max_running_requests=8)
    params = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    results = engine.generate_batch(PROMPTS, params)
    assert engine.stats()["peak_running"] == len(PROMPTS)  # really batched together
    for prompt, result in zip(PROMPTS, results, strict=True):
        assert result.output_ids == hf_greedy(tiny_model, prompt, 24)
        assert result.finish_reason == "length"
        assert result.prompt_tokens == len(prompt)


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.3])
def test_logprobs_equal_trainer_recompute(make_engine, tiny_model, temperature):
    engine = make_engine(max_running_requests=4)
    params = [
        SamplingParams(max_new_tokens=20, temperature=temperature, seed=i, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    for prompt, result in zip(PROMPTS, engine.generate_batch(PROMPTS, params), strict=True):
        ref = recompute_logprobs(tiny_model, prompt, result.output_ids, temperature)
        assert len(result.output_logprobs) == len(result.output_ids) == 20
        assert max(abs(a - b) for a, b in zip(ref, result.output_logprobs, strict=True)) < 1e-4


def test_top_k_top_p_sample_inside_the_filter(make_engine, tiny_model):
    engine = make_engine()
    params = SamplingParams(max_new_tokens=30, temperature=1.5, top_k=3, seed=0, ignore_eos=True)
    result = engine.generate_batch([PROMPTS[0]], params)[0]
    seq = PROMPTS[0] + result.output_ids
    with torch.no_grad():
        logits = tiny_model(torch.tensor([seq])).logits[0, len(PROMPTS[0]) - 1 : -1]
    top3 = logits.topk(3, dim=-1).indices
    assert all(tok in top3[i].tolist() for i, tok in enumerate(result.output_ids))
    nucleus = SamplingParams(
        max_new_tokens=30, temperature=1.0, top_p=1e-6, seed=0, ignore_eos=True
    )
    greedy = SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True)
    a, b = engine.generate_batch([PROMPTS[0], PROMPTS[0]], [nucleus, greedy])
    assert a.output_ids == b.output_ids  # top_p -> 0 keeps only the argmax


def test_seeded_request_is_independent_of_batch(make_engine):
    engine = make_engine(max_running_requests=8)
    target = SamplingParams(max_new_tokens=32, temperature=1.0, seed=1234, ignore_eos=True)
    alone = engine.generate_batch([PROMPTS[0]], target)[0]
    others = [SamplingParams(max_new_tokens=n, temperature=0.9, seed=n) for n in (5, 40, 17, 9)]
    mixed = engine.generate_batch(PROMPTS[:5], [target] + others)[0]
    assert mixed.output_ids == alone.output_ids
    again = engine.generate_batch([PROMPTS[0]], target)[0]
    assert again.output_ids == alone.output_ids
    other_seed = SamplingParams(max_new_tokens=32, temperature=1.0, seed=99, ignore_eos=True)
    assert engine.generate_batch([PROMPTS[0]], other_seed)[0].output_ids != alone.output_ids


def test_short_request_overtakes_long_one(make_engine):
    engine = make_engine(max_running_requests=2)
    long = engine.submit(
        PROMPTS[0], SamplingParams(max_new_tokens=400, temperature=0, ignore_eos=True)
    )
    wait_for(lambda: engine.stats()["generated_tokens"] >= 3)
    short = engine.submit(
        PROMPTS[1], SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    )
    short.result(timeout=60)
    assert not long.done()  # the short one joined the running batch and left it first
    assert long.result(timeout=120).finish_reason == "length"


def test_max_running_requests_is_respected(make_engine):
    engine = make_engine(max_running_requests=3)
    params = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)
    results = engine.generate_batch(PROMPTS * 2, params)
    assert all(len(r.output_ids) == 10 for r in results)
    stats = engine.stats()
    assert stats["peak_running"] == 3
    assert stats["num_requests"] == stats["num_running"] == stats["num_waiting"] == 0


def test_max_total_tokens_bounds_the_running_requests(make_engine):
    # every request counts at its longest (prompt + 50); three of the longest fit, four never
    longest = max(len(p) for p in PROMPTS) + 50
    engine = make_engine(max_running_requests=16, max_total_tokens=3 * longest)
    engine.generate_batch(
        PROMPTS, SamplingParams(max_new_tokens=50, temperature=0, ignore_eos=True)
    )
    stats = engine.stats()
    assert stats["peak_running"] == 3
    assert stats["kv_budget_waits"] > 0


def test_weight_update_versions_and_kv_recompute(make_engine, tiny_model):
    old_model = copy.deepcopy(tiny_model)
    engine = make_engine(max_running_requests=4)
    params = SamplingParams(max_new_tokens=300, temperature=1.0, seed=3, ignore_eos=True)
    future = engine.submit(PROMPTS[2], params)
    wait_for(lambda: engine.stats()["generated_tokens"] >= 5)
    new_state = perturbed_state(tiny_model)
    assert engine.update_weights(new_state, version=7) == 7
    result = future.result(timeout=120)
    versions = result.output_versions
    n_old = versions.count(0)
    assert 5 <= n_old < 300 and versions == [0] * n_old + [7] * (300 - n_old)
    # Old tokens: logprobs of the old weights; new tokens: of the new weights over the whole
    # prefix (their KV was recomputed, not reused).
    old_ref = recompute_logprobs(old_model, PROMPTS[2], result.output_ids, 1.0)
    new_ref = recompute_logprobs(tiny_model, PROMPTS[2], result.output_ids, 1.0)
    lp = result.output_logprobs
    assert max(abs(a - b) for a, b in zip(old_ref[:n_old], lp[:n_old], strict=True)) < 1e-4
    assert max(abs(a - b) for a, b in zip(new_ref[n_old:], lp[n_old:], strict=True)) < 1e-4
    assert engine.update_weights(new_state) == 8  # None increments


def test_inflight_update_keeps_the_old_kv(make_engine, tiny_model):
    """keep_kv (PipelineRL's in-flight update): nothing is retracted or prefilled again; the
    tokens after the update are sampled from the new weights attending to the KV the old
    weights built, and their logprobs are exactly that distribution's."""
    old_model = copy.deepcopy(tiny_model)
    engine = make_engine(max_running_requests=4)
    params = SamplingParams(max_new_tokens=120, temperature=1.0, seed=3, ignore_eos=True)
    future = engine.submit(PROMPTS[2], params)
    wait_for(lambda: engine.stats()["generated_tokens"] >= 5)
    before = engine.stats()
    new_state = perturbed_state(tiny_model)
    assert engine.update_weights(new_state, version=7, keep_kv=True) == 7
    result = future.result(timeout=120)
    stats = engine.stats()
    assert stats["kept_kv"] - before["kept_kv"] == 1
    assert stats["retracted"] == before["retracted"] and stats["reprefill_tokens"] == 0
    n_old = result.output_versions.count(0)
    assert 5 <= n_old < 120 and result.output_versions == [0] * n_old + [7] * (120 - n_old)
    lp = result.output_logprobs
    old_ref = recompute_logprobs(old_model, PROMPTS[2], result.output_ids, 1.0)
    kept = kept_kv_logprobs(old_model, tiny_model, PROMPTS[2], result.output_ids, n_old, 1.0)
    full = recompute_logprobs(tiny_model, PROMPTS[2], result.output_ids, 1.0)[n_old:]
    assert max(abs(a - b) for a, b in zip(old_ref[:n_old], lp[:n_old], strict=True)) < 1e-4
    assert max(abs(a - b) for a, b in zip(kept, lp[n_old:], strict=True)) < 1e-4
    # and that is not what a recompute under the new weights gives: the old KV was used
    assert max(abs(a - b) for a, b in zip(full, lp[n_old:], strict=True)) > 1e-3


def test_weight_update_from_disk(make_engine, tiny_model, tmp_path):
    engine = make_engine()
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    before = engine.generate_batch([PROMPTS[0]], params)[0]
    other = copy.deepcopy(tiny_model)
    other.load_state_dict(perturbed_state(tiny_model, scale=0.5), strict=False)
    other.save_pretrained(tmp_path / "new")
    expected = hf_greedy(other, PROMPTS[0], 12)
    assert engine.update_weights(tmp_path / "new") == 1
    after = engine.generate_batch([PROMPTS[0]], params)[0]
    assert after.output_ids == expected != before.output_ids
    assert after.output_versions == [1] * 12


def test_bad_weight_update_leaves_model_unchanged(make_engine, tiny_model, tmp_path):
    engine = make_engine()
    snapshot = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    with pytest.raises(RelayError, match="does not exist"):
        engine.update_weights(tmp_path / "missing")
    bad = perturbed_state(tiny_model)
    bad["model.norm.weight"] = torch.ones(3)
    with pytest.raises(RelayError, match="shape"):
        engine.update_weights(bad)
    assert all(torch.equal(v, tiny_model.state_dict()[k]) for k, v in snapshot.items())
    assert engine.weight_version == 0


def test_pause_abort_returns_running_and_queued(make_engine):
    engine = make_engine(max_running_requests=2)
    params = SamplingParams(max_new_tokens=400, temperature=1.0, seed=0, ignore_eos=True)
    futures = [engine.submit(p, params) for p in PROMPTS[:4]]
    wait_for(lambda: engine.stats()["generated_tokens"] >= 6)
    aborted = engine.pause("abort")
    assert len(aborted) == 4
    results = [f.result(timeout=5) for f in futures]
    assert all(r.finish_reason == "abort" for r in results)
    assert any(r.output_ids for r in results) and any(not r.output_ids for r in results)
    for r in results:
        assert len(r.output_ids) == len(r.output_logprobs) == len(r.output_versions)
    late = engine.submit(PROMPTS[0], SamplingParams(max_new_tokens=3, temperature=0))
    time.sleep(0.2)
    assert not late.done() and engine.stats()["num_waiting"] == 1  # queued while paused
    engine.continue_generation()
    assert late.result(timeout=30).finish_reason in ("stop", "length")
    assert engine.stats()["num_requests"] == 0


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_pause_keep_modes_resume_consistently(make_engine, mode):
    engine = make_engine()
    params = SamplingParams(max_new_tokens=60, temperature=1.0, seed=5, ignore_eos=True)
    reference = engine.generate_batch([PROMPTS[3]], params)[0]
    future = engine.submit(PROMPTS[3], params)
    wait_for(lambda: engine.stats()["generated_tokens"] >= 70)
    assert engine.pause(mode) == []
    engine.continue_generation()
    result = future.result(timeout=60)
    assert result.output_ids == reference.output_ids  # same weights, same generator stream


def test_retract_requeues_shortest_first_and_counts_the_recomputed_kv(make_engine):
    engine = make_engine()
    params = SamplingParams(max_new_tokens=40, temperature=1.0, seed=3, ignore_eos=True)
    reference = engine.generate_batch(PROMPTS[:4], params)
    before = engine.stats()
    futures = [engine.submit(p, params) for p in PROMPTS[:4]]
    wait_for(lambda: engine.stats()["generated_tokens"] >= before["generated_tokens"] + 20)
    engine.pause("retract")
    lengths = engine._call(lambda: [len(r.all_ids()) for r in engine.scheduler.waiting])
    stats = engine.stats()
    assert lengths == sorted(lengths) and len(lengths) == 4  # all four, shortest first
    assert stats["retracted"] - before["retracted"] == 4
    engine.continue_generation()
    assert [f.result(timeout=60).output_ids for f in futures] == [r.output_ids for r in reference]
    after = engine.stats()
    assert after["reprefill_tokens"] - before["reprefill_tokens"] == sum(lengths)
    fresh = sum(len(p) for p in PROMPTS[:4])  # the first prefill of each request
    assert after["prefill_tokens"] - before["prefill_tokens"] == fresh + sum(lengths)
    assert after["prefill_padded_tokens"] >= after["prefill_tokens"]


def test_stops_and_validation(make_engine, tiny_tokenizer):
    engine = make_engine(max_seq_len=64)
    free = engine.generate_batch([PROMPTS[0]], SamplingParams(max_new_tokens=10, temperature=0))[0]
    stop_tok = free.output_ids[3]
    first = free.output_ids.index(stop_tok)
    params = SamplingParams(max_new_tokens=10, temperature=0, stop_token_ids=[stop_tok])
    stopped = engine.generate_batch([PROMPTS[0]], params)[0]
    assert stopped.finish_reason == "stop" and stopped.output_ids == free.output_ids[: first + 1]
    text = tiny_tokenizer.decode(free.output_ids[: first + 1])
    by_text = SamplingParams(max_new_tokens=10, temperature=0, stop=[text[-1]])
    assert engine.generate_batch([PROMPTS[0]], by_text)[0].finish_reason == "stop"
    for bad_ids, bad_params, field in [
        ([], SamplingParams(), "input_ids"),
        ([10**6], SamplingParams(), "vocabulary"),
        ([1], SamplingParams(max_new_tokens=0), "max_new_tokens"),
        ([1] * 10, SamplingParams(max_new_tokens=60), "max_seq_len"),
        ([1], SamplingParams(top_p=0), "top_p"),
    ]:
        with pytest.raises(ValueError, match=field):
            engine.submit(bad_ids, bad_params)
    assert engine.stats()["num_requests"] == 0


def test_a_context_beyond_the_models_positions_is_capped_with_a_warning(
    make_engine, tiny_model, capsys
):
    positions = tiny_model.config.max_position_embeddings
    engine = make_engine(max_seq_len=positions * 2)
    assert engine.max_seq_len == positions
    warning = capsys.readouterr().err
    assert f"max_seq_len {positions * 2}" in warning
    assert f"max_position_embeddings {positions}" in warning
    with pytest.raises(ValueError, match=f"max_seq_len {positions}"):
        engine.submit([1] * positions, SamplingParams(max_new_tokens=1))
    within = make_engine(max_seq_len=positions)
    assert within.max_seq_len == positions and capsys.readouterr().err == ""
