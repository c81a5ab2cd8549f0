"""The T5 backend's state pool: every decoder row's state in buffers allocated once per backend
and addressed by slot, at static addresses (registered buffers marked with
``torch._dynamo.mark_static_address``: a compiled step slices them inside the compiled code,
so CUDA-graph trees keep its graphs).

``mem`` ``[slots, enc_capacity, d_model]`` holds each row's encoder states, ``kv`` ``[slots,
layers, 2, heads, capacity + 1, d_kv]`` its decoder self-attention K/V (column ``capacity`` is
scratch: right padding writes there), ``enc_lengths`` / ``dec_lengths`` each row's prompt and
decoder lengths (device; ``enc_held`` / ``dec_held`` mirror them on the host, so the host plans
without reading the device). The reassociated cross-attention reads the encoder states; for the
projected one, the first ``cross_slots`` slots also have ``xkv`` ``[cross_slots, layers, 2,
heads, enc_capacity, d_kv]``, every layer's cross-attention K/V of the row's encoder states
(``model.T5Model.project_cross``; ``cross_slots`` is 0, and ``xkv`` empty, in a pool that never
needed it). Slots are never cleared: a masked position's weight is exactly 0.
The attention K/V (``kv``, ``xkv``) are kept, and attended, in :func:`attention_dtype`: float32
on the CPU whatever the model's dtype.
Memory: ``slots * (enc_capacity * d_model * b + layers * 2 * heads * (capacity + 1) * d_kv * a)``
bytes (:func:`row_bytes`), ``b`` the bytes per element of the model's dtype and ``a`` of the
attention dtype, plus ``cross_slots * layers * 2 * heads * enc_capacity * d_kv * a``
(:func:`cross_row_bytes`).
"""

from __future__ import annotations

import numpy as np
import torch

from ..slots import move_rows
from .shape import T5Shape


def row_bytes(shape: T5Shape, enc_capacity: int, capacity: int, element_size: int,
              attention_size: int | None = None) -> int:
    """Bytes one slot holds: its encoder states (``element_size`` bytes an element) and its
    self-attention K/V (``attention_size``, default the same)."""
    kv = shape.num_decoder_layers * 2 * shape.num_heads * (capacity + 1) * shape.d_kv
    return shape.d_model * enc_capacity * element_size + kv * (attention_size or element_size)


def cross_row_bytes(shape: T5Shape, enc_capacity: int, element_size: int) -> int:
    """Bytes one slot's projected cross-attention K/V hold (``element_size``: of
    :func:`attention_dtype`)."""
    return shape.num_decoder_layers * 2 * shape.num_heads * shape.d_kv * enc_capacity * element_size


def attention_dtype(device, dtype: torch.dtype) -> torch.dtype:
    """The dtype the decoder's attention K/V are kept and attended in: float32 on the CPU, the
    model's dtype elsewhere. SDPA's CPU kernel with one query per head is slower in bfloat16
    than in float32 (Flan-T5-small's shape, 16 rows, a layer): self-attention over 100 decoder
    positions 555 us against 147 us (casts included), and per-head cross-attention over 490
    encoder tokens 3.0 against 1.7 ms, where the reassociated form it replaces takes 2.3 ms (128
    tokens: 840 / 171 us against 654; 1,190: 7.3 / 2.7 ms against 4.3)."""
    return torch.float32 if torch.device(device).type == "cpu" else dtype


class T5View:
    """Slots ``start .. stop - 1`` of a pool, every tensor a view."""

    def __init__(self, pool: "T5Pool", start: int, stop: int):
        self.pool, self.start = pool, start
        self.capacity = pool.capacity
        self.mem, self.kv, self.xkv = pool.mem[start:stop], pool.kv[start:stop], pool.xkv[start:stop]
        self.projected = pool.projected
        self.enc_lengths, self.dec_lengths = pool.enc_lengths[start:stop], pool.dec_lengths[start:stop]


class T5Pool(torch.nn.Module):
    def __init__(self, shape: T5Shape, slots: int, enc_capacity: int, capacity: int, device, dtype,
                 cross_slots: int = 0):
        super().__init__()
        self.capacity, self.enc_capacity = int(capacity), int(enc_capacity)
        self.register_buffer("mem", torch.zeros(slots, enc_capacity, shape.d_model, dtype=dtype, device=device))
        kv_dtype = attention_dtype(device, dtype)
        self.register_buffer("kv", torch.zeros(slots, shape.num_decoder_layers, 2, shape.num_heads, capacity + 1,
                                               shape.d_kv, dtype=kv_dtype, device=device))
        self.register_buffer("xkv", torch.zeros(min(cross_slots, slots), shape.num_decoder_layers, 2, shape.num_heads,
                                                enc_capacity, shape.d_kv, dtype=kv_dtype, device=device))
        self.register_buffer("enc_lengths", torch.zeros(slots, dtype=torch.long, device=device))
        self.register_buffer("dec_lengths", torch.zeros(slots, dtype=torch.long, device=device))
        for t in self.buffers():
            torch._dynamo.mark_static_address(t)
        self.enc_held = np.zeros(slots, dtype=np.int64)
        self.dec_held = np.zeros(slots, dtype=np.int64)
        # whether the live rows' cross-attention reads their projected K/V (set by the decode
        # loop for its run; a compiled forward is specialised on it)
        self.projected = False

    @property
    def slots(self) -> int:
        return len(self.enc_held)

    @property
    def cross_slots(self) -> int:
        return self.xkv.shape[0]

    def view(self, start: int, stop: int) -> T5View:
        return T5View(self, start, stop)

    def load(self, first: int, states: list[torch.Tensor]) -> None:
        """Rows' encoder states (``[n, d]`` each) into slots ``first ..``, at decoder length 0."""
        for i, st in enumerate(states):
            self.mem[first + i, : st.shape[0]] = st
            self.enc_held[first + i] = st.shape[0]
        rows = slice(first, first + len(states))
        self.enc_lengths[rows] = torch.tensor(self.enc_held[rows]).to(self.mem.device, non_blocking=True)
        self.dec_lengths[rows] = 0
        self.dec_held[rows] = 0


    def move(self, src: list[int], dst: list[int]) -> None:
        """The rows of slots ``src`` into slots ``dst`` (``slots.move_rows``: one gather a buffer;
        the projected K/V only while the rows decode with them)."""
        buffers = [self.mem, self.kv, self.enc_lengths, self.dec_lengths] + ([self.xkv] if self.projected else [])
        move_rows(buffers, [self.enc_held, self.dec_held], src, dst)
