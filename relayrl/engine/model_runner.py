"""The model side of the engine: batched forward passes over the slot KV cache, sampling,
and weight loading.

Owns :class:`ModelRunner`: the model (used as is: device and dtype included), its slot KV
cache, the left-padded prefill of newly admitted requests, the one-token decode of every
running request, sampling with per-request generators (token + its logprob under the
sampling distribution, docs/engine.md) and loading new weights in place. Touched only by
the engine's loop thread.

Imports: torch, relayrl.engine (kv cache, sampling, sequence, weights), relayrl.models
(attention backend choice), relayrl.errors.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch

from relayrl.engine.adapter import load_partial
from relayrl.engine.attention import ATTENTION_NAME
from relayrl.engine.kv import SlotKVCache, kv_bytes_per_token
from relayrl.engine.sampling import make_batch, sample, top_logprobs
from relayrl.engine.sequence import Sequence
from relayrl.engine.types import EngineOptions
from relayrl.engine.weights import load_into
from relayrl.errors import RelayError
from relayrl.models.loading import prefer_shape_agnostic_attention


def eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def sliding_window(config) -> int | None:
    """The attention window the model's config.json sets for some of its layers, or None
    (Mistral and Phi3 set ``sliding_window``; Qwen2 only with ``use_sliding_window``; models
    with ``layer_types`` only if a layer is ``sliding_attention``)."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types and "sliding_attention" not in layer_types:
        return None
    return int(window)


def served_context(config, requested: int | None) -> int:
    """The longest sequence the engine serves: ``requested`` (``max_seq_len``: ``relayrl
    serve --max-seq-len``, a run's ``model.max_context``), else the model's
    ``max_position_embeddings``; a request beyond the model's positions is capped at them,
    with a warning naming both numbers (the cap was silent: ``--max-seq-len 16384`` served
    8192 tokens)."""
    positions = getattr(config, "max_position_embeddings", None) or 4096
    if requested is None or requested <= positions:
        return requested or positions
    print(
        f"warning: max_seq_len {requested} (relayrl serve --max-seq-len, model.max_context) "
        f"is more than the model's max_position_embeddings {positions}; the engine serves "
        f"at most {positions} tokens per request (prompt + completion)",
        file=sys.stderr,
        flush=True,
    )
    return positions


def check_supported(config, max_seq_len: int) -> None:
    """Refuse what the built-in engine would generate wrongly: it implements full attention
    only, so a sliding window must cover every sequence it serves (``max_seq_len`` tokens:
    model.max_context for a run's servers), where it never slides."""
    layer_types = getattr(config, "layer_types", None) or []
    odd = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if odd:
        raise RelayError(
            f"model layer types {odd} are not supported by the built-in engine "
            "(only full-attention layers; linear attention needs its own state)"
        )
    window = sliding_window(config)
    if window is not None and window < max_seq_len:
        raise RelayError(
            f"the model's config.json sets `sliding_window`: {window}, shorter than the "
            f"{max_seq_len}-token sequences this engine would serve; the built-in engine "
            "implements full attention only and would generate with wrong logprobs. Use "
            "rollout.engine=vllm (relayrl eval: --engine vllm), or cap the context at the "
            f"window (model.max_context <= {window}; relayrl serve --max-seq-len {window}), "
            "where it has no effect"
        )


def available_memory_bytes() -> int | None:
    """MemAvailable of /proc/meminfo, lowered to the cgroup's room when one caps it; None
    where neither can be read."""
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        return None
    try:
        limit = open("/sys/fs/cgroup/memory.max").read().strip()
        used = int(open("/sys/fs/cgroup/memory.current").read())
        if limit != "max" and available is not None:
            available = min(available, int(limit) - used)
    except (OSError, ValueError):
        pass
    return available


def kv_token_budget(options: EngineOptions, bytes_per_token: int) -> int | None:
    """How many KV tokens (running rows x the longest one's columns) the engine may hold:
    ``max_total_tokens``, else ``kv_memory_fraction`` of the memory available at start;
    None: no cap beyond ``max_running_requests`` (the memory could not be read)."""
    if options.max_total_tokens is not None:
        return options.max_total_tokens
    available = available_memory_bytes()
    if available is None:
        return None
    return max(1, int(available * options.kv_memory_fraction) // bytes_per_token)


class ModelRunner:
    def __init__(self, model, options: EngineOptions, stats: dict[str, Any]) -> None:
        self.model = model.eval()
        config = model.config
        self.max_seq_len = served_context(config, options.max_seq_len)
        check_supported(config, self.max_seq_len)
        self.stats = stats  # the engine's counters, shared
        self.device = next(model.parameters()).device
        prefer_shape_agnostic_attention(self.device)
        if getattr(config, "_attn_implementation", None) == "sdpa" and self.device.type == "cpu":
            # the same attention, its one-token decode steps without SDPA's CPU overhead
            model.set_attn_implementation(ATTENTION_NAME)
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)
        self.num_slots = options.max_running_requests
        self.share_prefill = options.share_prefill
        dtype = next(model.parameters()).dtype
        self.kv_bytes_per_token = kv_bytes_per_token(config, dtype)
        self.kv_budget_tokens = kv_token_budget(options, self.kv_bytes_per_token)
        self.cache = SlotKVCache(config.num_hidden_layers, self.num_slots, self.max_seq_len)
        self._takes_logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters

    def forward(self, input_ids, attention_mask, position_ids) -> torch.Tensor:
        kwargs = {"logits_to_keep": 1} if self._takes_logits_to_keep else {}
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=self.cache,
            use_cache=True,
            **kwargs,
        )
        return out.logits[:, -1, :]

    def prefill(
        self, seqs: list[Sequence], route: Callable[[list[Sequence]], None] | None = None
    ) -> torch.Tensor:
        """Prompt (+ partial output) of each newly admitted request into its KV row; the
        next-token logits of each. Requests with the same tokens (a GRPO group's n samples
        of one prompt) are computed once: the first one's KV row is copied to the others
        and its logits row repeated, which is what computing them again would give.
        ``route``: tells the kept adapters the version of each row of the batch computed
        (requests pinned to different versions are never shared)."""
        if not self.share_prefill:
            return self._prefill_batch(seqs)
        first_of: dict[tuple, int] = {}
        unique: list[Sequence] = []
        source: list[int] = []  # per seq: its row in the unique batch
        for seq in seqs:
            key = (seq.pinned_version, *seq.all_ids())
            if key not in first_of:
                first_of[key] = len(unique)
                unique.append(seq)
            source.append(first_of[key])
        if route is not None and len(unique) < len(seqs):
            route(unique)
        logits = self._prefill_batch(unique, total_rows=max(s.row for s in seqs) + 1)
        if len(unique) == len(seqs):
            return logits
        for seq, i in zip(seqs, source, strict=True):
            rep = unique[i]
            if seq is not rep:
                self.cache.move_row(rep.row, seq.row, rep.kv_len)
                seq.kv_len = rep.kv_len
                self._count_reprefill(seq)
                self.stats["shared_prefill_tokens"] += rep.kv_len
        return logits[torch.tensor(source, device=logits.device)]

    def _count_reprefill(self, seq: Sequence) -> None:
        if seq.retracted:
            self.stats["reprefill_tokens"] += seq.kv_len
            seq.retracted = False

    def _prefill_batch(self, seqs: list[Sequence], total_rows: int = 0) -> torch.Tensor:
        """The requests' tokens as one left-padded batch into their KV rows; their logits."""
        tokens = [s.all_ids() for s in seqs]
        lengths = [len(t) for t in tokens]
        pad_to = max(lengths)
        dev = self.device
        ids = torch.zeros(len(tokens), pad_to, dtype=torch.long, device=dev)
        mask = torch.zeros(len(tokens), pad_to, dtype=torch.long, device=dev)
        for i, t in enumerate(tokens):
            ids[i, pad_to - len(t) :] = torch.tensor(t, dtype=torch.long)
            mask[i, pad_to - len(t) :] = 1
        offsets = torch.tensor([pad_to - n for n in lengths], device=dev)
        positions = (torch.arange(pad_to, device=dev)[None, :] - offsets[:, None]).clamp(min=0)
        self.cache.set_prefill([s.row for s in seqs], lengths, pad_to, total_rows)
        logits = self.forward(ids, mask, positions)
        self.cache.after_forward()
        for s, n in zip(seqs, lengths, strict=True):
            s.kv_len = n
            self._count_reprefill(s)
        self.stats["prefills"] += 1
        self.stats["prefill_tokens"] += sum(lengths)
        self.stats["prefill_padded_tokens"] += pad_to * len(lengths)
        return logits

    def decode(self, running: list[Sequence]) -> torch.Tensor:
        """One token for every running request (row i = KV slot i); their logits."""
        dev = self.device
        ids = torch.tensor([s.output_ids[-1] for s in running], dtype=torch.long, device=dev)
        positions = torch.tensor([s.kv_len for s in running], dtype=torch.long, device=dev)
        kv_len = int(positions.max()) + 1
        mask = torch.arange(kv_len, device=dev)[None, :] <= positions[:, None]
        self.cache.set_decode(positions)
        logits = self.forward(ids[:, None], mask, positions[:, None])
        self.cache.after_forward()
        for s in running:
            s.kv_len += 1
        self.stats["steps"] += 1
        return logits

    def sample(
        self, seqs: list[Sequence], logits: torch.Tensor
    ) -> tuple[list[int], list[float], list[list[tuple[int, float]]]]:
        """One token per request, its logprob under the distribution it was drawn from and
        that distribution's ``top_logprobs`` most likely tokens (empty if 0)."""
        ps = [s.params for s in seqs]
        batch = make_batch(
            [p.temperature for p in ps],
            [p.top_p for p in ps],
            [p.top_k for p in ps],
            [s.generator for s in seqs],
            logits.device,
        )
        tokens, logprobs = sample(logits, batch)
        top = top_logprobs(logits, batch, [s.top_logprobs for s in seqs])
        return tokens.tolist(), logprobs.tolist(), top

    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        with torch.inference_mode(False):
            load_into(self.model, state)

    def load_adapter(self, state: Mapping[str, torch.Tensor]) -> None:
        """Write an adapter publication's merged weights (``relayrl.engine.adapter``)."""
        with torch.inference_mode(False):
            load_partial(self.model, state)
