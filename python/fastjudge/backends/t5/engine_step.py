"""A T5 decoder step as one engine call on the CPU (``_engine.T5Decoder``, engine/t5_step.hpp):
the embeddings, every decoder layer and the residual stream of a few new tokens a row, on the
projections' engine panels and on the state pool's buffers in place.

Written as tensor ops (:meth:`model.T5Model.forward`), a step of Flan-T5-small's decoder is
about three hundred dispatched ops (the self-attention's bias-and-causal mask built and read by
SDPA, ~120 kernels, ~180 views); at a decoding step's size each costs the host a few
microseconds. The engine runs the same kernels back to back: the panel projections, RMSNorm,
the self-attention on the few-token attention kernel with T5's position bias added by distance,
and the cross-attention in the form the pool is in (reassociated over the encoder states, or per
head over their projected K/V). The decoder is bound once to the model's weights and to the
pool's buffers, whose addresses do not change while the pool lives, and is made again when the
pool or any projection's panels change (:func:`dense.panels_version`).

Which steps take it (:func:`engine_step`): CPU, eager, float32 (or bfloat16 where the CPU has
AVX512-BF16), a gated feed-forward whose activation the engine applies, every projection on the
engine's panels, d_model and d_kv multiples of 16, at most ``ENGINE_STEP_MAX_TOKENS`` new tokens
a row (decoding: one). Everything else stays on the tensor ops, which CUDA and traced graphs run.

Greedy decoding (:meth:`EngineStep.run_picks`) also takes the final norm, the head and the
argmax, and the tracked ids' logits, into the same call, where the head runs on the engine's
panels (as ``model.logits`` runs it on the CPU then: the engine's RMSNorm and projection, whose
bits do not depend on the row count), and runs such steps back to back, each feeding the picks of
the one before, until a row ends: between two steps the host only handed the picks back. That
work cost ~1 ms a step (Flan-T5-small's shape, 1 or 16 rows, two threads: the head's norm, the
argmax and the copy as tensor ops, and the loop's Python), against a 4.5-9 ms engine step.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ... import _engine
from ..cpu_engine import engine_array, engine_takes
from ..dense import ENGINE_ACTIVATIONS, panels_version

# the few-token attention kernel's limit, which the position bias needs (engine/causal_attention.hpp)
ENGINE_STEP_MAX_TOKENS = 4
# A run of picking steps in one call (EngineStep.run_picks) takes at most this many: the host
# still regains control every few tenths of a second (an interrupt is seen)
ENGINE_RUN_MAX_STEPS = 64


class EngineStep:
    """``model``'s decoder step on ``pool`` (a ``pool.T5Pool``), as one engine call (module
    notes)."""

    def __init__(self, model, pool):
        s = model.s
        shape = dict(d=s.d_model, heads=s.num_heads, d_kv=s.d_kv, d_ff=model.decoder[0].wi.out_features // 2,
                     vocab=model.embed.shape[0], eps=s.eps,
                     activation=ENGINE_ACTIVATIONS[model.decoder[0].wi.gate])
        arrays = dict(slots=pool.slots, capacity=pool.capacity, enc_capacity=pool.enc_capacity,
                      cross_slots=pool.cross_slots, mem=engine_array(pool.mem), kv=pool.kv.numpy(),
                      xkv=pool.xkv.numpy(), enc_lengths=pool.enc_lengths.numpy(), dec_lengths=pool.dec_lengths.numpy())
        self.decoder = _engine.T5Decoder(shape, [_layer_arrays(layer) for layer in model.decoder],
                                         engine_array(model.embed.detach()),
                                         model.decoder_bias_by_distance(pool.capacity).numpy(), arrays)
        self.dtype, self.d = model.embed.dtype, s.d_model
        # greedy picks in the step's own call where the head runs on the engine's panels, as
        # model.logits runs it then (module notes)
        self.picks = model.head.panels is not None
        if self.picks:
            self.decoder.set_head(_norm(model.dec_final_norm), model.head.panels, model.head.out_features,
                                  s.head_scale)

    def __deepcopy__(self, memo):
        return None  # bound to this model's arrays: a copy of the model binds its own at its first step

    def __call__(self, tokens: torch.Tensor, counts: torch.Tensor, rows, projected: bool) -> torch.Tensor:
        """Hidden states [B, P, d] of ``tokens`` [B, P] (``counts`` [B]) on the pool's slots
        ``rows.start ..`` (``rows``: the pool, or a ``pool.T5View`` of it)."""
        B, P = tokens.shape
        out = torch.empty(B, P, self.d, dtype=self.dtype)
        self.decoder.step(tokens.contiguous().numpy(), counts.numpy(), getattr(rows, "start", 0), projected,
                          engine_array(out), torch.get_num_threads())
        return out


    def run_picks(self, tokens: torch.Tensor, start: int, projected: bool, room: np.ndarray, stops, steps: int,
                  track: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray]:
        """Steps of one token a row (``tokens`` [B, 1]) on the pool's slots ``start ..``,
        back to back in one engine call, each then picking every row's next token greedily and
        feeding it to the next, until ``steps`` have run or a row picks one of ``stops`` or as
        many tokens as its ``room`` (int64 [B], each at least 1). Returns the picks (int64 [B,
        n], column s step s's; n the steps run) and the logits of the ``track`` ids at each step
        (float32 [B, n, len(track)]): what ``model.logits`` of each step's hidden states gives."""
        B = tokens.shape[0]
        picks = np.empty((B, steps), dtype=np.int64)
        tracked = np.empty((B, steps, len(track)), dtype=np.float32)
        ran = self.decoder.run_picks(tokens.contiguous().numpy(), np.ones(B, dtype=np.int64), start, projected,
                                     picks, room,
                                     np.fromiter(stops, dtype=np.int64), np.asarray(track, dtype=np.int64), tracked,
                                     torch.get_num_threads())
        return picks[:, :ran], tracked[:, :ran]


def _norm(weight: torch.Tensor):
    return weight.detach().float().contiguous().numpy()


def _layer_arrays(layer) -> dict:
    # a decoder block's weights as the engine's decoder takes them
    gate, up = layer.wi.panels
    s = layer.s
    return dict(norm=_norm(layer.norm), x_norm=_norm(layer.x_norm), ff_norm=_norm(layer.ff_norm),
                qkv=layer.qkv.panels, o=layer.o.panels, x_q=layer.x_q.panels, x_o=layer.x_o.panels, gate=gate, up=up,
                down=layer.wo.panels, x_k=engine_array(layer.x_k.detach().view(s.num_heads, s.d_kv, s.d_model)),
                x_v=engine_array(layer.x_v.detach().view(s.num_heads, s.d_kv, s.d_model)))


def _pool_key(pool) -> tuple:
    # what a decoder bound to the pool's buffers depends on (a new pool has new buffers)
    return (id(pool), pool.slots, pool.capacity, pool.enc_capacity, pool.cross_slots,
            *(t.data_ptr() for t in (pool.mem, pool.kv, pool.xkv, pool.enc_lengths, pool.dec_lengths)))


def _engine_runs(model, pool) -> bool:
    """Whether the engine can run ``model``'s decoder steps on ``pool`` at all."""
    s, embed = model.s, model.embed
    if not engine_takes(embed) or embed.dtype not in (torch.float32, torch.bfloat16):
        return False
    if embed.dtype == torch.bfloat16 and not _engine.bf16_dense_available():
        return False
    if not s.gated or s.d_model % 16 or s.d_kv % 16 or pool.kv.dtype != torch.float32 or pool.mem.dtype != embed.dtype:
        return False
    for layer in model.decoder:
        if layer.wi.gate not in ENGINE_ACTIVATIONS or layer.x_kv.weight.dtype != embed.dtype:
            return False
        if any(p.panels is None for p in (layer.qkv, layer.o, layer.x_q, layer.x_o, layer.wi, layer.wo)):
            return False
    return True


def engine_step(model, pool, tokens: torch.Tensor) -> EngineStep | None:
    """The engine's step for decoder ``tokens`` [B, P] on ``pool`` (a ``pool.T5Pool`` or a view
    of one: its ``pool``), or None where the tensor ops run it (module notes). Made once for a
    model and pool and kept on the model (``model.engine_step_cache``: the key it was made for,
    and the step or None)."""
    if tokens.shape[1] > ENGINE_STEP_MAX_TOKENS or not engine_takes(tokens):
        return None
    base = getattr(pool, "pool", pool)
    key = (panels_version(), model.embed.data_ptr(), model.embed.dtype, _pool_key(base))
    cached = model.engine_step_cache
    if cached is None or cached[0] != key:
        cached = model.engine_step_cache = (key, EngineStep(model, base) if _engine_runs(model, base) else None)
    return cached[1]
