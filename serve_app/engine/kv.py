"""Batched KV state with ragged per-sequence lengths, written by position.

Each running sequence owns one row of every layer's key/value tensor. A forward writes each new
token's K/V at that token's own position in its row, and the attention mask (built from positions)
decides what each query sees. So a sequence's valid KV is simply its first `kv_len` positions:
rolling back rejected draft tokens is lowering `kv_len`, never copying caches; stale entries past it
are masked and overwritten by the next write at that position.

Rows of running sequences are kept contiguous (0..n-1) so a batch forward works on a view; when a
sequence leaves, the last row moves into its place (one sequence's K/V, once per eviction).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache


class SlotKVCache(Cache):
    """HF-compatible cache over rows of [rows, kv_heads, capacity, head_dim] tensors per layer."""

    def __init__(self) -> None:
        super().__init__(layers=[])
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._rows = 0  # allocated rows / capacity wanted by the next forward
        self._cap = 0
        self._row_start = 0
        self._positions: torch.Tensor | None = None  # [B, T] positions written by the current forward
        self._positions_on: dict = {}  # device -> _positions there (a model split over devices: layers differ)
        self._kv_max = 0

    def prepare(self, row_start: int, positions: torch.Tensor) -> None:
        """Set where the next forward writes: rows [row_start, row_start+B), positions [B, T]."""
        self._row_start = row_start
        self._positions = positions
        self._positions_on = {positions.device: positions}
        self._kv_max = int(positions.max()) + 1
        self._rows = max(self._rows, _round_up_pow2(row_start + positions.shape[0]))
        self._cap = max(self._cap, -(-self._kv_max // 128) * 128)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # key_states, value_states: [B, kv_heads, T, head_dim] for the tokens of this forward
        if layer_idx == len(self.keys):
            shape = (self._rows, key_states.shape[1], self._cap, key_states.shape[3])
            self.keys.append(key_states.new_zeros(shape))
            self.values.append(value_states.new_zeros(shape))
        self._grow(layer_idx)
        r0, bsz = self._row_start, key_states.shape[0]
        index = self._positions_at(key_states.device)[:, None, :, None].expand_as(key_states)
        keys = self.keys[layer_idx][r0 : r0 + bsz]
        values = self.values[layer_idx][r0 : r0 + bsz]
        keys.scatter_(2, index, key_states)
        values.scatter_(2, index, value_states)
        return keys[:, :, : self._kv_max], values[:, :, : self._kv_max]

    def _positions_at(self, device) -> torch.Tensor:
        """The current positions on a layer's device: with `--device auto` a model's layers may sit on
        several GPUs, and a scatter needs its index where its tensor is (copied once per device)."""
        if device not in self._positions_on:
            self._positions_on[device] = self._positions.to(device)
        return self._positions_on[device]

    def _grow(self, layer_idx: int) -> None:
        """Reallocate a layer when the batch or the longest sequence outgrew it (amortised, rare)."""
        old_k, old_v = self.keys[layer_idx], self.values[layer_idx]
        rows, _, cap, _ = old_k.shape
        if rows >= self._rows and cap >= self._cap:
            return
        shape = (max(rows, self._rows), old_k.shape[1], max(cap, self._cap), old_k.shape[3])
        new_k, new_v = old_k.new_zeros(shape), old_v.new_zeros(shape)
        new_k[:rows, :, :cap] = old_k
        new_v[:rows, :, :cap] = old_v
        self.keys[layer_idx], self.values[layer_idx] = new_k, new_v

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` positions of row src into row dst (compaction on eviction)."""
        if length == 0:  # nothing cached for it yet: a draft that ran no forward since the row joined
            return  # (k = 0 steps) has not even grown the cache to that row
        for k, v in zip(self.keys, self.values):
            k[dst, :, :length] = k[src, :, :length]
            v[dst, :, :length] = v[src, :, :length]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        # Only consulted by models when no position_ids are given; we always give them.
        return self._kv_max

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self._kv_max, 0

    @property
    def is_compileable(self) -> bool:
        return False

    def __len__(self) -> int:
        return len(self.keys)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


def _round_up_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def compact_rows(order: list, removed: set) -> tuple[list, list[tuple[int, int]]]:
    """New row order after removing sequences, and the (src, dst) row moves that achieve it.

    Each removed row is filled by the current last row, so survivors stay in rows 0..n-1. Both
    workers and the engine call this same function, so they agree on rows without talking.
    """
    order = list(order)
    moves: list[tuple[int, int]] = []
    for row in sorted((i for i, s in enumerate(order) if s in removed), reverse=True):
        last = len(order) - 1
        if row != last:
            order[row] = order[last]
            moves.append((last, row))
        order.pop()
    return order, moves


def ragged_inputs(
    fed: list[list[int]], starts: list[int], pad_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad ragged token lists into input_ids [B, T] and positions [B, T].

    Row b feeds fed[b] at positions starts[b], starts[b]+1, ... Left padding puts every row's last
    real token in the last column, so `logits_to_keep` selects the same columns for all rows. Pad
    columns get positions just past the row's real tokens: they write K/V where nothing valid lives
    and no real query can see them (keys past a query's own position are masked).
    """
    width = max(len(f) for f in fed)
    ids = torch.full((len(fed), width), pad_id, dtype=torch.long)
    pos = torch.empty((len(fed), width), dtype=torch.long)
    cols = torch.arange(width)
    for b, (tokens, start) in enumerate(zip(fed, starts)):
        n, pad = len(tokens), width - len(tokens)
        ids[b, pad:] = torch.tensor(tokens, dtype=torch.long)
        pos[b] = torch.where(cols >= pad, start + cols - pad, start + n + cols)
    return ids, pos


def causal_mask(positions: torch.Tensor, kv_len: int, dtype: torch.dtype | None) -> torch.Tensor:
    """[B, 1, T, kv_len] mask from positions [B, T]: a query sees keys at positions <= its own.

    dtype None gives a boolean mask (SDPA); a float dtype gives an additive mask (eager attention).
    """
    keys = torch.arange(kv_len, device=positions.device)
    allowed = keys[None, None, None, :] <= positions[:, None, :, None]
    if dtype is None:
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=positions.device).masked_fill_(
        ~allowed, torch.finfo(dtype).min
    )
