"""Slot-based KV cache: one preallocated ``[slots, kv_heads, max_seq_len, head_dim]`` key and
value buffer per layer, plugged into any Hugging Face causal LM as a ``transformers`` Cache.

Row ``r`` of the buffer holds the keys/values of the request in slot ``r``, left-aligned
(token ``j`` of the sequence at column ``j``). The engine keeps running requests in rows
``0..R-1`` (a finished request's row is refilled by moving the last row into it).

Two forward modes, set by the engine before each model call:

* ``prefill(rows, lengths, pad_to)``: a left-padded batch of new sequences; each row's real
  tokens are copied into the first ``lengths[i]`` columns of its slot. Attention inside the
  prefill uses the freshly computed states, so no earlier content of the slot is read.
* ``decode(lengths)``: one new token per running row at column ``lengths[i]``; attention reads
  columns ``0..max(lengths)`` of rows ``0..R-1`` and the engine's 2D attention mask hides each
  row's columns beyond its own length.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class _Mode:
    """What the current forward does; shared by all layers of one cache."""

    def __init__(self) -> None:
        self.decode = False
        self.rows: list[int] = []  # prefill: destination slot of each batch row
        self.lengths: list[int] = []  # prefill: real tokens per row
        self.pad_to = 0  # prefill: padded length
        self.positions: torch.Tensor | None = None  # decode: write column per row
        self.row_index: torch.Tensor | None = None  # decode: arange(R)
        self.kv_len = 0  # decode: columns read


class SlotLayer(CacheLayerMixin):
    """One layer's slot buffers; allocated on the first write (dtype/heads from the model)."""

    is_sliding = False
    is_compileable = False

    def __init__(self, mode: _Mode, num_slots: int, max_seq_len: int) -> None:
        super().__init__()
        self.mode = mode
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        heads, kd, vd = key_states.shape[1], key_states.shape[-1], value_states.shape[-1]
        shape = (self.num_slots, heads, self.max_seq_len)
        opts = {"dtype": key_states.dtype, "device": key_states.device}
        self.keys = torch.zeros(*shape, kd, **opts)
        self.values = torch.zeros(*shape, vd, **opts)
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        m = self.mode
        if not m.decode:
            for i, (row, n) in enumerate(zip(m.rows, m.lengths, strict=True)):
                self.keys[row, :, :n] = key_states[i, :, m.pad_to - n :]
                self.values[row, :, :n] = value_states[i, :, m.pad_to - n :]
            return key_states, value_states
        self.keys[m.row_index, :, m.positions] = key_states[:, :, 0]
        self.values[m.row_index, :, m.positions] = value_states[:, :, 0]
        n_rows = key_states.shape[0]
        return self.keys[:n_rows, :, : m.kv_len], self.values[:n_rows, :, : m.kv_len]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self.mode.kv_len - 1 if self.mode.decode else 0

    def get_max_length(self) -> int:
        return self.max_seq_len

    def move_row(self, src: int, dst: int, length: int) -> None:
        if self.is_initialized and length > 0:
            self.keys[dst, :, :length] = self.keys[src, :, :length]
            self.values[dst, :, :length] = self.values[src, :, :length]

    def nbytes(self) -> int:
        if not self.is_initialized:
            return 0
        return self.keys.nbytes + self.values.nbytes


class SlotKVCache(Cache):
    """A ``transformers`` Cache over per-slot buffers; see the module docstring."""

    def __init__(self, num_layers: int, num_slots: int, max_seq_len: int) -> None:
        self.mode = _Mode()
        layers = [SlotLayer(self.mode, num_slots, max_seq_len) for _ in range(num_layers)]
        super().__init__(layers=layers)
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len

    def set_prefill(self, rows: list[int], lengths: list[int], pad_to: int) -> None:
        m = self.mode
        m.decode, m.rows, m.lengths, m.pad_to, m.kv_len = False, rows, lengths, pad_to, 0

    def set_decode(self, positions: torch.Tensor) -> None:
        """``positions[i]``: the column the new token of row ``i`` is written to."""
        m = self.mode
        m.decode = True
        m.positions = positions
        m.row_index = torch.arange(positions.shape[0], device=positions.device)
        m.kv_len = int(positions.max()) + 1

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` columns of slot ``src`` into slot ``dst`` (all layers)."""
        for layer in self.layers:
            layer.move_row(src, dst, length)

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)
