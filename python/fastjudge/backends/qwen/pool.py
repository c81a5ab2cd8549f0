"""The Qwen backend's state pool: every row's model state in buffers allocated once per backend
and addressed by slot, and the snapshots the prefix cache keeps.

One pool serves everything the model runs: a prefix is prefilled into a slot (and its snapshot
kept), a score-only suffix or a decoding row continues from a snapshot copied into its slot.
Its tensors are registered buffers marked as static addresses (``torch._dynamo
.mark_static_address``), and a compiled step slices them inside the compiled code: CUDA-graph
trees keep a graph only when every input it mutates lives at a static address, and the pool is
the only thing a step mutates.

Layout, with ``slots`` rows of ``capacity`` tokens: per full-attention layer K and V
``[slots, kv_heads, capacity + 1, head_dim]``; per Gated DeltaNet layer the conv state
``[slots, kernel - 1, conv_dim]`` (channels last) and the recurrent state
``[slots, v_heads, k_dim, v_dim]`` (float32, as the delta rule keeps it); per slot its token
count and next rotary position (device) with a host mirror of the counts (``held``), so the host
never reads a device value to plan a step. Column ``capacity`` of K/V is scratch: right padding
writes there, past every real token. Live rows sit in slots ``0 .. live - 1``, so a step runs on leading slices (views).

Memory (:func:`pool_bytes`): ``slots * (A * 2 * kv_heads * (capacity + 1) * head_dim * b
+ D * (conv_dim * (kernel - 1) * b + v_heads * k_dim * v_dim * 4))`` bytes, with ``A`` / ``D``
the full-attention / DeltaNet layer counts, ``b`` the bytes per element of the model's dtype and
``conv_dim = 2 * k_heads * k_dim + v_heads * v_dim``. The backend sizes ``slots`` from one
budget (``EngineOptions.decode_cache_bytes``) at the capacity its rows need.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from ..slots import move_rows
from .shape import QwenShape


class PrefixState:
    """A snapshot of one slot: per layer (K, V) ``[1, kv_heads, length, head_dim]`` or (conv,
    recurrent) state, the token count and the next rotary position (which runs ahead of the
    length after an image: M-RoPE text continues from the largest position so far + 1).
    ``serial`` names the snapshot for as long as the process runs (never reused, unlike ``id``)."""

    _serials = itertools.count()

    def __init__(self, layers: list[tuple[torch.Tensor, torch.Tensor]], length: int, next_position: int | None = None):
        self.layers = layers
        self.length = length
        self.next_position = length if next_position is None else next_position
        self.serial = next(PrefixState._serials)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.layers for t in pair)


def _conv_dim(shape: QwenShape) -> int:
    return 2 * shape.lin_k_heads * shape.lin_k_dim + shape.lin_v_heads * shape.lin_v_dim


def pool_bytes(shape: QwenShape, slots: int, capacity: int, element_size: int) -> int:
    """The bytes of a :class:`StatePool` of ``slots`` rows of ``capacity`` tokens (module notes)."""
    per_slot = 0
    for kind in shape.layer_types:
        if kind == "full_attention":
            per_slot += 2 * shape.kv_heads * (capacity + 1) * shape.head_dim * element_size
        else:
            per_slot += _conv_dim(shape) * (shape.conv_kernel - 1) * element_size
            per_slot += shape.lin_v_heads * shape.lin_k_dim * shape.lin_v_dim * 4
    return slots * per_slot


class StateView:
    """Slots ``start .. stop - 1`` of a pool: every tensor a view, so a forward on the view
    writes the pool."""

    def __init__(self, pool: "StatePool", start: int, stop: int):
        self.capacity, self.start = pool.capacity, start
        self.layers = [(a[start:stop], b[start:stop]) for a, b in pool.layers]
        self.lengths, self.positions = pool.lengths[start:stop], pool.positions[start:stop]
        self.held = pool.held[start:stop]


class StatePool(torch.nn.Module):
    """Per-slot model state (module notes); ``layers[i]`` is ``(K, V)`` of a full-attention layer
    or ``(conv, recurrent)`` of a DeltaNet layer."""

    def __init__(self, shape: QwenShape, slots: int, capacity: int, device, dtype):
        super().__init__()
        self.capacity, self.kinds = int(capacity), shape.layer_types
        for i, kind in enumerate(shape.layer_types):
            if kind == "full_attention":
                size = (slots, shape.kv_heads, self.capacity + 1, shape.head_dim)
                pair = (torch.zeros(size, dtype=dtype, device=device), torch.zeros(size, dtype=dtype, device=device))
            else:
                pair = (torch.zeros(slots, shape.conv_kernel - 1, _conv_dim(shape), dtype=dtype, device=device),
                        torch.zeros(slots, shape.lin_v_heads, shape.lin_k_dim, shape.lin_v_dim,
                                    dtype=torch.float32, device=device))
            self.register_buffer(f"layer{i}_a", pair[0])
            self.register_buffer(f"layer{i}_b", pair[1])
        self.register_buffer("lengths", torch.zeros(slots, dtype=torch.long, device=device))
        self.register_buffer("positions", torch.zeros(slots, dtype=torch.long, device=device))
        for t in self.buffers():
            torch._dynamo.mark_static_address(t)
        self.held = np.zeros(slots, dtype=np.int64)
        # host only: the snapshot each slot was loaded from (its serial, -1 for none) and that
        # snapshot's length. Slots of one snapshot hold the same K/V in its first columns, which
        # a decoding step may then read once for all of them (``shared_prefix``)
        self.source = np.full(slots, -1, dtype=np.int64)
        self.source_len = np.zeros(slots, dtype=np.int64)
        self._shared = None  # shared_prefix's last (rows, answer)

    @property
    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(getattr(self, f"layer{i}_a"), getattr(self, f"layer{i}_b")) for i in range(len(self.kinds))]

    @property
    def slots(self) -> int:
        return len(self.held)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.layers for t in pair)

    def view(self, start: int, stop: int) -> StateView:
        return StateView(self, start, stop)

    def load(self, slot: int, state: PrefixState | None) -> None:
        """A snapshot into ``slot``; None empties the slot (a row with no prefix)."""
        self.load_rows(slot, [state])

    def load_rows(self, start: int, states: list[PrefixState | None]) -> None:
        """``states[b]`` into slot ``start + b`` for every b (None empties a slot), with one write
        a buffer for all rows that share a snapshot (a batch of suffixes after
        one prefix: 64 rows x 6 layers, 15 small ops a row -> 15 ops), the rows of a snapshot
        addressed by a slice where they are consecutive."""
        groups: dict[int, tuple[PrefixState | None, list[int]]] = {}
        for b, state in enumerate(states):
            groups.setdefault(id(state), (state, []))[1].append(start + b)
        for state, slots in groups.values():
            if state is not None and state.length > self.capacity:
                raise ValueError(f"a state of {state.length} tokens does not fit {self.capacity} positions")
            if slots == list(range(slots[0], slots[-1] + 1)):
                rows = slice(slots[0], slots[-1] + 1)
            else:
                rows = torch.tensor(slots, device=self.lengths.device)
            n = 0 if state is None else state.length
            for kind, (a, b), pair in zip(self.kinds, self.layers, [None] * len(self.kinds) if state is None
                                          else state.layers):
                if state is None:
                    a[rows] = 0
                    b[rows] = 0
                elif kind == "full_attention":
                    a[rows, :, :n] = pair[0][0]
                    b[rows, :, :n] = pair[1][0]
                else:
                    a[rows] = pair[0][0]
                    b[rows] = pair[1][0]
            self.lengths[rows] = n
            self.positions[rows] = 0 if state is None else state.next_position
            self.held[slots] = n
            self.source[slots] = -1 if state is None else state.serial
            self.source_len[slots] = n

    def snapshot(self, slot: int, next_position: int) -> PrefixState:
        """A copy of ``slot``'s state (its written part), to keep beyond the slot's next use."""
        n = int(self.held[slot])
        layers = [(a[slot:slot + 1, :, :n].clone(), b[slot:slot + 1, :, :n].clone()) if kind == "full_attention"
                  else (a[slot:slot + 1].clone(), b[slot:slot + 1].clone())
                  for kind, (a, b) in zip(self.kinds, self.layers)]
        return PrefixState(layers, n, next_position)

    def move(self, src: list[int], dst: list[int], *riders: torch.Tensor) -> None:
        """The rows of slots ``src`` into slots ``dst`` (``slots.move_rows``: one gather a buffer),
        with the same rows of ``riders`` (per-slot tensors kept beside the pool)."""
        move_rows([*self.buffers(), *riders], [self.held, self.source, self.source_len], src, dst)

    def shared_prefix(self, start: int, stop: int, min_keys: int, min_rows: int) -> SharedPrefix | None:
        """How slots ``start .. stop - 1`` share prefix K/V, where a step can read it once per
        snapshot: every slot loaded from a snapshot, at least ``min_rows`` slots per snapshot and
        ``min_keys`` columns that every slot holds from its snapshot. None otherwise."""
        source = self.source[start:stop]
        if len(source) < min_rows or (source < 0).any():
            return None
        # the rows only change when some leave or join: the last answer (and its device index
        # tensors) serves every step in between
        key = (start, min_keys, min_rows, source.tobytes(), self.source_len[start:stop].tobytes())
        if self._shared is not None and self._shared[0] == key:
            return self._shared[1]
        columns = int(self.source_len[start:stop].min())
        serials, first = np.unique(source, return_index=True)
        shared = None
        if columns >= min_keys and len(serials) * min_rows <= len(source):
            device = self.lengths.device
            shared = SharedPrefix(columns, [(int(f), None if len(serials) == 1 else
                                             torch.tensor(np.flatnonzero(source == s)).to(device))
                                            for s, f in zip(serials, first)])
        self._shared = (key, shared)
        return shared


class SharedPrefix:
    """The first ``columns`` K/V columns of a step's rows, by snapshot: ``groups`` lists, per
    snapshot, one row holding its columns and the rows that share them (None: every row).

    The same object serves every step while the rows stay (``StatePool.shared_prefix``), and
    those columns do not change meanwhile (decoding writes past them), so their float32 copies
    are made once per layer (:meth:`float_columns`), not once per step."""

    def __init__(self, columns: int, groups: list[tuple[int, torch.Tensor | None]]):
        self.columns, self.groups = columns, groups
        self._float: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._sources: np.ndarray | None = None

    def sources(self, rows: int) -> np.ndarray:
        """For each of the step's ``rows`` rows, the row holding its shared columns (int64 on
        the host, as the engine's step takes it), made once."""
        if self._sources is None or len(self._sources) != rows:
            sources = np.empty(rows, dtype=np.int64)
            for first, members in self.groups:
                sources[slice(None) if members is None else members.cpu().numpy()] = first
            self._sources = sources
        return self._sources

    def float_columns(self, keys: torch.Tensor, values: torch.Tensor, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row ``row``'s shared K/V columns of one layer's buffers ([B, kv_heads, W, hd]) as
        [1, kv_heads, columns, hd] float32, converted on the first step that asks."""
        key = (keys.data_ptr(), row)
        pair = self._float.get(key)
        if pair is None:
            pair = self._float[key] = tuple(t[row:row + 1, :, :self.columns].float() for t in (keys, values))
        return pair
