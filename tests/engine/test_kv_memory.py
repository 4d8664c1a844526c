"""KV memory by need and a group's prompt prefilled once.

The cache must hold what the running requests need, never ``max_running_requests x
max_seq_len`` (what the engine preallocated before, 12 GB for SmolLM2 at 32 slots); and n
samples of one prompt must compute its KV once and produce the tokens computing it n times
gives (and their logprobs up to the last float bit a different batch shape rounds)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from relayrl.engine.kv import COLUMN_BLOCK, ROW_BLOCK, fitted_size, kv_bytes_per_token
from relayrl.engine.types import SamplingParams

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13]


def test_kv_bytes_per_token_by_hand(tiny_model):
    c = tiny_model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    expected = c.num_hidden_layers * 2 * c.num_key_value_heads * head_dim * 4
    assert kv_bytes_per_token(c, torch.float32) == expected
    assert kv_bytes_per_token(c, torch.bfloat16) == expected // 2


@pytest.mark.parametrize(
    ("current", "needed", "expected"),
    [
        (0, 1, 128),  # first allocation: one block
        (128, 128, 128),  # fits
        (128, 129, 256),  # grows by blocks
        (512, 200, 512),  # at most twice the need: kept (no churn)
        (1024, 200, 256),  # more than twice: shrinks to the need
        (0, 5000, 4096),  # capped
    ],
)
def test_fitted_size(current, needed, expected):
    assert fitted_size(current, needed, 128, 4096) == expected


def test_kv_follows_the_running_requests_not_the_context(make_engine, tiny_model):
    engine = make_engine(max_running_requests=64)
    assert engine.max_seq_len == 512  # the model's context: what the old cache preallocated
    per_token = kv_bytes_per_token(tiny_model.config)
    params = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
    engine.generate_batch([PROMPT, PROMPT[:3], PROMPT[2:], [40, 41]], params)
    stats = engine.stats()
    # 4 rows (one row block) x the longest 49 tokens rounded to one column block
    assert stats["kv_cache_peak_bytes"] == ROW_BLOCK * COLUMN_BLOCK * per_token
    preallocated = 64 * engine.max_seq_len * per_token  # the old slots x max_seq_len buffer
    assert stats["kv_cache_peak_bytes"] == preallocated // 64
    assert stats["kv_cache_bytes"] == 0  # nothing runs: freed
    # the process's peak (the run's server_peak_rss_mb), in MiB: about what it holds now at
    # least (the kernel's per-thread RSS counters lag by some pages)
    resident_kib = int(Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0])
    assert engine.stats()["peak_rss_mb"] >= 0.95 * resident_kib / 1024


def test_kv_grows_with_a_long_request_and_keeps_its_tokens(make_engine, tiny_model):
    """Growth copies the cache: a request crossing several column blocks still decodes
    exactly what a fresh full forward gives (greedy = argmax of the recompute)."""
    from tests.engine.conftest import recompute_logprobs

    engine = make_engine(max_running_requests=8)
    params = SamplingParams(max_new_tokens=3 * COLUMN_BLOCK, temperature=0, ignore_eos=True)
    short = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)
    long_result, short_result = engine.generate_batch([PROMPT, PROMPT[:4]], [params, short])
    expected = recompute_logprobs(tiny_model, PROMPT, long_result.output_ids, 1.0)
    assert long_result.output_logprobs == pytest.approx(expected, abs=1e-4)
    assert len(short_result.output_ids) == 10
    per_token = kv_bytes_per_token(tiny_model.config)
    peak = engine.stats()["kv_cache_peak_bytes"]
    assert peak == ROW_BLOCK * 4 * COLUMN_BLOCK * per_token  # 9 + 384 tokens: 4 blocks


def test_admission_is_bounded_by_the_kv_budget(make_engine):
    longest = len(PROMPT) + 30
    engine = make_engine(max_running_requests=64, max_total_tokens=2 * longest)
    params = SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True)
    results = engine.generate_batch([PROMPT] * 5, params)
    assert all(len(r.output_ids) == 30 for r in results)
    assert engine.stats()["peak_running"] == 2
    with pytest.raises(ValueError, match="KV budget of 78 tokens"):
        engine.submit(PROMPT, SamplingParams(max_new_tokens=70))


def test_default_budget_comes_from_available_memory(make_engine):
    engine = make_engine()
    budget = engine.stats()["kv_budget_tokens"]
    assert budget is None or budget > 1000  # a quarter of this machine's free memory


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_group_prompt_is_prefilled_once_with_identical_results(make_engine, temperature):
    n = 8
    params = [
        SamplingParams(max_new_tokens=24, temperature=temperature, seed=100 + i, ignore_eos=True)
        for i in range(n)
    ]
    prompts = [PROMPT] * n + [PROMPT[:5]]  # one group and one other request in the batch
    params.append(SamplingParams(max_new_tokens=24, temperature=temperature, seed=7))
    shared = make_engine(max_running_requests=16)
    unshared = make_engine(max_running_requests=16, share_prefill=False)
    got = shared.generate_batch(prompts, params)
    want = unshared.generate_batch(prompts, params)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    # a smaller prefill batch may round the last float bit differently (any batch does:
    # docs/engine.md "batch invariance"); the sampled tokens are the same
    for g, w in zip(got, want, strict=True):
        assert g.output_logprobs == pytest.approx(w.output_logprobs, abs=1e-5, rel=0)
    s, u = shared.stats(), unshared.stats()
    assert s["shared_prefill_tokens"] == (n - 1) * len(PROMPT)
    assert u["shared_prefill_tokens"] == 0
    assert u["prefill_tokens"] - s["prefill_tokens"] == (n - 1) * len(PROMPT)
    if temperature > 0:  # the samples of the group differ: each row has its own generator
        assert len({tuple(r.output_ids) for r in got[:n]}) > 1


def test_rollout_share_prefill_reaches_the_servers_engine(tmp_path):
    """``rollout.share_prefill`` (true by default) is the built-in servers' engine option."""
    from relayrl.config.loader import load_config
    from relayrl.launch.backends import make_backend

    def options(*overrides: str):
        config = load_config(None, [f"output_dir={tmp_path}", *overrides])
        return make_backend(config, tmp_path).server_spec().engine_options()

    assert options().share_prefill is True
    assert options("rollout.share_prefill=false").share_prefill is False
