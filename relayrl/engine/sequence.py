"""One request as the engine sees it while it is queued or running.

Owns :class:`Sequence` (token ids so far, per-token logprobs and weight versions, the KV slot
it holds, its sampler, the listener that streams its tokens) and :func:`stop_reason`.
Touched only by the engine's loop thread.

Imports: torch, relayrl.engine.types.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from relayrl.engine.types import FinishReason, SamplingParams

TokenListener = Callable[[int, float, int, list[tuple[int, float]]], None]


@dataclass
class Sequence:
    """Engine-side state of one request."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    future: concurrent.futures.Future
    generator: torch.Generator | None
    stop_ids: set[int]
    submitted_at: float
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    row: int = -1  # KV slot while running
    kv_len: int = 0  # tokens whose keys/values are in the slot
    retracted: bool = False  # its next prefill recomputes KV it had (counted in the stats)
    # the adapter version it decodes under when the engine keeps K versions (set at
    # admission, kept across publications; None: the engine's current weights)
    pinned_version: int | None = None
    top_logprobs: int = 0  # alternatives recorded per token
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # called on the loop thread with each new token's (id, logprob, version, top logprobs);
    # it must only hand them over (e.g. ``loop.call_soon_threadsafe``), never block
    on_token: TokenListener | None = None

    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def max_length(self) -> int:
        """The most tokens it can hold: prompt + max_new_tokens (its KV at its longest)."""
        return len(self.prompt_ids) + self.params.max_new_tokens

    def append(
        self,
        token: int,
        logprob: float,
        version: int,
        now: float,
        top: list[tuple[int, float]] | None = None,
    ) -> None:
        """Record one sampled token with its logprob, the weight version behind it and the
        most likely alternatives (when the request asked for them); tell the listener."""
        self.output_ids.append(token)
        self.output_logprobs.append(logprob)
        self.output_versions.append(version)
        if self.top_logprobs:
            self.output_top_logprobs.append(list(top or []))
        self.first_token_at = self.first_token_at or now
        if self.on_token is not None:
            try:
                self.on_token(token, logprob, version, list(top or []))
            except Exception:  # noqa: BLE001 - a broken listener never stops the batch
                self.on_token = None


def stop_reason(seq: Sequence, token: int, tokenizer) -> tuple[FinishReason | None, Any]:
    """Why ``seq`` stops after sampling ``token`` (and the stop token or string), if it does."""
    if token in seq.stop_ids:
        return "stop", token
    if seq.params.stop:
        window = max(len(s) for s in seq.params.stop) + 2
        tail = tokenizer.decode(seq.output_ids[-window:])
        for s in seq.params.stop:
            if s in tail:
                return "stop", s
    if len(seq.output_ids) >= seq.params.max_new_tokens:
        return "length", None
    return None, None
