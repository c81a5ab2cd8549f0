"""T5 v1.1 / Flan-T5 in plain PyTorch: the model math only (weights in the engine's fused layout,
the packed encoder, the score-only decoder step; the shape is ``t5_shape``, greedy decoding
``t5_decode``).

Same math as transformers' T5ForConditionalGeneration, with the engine owning the parts that
decide speed:

* **Packed encoder.** Requests of a batch are concatenated into one ``[tokens, d_model]``
  matrix, so every GEMM runs on real tokens only; attention runs per sequence through
  ``scaled_dot_product_attention`` with the relative-position bias as its mask (no padding
  masks, no ``[batch, heads, L, L]`` score tensor in eager code).
* **Fused projections.** q/k/v and the two gated-FF input projections are concatenated at
  load time: fewer, larger GEMMs.
* **Cross-attention without K/V.** ``q . (W_k m)`` is computed as ``(W_k^T q) . m`` and
  ``sum p W_v m`` as ``W_v (sum p m)``: exact reassociation that never projects an encoder
  token to K or V. Mapped to model space, every head's query attends over the same keys and
  values (the encoder states themselves), so all heads and positions of a row are the queries
  of one ``scaled_dot_product_attention`` head: one pass over a row's encoder states per layer,
  fewer bytes than its K/V (``d_model`` against ``2 * heads * d_kv`` per token). For the few
  queries of a decoder step this is cheaper than K/V, which would cost ``2 * heads * d_kv *
  d_model`` per encoder token and layer up front (``d_kv`` steps' worth of the reassociated
  scores). Only the K candidate rows of the LM head are computed for a score-only step.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from fastjudge.kernels.choice_head import choice_logits

from .fp8 import Fp8Weight, fuse, linear, projection_weight
from .loading import CheckpointError, check_shapes
from .t5_shape import T5Shape


def relative_position_bucket(relative_position: torch.Tensor, bidirectional: bool,
                             num_buckets: int, max_distance: int) -> torch.Tensor:
    """T5's bucketing of key-minus-query distances (exact for small distances, log-spaced
    beyond, clipped at max_distance)."""
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    large = max_exact + (
        torch.log(distance.float() / max_exact) / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).long()
    large = large.clamp(max=num_buckets - 1)
    return buckets + torch.where(is_small, distance, large)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # T5's norm (no mean, no bias). The fused op accumulates in float32 like transformers'
    # T5LayerNorm and is bit-identical to it in float32, at half its cost in bfloat16.
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def activation(name: str):
    if name == "gelu_new":
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "relu":
        return F.relu
    if name in ("gelu", "gelu_python"):
        return F.gelu
    if name in ("silu", "swish"):
        return F.silu
    raise CheckpointError(f"unsupported T5 activation {name!r}")


def pad_rows(packed: torch.Tensor, lengths: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Packed rows [T, d] as a right-padded batch [B, L, d] (padding zero) and the key bias
    [B, 1, 1, L] in their dtype that masks the padding (None when no row is padded)."""
    longest = max(lengths)
    if all(n == longest for n in lengths):
        return packed.view(len(lengths), longest, packed.shape[-1]), None
    out = packed.new_zeros(len(lengths), longest, packed.shape[-1])
    start = 0
    for i, n in enumerate(lengths):
        out[i, :n] = packed[start:start + n]
        start += n
    return out, key_bias(lengths, longest, packed.dtype, packed.device)


def key_bias(lengths: Sequence[int], width: int, dtype, device) -> torch.Tensor:
    """[B, 1, 1, width]: 0 over each row's first ``lengths[b]`` keys, -inf after them."""
    keys = torch.arange(width, device=device)
    n = torch.tensor(list(lengths), device=device)[:, None]
    return torch.zeros(len(lengths), width, dtype=dtype, device=device) \
        .masked_fill(keys >= n, float("-inf")).view(len(lengths), 1, 1, width)


def _registered(w):
    """A weight as a module attribute that registers: FP8 weights are modules (their data and
    scales buffers), every other tensor a frozen parameter."""
    return w if isinstance(w, torch.nn.Module) else torch.nn.Parameter(w, requires_grad=False)


class T5Block(torch.nn.Module):
    """One encoder or decoder block's weights, by role: ``norm``/``qkv``/``o`` (self-attention),
    ``x_norm``/``x_q``/``x_k``/``x_v``/``x_o`` (decoder cross-attention), ``ff_norm``/``wi``/``wo``
    (feed-forward; ``wi`` holds both gated inputs)."""

    def __init__(self, weights: dict):
        super().__init__()
        for name, w in weights.items():
            setattr(self, name, _registered(w))


class T5Weights(torch.nn.Module):
    """The checkpoint's tensors, reshaped for the engine's fused layout, as registered parameters
    (``state_dict``, ``.to(device)``, forward callbacks and compilers see them). A state with FP8
    weights (``load_state_dict(keep_fp8=True)``) keeps the encoder's projections FP8
    (:class:`fp8.Fp8Weight` modules, run as FP8 GEMMs: the encoder is where the FLOPs are); the
    decoder step reads its cross-attention weights directly (reassociated), so decoder weights
    are dequantized."""

    def __init__(self, state: dict[str, torch.Tensor], shape: T5Shape, device, dtype):
        super().__init__()
        check_shapes(state, shape.tensor_shapes())

        def dense(name: str):
            if name not in state:
                raise CheckpointError(f"checkpoint lacks tensor {name!r}")
            return projection_weight(state, name, device, dtype)

        def take(name: str) -> torch.Tensor:
            w = dense(name)
            return w.dequantize(dtype) if isinstance(w, Fp8Weight) else w

        self.shape = shape
        self.embed = _registered(take("shared.weight"))
        # a tied head is the embedding parameter itself, registered under both names
        self.lm_head = _registered(take("lm_head.weight")) if "lm_head.weight" in state else self.embed
        self.enc_bias_table = _registered(
            take("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"))
        self.dec_bias_table = _registered(
            take("decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"))
        self.enc_final_norm = _registered(take("encoder.final_layer_norm.weight"))
        self.dec_final_norm = _registered(take("decoder.final_layer_norm.weight"))

        def ff(prefix: str, get) -> dict:
            if shape.gated:
                wi = fuse([get(f"{prefix}.DenseReluDense.wi_{n}.weight") for n in (0, 1)], dtype)
            else:
                wi = get(f"{prefix}.DenseReluDense.wi.weight")
            return {"ff_norm": take(f"{prefix}.layer_norm.weight"), "wi": wi,
                    "wo": get(f"{prefix}.DenseReluDense.wo.weight")}

        def self_attn(prefix: str, get) -> dict:
            qkv = fuse([get(f"{prefix}.SelfAttention.{n}.weight") for n in "qkv"], dtype)
            return {"norm": take(f"{prefix}.layer_norm.weight"), "qkv": qkv,
                    "o": get(f"{prefix}.SelfAttention.o.weight")}

        def cross_attn(prefix: str) -> dict:
            names = {n: take(f"{prefix}.EncDecAttention.{n}.weight") for n in "qkvo"}
            return {"x_norm": take(f"{prefix}.layer_norm.weight"),
                    **{f"x_{n}": w for n, w in names.items()}}

        self.encoder = torch.nn.ModuleList(
            T5Block({**self_attn(f"encoder.block.{i}.layer.0", dense), **ff(f"encoder.block.{i}.layer.1", dense)})
            for i in range(shape.num_layers))
        self.decoder = torch.nn.ModuleList(
            T5Block({**self_attn(f"decoder.block.{i}.layer.0", take),
                     **cross_attn(f"decoder.block.{i}.layer.1"),
                     **ff(f"decoder.block.{i}.layer.2", take)})
            for i in range(shape.num_decoder_layers))


class T5Model(torch.nn.Module):
    """Forward passes over :class:`T5Weights` (registered as ``w``); stateless apart from the
    cached position biases (non-persistent buffers: they follow the model's device)."""

    def __init__(self, weights: T5Weights):
        super().__init__()
        self.w = weights
        self.s = weights.shape
        self.act = activation(self.s.act)
        self.register_buffer("_enc_bias", torch.empty(0, device=weights.embed.device), persistent=False)
        self.register_buffer("_dec_bias", torch.empty(0, device=weights.embed.device), persistent=False)

    # -- position bias -------------------------------------------------------------------
    def _bias(self, table: torch.Tensor, length: int, bidirectional: bool) -> torch.Tensor:
        pos = torch.arange(length, device=table.device)
        buckets = relative_position_bucket(pos[None, :] - pos[:, None], bidirectional,
                                           self.s.num_buckets, self.s.max_distance)
        return F.embedding(buckets, table).permute(2, 0, 1).contiguous()  # [H, L, L]

    def encoder_bias(self, length: int) -> torch.Tensor:
        # The bias depends only on key - query, so the top-left block of a larger table is the
        # table of a shorter sequence: compute once for the longest length seen.
        if self._enc_bias.shape[-1] < length:
            self._enc_bias = self._bias(self.w.enc_bias_table, max(length, 512), True)
        return self._enc_bias[:, :length, :length]

    def decoder_bias(self, length: int) -> torch.Tensor:
        if self._dec_bias.shape[-1] < length:
            self._dec_bias = self._bias(self.w.dec_bias_table, max(length, 128), False)
        return self._dec_bias[:, :length, :length]

    # -- blocks ------------------------------------------------------------------------------
    def feed_forward(self, x: torch.Tensor, layer: T5Block) -> torch.Tensor:
        h = linear(rms_norm(x, layer.ff_norm, self.s.eps), layer.wi)
        if self.s.gated:
            gate, up = h.chunk(2, dim=-1)
            h = self.act(gate).mul_(up)  # in place: one pass and no extra [T, d_ff] buffer
        else:
            h = self.act(h)
        return x + linear(h, layer.wo)

    def encode(self, packed_ids: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
        """Encoder over packed sequences: ``packed_ids`` [T] -> hidden [T, d]."""
        s = self.s
        h, dk = s.num_heads, s.d_kv
        inner = h * dk
        x = F.embedding(packed_ids, self.w.embed)
        bias = self.encoder_bias(max(lengths))
        starts = np.concatenate([[0], np.cumsum(lengths)])
        for layer in self.w.encoder:
            qkv = linear(rms_norm(x, layer.norm, s.eps), layer.qkv)  # [T, 3*inner]
            out = torch.empty(x.shape[0], inner, dtype=x.dtype, device=x.device)
            for i, n in enumerate(lengths):
                a, b = int(starts[i]), int(starts[i + 1])
                q, k, v = qkv[a:b].view(n, 3, h, dk).permute(1, 2, 0, 3).unsqueeze(1)
                # T5 folds 1/sqrt(d_kv) into its weights: scale=1.
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias[:, :n, :n].unsqueeze(0),
                                                   scale=1.0)
                out[a:b].view(n, h, dk).copy_(o[0].transpose(0, 1))
            x = x + linear(out, layer.o)
            x = self.feed_forward(x, layer)
        return rms_norm(x, self.w.enc_final_norm, s.eps)

    def _logits_rows(self, hidden: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """LM-head logits of the final decoder states: only the candidate ``rows`` (fused choice
        head: final norm + K rows, never ``[B, vocab]``), or the full vocabulary for decoding."""
        scale = self.s.d_model ** -0.5 if self.s.scale_decoder_outputs else 1.0
        if rows is not None:
            return choice_logits(hidden, self.w.dec_final_norm, self.w.lm_head, rows,
                                 eps=self.s.eps, scale=scale)
        x = rms_norm(hidden, self.w.dec_final_norm, self.s.eps) * scale
        return F.linear(x, self.w.lm_head).float()

    def cross_attention(self, xq: torch.Tensor, layer: T5Block, mem: torch.Tensor,
                        bias: torch.Tensor | None) -> torch.Tensor:
        """Cross-attention output [B, P, heads * d_kv] (before ``o``) of the projected queries
        ``xq`` [B, P, heads, d_kv] over encoder states ``mem`` [B, L, d] (``bias`` [B, 1, 1, L]
        masks padded keys), reassociated: no encoder token is projected to K or V."""
        B, P, h, dk = xq.shape
        d = mem.shape[-1]
        q = torch.einsum("bphk,hkd->bhpd", xq, layer.x_k.view(h, dk, d)).reshape(B, 1, h * P, d)
        kv = mem.unsqueeze(1)  # one head whose keys and values are the encoder states
        # T5 folds 1/sqrt(d_kv) into its weights: scale=1.
        ctx = F.scaled_dot_product_attention(q, kv, kv, attn_mask=bias, scale=1.0)
        return torch.einsum("bhpd,hkd->bphk", ctx.view(B, h, P, d), layer.x_v.view(h, dk, d)).reshape(B, P, h * dk)

    def decode_choice(self, enc: torch.Tensor, lengths: Sequence[int],
                      decoder_ids: list[list[int]], candidates: torch.Tensor | None, compiled=None) -> torch.Tensor:
        """Candidate logits [B, K] at the last decoder position of each row (``candidates``
        None: full-vocabulary logits [B, V]).

        ``decoder_ids`` start with the decoder start token; rows may differ in length (right
        padding; causal attention keeps padding out of real positions). ``compiled``: a
        ``compiled.CompiledFunction`` of :meth:`choice_core` to run it with.
        """
        P = max(len(r) for r in decoder_ids)
        ids = torch.tensor([[*r, *[0] * (P - len(r))] for r in decoder_ids], device=enc.device)
        last = torch.tensor([len(r) - 1 for r in decoder_ids], device=enc.device)
        mem, key_mask = pad_rows(enc, lengths)  # [B, L, d], [B, 1, 1, L]
        self.decoder_bias(P)  # the bias table grown here, outside any compiled code
        if compiled is not None:
            return compiled(("choice", *ids.shape, mem.shape[1]), ids, last, mem, key_mask, candidates)
        return self.choice_core(ids, last, mem, key_mask, candidates)

    def choice_core(self, ids: torch.Tensor, last: torch.Tensor, mem: torch.Tensor, key_mask: torch.Tensor,
                    candidates: torch.Tensor | None) -> torch.Tensor:
        """:meth:`decode_choice` on tensors alone: decoder ``ids`` [B, P] read at ``last`` [B],
        encoder states ``mem`` [B, L, d] under ``key_mask``."""
        s = self.s
        h, dk = s.num_heads, s.d_kv
        B, P = ids.shape
        x = F.embedding(ids, self.w.embed)  # [B, P, d]
        self_bias = self.decoder_bias(P).unsqueeze(0)
        causal = torch.ones(P, P, dtype=torch.bool, device=ids.device).tril()
        self_mask = self_bias.masked_fill(~causal, float("-inf"))
        for layer in self.w.decoder:
            # causal self-attention over the (short) decoder prefix
            qkv = F.linear(rms_norm(x, layer.norm, s.eps), layer.qkv)
            q, k, v = qkv.view(B, P, 3, h, dk).permute(2, 0, 3, 1, 4)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=self_mask, scale=1.0)
            x = x + F.linear(o.transpose(1, 2).reshape(B, P, h * dk), layer.o)
            xq = F.linear(rms_norm(x, layer.x_norm, s.eps), layer.x_q).view(B, P, h, dk)
            x = x + F.linear(self.cross_attention(xq, layer, mem, key_mask), layer.x_o)
            x = self.feed_forward(x, layer)
        final = x[torch.arange(B, device=x.device), last]  # [B, d]
        return self._logits_rows(final, candidates)
