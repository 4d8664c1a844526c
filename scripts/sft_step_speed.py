"""The demo's SFT step under faster-kernel settings, side by side (docs/demo.md).

    PYTHONPATH=$PWD python scripts/sft_step_speed.py [--threads 2] [--rounds 6] [--quick]

One forward + backward + AdamW step of the demo's model (the ``tiny`` preset, vocabulary 384)
on a batch of the demo's SFT shape (64 sequences of up to 76 tokens, ~95 % real, the loss on
the completion part), repeated for each variant in interleaved rounds of 10 steps so that
the machine's drift hits every variant alike. Variants:

- ``baseline``: what ``relayrl sft`` runs (transformers' Qwen3, float32);
- ``fused_rmsnorm``: Qwen3's RMSNorm replaced by ``torch.nn.functional.rms_norm``;
- ``fused_adamw``: ``torch.optim.AdamW(fused=True)``;
- ``onednn_bf16`` / ``onednn_tf32``: oneDNN's reduced-precision fp32 matmuls
  (``torch.backends.mkldnn.matmul.fp32_precision``; bf16 runs on AMX where the CPU has it).

Prints each variant's median step time and its ratio to the baseline, and last
``best_variant_speedup=X.XX`` (baseline time / the fastest variant's; 1.00 when nothing
beats it). Random token ids: the step's cost depends on the shapes only.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from relayrl.models.factory import build_config

BATCH, WIDTH, PROMPT, VOCAB = 64, 76, 30, 384


def demo_batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, attention mask and labels (prompt and padding ignored)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (BATCH, WIDTH), generator=g)
    mask = torch.ones(BATCH, WIDTH, dtype=torch.long)
    for row, length in enumerate(torch.randint(WIDTH - 10, WIDTH + 1, (BATCH,), generator=g)):
        mask[row, length:] = 0
    labels = ids.clone()
    labels[:, :PROMPT] = -100
    labels[mask == 0] = -100
    return ids, mask, labels


def fused_rms_norm(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.rms_norm(
        hidden_states, (hidden_states.shape[-1],), self.weight, self.variance_epsilon
    )


class Variant:
    """A model and optimizer, and the global settings its steps run under."""

    def __init__(
        self,
        name: str,
        fused_adam: bool = False,
        norm: Callable | None = None,
        matmul_precision: str = "none",
    ):
        from transformers import Qwen3ForCausalLM

        self.name, self.norm, self.matmul_precision = name, norm, matmul_precision
        torch.manual_seed(0)
        self.model = Qwen3ForCausalLM(build_config("tiny", VOCAB, 512, 1, 2, 0)).train()
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=1e-3, betas=(0.9, 0.98), fused=fused_adam or None
        )

    def steps(self, batch, count: int) -> float:
        """Seconds per step over ``count`` steps."""
        from transformers.models.qwen3 import modeling_qwen3

        original = modeling_qwen3.Qwen3RMSNorm.forward
        modeling_qwen3.Qwen3RMSNorm.forward = self.norm or original
        torch.backends.mkldnn.matmul.fp32_precision = self.matmul_precision
        ids, mask, labels = batch
        try:
            start = time.perf_counter()
            for _ in range(count):
                logits = self.model(input_ids=ids, attention_mask=mask).logits[:, :-1]
                loss = torch.nn.functional.cross_entropy(
                    logits.reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100
                )
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
                self.optimizer.step()
            return (time.perf_counter() - start) / count
        finally:
            modeling_qwen3.Qwen3RMSNorm.forward = original
            torch.backends.mkldnn.matmul.fp32_precision = "none"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="torch threads (the demo's SFT: 2)")
    parser.add_argument("--rounds", type=int, default=6, help="interleaved rounds of 10 steps")
    parser.add_argument("--quick", action="store_true", help="3 rounds of 3 steps: a smoke test")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rounds, per_round = (3, 3) if args.quick else (args.rounds, 10)
    variants = [
        Variant("baseline"),
        Variant("fused_rmsnorm", norm=fused_rms_norm),
        Variant("fused_adamw", fused_adam=True),
        Variant("onednn_bf16", matmul_precision="bf16"),
        Variant("onednn_tf32", matmul_precision="tf32"),
    ]
    batch = demo_batch()
    for v in variants:
        v.steps(batch, 2)  # warm-up
    times: dict[str, list[float]] = {v.name: [] for v in variants}
    for _ in range(rounds):
        for v in variants:
            times[v.name].append(v.steps(batch, per_round))
    base = statistics.median(times["baseline"])
    for name, ts in times.items():
        median = statistics.median(ts)
        print(f"{name:14s} {median * 1000:7.1f} ms per step  baseline/this {base / median:.2f}")
    if args.quick:
        print("note: --quick is a smoke test (3 rounds of 3 steps), not a measurement")
    best = min(statistics.median(ts) for ts in times.values())
    print(f"best_variant_speedup={base / best:.2f}")


if __name__ == "__main__":
    main()
