"""A decoding step as one engine call on the CPU (``_engine.QwenDecoder``,
engine/qwen_step.hpp): the embeddings, every layer and the residual stream of a few new tokens
a row, on the projections' engine panels and on the state pool's buffers in place.

Written as tensor ops (:meth:`model.QwenModel.forward`), a step is about two hundred dispatched
ops; at a decoding step's size each costs the host a few microseconds against kernels of a few
to tens of microseconds, so on the CPU the host spent about as long between the kernels as in
them. The engine runs the same kernels (projections, RMSNorm, the DeltaNet step, few-token
attention) back to back. The decoder is bound once to the model's weights and to the pool's
buffers, whose addresses do not change while the pool lives (``StatePool``), and is made again
when the pool or any projection's panels change (:func:`dense.panels_version`).

Which steps take it (:func:`engine_step`): CPU, eager, float32 (or bfloat16 where the CPU has
AVX512-BF16), every projection on the engine's panels, a step of at most
``ENGINE_STEP_MAX_TOKENS`` new tokens a row and ``ENGINE_STEP_MAX_ROWS`` in all, continuing rows
with no images. Everything else stays on the tensor ops, which CUDA and traced graphs run.

Rows that hold one prefix snapshot's keys and values (``StatePool.shared_prefix``) read those
columns once per snapshot in the few-token attention (``causal_attention.cpp``,
``attend_few_shared``: each block of them while it is in cache, for every row that shares it),
with the bits each row reading its own copy gives. Greedy decoding of text rows
(:meth:`EngineStep.pick`) also takes the final norm, the head and the argmax into the same call
(and the logits of any tracked ids: LAVE's rating tokens),
where the head runs on the engine's panels (as ``model.logits`` runs it on the CPU then: the
engine's RMSNorm and projection, whose bits do not depend on the row count): the host gets each
row's next token without a logits tensor, an argmax or a copy of its own. Such steps run back to
back in one call (:meth:`EngineStep.run_picks`), each feeding the picks of the one before, until
a row ends: between two steps the host would only hand the picks back. That work was small (some
40 us of Python a step) but ran with the step's weights just through the caches, at several times
that: 0.3-0.45 ms a step at 16 rows, against a 1.5-1.9 ms engine step.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ... import _engine
from ..cpu_engine import engine_array, engine_takes
from ..dense import panels_version
from .gated_delta import L2_EPS
from .layers import AttentionLayer, DeltaNetLayer
from .pool import SharedPrefix, StatePool

# A step takes the engine up to ENGINE_STEP_MAX_TOKENS new tokens a row (decoding: one; jump-
# forward's forced runs) and ENGINE_STEP_MAX_ROWS tokens in all; past either the tensor ops are
# as fast (the prompts' GEMM, the chunked delta rule). Whole steps of the mini Qwen3.5 after 448
# cached tokens (in-process alternation, two threads), tensor ops -> engine, rows x tokens:
# float32 1x1 1.89 -> 0.45 ms, 16x1 3.65 -> 2.04, 64x1 10.5 -> 8.6, 16x4 9.5 -> 7.1, 16x16 -4.4 %,
# 64x8 +0.6 %, 16x32 +2.2 %; bfloat16 1x1 1.73 -> 0.31, 16x1 3.10 -> 1.49, 64x1 9.7 -> 6.7, 64x4
# -13.5 %, 16x16 -7.7 %, 64x8 +2.0 %, 16x32 +5.6 %
ENGINE_STEP_MAX_TOKENS = 16
ENGINE_STEP_MAX_ROWS = 256
# Rows of an engine step that share at least this many prefix columns by snapshot, at least this
# many a snapshot, read those columns once per snapshot (StatePool.shared_prefix; the same bits
# as each row reading its own): one block of the few-token kernel's keys. Above 16 rows such steps
# ran on the tensor ops' shared attention before. Mini Qwen3.5 (in-process alternation, whole
# calls, prefill included): 48 rows after 1,100 shared tokens, 24 new tokens, tensor ops -> engine
# float32 291 -> 227 ms, bfloat16 302 -> 189 ms; 64 rows after 448 (below the tensor ops'
# threshold: the engine reading every row's copy before), 16 new tokens, float32 211 -> 193 ms;
# a decoding step after 448 shared tokens, each row's copy -> shared, float32 16 rows 2.42 ->
# 1.86 ms, 64 rows 8.8 -> 7.3 ms; bfloat16 16 rows 1.73 -> 1.51 ms, 64 rows 5.7 -> 5.0 ms
ENGINE_SHARED_MIN_KEYS = 64
ENGINE_SHARED_MIN_ROWS = 2
# A run of picking steps in one call (EngineStep.run_picks) takes at most this many: the host
# still regains control every few tens of milliseconds (an interrupt is seen), at 1/64 of the cost
# it had between steps
ENGINE_RUN_MAX_STEPS = 64


class EngineStep:
    """``model``'s decoding step on ``pool``, as one engine call (module notes)."""

    def __init__(self, model, pool: StatePool):
        s = model.s
        self.model, self.dtype = model, model.embed.dtype
        gate_up = model.layers[0].gate_up
        shape = dict(d=s.hidden, inner=gate_up.out_features // 2, vocab=model.embed.shape[0], heads=s.heads,
                     kv_heads=s.kv_heads, head_dim=s.head_dim, rotary_half=s.rotary_dim // 2, output_gate=s.hybrid,
                     lin_k_heads=s.lin_k_heads, lin_k_dim=s.lin_k_dim, lin_v_heads=s.lin_v_heads,
                     lin_v_dim=s.lin_v_dim, conv_kernel=s.conv_kernel, eps=s.eps, l2_eps=L2_EPS,
                     slots=pool.slots, capacity=pool.capacity)
        layers = [_layer_arrays(layer, a, b) for layer, (a, b) in zip(model.layers, pool.layers)]
        self.decoder = _engine.QwenDecoder(shape, layers, engine_array(model.embed.detach()), pool.lengths.numpy(),
                                           pool.positions.numpy())
        self.table_positions = 0
        # greedy picks in the step's own call where the head runs on the engine's panels, as
        # model.logits runs it then (module notes)
        self.picks = model.head.panels is not None
        if self.picks:
            self.decoder.set_head(model.final_norm.numpy(), model.head.panels, model.head.out_features)

    def __call__(self, tokens: torch.Tensor, counts: np.ndarray, start: int, last_position: int,
                 shared: SharedPrefix | None = None) -> torch.Tensor:
        """Hidden states [B, k, d] of ``tokens`` [B, k] (``counts`` int64 on the host) on slots
        ``start ..``, whose positions are all below ``last_position``; rows that share prefix
        columns by snapshot (``shared``) read each block of them once for all (the same bits)."""
        if last_position > self.table_positions:
            self._grow_tables(last_position)
        B, k = tokens.shape
        out = torch.empty(B, k, self.model.s.hidden, dtype=self.dtype)
        self.decoder.step(tokens.numpy(), counts, start, engine_array(out), torch.get_num_threads(),
                          *_sharing(shared, B))
        return out

    def pick(self, tokens: torch.Tensor, counts: np.ndarray, start: int, last_position: int,
             hidden: torch.Tensor, shared: SharedPrefix | None = None) -> np.ndarray:
        """The step (as a call), then greedy decoding's pick in the same engine call: each row's
        last real token's hidden state into ``hidden`` [B, d] (contiguous, the model's dtype) and
        the index of its largest logit (int64 [B] on the host), the same bits and token as
        ``model.logits`` of that state and its ``argmax``. Needs :attr:`picks`."""
        picks, _ = self.run_picks(tokens, counts, start, last_position, hidden,
                                  np.ones(len(tokens), dtype=np.int64), (), 1, (), shared)
        return picks[:, 0]

    def run_picks(self, tokens: torch.Tensor, counts: np.ndarray, start: int, last_position: int,
                  hidden: torch.Tensor, room: np.ndarray, stops, steps: int, track: Sequence[int] = (),
                  shared: SharedPrefix | None = None) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`pick`'s step and pick, then up to ``steps - 1`` more in the same call, each
        feeding every row's pick of the step before, until a row picks one of ``stops`` or as
        many tokens as its ``room`` (int64 [B], each at least 1): the rows' picks (int64 [B, n],
        column s step s's; n the steps run) and the logits of the ``track`` ids at each step
        (float32 [B, n, K]: what ``model.logits`` gives them); ``hidden`` the last step's. The
        host does nothing between these steps (module notes)."""
        if last_position + steps - 1 > self.table_positions:
            self._grow_tables(last_position + steps - 1)
        B = tokens.shape[0]
        picks = np.empty((B, steps), dtype=np.int64)
        tracked = np.empty((B, steps, len(track)), dtype=np.float32)
        ran = self.decoder.run_picks(tokens.numpy(), counts, start, engine_array(hidden), picks, room,
                                     np.fromiter(stops, dtype=np.int64), np.asarray(track, dtype=np.int64), tracked,
                                     torch.get_num_threads(), *_sharing(shared, B))
        return picks[:, :ran], tracked[:, :ran]

    def _grow_tables(self, positions: int) -> None:
        """Rotary tables for positions ``0 .. P - 1`` (P a power of two, at least ``positions``),
        from :meth:`model.QwenModel._rope` itself: the values its tensor ops give each text
        position."""
        P = max(256, 1 << (positions - 1).bit_length())
        cos, sin, _ = self.model._rope(torch.arange(P)[None, :], self.dtype, mrope=False)
        self.tables = [engine_array(t.reshape(P, -1).contiguous()) for t in (cos, sin)]
        self.decoder.set_rotary(*self.tables)
        self.table_positions = P


def _sharing(shared: SharedPrefix | None, rows: int) -> tuple[int, np.ndarray | None]:
    # the decoder's shared_columns and shared_from for a step's rows
    return (0, None) if shared is None else (shared.columns, shared.sources(rows))


def _layer_arrays(layer, a: torch.Tensor, b: torch.Tensor) -> dict:
    # a layer's weights and pool buffers as the engine's decoder takes them
    gate, up = layer.gate_up.panels
    arrays = dict(attention=isinstance(layer, AttentionLayer), in_norm=layer.in_norm.numpy(),
                  post_norm=layer.post_norm.numpy(), gate=gate, up=up, down=layer.down.panels)
    if isinstance(layer, AttentionLayer):
        arrays.update(qkv=layer.qkv.panels, o=layer.o.panels, qk_norm=layer.qk_norm.numpy(), keys=engine_array(a),
                      values=engine_array(b))
    else:
        arrays.update(in_proj=layer.in_proj.panels, out=layer.out.panels, taps=engine_array(layer.taps.detach()),
                      dt_bias=layer.dt_bias_f32.numpy(), neg_A=layer.neg_A.numpy(),
                      gated_norm=layer.gated_norm_f32.numpy(), conv_state=engine_array(a), memory=b.numpy())
    return arrays


def _pool_key(pool: StatePool) -> tuple:
    # what a decoder bound to the pool's buffers depends on (moving the pool moves every buffer)
    return id(pool), pool.slots, pool.capacity, pool.lengths.data_ptr(), pool.positions.data_ptr()


def _engine_runs(model) -> bool:
    """Whether the engine can run ``model``'s decoding steps at all."""
    embed = model.embed
    if not engine_takes(embed) or embed.dtype not in (torch.float32, torch.bfloat16):
        return False
    if embed.dtype == torch.bfloat16 and not _engine.bf16_dense_available():
        return False
    for layer in model.layers:
        if layer.gate_up.gate != "silu" or _lacks_panels(layer.gate_up, layer.down):
            return False
        if isinstance(layer, AttentionLayer):
            if not layer.qk_adjacent or layer.kv is not None or model.s.head_dim % 16 \
                    or _lacks_panels(layer.qkv, layer.o):
                return False
        elif not isinstance(layer, DeltaNetLayer) or _lacks_panels(layer.in_proj, layer.out):
            return False
    return True


def _lacks_panels(*projections) -> bool:
    return any(p.panels is None for p in projections)


def engine_step(model, pool: StatePool, rows: int, tokens: int) -> EngineStep | None:
    """The engine's step for ``rows`` rows of ``tokens`` new tokens each on ``pool``, or None
    where the tensor ops run it (module notes). Made once for a model and pool and kept on the
    model (``model.engine_step_cache``: the key it was made for, and the step or None)."""
    if tokens > ENGINE_STEP_MAX_TOKENS or rows * tokens > ENGINE_STEP_MAX_ROWS or torch.compiler.is_compiling():
        return None
    key = (panels_version(), _pool_key(pool))
    cached = model.engine_step_cache
    if cached is None or cached[0] != key:
        cached = model.engine_step_cache = (key, EngineStep(model, pool) if _engine_runs(model) else None)
    return cached[1]
