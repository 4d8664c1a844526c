"""Plain data types of the generation engine: engine options, per-request sampling parameters
and the generation result. No torch import, so configs and clients can use them cheaply.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any, Literal

# admission bounds of one request (SamplingParams.validate)
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes
# far from float32's denormals and overflow in logits / T; outside is not sampling anyway
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-4, 1e4
MIN_TOP_P = 1e-6
MAX_STOP, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS = 64, 1024, 1024

FinishReason = Literal["stop", "length", "abort"]


class PauseMode(StrEnum):
    """How :meth:`Engine.pause` treats the running requests (``/pause_generation``'s
    ``mode``): ``abort`` returns them with their partial output, ``retract`` frees their KV
    and re-queues them, ``in_place`` keeps them waiting with their KV."""

    ABORT = "abort"
    RETRACT = "retract"
    IN_PLACE = "in_place"


PAUSE_MODES: tuple[str, ...] = tuple(m.value for m in PauseMode)
MAX_TOP_LOGPROBS = 20  # the most alternatives a request may ask for (OpenAI's limit)


@dataclass
class EngineOptions:
    """Options of the built-in engine (the run config refers to this dataclass).

    Memory: the KV cache holds what the running requests need (``relayrl.engine.kv``), never
    ``max_running_requests x max_seq_len``. A request is admitted while the running ones
    (at most ``max_running_requests``), each counted at its longest (prompt +
    ``max_new_tokens``), fit in the KV budget: ``max_total_tokens`` tokens, or by default
    ``kv_memory_fraction`` of the memory available when the engine starts. The others wait
    in a queue; one that could never fit is refused at submission.
    """

    device: str = "cpu"
    dtype: str = "float32"
    max_running_requests: int = 128
    # KV budget in tokens (running rows x the longest one's prompt + max_new_tokens);
    # None: kv_memory_fraction of the memory available at start
    max_total_tokens: int | None = None
    kv_memory_fraction: float = 0.25
    # Longest prompt + output per request; None: the model's max_position_embeddings.
    max_seq_len: int | None = None
    # Token budget of one batched prefill (prompts are packed up to this, at least one runs).
    max_prefill_tokens: int = 4096
    # Prefill a batch's identical requests (a GRPO group's prompt) once and copy the KV;
    # False computes each (the same tokens and logprobs: tests/engine/test_kv_memory.py).
    share_prefill: bool = True
    # Initial weight version.
    weight_version: int = 0
    # LoRA publications: 1 merges each adapter into a copy of the weights (running requests
    # are retracted); K >= 2 keeps the last K adapters and applies each request's own in the
    # forward pass, so a publication interrupts no request (docs/lora.md).
    max_adapters: int = 1

    def __post_init__(self) -> None:
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise ValueError("max_total_tokens must be >= 1 or None")
        if not 0 < self.kv_memory_fraction <= 1:
            raise ValueError("kv_memory_fraction must be in (0, 1]")
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise ValueError("max_seq_len must be >= 2 or None")
        if self.max_prefill_tokens < 1:
            raise ValueError("max_prefill_tokens must be >= 1")
        if self.max_adapters < 1:
            raise ValueError("max_adapters must be >= 1")


@dataclass
class SamplingParams:
    """Per-request sampling parameters.

    ``temperature=0`` is greedy decoding. ``top_k=-1`` and ``top_p=1`` disable those filters.
    ``seed`` seeds a per-request ``torch.Generator`` (None: a random seed). EOS of the model
    stops generation unless ``ignore_eos``; ``stop_token_ids`` and ``stop`` (strings, needs a
    tokenizer) stop it too, with the stopping token kept in the output.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad field. Every bound here keeps one bad
        request from failing the engine step it would share with others (a ``top_k`` past
        int64 overflowed the batch's tensor and failed every request in it)."""
        if not 0 < self.max_new_tokens <= INT32_MAX:
            raise ValueError(
                f"max_new_tokens must be in [1, {INT32_MAX}], got {self.max_new_tokens}"
            )
        t = self.temperature
        if not (math.isfinite(t) and (t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE)):
            raise ValueError(
                f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], "
                f"got {t}"
            )
        if not (math.isfinite(self.top_p) and MIN_TOP_P <= self.top_p <= 1):
            raise ValueError(f"top_p must be in [{MIN_TOP_P}, 1], got {self.top_p}")
        if not (self.top_k == -1 or 1 <= self.top_k <= INT64_MAX):
            raise ValueError(f"top_k must be -1 (off) or in [1, {INT64_MAX}], got {self.top_k}")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be in [{SEED_MIN}, {SEED_MAX}], got {self.seed}")
        if len(self.stop) > MAX_STOP or any(
            not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_CHARS for s in self.stop
        ):
            raise ValueError(
                f"stop must be a list of at most {MAX_STOP} non-empty strings of at most "
                f"{MAX_STOP_CHARS} characters"
            )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS or any(
            not 0 <= t <= INT64_MAX for t in self.stop_token_ids
        ):
            raise ValueError(
                f"stop_token_ids must be at most {MAX_STOP_TOKEN_IDS} ids in [0, {INT64_MAX}]"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class GenerationResult:
    """The outcome of one request.

    ``output_logprobs[i]`` is ``log_softmax(logits / T)[output_ids[i]]`` (T = 1 for greedy) and
    ``output_versions[i]`` the weight version that produced ``output_ids[i]``. A request
    submitted with ``top_logprobs=k`` has in ``output_top_logprobs[i]`` the ``k`` most likely
    ``(token id, logprob)`` of that same distribution, most likely first (else it is empty).
    """

    rid: str
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    finish_reason: FinishReason
    prompt_tokens: int
    # Wall-clock seconds: submission -> first token, submission -> finish.
    time_to_first_token: float | None = None
    latency: float = 0.0
    matched_stop: int | str | None = None
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
