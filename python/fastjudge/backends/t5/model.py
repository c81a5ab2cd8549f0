"""T5 v1.1 / Flan-T5 in plain PyTorch: the weights in the engine's fused layout, the packed
encoder, and one decoder ``forward`` that serves both score-only rows and decoding steps, each
row continuing from its slot of the state pool (``pool``).

Same math as transformers' T5ForConditionalGeneration, with the engine owning what decides
speed:

* **Packed encoder.** Requests are concatenated into one ``[tokens, d_model]`` matrix, so every
  GEMM runs on real tokens only; attention runs per sequence (:meth:`T5Model.encoder_attention`:
  the engine's on the CPU, the bias added by distance; elsewhere SDPA with the bias as its mask).
* **Fused projections.** q/k/v and the two gated-FF input projections are one GEMM each.
* **Cross-attention in one of two exact forms.** Reassociated (:meth:`T5Block.cross_attention`):
  ``q . (W_k m)`` is computed as ``(W_k^T q) . m`` and ``sum p W_v m`` as ``W_v (sum p m)``, so
  no encoder token is ever projected to K or V; in model space every head's query attends over
  the same keys and values (the encoder states), so all heads and positions of a row are the
  queries of one SDPA head: one pass over a row's encoder states per layer, fewer bytes than its
  K/V (``d_model`` against ``2 * heads * d_kv`` per token) but ``d_model / d_kv`` times the
  FLOPs, in products with only ``heads * positions`` rows that run far below the GEMM rate.
  Projected (:meth:`T5Block.cross_attention_heads`): each encoder token's per-head K/V computed
  once (:meth:`T5Model.project_cross`, one GEMM per layer) and read by every later step, as
  transformers does. Score-only rows (one step) use the first; greedy decoding switches to the
  second once its rows have run as many steps as the projection costs
  (``decode.projection_step``). On the CPU both run in the engine: the reassociated form as one
  call with its maps (``cpu_engine.attend_reassociated``, each row's states read once), the
  per-head form on the few-token attention kernel; CUDA and traced graphs keep SDPA.
* **A step as one engine call on the CPU.** :meth:`T5Model.forward` hands an eager CPU step of
  at most four tokens a row to ``engine_step`` (``_engine.T5Decoder``: every layer, the self-
  attention's position bias added by distance, either cross-attention form); the tensor ops
  below are the path of every other step and the reference it is tested against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from fastjudge.kernels.choice_head import choice_logits

from ..cpu_engine import (
    ENGINE_DTYPES,
    attend_all_in_engine,
    attend_in_engine,
    attend_reassociated,
    engine_attends,
    engine_takes,
    rms_norm_in_engine,
)
from ..cpu_memory import keep_freed_memory
from ..dense import ACTIVATIONS, Dense
from ..fp8 import Fp8Weight, fuse, projection_weight
from ..loading import CheckpointError, check_shapes
from .engine_step import engine_step
from .norm import float32_copy, rms_norm
from .shape import T5Shape


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
    large = max_exact + (torch.log(distance.float() / max_exact) / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).long()
    return buckets + torch.where(distance < max_exact, distance, large.clamp(max=num_buckets - 1))


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # ``x`` as it is when it has the dtype already: even a no-op ``.to`` is one more dispatched
    # op per call (the attention casts below are no-ops in float32 and on CUDA)
    return x if x.dtype == dtype else x.to(dtype)


# transformers' names of the same activations
ACTIVATION_ALIASES = {"gelu_python": "gelu", "swish": "silu"}


def activation_name(name: str) -> str:
    """The checkpoint's ``dense_act_fn`` as a key of :data:`dense.ACTIVATIONS`."""
    name = ACTIVATION_ALIASES.get(name, name)
    if name not in ACTIVATIONS:
        raise CheckpointError(f"unsupported T5 activation {name!r}")
    return name


PROJECTIONS = ("qkv", "o", "x_q", "x_kv", "x_o", "wi", "wo")  # applied as GEMMs: Dense modules


def _registered(w):
    """A weight as a module attribute that registers: FP8 weights are modules (their data and
    scales buffers), every other tensor a frozen parameter."""
    return w if isinstance(w, torch.nn.Module) else torch.nn.Parameter(w, requires_grad=False)


@dataclass
class DecoderStep:
    """What every decoder block of one forward reads: each token's K/V column ``where`` [B, P]
    (the scratch column for padding) with its row index ``rows``, the self-attention mask
    [B, H, P, width] (position bias, causal), and for cross-attention either each row's
    encoder length ``enc_lengths`` [B] (the engine's attention, CPU) or the encoder key mask
    ``key_mask`` [B, 1, 1, L] (SDPA)."""

    where: torch.Tensor
    rows: torch.Tensor
    self_mask: torch.Tensor
    key_mask: torch.Tensor | None
    enc_lengths: torch.Tensor | None = None


class T5Block(torch.nn.Module):
    """One encoder or decoder block: ``norm``/``qkv``/``o`` (self-attention), in the decoder
    ``x_norm``/``x_q``/``x_kv``/``x_o`` (cross-attention; ``x_kv`` holds K and V, read as the
    tensors ``x_k``/``x_v`` by the reassociated form), ``ff_norm``/``wi``/``wo`` (feed-forward;
    ``wi`` holds both gated inputs). The projections are :class:`dense.Dense` modules.
    ``index``: the block's place in its stack (odd blocks take the rows in reverse order where
    the order is free, so that each starts on what the last one read most recently)."""

    def __init__(self, shape: T5Shape, weights: dict, index: int = 0):
        super().__init__()
        act = activation_name(shape.act)
        self.s, self.act = shape, ACTIVATIONS[act][0]
        self.reverse_rows = index % 2 == 1
        for name, w in weights.items():
            if name in PROJECTIONS:  # a gated feed-forward's wi holds both inputs, gate first
                setattr(self, name, Dense(w, gate=act if name == "wi" and shape.gated else None))
            else:
                setattr(self, name, _registered(w))

    @property
    def x_k(self) -> torch.Tensor:
        return self.x_kv.weight[: self.s.num_heads * self.s.d_kv]

    @property
    def x_v(self) -> torch.Tensor:
        return self.x_kv.weight[self.s.num_heads * self.s.d_kv:]

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        h = rms_norm(x, self.ff_norm, self.s.eps)
        h = self.wi.gated_product(h) if self.s.gated else self.act(self.wi(h))
        return x + self.wo(h)

    def encode(self, x: torch.Tensor, lengths: Sequence[int], starts: np.ndarray, attend) -> torch.Tensor:
        """The encoder block over packed sequences ``x`` [T, d]: attention within each sequence
        (``attend(qkv [n, 3, heads, d_kv], out [n, heads, d_kv])``, :meth:`T5Model.encoder_attention`)."""
        h, dk = self.s.num_heads, self.s.d_kv
        qkv = self.qkv(rms_norm(x, self.norm, self.s.eps))  # [T, 3 * inner]
        out = torch.empty(x.shape[0], h * dk, dtype=x.dtype, device=x.device)
        for i, n in enumerate(lengths):
            a, b = int(starts[i]), int(starts[i + 1])
            attend(qkv[a:b].view(n, 3, h, dk), out[a:b].view(n, h, dk))
        return self.feed_forward(x + self.o(out))

    def forward(self, x: torch.Tensor, step: DecoderStep, kv: torch.Tensor, cross: torch.Tensor) -> torch.Tensor:
        """The decoder block over ``x`` [B, P, d]: self-attention K/V written into ``kv``
        [B, 2, heads, capacity + 1, d_kv] at ``step.where``, cross-attention over ``cross``:
        encoder states [B, L, d] (reassociated) or their projected K/V [B, 2, heads, L, d_kv]."""
        s = self.s
        B, P, _ = x.shape
        h, dk = s.num_heads, s.d_kv
        # attention in the K/V's dtype (``pool.attention_dtype``: float32 on the CPU), rounded back once
        qkv = as_dtype(self.qkv(rms_norm(x, self.norm, s.eps)), kv.dtype)
        q, k, v = qkv.view(B, P, 3, h, dk).unbind(2)
        kv[step.rows, 0, :, step.where] = k
        kv[step.rows, 1, :, step.where] = v
        width = step.self_mask.shape[-1]
        o = F.scaled_dot_product_attention(q.transpose(1, 2), kv[:, 0, :, :width], kv[:, 1, :, :width],
                                           attn_mask=step.self_mask, scale=1.0)
        x = x + self.o(as_dtype(o.transpose(1, 2).reshape(B, P, h * dk), x.dtype))
        xq = self.x_q(rms_norm(x, self.x_norm, s.eps)).view(B, P, h, dk)
        attend = self.cross_attention_heads if cross.dim() == 5 else self.cross_attention
        return self.feed_forward(x + self.x_o(attend(xq, cross, step)))

    def cross_attention(self, xq: torch.Tensor, mem: torch.Tensor, step: DecoderStep) -> torch.Tensor:
        """Cross-attention output [B, P, heads * d_kv] (before ``x_o``) of the projected queries
        ``xq`` [B, P, heads, d_kv] over encoder states ``mem`` [B, L, d], reassociated."""
        B, P, h, dk = xq.shape
        d = mem.shape[-1]
        w_k, w_v = self.x_k.view(h, dk, d), self.x_v.view(h, dk, d)
        if step.enc_lengths is not None and d % 16 == 0 and xq.is_contiguous():
            # the engine: the maps and the attention in one call, each row's states read once
            return attend_reassociated(xq, w_k, w_v, mem, step.enc_lengths, self.reverse_rows).view(B, P, h * dk)
        q = torch.einsum("bphk,hkd->bhpd", xq, w_k).reshape(B, 1, h * P, d)
        ctx = attend_encoder(q, mem.unsqueeze(1), mem.unsqueeze(1), step)  # one head: keys = values = states
        return torch.einsum("bhpd,hkd->bphk", ctx.view(B, h, P, d), w_v).reshape(B, P, h * dk)

    def cross_attention_heads(self, xq: torch.Tensor, xkv: torch.Tensor, step: DecoderStep) -> torch.Tensor:
        """The same output from the encoder states' projected K/V ``xkv`` [B, 2, heads, L, d_kv]
        (:meth:`T5Model.project_cross`), read in place, in the K/V's dtype
        (``pool.attention_dtype``: float32 on the CPU; ``key_mask`` is in it too). Each head's
        positions are the query rows of that head (a copy where P > 1)."""
        B, P, h, dk = xq.shape
        q = as_dtype(xq.transpose(1, 2), xkv.dtype).reshape(B, 1, h * P, dk)
        ctx = attend_encoder(q, xkv[:, 0], xkv[:, 1], step).view(B, h, P, dk)
        return as_dtype(ctx.transpose(1, 2).reshape(B, P, h * dk), xq.dtype)


def attend_encoder(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, step: DecoderStep) -> torch.Tensor:
    """Cross-attention of query rows ``q`` [B, 1, R, D] over ``keys``/``values`` [B, K, L, D]
    (query rows ``R / K`` per key head, in head order), each row over its own encoder keys;
    returns [B, R, 1, D] (SDPA's layout with the rows as heads). On the CPU the engine's
    few-token attention, which reads the keys in place, with each row's last key as its offset
    (one query token sees keys up to ``offset``: its whole prompt); elsewhere SDPA under the key
    mask, the rows as one head's queries. T5 folds 1/sqrt(d_kv) into its weights: scale 1."""
    if step.enc_lengths is not None:
        return attend_in_engine(q, keys, values, offsets=step.enc_lengths - 1, scale=1.0)
    B, _, R, D = q.shape
    K = keys.shape[1]
    ctx = F.scaled_dot_product_attention(q.view(B, K, R // K, D), keys, values, attn_mask=step.key_mask, scale=1.0)
    return ctx.view(B, R, 1, D)


class T5Model(torch.nn.Module):
    """The checkpoint as a module (``state_dict``, ``.to()``, hooks and compilers see it). A state
    with FP8 weights (``load_state_dict(keep_fp8=True)``) keeps the encoder's projections FP8
    (:class:`fp8.Fp8Weight`: the encoder is where the FLOPs are); the decoder reads its
    cross-attention weights directly (reassociated), so decoder weights are dequantized."""

    def __init__(self, state: dict[str, torch.Tensor], shape: T5Shape, device, dtype):
        super().__init__()
        check_shapes(state, shape.tensor_shapes())
        self.s = shape
        if torch.device(device).type == "cpu":  # every forward's temporaries reuse the last one's pages
            keep_freed_memory()

        def dense(name: str):
            if name not in state:
                raise CheckpointError(f"checkpoint lacks tensor {name!r}")
            return projection_weight(state, name, device, dtype)

        def take(name: str) -> torch.Tensor:
            w = dense(name)
            return w.dequantize(dtype) if isinstance(w, Fp8Weight) else w

        def block(stack: str, i: int, get) -> T5Block:
            p = f"{stack}.block.{i}.layer"
            w = {"norm": take(f"{p}.0.layer_norm.weight"), "o": get(f"{p}.0.SelfAttention.o.weight"),
                 "qkv": fuse([get(f"{p}.0.SelfAttention.{n}.weight") for n in "qkv"], dtype)}
            if stack == "decoder":
                w["x_norm"] = take(f"{p}.1.layer_norm.weight")
                w.update({f"x_{n}": take(f"{p}.1.EncDecAttention.{n}.weight") for n in "qo"})
                w["x_kv"] = fuse([take(f"{p}.1.EncDecAttention.{n}.weight") for n in "kv"], dtype)
            ff = f"{p}.{2 if stack == 'decoder' else 1}"
            wi = [f"{ff}.DenseReluDense.wi{n}.weight" for n in (("_0", "_1") if shape.gated else ("",))]
            w.update(ff_norm=take(f"{ff}.layer_norm.weight"), wi=fuse([get(n) for n in wi], dtype),
                     wo=get(f"{ff}.DenseReluDense.wo.weight"))
            return T5Block(shape, w, i)

        self.embed = _registered(take("shared.weight"))
        # a tied head is the embedding parameter itself, registered under both names
        self.lm_head = _registered(take("lm_head.weight")) if "lm_head.weight" in state else self.embed
        # decoding's full-vocabulary head as a GEMM of its own over that same parameter (a Dense:
        # prepacked on the CPU, where F.linear ran a 16-row step's head at a third of the speed)
        self.head = Dense(self.lm_head, prompts=False)  # decoding steps only: one packed copy
        self.head.weight = self.lm_head
        self.enc_bias_table = _registered(take("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"))
        self.dec_bias_table = _registered(take("decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"))
        self.enc_final_norm = _registered(take("encoder.final_layer_norm.weight"))
        self.dec_final_norm = _registered(take("decoder.final_layer_norm.weight"))
        self.encoder = torch.nn.ModuleList(block("encoder", i, dense) for i in range(shape.num_layers))
        self.decoder = torch.nn.ModuleList(block("decoder", i, take) for i in range(shape.num_decoder_layers))
        self.engine_step_cache = None  # engine_step.engine_step's decoder for the last pool
        # position biases, grown outside compiled code (non-persistent: they follow the device)
        self.register_buffer("_enc_bias", torch.empty(0, device=device), persistent=False)
        self.register_buffer("_dec_bias", torch.empty(0, device=device), persistent=False)

    def _bias(self, table: torch.Tensor, length: int, bidirectional: bool) -> torch.Tensor:
        pos = torch.arange(length, device=table.device)
        buckets = relative_position_bucket(pos[None, :] - pos[:, None], bidirectional, self.s.num_buckets,
                                           self.s.max_distance)
        return F.embedding(buckets, table).permute(2, 0, 1).contiguous()  # [H, L, L]

    def encoder_bias(self, length: int) -> torch.Tensor:
        # The bias depends only on key - query, so the top-left block of a larger table is the
        # table of a shorter sequence: computed once for the longest length seen.
        if self._enc_bias.shape[-1] < length:
            self._enc_bias = self._bias(self.enc_bias_table, max(length, 512), True)
        return self._enc_bias[:, :length, :length]

    def encoder_bias_by_distance(self, length: int) -> torch.Tensor:
        """:meth:`encoder_bias`'s values by distance, [heads, 2 * length - 1] float32: column
        ``length - 1 + t - j`` holds query ``t``'s bias on key ``j``."""
        relative = length - 1 - torch.arange(2 * length - 1, device=self.enc_bias_table.device)  # j - t
        return self._bias_by_relative(self.enc_bias_table, relative, True)

    def encoder_attention(self, x: torch.Tensor, lengths: Sequence[int]):
        """``attend(qkv [n, 3, heads, d_kv], out [n, heads, d_kv])`` for sequences of ``lengths``:
        each query over its sequence's every key, scale 1 (folded into T5's weights), the bias
        added by distance on the CPU engine, as SDPA's mask elsewhere (docs/engine.md)."""
        longest = max(lengths)
        if engine_attends(x, x):
            by_distance = self.encoder_bias_by_distance(longest)  # n tokens read its columns from longest - n
            tables = {n: by_distance[:, longest - n:longest + n - 1].contiguous() for n in set(lengths)}
            return lambda qkv, out: attend_all_in_engine(*(qkv[:, i].unsqueeze(0) for i in range(3)), out.unsqueeze(0),
                                                         1.0, tables[qkv.shape[0]])
        bias = self.encoder_bias(longest)

        def attend(qkv: torch.Tensor, out: torch.Tensor) -> None:
            n = qkv.shape[0]
            q, k, v = qkv.permute(1, 2, 0, 3).unsqueeze(1)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias[:, :n, :n].unsqueeze(0), scale=1.0)
            out.copy_(o[0].transpose(0, 1))

        return attend

    def decoder_bias(self, length: int) -> torch.Tensor:
        if self._dec_bias.shape[-1] < length:
            self._dec_bias = self._bias(self.dec_bias_table, max(length, 128), False)
        return self._dec_bias[:, :length, :length]

    def decoder_bias_by_distance(self, capacity: int) -> torch.Tensor:
        """The decoder self-attention's bias [heads, capacity + 1] (float32) of a key ``n``
        positions before its query: the bias table at the causal bucket of distance ``n``, the
        values :meth:`decoder_bias` holds (the engine's step adds them by distance)."""
        distance = -torch.arange(capacity + 1, device=self.dec_bias_table.device)
        return self._bias_by_relative(self.dec_bias_table, distance, False)

    def _bias_by_relative(self, table: torch.Tensor, relative: torch.Tensor, bidirectional: bool) -> torch.Tensor:
        buckets = relative_position_bucket(relative, bidirectional, self.s.num_buckets, self.s.max_distance)
        return F.embedding(buckets, table.detach()).t().float().contiguous()

    def encode(self, packed_ids: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
        """Encoder over packed sequences: ``packed_ids`` [T] -> hidden [T, d]."""
        x = F.embedding(packed_ids, self.embed)
        attend = self.encoder_attention(x, lengths)
        starts = np.concatenate([[0], np.cumsum(lengths)])
        for layer in self.encoder:
            x = layer.encode(x, lengths, starts, attend)
        return rms_norm(x, self.enc_final_norm, self.s.eps)

    def project_cross(self, pool, start: int, stop: int) -> None:
        """Every decoder layer's cross-attention K/V of the encoder states of slots ``start ..
        stop - 1`` of ``pool`` into its ``xkv`` (one GEMM per layer over those rows, up to the
        longest of their prompts)."""
        s, n = self.s, int(pool.enc_held[start:stop].max())
        mem = pool.mem[start:stop, :n]
        for i, layer in enumerate(self.decoder):
            pool.xkv[start:stop, i, :, :, :n] = layer.x_kv(mem).view(stop - start, n, 2, s.num_heads,
                                                                     s.d_kv).permute(0, 2, 3, 1, 4)

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor, pool, width: int, enc_width: int) -> torch.Tensor:
        """Decoder hidden states [B, P, d] of ``tokens`` [B, P] (row ``b``: ``counts[b]`` real
        tokens, then right padding) continuing each row of the first B slots of ``pool``
        (``pool.T5Pool`` or a view of one), whose decoder lengths advance by the counts. Self-
        attention reads the first ``width`` decoder positions, cross-attention the first
        ``enc_width`` encoder states (each row masked to its own prompt): reassociated over
        ``pool.mem``, or per head over ``pool.xkv`` while ``pool.projected``."""
        engine = engine_step(self, pool, tokens)
        if engine is not None:  # the CPU: the whole step as one engine call
            return engine(tokens, counts, pool, pool.projected)
        B, P = tokens.shape
        device = tokens.device
        steps = torch.arange(P, device=device)
        start = pool.dec_lengths[:B]
        where = torch.where(steps[None, :] < counts[:, None], start[:, None] + steps, pool.capacity)
        # each token's bias row (its own position), and -inf on keys past it
        bias_rows = where.clamp(max=self._dec_bias.shape[-1] - 1)
        bias = as_dtype(self._dec_bias[:, bias_rows, :width].transpose(0, 1), pool.kv.dtype)
        keys = torch.arange(width, device=device)
        self_mask = bias.masked_fill(keys[None, None, None, :] > where[:, None, :, None], float("-inf"))
        cross_dtype = pool.xkv.dtype if pool.projected else pool.mem.dtype  # the cross-attention's dtype
        if engine_takes(tokens) and cross_dtype in ENGINE_DTYPES:
            key_mask, enc_lengths = None, pool.enc_lengths[:B]
        else:
            enc_keys = torch.arange(enc_width, device=device)[None, :]
            key_mask = torch.zeros(B, enc_width, dtype=cross_dtype, device=device).masked_fill(
                enc_keys >= pool.enc_lengths[:B, None], float("-inf")).view(B, 1, 1, enc_width)
            enc_lengths = None
        step = DecoderStep(where, torch.arange(B, device=device)[:, None].expand(B, P), self_mask, key_mask,
                           enc_lengths)
        x = F.embedding(tokens, self.embed)
        mem = pool.mem[:B, :enc_width]
        for i, layer in enumerate(self.decoder):
            x = layer(x, step, pool.kv[:B, i], pool.xkv[:B, i, :, :, :enc_width] if pool.projected else mem)
        start += counts
        return x

    def logits(self, hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """LM-head logits of final decoder states: only the candidate ``rows`` (fused choice head: final norm + K
        rows, never ``[B, vocab]``), or all (the norm on the CPU engine, as ``EngineStep.run_picks``: same bits)."""
        if rows is not None:
            return choice_logits(hidden, self.dec_final_norm, self.lm_head, rows, self.s.eps, self.s.head_scale,
                                 t5_norm=True)
        normed = rms_norm_in_engine(hidden.contiguous(), float32_copy(self.dec_final_norm), self.s.eps,
                                    round_first=True)
        normed = rms_norm(hidden, self.dec_final_norm, self.s.eps) if normed is None else normed
        return self.head(normed * self.s.head_scale).float()
