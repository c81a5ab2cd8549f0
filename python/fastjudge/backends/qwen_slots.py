"""The static decode cache of the Qwen backend: every row's model state in preallocated,
slot-addressed buffers.

A decode batch gets one pool of ``slots`` rows, each ``capacity`` tokens long, allocated once
from the requests' token budgets (prompt + forced response start + ``max_new_tokens``, all known
up front): per full-attention layer K and V ``[slots, kv_heads, capacity + 1, head_dim]``, per
Gated DeltaNet layer the conv state ``[slots, conv_dim, kernel - 1]`` and the recurrent state
``[slots, v_heads, k_dim, v_dim]`` (float32, as the delta rule keeps it). Nothing grows by
concatenation: a step writes each new token's K/V at its row's length, in place.

Live rows sit in slots ``0 .. live - 1``, so a step runs on plain leading slices of every buffer
(views, no gather). A row that finishes frees its slot: the last live row's state is copied into
it (one row, never a re-gather of every row), and a newcomer takes the first free slot (refill).
The rows that leave in one step move in one batched copy. Column ``capacity`` of the K/V buffers
is scratch: the right padding of a multi-token step writes there, past every real token, so
padding never lands on a row's state.

Memory: ``slots * (A * 2 * kv_heads * (capacity + 1) * head_dim * b
+ D * (conv_dim * (kernel - 1) * b + v_heads * k_dim * v_dim * 4))`` bytes, with ``A`` / ``D``
the full-attention / DeltaNet layer counts, ``b`` the bytes per element of the model's dtype and
``conv_dim = 2 * k_heads * k_dim + v_heads * v_dim`` (:func:`pool_bytes`).
"""

from __future__ import annotations

import numpy as np
import torch

from .qwen_shape import QwenShape


def _conv_dim(shape: QwenShape) -> int:
    return 2 * shape.lin_k_heads * shape.lin_k_dim + shape.lin_v_heads * shape.lin_v_dim


def pool_bytes(shape: QwenShape, slots: int, capacity: int, element_size: int) -> int:
    """The bytes of a :class:`SlotCache` of ``slots`` rows of ``capacity`` tokens (module notes)."""
    per_slot = 0
    for kind in shape.layer_types:
        if kind == "full_attention":
            per_slot += 2 * shape.kv_heads * (capacity + 1) * shape.head_dim * element_size
        else:
            per_slot += _conv_dim(shape) * (shape.conv_kernel - 1) * element_size
            per_slot += shape.lin_v_heads * shape.lin_k_dim * shape.lin_v_dim * 4
    return slots * per_slot


class SlotCache:
    """Per-slot decoding state (module notes). ``layers[i]`` is ``(K, V)`` of a full-attention
    layer or ``(conv, recurrent)`` of a DeltaNet layer; ``lengths`` / ``positions`` (device) are
    each slot's token count and next rotary position; ``held`` (host) mirrors ``lengths`` so that
    the host never reads a device value to plan a step."""

    def __init__(self, shape: QwenShape, slots: int, capacity: int, device, dtype):
        self.capacity = int(capacity)
        self.kinds = shape.layer_types
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        for kind in shape.layer_types:
            if kind == "full_attention":
                size = (slots, shape.kv_heads, self.capacity + 1, shape.head_dim)
                self.layers.append((torch.zeros(size, dtype=dtype, device=device),
                                    torch.zeros(size, dtype=dtype, device=device)))
            else:
                self.layers.append((
                    torch.zeros(slots, _conv_dim(shape), shape.conv_kernel - 1, dtype=dtype, device=device),
                    torch.zeros(slots, shape.lin_v_heads, shape.lin_k_dim, shape.lin_v_dim,
                                dtype=torch.float32, device=device)))
        self.lengths = torch.zeros(slots, dtype=torch.long, device=device)
        self.positions = torch.zeros(slots, dtype=torch.long, device=device)
        self.held = np.zeros(slots, dtype=np.int64)
        self._pool, self._start = self, 0

    @property
    def slots(self) -> int:
        return len(self.held)

    def window(self, start: int, stop: int) -> "SlotCache":
        """Slots ``start .. stop - 1`` as a cache of their own: every buffer a view, so a step on
        the window writes the pool."""
        view = object.__new__(SlotCache)
        view.capacity, view.kinds = self.capacity, self.kinds
        view.layers = [(a[start:stop], b[start:stop]) for a, b in self.layers]
        view.lengths, view.positions = self.lengths[start:stop], self.positions[start:stop]
        view.held = self.held[start:stop]
        view._pool, view._start = self._pool, self._start + start
        return view

    def widen(self, slots: int) -> "SlotCache | None":
        """This window grown to ``slots`` slots of the same pool (the added ones free), or None
        where the pool ends first."""
        if self._start + slots > self._pool.slots:
            return None
        return self._pool.window(self._start, self._start + slots)

    def load(self, slot: int, state) -> None:
        """A prefix state (``qwen_model.PrefixState`` of one row) into ``slot``."""
        if state.length > self.capacity:
            raise ValueError(f"a state of {state.length} tokens does not fit {self.capacity} positions")
        for kind, (a, b), (x, y) in zip(self.kinds, self.layers, state.layers):
            if kind == "full_attention":
                a[slot, :, : state.length] = x[0]
                b[slot, :, : state.length] = y[0]
            else:
                a[slot] = x[0]
                b[slot] = y[0]
        self.lengths[slot] = state.length
        self.positions[slot] = state.next_position
        self.held[slot] = state.length

    def move(self, src: list[int], dst: list[int]) -> None:
        """The rows of slots ``src`` into slots ``dst``, all in one gather per buffer (every
        source read before any slot is written), whatever the number of rows."""
        device = self.lengths.device
        s = torch.tensor(src).to(device, non_blocking=True)
        d = torch.tensor(dst).to(device, non_blocking=True)
        for pair in self.layers:
            for t in pair:
                t[d] = t[s]
        self.lengths[d] = self.lengths[s]
        self.positions[d] = self.positions[s]
        self.held[dst] = self.held[src]
