"""How tensors cross into the engine's CPU kernels (``fastjudge._engine``): which tensors they
take, and as what. The kernels work on host memory outside torch, through numpy views of the
tensors' own memory (no copies), and release the GIL while they run."""

from __future__ import annotations

import numpy as np
import torch

from .. import _engine

ENGINE_DTYPES = (torch.float32, torch.bfloat16)  # what the attention and DeltaNet step kernels take


def engine_takes(x: torch.Tensor) -> bool:
    """Whether the engine's CPU kernels can take ``x``: CPU tensors in eager code only (a
    compiled or traced graph, e.g. an ONNX export, keeps the tensor ops: it cannot record a
    kernel that writes through numpy)."""
    return x.device.type == "cpu" and not torch.compiler.is_compiling() and not torch.jit.is_tracing()


def engine_array(t: torch.Tensor) -> np.ndarray:
    """``t`` as the engine reads it: a numpy view of the same memory (bfloat16, which numpy
    lacks, as its 16-bit patterns)."""
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def rms_norm_in_engine(x: torch.Tensor, weight_f32: torch.Tensor, eps: float,
                       round_first: bool = False) -> torch.Tensor | None:
    """RMSNorm of ``x`` [..., D] on the engine (``_engine.rms_norm``: one pass a row, its sums in
    float32), in ``x``'s dtype; ``weight_f32`` one float32 scale per channel ``[D]`` or per head
    ``[heads, D]`` (over the last ``heads * D`` values); ``round_first``: the normalised ``x``
    rounded to its dtype before the weight multiplies it (T5's norm). ``x`` is read in place, even
    a slice of a fused projection's output. None where the engine does not take it: not a CPU
    tensor in eager code, not float32 or bfloat16, or strides that do not merge into rows."""
    if not engine_takes(x) or x.dtype not in ENGINE_DTYPES:
        return None
    weight = _weight_rows(weight_f32)
    heads, D = weight.shape
    try:
        rows = x.view(-1, heads, D)  # the leading dims merged (a view: no copy)
    except RuntimeError:
        return None
    if rows.stride(-1) != 1:
        return None
    out = x.new_empty(rows.shape)
    _engine.rms_norm(engine_array(rows), weight, engine_array(out), eps, torch.get_num_threads(), round_first)
    return out.view(x.shape)


def _weight_rows(weight_f32: torch.Tensor) -> np.ndarray:
    """A norm's weight as the engine takes it, ``[heads, D]`` (one head for a ``[D]`` weight): a
    view of its memory, made once per weight tensor and kept on it (a decoding step normalises a
    dozen times)."""
    rows = getattr(weight_f32, "_engine_rows", None)
    if rows is None:
        rows = weight_f32.detach().reshape(-1, weight_f32.shape[-1]).contiguous().numpy()
        weight_f32._engine_rows = rows
    return rows


def rotate_halves_in_engine(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """Rotary embedding of ``x`` [B, n, ..., D] on the engine (``_engine.rotate_halves``: one
    pass, where torch's ops take five): element ``i`` of each row's first half paired with ``i +
    D / 2``, position ``t`` taking float32 ``cos``/``sin`` rows ``[n, D]`` (any shape of ``n x D``
    values), the products and sums in float32 each rounded apart (transformers' ``x cos +
    rotate_half(x) sin``, the same bits), back to ``x``'s dtype. ``x`` is read in place, even a
    slice of a fused projection's output. None where the engine does not take it."""
    if not engine_takes(x) or x.dtype not in ENGINE_DTYPES or x.dim() < 3 or x.shape[-1] % 2:
        return None
    B, n, D = x.shape[0], x.shape[1], x.shape[-1]
    try:
        rows = x.view(B * n, -1, D)  # the batch and positions merged, the rest as heads (views)
        tables = [t.view(n, D) for t in (cos, sin)]
    except RuntimeError:
        return None
    if rows.stride(-1) != 1 or any(t.dtype != torch.float32 or not t.is_contiguous() for t in tables):
        return None
    out = x.new_empty(rows.shape)
    _engine.rotate_halves(engine_array(rows), tables[0].numpy(), tables[1].numpy(), engine_array(out),
                          torch.get_num_threads())
    return out.view(x.shape)


def attention_inputs_in_engine(qkv: torch.Tensor, qk_norm: torch.Tensor, rope: tuple, keys: torch.Tensor,
                               values: torch.Tensor, where: torch.Tensor, heads: int, kv_heads: int,
                               values_at: int, eps: float) -> torch.Tensor | None:
    """A Qwen attention layer's inputs in one engine pass (``_engine.attention_inputs``), from the
    fused projection's output ``qkv`` [B, S, width] (queries then keys from column 0, values from
    ``values_at``): the queries and keys normalised per head (``qk_norm`` [heads + kv_heads, hd]
    float32) and rotated (``rope``: cos, sin [B, S, 1, hd] in qkv's dtype and half the rotary
    dims, as ``layers.rotate`` takes them), returned as [B, S, heads + kv_heads, hd]; each
    token's key and value written into the pool's ``keys``/``values`` [B, kv_heads, columns,
    hd] at column ``where`` [B, S], as the layer's scattered writes put them (padding's, in the
    pool's last column, never read, are left out). The same roundings as the layer's tensor ops
    (``layers.rms``, ``layers.rotate``). None where the engine does not take these tensors (the
    caller then runs those ops)."""
    cos, sin, half = rope
    B, S = qkv.shape[:2]
    hd = keys.shape[-1]
    if (not engine_takes(qkv) or qkv.dtype not in ENGINE_DTYPES or hd % 16 or cos.dtype != qkv.dtype
            or not all(t.is_contiguous() for t in (qkv, keys, values, cos, sin))
            or cos.shape != (B, S, 1, hd) or sin.shape != cos.shape):
        return None
    rotated = qkv.new_empty(B, S, heads + kv_heads, hd)
    tables = (engine_array(t.view(B, S, hd)) for t in (cos, sin))
    _engine.attention_inputs(engine_array(qkv), _weight_rows(qk_norm), *tables, engine_array(rotated),
                             engine_array(keys), engine_array(values), where.reshape(-1).numpy(), heads, kv_heads,
                             values_at, half, eps, torch.get_num_threads())
    return rotated


def output_gate_in_engine(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor | None:
    """``o * sigmoid(gate)`` (the sigmoid rounded to o's dtype first, as the tensor ops round
    it) in place on ``o`` [..., n] (contiguous) in one engine pass (``_engine.output_gate``),
    ``gate`` of o's size read in place as rows of n contiguous values (a slice of the fused
    projection's rows, in any shape that views so); returns ``o``. None where the engine does
    not take them."""
    n = o.shape[-1]
    if not engine_takes(o) or o.dtype not in ENGINE_DTYPES or gate.dtype != o.dtype or n % 16 or not o.is_contiguous():
        return None
    try:
        rows = gate.view(-1, 1, n)
    except RuntimeError:
        return None
    if rows.stride(-1) != 1:
        return None
    _engine.output_gate(engine_array(o.view(-1, n)), engine_array(rows), torch.get_num_threads())
    return o


def engine_attends(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether the engine's attention takes these queries and keys (CPU, eager, float32 or
    bfloat16 alike)."""
    return engine_takes(q) and q.dtype in ENGINE_DTYPES and keys.dtype == q.dtype


def attend_in_engine(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     offsets: torch.Tensor | None = None, counts: torch.Tensor | None = None,
                     scale: float | None = None, shared=None) -> torch.Tensor:
    """``_engine.causal_attention`` of ``q`` [B, S, H, hd] over ``keys``/``values`` [B, kv_heads,
    W, hd] (query token ``t`` of row ``b`` sees keys up to ``offsets[b] + t``; without
    ``offsets``, W = S and up to ``t``; tokens past ``counts[b]`` are padding: zeros), scores
    scaled by ``scale`` (None: ``hd ** -0.5``), every array read in place; returns [B, H, S,
    hd], a transposed view of a contiguous [B, S, H, hd]. ``shared`` (a
    ``qwen.pool.SharedPrefix``, with ``offsets``): the rows' first ``shared.columns`` keys are
    one snapshot's, read (or packed) once for the rows that share them, with the same bits."""
    B, S, H, hd = q.shape
    out = q.new_empty(B, S, H, hd)
    rows = [engine_array(t) for t in (q, keys.transpose(1, 2), values.transpose(1, 2))]  # [B, tokens, heads, hd]
    sharing = {} if shared is None else dict(shared_columns=shared.columns, shared_from=shared.sources(B))
    _engine.causal_attention(*rows, engine_array(out), hd ** -0.5 if scale is None else scale,
                             offsets=None if offsets is None else offsets.numpy(),
                             counts=None if counts is None else counts.numpy(), threads=torch.get_num_threads(),
                             **sharing)
    return out.transpose(1, 2)


def attend_all_in_engine(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, scale: float,
                         bias: torch.Tensor | None = None) -> None:
    """Attention of each row's ``n`` queries over all of its ``n`` keys (encoders: T5's, the
    vision tower's frames): ``q``, ``k``, ``v`` [B, n, heads, hd] read in place, ``out`` [B, n,
    heads, hd] (contiguous) written, scores scaled by ``scale``; ``bias`` (float32 [heads,
    2n - 1], None: none) added by distance, query ``t``'s bias on key ``j`` at column
    ``n - 1 + t - j``. One ``_engine.causal_attention`` call whose rows hold their queries after
    their keys (offsets ``n - 1``), so each query sees every key."""
    B, n = q.shape[:2]
    _engine.causal_attention(engine_array(q), engine_array(k), engine_array(v), engine_array(out), scale,
                             offsets=np.full(B, n - 1, dtype=np.int64), bias=None if bias is None else bias.numpy(),
                             threads=torch.get_num_threads())


def attend_reassociated(xq: torch.Tensor, w_k: torch.Tensor, w_v: torch.Tensor, states: torch.Tensor,
                        lengths: torch.Tensor, reverse: bool = False) -> torch.Tensor:
    """T5's reassociated cross-attention as one engine call (``_engine.reassociated_attention``):
    each head's query ``xq`` [B, P, H, dk] mapped into model space through ``w_k`` [H, dk, d],
    attention with scale 1 over ``states`` [B, L, d], which are both the keys and the values (row
    ``b`` sees its first ``lengths[b]``, each row's read once), and each context mapped back
    through ``w_v`` [H, dk, d]. ``reverse``: the rows in reverse order (the same results; layers
    that alternate it start on the states the last one read most recently). Returns [B, P, H,
    dk]."""
    out = torch.empty_like(xq)
    _engine.reassociated_attention(engine_array(xq), engine_array(w_k), engine_array(w_v),
                                   engine_array(states.unsqueeze(2)), lengths.numpy(), engine_array(out), 1.0,
                                   reverse=reverse, threads=torch.get_num_threads())
    return out
