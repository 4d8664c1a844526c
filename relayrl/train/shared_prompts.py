"""Shared prompts in the trainer's forward passes: a group's prompt computed once.

GRPO trains n samples of each prompt, and a right-padded micro-batch recomputes that prompt
n times: on a real chat model the prompt (system turn, template, question) is often as long
as the answer, so half of a step's forward and backward work is repeated. Here the samples
of one prompt in a micro-batch become one *packed row*: the prompt once, then each
completion after it. Position ids restart after the prompt for every completion, and a block
attention mask lets a completion token see the prompt and its own completion's earlier
tokens, never a sibling's. The logits that predict each trajectory's tokens are then gathered
back into the trainer's usual right-padded layout (row = trajectory), so the loss,
statistics and gradient are those of the unshared pass, up to floating-point summation
order (tests/train/test_shared_prompts.py compares both).

The mask is a custom 4-D mask, which Hugging Face models take as given: it needs an
attention implementation that reads one (``sdpa``: boolean, ``eager``: additive), and it
replaces a sliding-window mask, so a model with sliding-window layers is packed only where a
whole packed row fits inside its window (:func:`sharing_for`).

Owns: :class:`PackedPrompts`, :class:`Sharing` / :func:`sharing_for`, :func:`pack_by_prompt`,
:func:`plan_prompt_units`, :func:`packed_logits`.

Imports: torch and the Trajectory record.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from relayrl.rollout.trajectory import Trajectory

MASKED_ATTENTION = ("sdpa", "eager")


@dataclass
class PackedPrompts:
    """The packed rows of one micro-batch, and where each trajectory's logits come from.

    ``input_ids``, ``position_ids``: ``[R, Lp]``; ``attention_mask``: ``[R, 1, Lp, Lp]``
    (boolean for sdpa, additive float for eager); ``keep``: the last ``keep`` positions of a
    packed row get the output head; ``source``: ``[b, K]``, for the trainer layout's logit
    columns ``start .. start+K-1`` of each trajectory row, the flat index into those kept
    positions (``row * keep + column``) whose logits predict the same token (padding
    columns point anywhere: their values are masked)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    keep: int
    source: torch.Tensor

    def to(self, device: torch.device) -> PackedPrompts:
        return PackedPrompts(
            self.input_ids.to(device),
            self.position_ids.to(device),
            self.attention_mask.to(device),
            self.keep,
            self.source.to(device),
        )

    @property
    def tokens(self) -> int:
        """Positions the packed forward pass computes (padding included)."""
        return int(self.input_ids.numel())


@dataclass(frozen=True)
class Sharing:
    """How a model takes packed rows: its attention implementation (the mask's form) and
    the longest packed row (``None``: no limit; a sliding window bounds it)."""

    attention: str
    limit: int | None


def sharing_for(model: torch.nn.Module) -> Sharing | None:
    """How ``model`` takes packed rows, or None when its attention cannot read a custom
    mask (prompts are then not shared)."""
    config = getattr(model, "config", None)
    attention = getattr(config, "_attn_implementation", None)
    if attention not in MASKED_ATTENTION:
        return None
    layer_types = getattr(config, "layer_types", None) or []
    window = getattr(config, "sliding_window", None)
    slides = "sliding_attention" in layer_types or bool(getattr(config, "use_sliding_window", 0))
    return Sharing(attention, int(window) if slides and window else None)


def plan_prompt_units(
    trajs: Sequence[Trajectory], index: Sequence[int], limit: int | None
) -> list[list[int]]:
    """``index`` grouped by prompt, in order of first appearance: each unit is one packed
    row, cut where the prompt plus its completions would pass ``limit`` tokens."""
    by_prompt: dict[tuple[int, ...], list[list[int]]] = {}
    lengths: dict[int, int] = {}  # id(unit) -> its packed length
    units: list[list[int]] = []
    for i in index:
        t = trajs[i]
        chunks = by_prompt.setdefault(tuple(t.prompt_ids), [])
        unit = chunks[-1] if chunks else None
        grown = lengths[id(unit)] + len(t.completion_ids) if unit is not None else 0
        if unit is None or (limit is not None and grown > limit):
            unit = []
            chunks.append(unit)
            units.append(unit)
            grown = t.num_tokens
        unit.append(i)
        lengths[id(unit)] = grown
    return units


def unit_length(trajs: Sequence[Trajectory], unit: Sequence[int]) -> int:
    """Tokens of a packed row: the prompt once, then every completion."""
    return len(trajs[unit[0]].prompt_ids) + sum(len(trajs[i].completion_ids) for i in unit)


def pack_by_prompt(
    trajs: Sequence[Trajectory],
    index: Sequence[int],
    pad_id: int,
    sharing: Sharing,
    start: int,
    width: int,
) -> PackedPrompts | None:
    """The packed rows of the micro-batch ``index`` (whose trainer layout is ``width``
    tokens wide, logits kept from column ``start``), or None when no prompt repeats in it
    (packing would then only add work)."""
    units = plan_prompt_units(trajs, index, sharing.limit)
    if len(units) == len(index):
        return None
    lengths = [unit_length(trajs, u) for u in units]
    rows, row_width = len(units), max(lengths)
    ids = torch.full((rows, row_width), pad_id, dtype=torch.long)
    positions = torch.zeros((rows, row_width), dtype=torch.long)
    segment = torch.full((rows, row_width), -2, dtype=torch.long)  # -1 prompt, k completion
    first_kept = min(len(trajs[u[0]].prompt_ids) for u in units) - 1
    keep = row_width - first_kept
    source = torch.zeros((len(index), width - 1 - start), dtype=torch.long)
    row_of = {i: r for r, u in enumerate(units) for i in u}
    offsets: dict[int, int] = {}
    for r, unit in enumerate(units):
        prompt = trajs[unit[0]].prompt_ids
        p = len(prompt)
        ids[r, :p] = torch.tensor(prompt)
        positions[r, :p] = torch.arange(p)
        segment[r, :p] = -1
        at = p
        for k, i in enumerate(unit):
            c = len(trajs[i].completion_ids)
            ids[r, at : at + c] = torch.tensor(trajs[i].completion_ids)
            positions[r, at : at + c] = torch.arange(p, p + c)
            segment[r, at : at + c] = k
            offsets[i] = at
            at += c
    for row, i in enumerate(index):
        p, c = len(trajs[i].prompt_ids), len(trajs[i].completion_ids)
        # the prompt's last position predicts completion token 0; completion position
        # offset + k - 1 predicts token k
        predictors = [p - 1] + list(range(offsets[i], offsets[i] + c - 1))
        columns = torch.tensor(predictors[:c], dtype=torch.long) - first_kept
        source[row, p - 1 - start : p - 1 - start + c] = row_of[i] * keep + columns
    mask = _block_mask(segment)
    if sharing.attention == "eager":
        mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    return PackedPrompts(ids, positions, mask, keep, source)


def _block_mask(segment: torch.Tensor) -> torch.Tensor:
    """``[R, 1, L, L]``: query q sees key k ≤ q when k is the prompt or q's own completion;
    padding queries see position 0 only (a row with no visible key would be NaN)."""
    length = segment.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    q, k = segment.unsqueeze(2), segment.unsqueeze(1)
    visible = causal & (k != -2) & ((k == -1) | (k == q))
    pad_query = (segment == -2).unsqueeze(2) & (torch.arange(length) == 0)
    return (visible | pad_query).unsqueeze(1)


def packed_logits(model: torch.nn.Module, packed: PackedPrompts) -> torch.Tensor:
    """``[b, K, V]`` logits in the trainer's layout, from one forward pass over the packed
    rows (the output head on their kept positions only)."""
    logits = model(
        input_ids=packed.input_ids,
        position_ids=packed.position_ids,
        attention_mask=packed.attention_mask,
        logits_to_keep=packed.keep,
    ).logits
    flat = logits[:, -packed.keep :].reshape(-1, logits.shape[-1])
    return flat[packed.source]
