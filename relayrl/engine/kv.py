"""The engine's KV cache: per layer one ``[rows, kv_heads, columns, head_dim]`` key and value
buffer, plugged into any Hugging Face causal LM as a ``transformers`` Cache, **sized by the
requests running now**, never by the model card's context.

Row ``r`` holds the keys/values of the request in row ``r`` of the running batch,
left-aligned (token ``j`` of the sequence at column ``j``). The engine keeps running
requests in rows ``0..R-1`` (a finished request's row is refilled by moving the last row
into it).

Memory by need: the buffer grows (in blocks of :data:`ROW_BLOCK` rows and
:data:`COLUMN_BLOCK` columns, contents kept) when a prefill or a decode step needs more,
and shrinks when it is more than twice what the running requests use; it is freed when
nothing runs. The allocation is therefore at most ``(R + ROW_BLOCK - 1) x
(longest + COLUMN_BLOCK - 1)`` tokens, twice that just before a shrink. How many requests
may run is the scheduler's business (:func:`kv_bytes_per_token` prices a token for its
memory budget).

Two forward modes, set by the engine before each model call:

* ``prefill(rows, lengths, pad_to)``: a left-padded batch of new sequences; each row's real
  tokens are copied into the first ``lengths[i]`` columns of its row. Attention inside the
  prefill uses the freshly computed states, so no earlier content of the row is read.
* ``decode(lengths)``: one new token per running row at column ``lengths[i]``; attention reads
  columns ``0..max(lengths)`` of rows ``0..R-1`` and the engine's 2D attention mask hides each
  row's columns beyond its own length.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

ROW_BLOCK = 4
COLUMN_BLOCK = 128


def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block


def fitted_size(current: int, needed: int, block: int, cap: int) -> int:
    """The new extent of one buffer axis: kept while it holds ``needed`` and is at most
    twice the block-rounded need (no churn), else the block-rounded need (capped)."""
    target = min(cap, _round_up(max(needed, 1), block))
    if needed <= current <= 2 * target:
        return current
    return target


def kv_bytes_per_token(config, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of KV one token occupies over all layers (keys and values)."""
    heads = getattr(config, "num_attention_heads", 1)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    element = torch.empty((), dtype=dtype).element_size()
    return int(config.num_hidden_layers) * 2 * int(kv_heads) * int(head_dim) * element


class _Mode:
    """What the current forward does; shared by all layers of one cache."""

    def __init__(self) -> None:
        self.decode = False
        self.rows: list[int] = []  # prefill: destination row of each batch row
        self.lengths: list[int] = []  # prefill: real tokens per row
        self.pad_to = 0  # prefill: padded length
        self.positions: torch.Tensor | None = None  # decode: write column per row
        self.row_index: torch.Tensor | None = None  # decode: arange(R)
        self.kv_len = 0  # decode: columns read
        self.shape = (0, 0)  # (rows, columns) every layer's buffer has during this forward


class SlotLayer(CacheLayerMixin):
    """One layer's buffers; (re)allocated on a write when the planned shape changed."""

    is_sliding = False
    is_compileable = False

    def __init__(self, mode: _Mode, max_seq_len: int) -> None:
        super().__init__()
        self.mode = mode
        self.max_seq_len = max_seq_len

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._reshape(key_states, value_states)

    def _reshape(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        rows, cols = self.mode.shape
        if self.is_initialized and tuple(self.keys.shape[::2]) == (rows, cols):
            return
        heads, kd, vd = key_states.shape[1], key_states.shape[-1], value_states.shape[-1]
        opts = {"dtype": key_states.dtype, "device": key_states.device}
        keys = torch.zeros(rows, heads, cols, kd, **opts)
        values = torch.zeros(rows, heads, cols, vd, **opts)
        if self.is_initialized:
            r, c = min(rows, self.keys.shape[0]), min(cols, self.keys.shape[2])
            keys[:r, :, :c] = self.keys[:r, :, :c]
            values[:r, :, :c] = self.values[:r, :, :c]
        self.keys, self.values = keys, values
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._reshape(key_states, value_states)
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

    def copy_row(self, src: int, dst: int, length: int) -> None:
        if self.is_initialized and length > 0:
            self.keys[dst, :, :length] = self.keys[src, :, :length]
            self.values[dst, :, :length] = self.values[src, :, :length]

    def free(self) -> None:
        if self.is_initialized:
            del self.keys, self.values
            self.is_initialized = False

    def nbytes(self) -> int:
        if not self.is_initialized:
            return 0
        return self.keys.nbytes + self.values.nbytes


class SlotKVCache(Cache):
    """A ``transformers`` Cache over row buffers sized by need; see the module docstring.
    ``max_rows`` caps the rows (the engine's running-request limit), ``max_seq_len`` the
    columns."""

    def __init__(self, num_layers: int, max_rows: int, max_seq_len: int) -> None:
        self.mode = _Mode()
        layers = [SlotLayer(self.mode, max_seq_len) for _ in range(num_layers)]
        super().__init__(layers=layers)
        self.max_rows = max_rows
        self.max_seq_len = max_seq_len
        self.peak_bytes = 0

    def _plan(self, rows: int, cols: int, grow_only: bool) -> None:
        cur_rows, cur_cols = self.mode.shape
        if grow_only:
            rows, cols = max(rows, cur_rows), max(cols, cur_cols)
        self.mode.shape = (
            fitted_size(cur_rows, rows, ROW_BLOCK, self.max_rows),
            fitted_size(cur_cols, cols, COLUMN_BLOCK, self.max_seq_len),
        )

    def set_prefill(
        self, rows: list[int], lengths: list[int], pad_to: int, total_rows: int = 0
    ) -> None:
        """A prefill writes only its own rows and knows nothing of the running ones' lengths:
        the buffer may grow, never shrink. ``total_rows``: rows the buffer must have after
        it (rows the prefill's KV is then copied to, ``move_row``)."""
        m = self.mode
        m.decode, m.rows, m.lengths, m.pad_to, m.kv_len = False, rows, lengths, pad_to, 0
        self._plan(max(max(rows) + 1, total_rows), max(lengths), grow_only=True)

    def set_decode(self, positions: torch.Tensor) -> None:
        """``positions[i]``: the column the new token of row ``i`` is written to. Every
        running row is in a decode step, so here the buffer may also shrink to fit them."""
        m = self.mode
        m.decode = True
        m.positions = positions
        m.row_index = torch.arange(positions.shape[0], device=positions.device)
        m.kv_len = int(positions.max()) + 1
        self._plan(positions.shape[0], m.kv_len, grow_only=False)

    def after_forward(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.nbytes())

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` columns of row ``src`` into row ``dst`` (all layers)."""
        for layer in self.layers:
            layer.copy_row(src, dst, length)

    def free(self) -> None:
        """Release every buffer (nothing runs); the next prefill allocates anew."""
        for layer in self.layers:
            layer.free()
        self.mode.shape = (0, 0)

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)
