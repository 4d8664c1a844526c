"""Plain data types of the generation engine: engine options, per-request sampling parameters
and the generation result. No torch import, so configs and clients can use them cheaply.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length", "abort"]
PauseMode = Literal["abort", "retract", "in_place"]
PAUSE_MODES: tuple[str, ...] = ("abort", "retract", "in_place")
MAX_TOP_LOGPROBS = 20  # the most alternatives a request may ask for (OpenAI's limit)


@dataclass
class EngineOptions:
    """Options of the built-in engine (the run config refers to this dataclass).

    Memory: the KV cache is a preallocated slot buffer of ``num_slots x max_seq_len`` tokens
    per layer, with ``num_slots = min(max_running_requests, max_total_tokens // max_seq_len)``
    (``max_total_tokens=None``: no extra cap). Requests beyond the free slots wait in a queue.
    """

    device: str = "cpu"
    dtype: str = "float32"
    max_running_requests: int = 64
    max_total_tokens: int | None = None
    # Longest prompt + output per request; None: the model's max_position_embeddings.
    max_seq_len: int | None = None
    # Token budget of one batched prefill (prompts are packed up to this, at least one runs).
    max_prefill_tokens: int = 4096
    # Initial weight version.
    weight_version: int = 0

    def __post_init__(self) -> None:
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise ValueError("max_total_tokens must be >= 1 or None")
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise ValueError("max_seq_len must be >= 2 or None")
        if self.max_prefill_tokens < 1:
            raise ValueError("max_prefill_tokens must be >= 1")


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
        """Raise ``ValueError`` naming the first bad field."""
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be > 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")

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
