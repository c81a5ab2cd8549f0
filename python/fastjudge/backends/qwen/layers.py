"""The Qwen decoder layers as modules, each with its own ``forward``: a full (gated, for Qwen3.5)
attention layer and a Gated DeltaNet layer, both followed by the gated MLP. Which kind a layer
is was decided when it was built (``build_layers``), never by a string at each call.

A layer's ``forward(x, step, state)`` continues every row of ``x`` [B, k, d] from its slot of
the state pool (``pool.StatePool``) and writes the rows' new state there, in place: K/V at each
token's column (``step.where``) for attention, the conv and recurrent states for DeltaNet.
Right padding never reaches a row's state: padded tokens write K/V to the pool's scratch column
and their DeltaNet steps are the identity (beta = 0, g = 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ... import _engine
from ..cpu_engine import (
    ENGINE_DTYPES,
    attention_inputs_in_engine,
    engine_array,
    engine_takes,
    output_gate_in_engine,
    rms_norm_in_engine,
)
from ..dense import Dense
from ..fp8 import Fp8Weight, fuse, projection_weight
from ..loading import CheckpointError, check_shapes
from .attention import attend_cached, attend_causal
from .gated_delta import EXP_FLOOR, L2_EPS, as_float, chunk_gated_delta_rule_, recurrent_gated_delta_rule_
from .pool import SharedPrefix
from .shape import QwenShape

SHORT_CONV_STEPS = 8  # up to this many new tokens, the causal conv runs as a windowed product
# The chunked delta rule pads every chunk to full length: an input of up to ONE_CHUNK_STEPS
# tokens is one chunk of its own length (padding a 30-token suffix to 64 doubles its work);
# longer inputs take DELTA_CHUNK-token chunks (on CPU, 32 beats transformers' 64 for every
# shape measured: the intra-chunk products grow with the square of the chunk).
ONE_CHUNK_STEPS = 64
DELTA_CHUNK = 32
RECURRENT_STEPS = 3  # up to this many new tokens the recurrent rule (one iteration a token) wins


@dataclass
class Step:
    """What every layer of one forward reads, computed once per forward: the rotary ``rope``
    (cos, sin, half the rotary dims; see :func:`rotate`), each row's new-token count ``counts`` [B], the K/V
    column of each token ``where`` [B, k] (the scratch column for padding) with its row index
    ``rows``, the attention mask over the first ``width`` keys, ``real`` [B, k, 1] (true for a
    row's real tokens, false for padding), ``conv_keep`` (which rows of the flattened conv
    windows [B * (kernel - 1 + k), conv_dim] are the rows' new conv states,
    :class:`DeltaNetLayer`; None without DeltaNet layers),
    ``fresh``: every row starts empty (causal attention over the new tokens, no state read;
    right padding follows a row's real tokens, so they never see it); ``shared``: the K/V
    columns rows share by snapshot, read once per snapshot (:func:`attend_cached`), or None;
    ``offsets`` [B]: each row's keys before this step's tokens (its new token ``t`` sees keys up
    to ``offsets[b] + t``: the mask's rule for real tokens), or None; ``packed``: the flat
    indices (into B x k) of the real tokens where the MLPs and projections run on those alone
    (:func:`project_real`), or None."""

    rope: tuple[torch.Tensor, torch.Tensor, int]
    counts: torch.Tensor
    where: torch.Tensor
    rows: torch.Tensor
    mask: torch.Tensor | None
    width: int
    fresh: bool
    real: torch.Tensor
    conv_keep: torch.Tensor | None
    shared: SharedPrefix | None = None
    offsets: torch.Tensor | None = None
    packed: torch.Tensor | None = None


def rms(x: torch.Tensor, weight_f32: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32 (as transformers computes norms), back in ``x``'s dtype; ``weight_f32``
    one scale per channel ``[D]`` or per head ``[heads, D]`` (broadcast over the leading dims).

    On the CPU, float32 or bfloat16, eager: the engine, one pass a row
    (``cpu_engine.rms_norm_in_engine``; 16 rows of 256, 10.4-12.9 us through ``F.rms_norm`` and
    15 us through the six ops below, a few us in the engine). Else the
    ops of ``F.rms_norm`` on the CPU (mean of squares, ``+ eps``, rsqrt, times ``x``, times the
    weight) in place on one float32 buffer."""
    out = rms_norm_in_engine(x, weight_f32, eps)
    if out is not None:
        return out
    xf = x.float()  # x itself in float32: the product below must not overwrite it
    scale = xf.square().mean(-1, keepdim=True).add_(eps).rsqrt_()
    out = xf * scale if xf is x else xf.mul_(scale)
    out.mul_(weight_f32)
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def project_real(proj, x: torch.Tensor, step: Step) -> torch.Tensor:
    """``proj(x)`` [B, k, n] of ``x`` [B, k, d], on the real tokens alone where the step packs
    them (``step.packed``), zeros at padding: a projection is per token, and a row's output has
    the same bits at any row count (the engine's panels by construction; oneDNN's packed GEMM as
    measured on an AVX2 CPU, where the two paths also agree), so every real token's value is what
    the whole product gives it. Zeros keep the padding finite for the ops that still run on it
    (norms, rotary, the DeltaNet rule with its gates at zero)."""
    if step.packed is None:
        return proj(x)
    B, k = x.shape[:2]
    real = proj(x.reshape(B * k, -1).index_select(0, step.packed))
    return real.new_zeros(B * k, real.shape[-1]).index_copy_(0, step.packed, real).view(B, k, -1)


def rotate(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor, int]) -> torch.Tensor:
    """Rotary embedding of ``x`` [B, k, heads, head_dim]: ``x * cos + rotate_half(x) * sin``
    where ``sin`` carries the sign of rotate-half (``-sin`` on the first half of the rotary
    dims) and ``half`` is half the rotary dims. Past ``rotary_dim``, cos is 1 and sin 0: those
    dims pass through unchanged. The swapped halves are added in place on the two rotary
    slices (the same ``x * cos + y * sin`` per element, bit for bit, as a gathered copy of the
    swapped ``x`` would give, without the gather over every head dim: 1.1 -> 0.26 ms at
    [4, 512, 4, 64], float32)."""
    cos, sin, half = rope
    out = x * cos
    out[..., :half].addcmul_(x[..., half:2 * half], sin[..., :half])
    out[..., half:2 * half].addcmul_(x[..., :half], sin[..., half:2 * half])
    return out


class QwenLayer(torch.nn.Module):
    """What every decoder layer has: its two RMSNorm scales (float32, as transformers computes
    norms) and the gated MLP (gate and up projections fused). Subclasses mix the tokens. Every
    projection is a :class:`dense.Dense` (its GEMM chosen at load)."""

    def __init__(self, shape: QwenShape, in_norm, post_norm, gate_up, down):
        super().__init__()
        self.s = shape
        self.register_buffer("in_norm", in_norm)
        self.register_buffer("post_norm", post_norm)
        self.gate_up, self.down = Dense(gate_up, gate="silu"), Dense(down)

    def forward(self, x: torch.Tensor, step: Step, state: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.mix(rms(x, self.in_norm, self.s.eps), step, state)
        if step.packed is None:
            return self.mlp(x)
        # the MLP on the real tokens only (it is per token): padding rows keep their input
        flat = x.view(-1, x.shape[-1])
        return flat.index_copy_(0, step.packed, self.mlp(flat.index_select(0, step.packed))).view_as(x)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """``x + down(silu(gate) * up)`` of ``rms(x)`` (:meth:`dense.Dense.gated_product`)."""
        return x + self.down(self.gate_up.gated_product(rms(x, self.post_norm, self.s.eps)))

    def mix(self, h, step: Step, state) -> torch.Tensor:
        raise NotImplementedError


class AttentionLayer(QwenLayer):
    """Full attention (Qwen3.5: with a sigmoid output gate): the q, k and v projections as one
    GEMM (``qkv``; or q alone and a fused ``kv`` where FP8 scales keep them apart), o, the q/k
    norms as one scale per head, q heads first (``qk_norm`` [heads + kv_heads, head_dim]: where
    the queries and keys are adjacent in the GEMM's output, one RMSNorm and one rotary over both
    save a dozen dispatched ops a layer). Qwen3's fused GEMM writes q, k, v; Qwen3.5's writes q,
    k, the output gate, v when ``gate_apart`` (its checkpoint interleaves each head's query and
    gate rows; ``build_layers`` takes them apart where the weight is not FP8). On the CPU in
    eager code, the norm, rotary and K/V writes of adjacent queries and keys are one engine pass
    (``cpu_engine.attention_inputs_in_engine``), and so is the output gate
    (``output_gate_in_engine``): 4 x 512 tokens, mini, two threads, the whole mix with its
    projections and attention, tensor ops -> engine: bfloat16 7.2-7.4 -> 6.4-6.5 ms, float32
    10.6 -> 10.1 ms. ``state``: the layer's K and V pool buffers [B, kv_heads, capacity + 1,
    head_dim]."""

    def __init__(self, shape: QwenShape, qkv, o, q_norm, k_norm, kv=None, gate_apart: bool = False, **common):
        super().__init__(shape, **common)
        self.qkv, self.o = Dense(qkv), Dense(o)
        self.kv = None if kv is None else Dense(kv)
        self.register_buffer("qk_norm", torch.cat([q_norm.expand(shape.heads, -1), k_norm.expand(shape.kv_heads, -1)]))
        self.qk_adjacent = kv is None and (gate_apart or not shape.hybrid)

    def mix(self, h, step: Step, state) -> torch.Tensor:
        s = self.s
        B, S, _ = h.shape
        H, Hkv, hd = s.heads, s.kv_heads, s.head_dim
        q_dim = H * hd * (2 if s.hybrid else 1)
        gate = None
        keys, values = state
        stored = None  # the keys and values already in the pool (the engine's pass writes them)
        if self.qk_adjacent:  # queries and keys side by side: normed and rotated as H + Hkv heads
            qkv = project_real(self.qkv, h, step)
            parts = qkv.split([(H + Hkv) * hd] + ([H * hd] if s.hybrid else []) + [Hkv * hd], dim=-1)
            qk, v = parts[0], parts[-1]
            if s.hybrid:
                gate = parts[1].view(B, S, H, hd)
            stored = attention_inputs_in_engine(qkv, self.qk_norm, step.rope, keys, values, step.where, H, Hkv,
                                                qkv.shape[-1] - Hkv * hd, s.eps)
            qk = stored if stored is not None else \
                rotate(rms(qk.view(B, S, H + Hkv, hd), self.qk_norm, s.eps), step.rope)
            q, k = qk[:, :, :H], qk[:, :, H:]
        else:
            if self.kv is None:
                q, k, v = project_real(self.qkv, h, step).split([q_dim, Hkv * hd, Hkv * hd], dim=-1)
            else:
                q, (k, v) = project_real(self.qkv, h, step), project_real(self.kv, h, step).chunk(2, dim=-1)
            if s.hybrid:  # per head: its hd query dims, then its hd gate dims
                q, gate = q.view(B, S, H, 2, hd).unbind(3)
            else:
                q = q.view(B, S, H, hd)
            q = rotate(rms(q, self.qk_norm[0], s.eps), step.rope)  # [B, S, H, hd]
            k = rotate(rms(k.view(B, S, Hkv, hd), self.qk_norm[H], s.eps), step.rope)
        v = v.view(B, S, Hkv, hd)
        if stored is None:  # keys[rows, :, where] = k, as one dispatched op
            torch.ops.aten.index_put_(keys, [step.rows, None, step.where], k)
            torch.ops.aten.index_put_(values, [step.rows, None, step.where], v)
        gqa = Hkv != H
        if step.fresh:  # causal attention over the new tokens alone
            o = attend_causal(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), gqa, step.counts)
        else:
            o = attend_cached(q, keys[:, :, :step.width], values[:, :, :step.width], step.mask, step.shared,
                              step.offsets, step.counts)
        o = o.transpose(1, 2).reshape(B, S, H * hd)  # a view where the attention wrote [B, S, H, hd]
        if gate is not None:
            gated = output_gate_in_engine(o, gate)
            o = gated if gated is not None else o * torch.sigmoid(gate.reshape(B, S, H * hd))
        return project_real(self.o, o, step)


class DeltaNetLayer(QwenLayer):
    """Gated DeltaNet: fused input projections (qkv, z, b, a), the causal depthwise conv (its
    taps [kernel, conv_dim]), the decay parameters and the gated output norm. ``state``: the conv
    state [B, kernel - 1, conv_dim] (each row's last inputs, channels last) and the recurrent
    state [B, v_heads, k_dim, v_dim] (float32)."""

    def __init__(self, shape: QwenShape, in_proj, conv, dt_bias, neg_A, gated_norm, out, **common):
        super().__init__(shape, **common)
        self.in_proj, self.out = Dense(in_proj), Dense(out)
        # the checkpoint's conv1d weight [conv_dim, 1, kernel] as taps [kernel, conv_dim]: channels
        # last, as the conv state and the projections' output, so a decoding step's conv is a
        # vectorised product and sum over the kernel, never a loop over 3- or 4-wide rows
        self.taps = torch.nn.Parameter(conv[:, 0, :].t().contiguous(), requires_grad=False)
        self.register_buffer("dt_bias", dt_bias)
        self.register_buffer("neg_A", neg_A)
        self.register_buffer("gated_norm", gated_norm)
        # the recurrent update's L2 norm of queries and keys is an RMSNorm (rms_norm(x, eps / d)
        # = sqrt(d) * x / sqrt(|x|^2 + eps)) times these: d^-0.5 (the L2 norm) and, for the
        # queries, the delta rule's d^-0.5 query scale
        d = shape.lin_k_dim
        self.register_buffer("qk_scale", torch.tensor([1.0 / d, d ** -0.5], device=dt_bias.device)
                             .view(2, 1, 1), persistent=False)
        # the engine's few-token step reads its parameters in float32
        self.register_buffer("dt_bias_f32", dt_bias.float(), persistent=False)
        self.register_buffer("gated_norm_f32", gated_norm.float(), persistent=False)

    def mix(self, h, step: Step, state) -> torch.Tensor:
        s = self.s
        B, S, _ = h.shape
        # the chunked form (more tokens) wants value heads in whole vectors and at most 16 conv taps
        chunked = s.lin_v_dim % 16 == 0 and s.conv_kernel <= 16
        if engine_takes(h) and h.dtype in ENGINE_DTYPES and (S <= RECURRENT_STEPS or chunked):
            return project_real(self.out, self._engine_step(h, step, state), step)
        key_dim, val_dim = s.lin_k_heads * s.lin_k_dim, s.lin_v_heads * s.lin_v_dim
        conv_dim, K = 2 * key_dim + val_dim, s.conv_kernel
        mixed, z, b, a = project_real(self.in_proj, h, step).split([conv_dim, val_dim, s.lin_v_heads, s.lin_v_heads],
                                                                   dim=-1)
        conv_state, memory = state
        history = mixed.new_zeros(B, K - 1, conv_dim) if step.fresh else conv_state
        window = torch.cat([history, mixed], dim=1)  # [B, K - 1 + S, C]
        if S == 1:
            conv = (window * self.taps).sum(1, keepdim=True)
        elif S <= SHORT_CONV_STEPS:  # a windowed product beats conv1d's setup cost
            conv = (window.unfold(1, K, 1) * self.taps.t()).sum(-1)
        else:  # causal: no future input
            # as a 2-D conv over channels-last [B, C, 1, K - 1 + S] views of the window (the
            # window's own memory, no transposed copy); oneDNN's depthwise kernel then writes
            # channels-last output too: [B, S, C] contiguous (7.3 -> 0.9 ms at 4 x 512 x 512,
            # float32, against conv1d on channels-first copies; same values)
            conv = F.conv2d(window.transpose(1, 2).unsqueeze(2), self.taps.t()[:, None, None, :],
                            groups=conv_dim).squeeze(2).transpose(1, 2)
        conv = F.silu(conv, inplace=True)  # [B, S, C]; every branch above made a tensor of its own
        # each row's last kernel - 1 inputs (window rows Step.conv_keep) are its new conv state
        torch.index_select(window.view(-1, conv_dim), 0, step.conv_keep, out=conv_state.view(-1, conv_dim))
        beta = b.sigmoid() * step.real  # a pad step: beta = 0 and g = 0, the identity update
        g = self.neg_A * F.softplus(as_float(a) + self.dt_bias) * step.real
        if S <= RECURRENT_STEPS:
            core = self._recurrent(conv, g, beta, memory, step.fresh)
        else:  # in place on the pool's memory, which holds the rows' final state after
            q, k, v = conv.split([key_dim, key_dim, val_dim], dim=-1)
            q = q.reshape(B, S, s.lin_k_heads, s.lin_k_dim)
            k = k.reshape(B, S, s.lin_k_heads, s.lin_k_dim)
            v = v.reshape(B, S, s.lin_v_heads, s.lin_v_dim)
            core = chunk_gated_delta_rule_(memory, q, k, v, g, beta, S if S <= ONE_CHUNK_STEPS else DELTA_CHUNK,
                                           fresh=step.fresh)
        core = core if h.dtype == torch.float32 else core.to(h.dtype)
        # gated RMSNorm: normalise in float32, scale, gate with silu(z)
        z = z.view(B, S, s.lin_v_heads, s.lin_v_dim)
        if core.dtype == torch.float32:
            gated = F.rms_norm(core, (s.lin_v_dim,), self.gated_norm, s.eps).mul_(F.silu(z))
        else:
            normed = F.rms_norm(core.float(), (s.lin_v_dim,), None, s.eps).to(core.dtype) * self.gated_norm
            gated = (normed.float() * F.silu(z.float())).to(h.dtype)
        return project_real(self.out, gated.view(B, S, val_dim), step)

    def _engine_step(self, h, step: Step, state) -> torch.Tensor:
        """Everything between the two projections as one engine call on the CPU
        (``_engine.deltanet_step``: the conv, gates, query/key norms, the delta rule on the pool's
        state and the gated norm, each value rounded where the tensor ops below round it), in
        place of some forty dispatched ops: the input [B, S, value heads x dim] of the output
        projection. Up to ``RECURRENT_STEPS`` tokens (decoding, jump-forward runs) the rule runs a
        token at a time; more (prompts, suffix passes) take the chunked form, in the chunks the
        tensor ops take, its conv summed as the convolution op sums it (4 x 512 tokens, mini, two
        threads, the whole mix with its projections, tensor ops -> engine: bfloat16 6.7-7.3 ->
        5.5-6.1 ms, float32 9.4-9.8 -> 8.5-8.9 ms)."""
        s = self.s
        B, S, _ = h.shape
        chunk = 0 if S <= RECURRENT_STEPS else S if S <= ONE_CHUNK_STEPS else DELTA_CHUNK
        projected = project_real(self.in_proj, h, step).contiguous()
        conv_state, memory = state
        out = h.new_empty(B, S, s.lin_v_heads * s.lin_v_dim)
        _engine.deltanet_step(engine_array(projected), engine_array(conv_state), engine_array(self.taps),
                              memory.numpy(), step.counts.numpy(), self.dt_bias_f32.numpy(), self.neg_A.numpy(),
                              self.gated_norm_f32.numpy(), engine_array(out), s.lin_k_heads, s.lin_k_dim, s.eps,
                              L2_EPS, step.fresh, chunk, EXP_FLOOR, torch.get_num_threads())
        return out

    def _recurrent(self, conv, g, beta, memory, fresh: bool) -> torch.Tensor:
        """:func:`gated_delta.recurrent_gated_delta_rule_` (in place on the pool's ``memory``) of
        ``conv`` [B, S, C] (queries, keys, values) and ``g``, ``beta`` [B, S, Hv]: the outputs
        [B, S, Hv, dv] (float32). Queries and keys are normalised together, as one RMSNorm
        (``qk_scale``)."""
        s = self.s
        B, S = conv.shape[:2]
        Hk, dk = s.lin_k_heads, s.lin_k_dim
        conv = as_float(conv)
        qk = F.rms_norm(conv[..., :2 * Hk * dk].reshape(B, S, 2, Hk, dk), (dk,), None, L2_EPS / dk)
        q, k = (qk * self.qk_scale).unbind(2)
        if fresh:
            memory.zero_()
        v = conv[..., 2 * Hk * dk:].reshape(B, S, s.lin_v_heads, s.lin_v_dim)
        return recurrent_gated_delta_rule_(memory, q, k, v, g, beta)


def build_layers(state: dict[str, torch.Tensor], shape: QwenShape, device, dtype):
    """The language model's tensors from a checkpoint state, projections fused where they read
    the same input: (embed, lm_head or None when tied, final norm, layers). A state with FP8
    weights (``load_state_dict(keep_fp8=True)``) gives :class:`fp8.Fp8Weight` projections, run
    as FP8 GEMMs; every other tensor is dequantized."""
    prefix = "model.language_model." if any(k.startswith("model.language_model.") for k in state) \
        else "model."
    check_shapes(state, shape.tensor_shapes(prefix))

    def dense(name: str, full: bool = False):
        key = name if full else prefix + name
        if key not in state:
            raise CheckpointError(f"checkpoint lacks tensor {key!r}")
        return projection_weight(state, key, device, dtype)

    def take(name: str, full: bool = False) -> torch.Tensor:
        w = dense(name, full)
        return w.dequantize(dtype) if isinstance(w, Fp8Weight) else w

    def fused(*names: str):
        return fuse([dense(n) for n in names], dtype)

    def f32(name: str) -> torch.Tensor:
        return state[prefix + name].to(device=device, dtype=torch.float32)

    def norm(name: str) -> torch.Tensor:
        # float32, as transformers computes norms; Qwen3.5's are zero-centred (scale = 1 + w)
        return 1.0 + f32(name) if shape.hybrid else f32(name)

    embed = take("embed_tokens.weight")
    lm_head = take("lm_head.weight", full=True) if "lm_head.weight" in state else None
    layers = []
    for i, kind in enumerate(shape.layer_types):
        p = f"layers.{i}."
        common = dict(in_norm=norm(p + "input_layernorm.weight"), post_norm=norm(p + "post_attention_layernorm.weight"),
                      gate_up=fused(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                      down=dense(p + "mlp.down_proj.weight"))
        if kind == "full_attention":
            a = p + "self_attn."
            q, k, v = (dense(a + f"{n}_proj.weight") for n in "qkv")
            # one GEMM for q, k and v, unless that would dequantize FP8 projections whose scales
            # differ (fp8.fuse): then q alone and k/v fused, as they are calibrated
            fp8 = any(isinstance(w, Fp8Weight) for w in (q, k, v))
            gate = None
            if shape.hybrid and not fp8:
                # Qwen3.5's query rows are per head [query dims, gate dims]: the queries of every
                # head first, then the gates, so that queries and keys sit side by side
                q, gate = (t.reshape(-1, t.shape[-1]) for t in q.view(shape.heads, 2, shape.head_dim, -1).unbind(1))
            qkv = fuse([q, k, v] if gate is None else [q, k, gate, v], dtype)
            split = fp8 and not isinstance(qkv, Fp8Weight)
            layers.append(AttentionLayer(shape, qkv=q if split else qkv, kv=fuse([k, v], dtype) if split else None,
                                         o=dense(a + "o_proj.weight"), q_norm=norm(a + "q_norm.weight"),
                                         k_norm=norm(a + "k_norm.weight"), gate_apart=gate is not None, **common))
        elif kind == "linear_attention":
            a = p + "linear_attn."
            layers.append(DeltaNetLayer(
                shape, in_proj=fused(*(a + f"in_proj_{n}.weight" for n in ("qkv", "z", "b", "a"))),
                conv=take(a + "conv1d.weight"), dt_bias=take(a + "dt_bias"), neg_A=-f32(a + "A_log").exp(),
                gated_norm=state[prefix + a + "norm.weight"].to(device=device, dtype=dtype),
                out=dense(a + "out_proj.weight"), **common))
        else:
            raise CheckpointError(f"unsupported layer type {kind!r}")
    return embed, lm_head, norm("norm.weight"), layers
