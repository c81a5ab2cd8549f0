"""Qwen3.5 (hybrid Gated DeltaNet + gated attention) and Qwen3 (dense) judges in plain PyTorch,
with exact shared-prefix reuse.

Requests that share a prompt prefix (LAVE: task description + demonstrations) run the prefix
once. Its state is kept in a byte-budgeted cache indexed by a C++ radix tree: the K/V of every
full-attention layer and, for every Gated DeltaNet layer, the convolution state (last
``kernel - 1`` inputs) and the recurrent state at the prefix end. Suffixes then continue from it
in batches.

Exactness with batching: suffixes are right-padded and each row is read at its own last token.
Every operation is causal (attention with a causal mask, causal depthwise conv, the chunked
delta rule), so padding placed after a row's last token never reaches that token's output, and
the padded rows' final states are never kept.

The Gated DeltaNet math (chunked and recurrent gated delta rule) is transformers' reference
implementation, called as a function; the engine owns batching, masking, state and heads.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from fastjudge.kernels.choice_head import choice_logits

from ..runtime.requests import Choice, Image, Output, Request, Text, choice_probs
from .fp8 import Fp8Weight, fp8_gemm_supported, fuse, linear, projection_weight
from .loading import CheckpointError, load_state_dict, read_config, resolve_device, resolve_dtype
from .qwen_vision import image_token_count, mrope_positions

log = logging.getLogger("fastjudge")

QWEN_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3")
DEFAULT_PREFIX_CACHE_BYTES = 2 << 30  # 2 GiB: thousands of LAVE prefixes of a small judge
SHORT_CONV_STEPS = 8  # up to this many new tokens, the causal conv runs as a windowed product
PREFIX_TOKENS_MEMO = 4096  # formatted prefixes whose tokens are remembered
DEFAULT_IMAGE_CACHE_BYTES = 512 << 20  # vision embeddings of recent images and crops


@dataclass(frozen=True)
class QwenShape:
    arch: str
    vocab_size: int
    hidden: int
    num_layers: int
    heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    eps: float
    layer_types: tuple[str, ...]
    hybrid: bool  # Qwen3.5: zero-centred norms, gated attention output, DeltaNet layers
    max_positions: int
    lin_k_heads: int = 0
    lin_v_heads: int = 0
    lin_k_dim: int = 0
    lin_v_dim: int = 0
    conv_kernel: int = 0
    # M-RoPE (multimodal Qwen3.5): rotary frequency pairs taken from the t/h/w position rows,
    # interleaved (transformers' default when the config names none)
    mrope_section: tuple[int, ...] = (11, 11, 10)

    @classmethod
    def from_config(cls, cfg: dict) -> "QwenShape":
        model_type = cfg.get("model_type")
        text = cfg.get("text_config", cfg) if model_type == "qwen3_5" else cfg
        hybrid = model_type in ("qwen3_5", "qwen3_5_text")
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
        partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0))
        if rope.get("rope_type", "default") not in ("default",) and not rope.get("mrope_section"):
            raise CheckpointError(f"rope type {rope.get('rope_type')!r} is not supported")
        n = text["num_hidden_layers"]
        layer_types = tuple(text.get("layer_types") or ["full_attention"] * n)
        return cls(
            arch=model_type, vocab_size=text["vocab_size"], hidden=text["hidden_size"],
            num_layers=n, heads=text["num_attention_heads"], kv_heads=text["num_key_value_heads"],
            head_dim=head_dim, rotary_dim=int(head_dim * partial),
            rope_theta=rope.get("rope_theta", text.get("rope_theta", 10000.0)),
            eps=text.get("rms_norm_eps", 1e-6), layer_types=layer_types, hybrid=hybrid,
            max_positions=text.get("max_position_embeddings", 32768),
            lin_k_heads=text.get("linear_num_key_heads", 0),
            lin_v_heads=text.get("linear_num_value_heads", 0),
            lin_k_dim=text.get("linear_key_head_dim", 0),
            lin_v_dim=text.get("linear_value_head_dim", 0),
            conv_kernel=text.get("linear_conv_kernel_dim", 0),
            mrope_section=tuple(rope.get("mrope_section") or (11, 11, 10)),
        )


def _delta_rule():
    """transformers' reference gated-delta-rule functions (chunked for prefill, recurrent for
    one-token steps)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    return m.torch_chunk_gated_delta_rule, m.torch_recurrent_gated_delta_rule


class QwenWeights:
    """The language model's tensors, projections fused where they read the same input. A state
    with FP8 weights (``load_state_dict(keep_fp8=True)``) gives :class:`fp8.Fp8Weight`
    projections, run as FP8 GEMMs; every other tensor is dequantized."""

    def __init__(self, state: dict[str, torch.Tensor], shape: QwenShape, device, dtype):
        prefix = "model.language_model." if any(k.startswith("model.language_model.") for k in state) \
            else "model."

        def take(name: str, full: bool = False) -> torch.Tensor:
            w = dense(name, full)
            return w.dequantize(dtype) if isinstance(w, Fp8Weight) else w

        def dense(name: str, full: bool = False):
            key = name if full else prefix + name
            if key not in state:
                raise CheckpointError(f"checkpoint lacks tensor {key!r}")
            return projection_weight(state, key, device, dtype)

        def fused(*names: str):
            return fuse([dense(n) for n in names], dtype)

        def norm(name: str) -> torch.Tensor:
            # Kept in float32: norms are computed in float32 as transformers does. Qwen3.5's
            # norms are zero-centred (scale = 1 + w).
            w = state[prefix + name].to(device=device, dtype=torch.float32)
            return 1.0 + w if shape.hybrid else w

        self.embed = take("embed_tokens.weight")
        self.lm_head = take("lm_head.weight", full=True) if "lm_head.weight" in state else self.embed
        self.final_norm = norm("norm.weight")
        self.layers = []
        for i, kind in enumerate(shape.layer_types):
            p = f"layers.{i}."
            layer = {"kind": kind, "in_norm": norm(p + "input_layernorm.weight"),
                     "post_norm": norm(p + "post_attention_layernorm.weight"),
                     "gate_up": fused(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                     "down": dense(p + "mlp.down_proj.weight")}
            if kind == "full_attention":
                a = p + "self_attn."
                layer.update(q=dense(a + "q_proj.weight"),
                             kv=fused(a + "k_proj.weight", a + "v_proj.weight"),
                             o=dense(a + "o_proj.weight"), q_norm=norm(a + "q_norm.weight"),
                             k_norm=norm(a + "k_norm.weight"))
            elif kind == "linear_attention":
                a = p + "linear_attn."
                layer.update(
                    in_proj=fused(*(a + f"in_proj_{n}.weight" for n in ("qkv", "z", "b", "a"))),
                    conv=take(a + "conv1d.weight"), dt_bias=take(a + "dt_bias"),
                    neg_A=-state[prefix + a + "A_log"].to(device=device, dtype=torch.float32).exp(),
                    gated_norm=state[prefix + a + "norm.weight"].to(device=device, dtype=dtype),
                    out=dense(a + "out_proj.weight"))
            else:
                raise CheckpointError(f"unsupported layer type {kind!r}")
            self.layers.append(layer)


def rms(x: torch.Tensor, weight_f32: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x.float(), (x.shape[-1],), weight_f32, eps).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class PrefixState:
    """Model state at the end of a prefix: per layer (k, v) or (conv_state, recurrent_state).

    ``length`` counts tokens; ``next_position`` is the rotary position of the next token, which
    differs from ``length`` after an image (M-RoPE: text after an image continues from the
    largest position so far + 1). It defaults to ``length``."""

    def __init__(self, layers: list[tuple[torch.Tensor, torch.Tensor]], length: int,
                 next_position: int | None = None):
        self.layers = layers
        self.length = length
        self.next_position = length if next_position is None else next_position

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.layers for t in pair)


class QwenModel:
    def __init__(self, weights: QwenWeights, shape: QwenShape):
        self.w = weights
        self.s = shape
        self.chunk_rule, self.step_rule = _delta_rule() if shape.hybrid else (None, None)
        rd = shape.rotary_dim
        self.inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd))

    def _rope(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for ``positions``: ``[S]`` (text), ``[3, S]`` (M-RoPE, shared by all rows) or
        ``[3, B, S]`` (M-RoPE per row; the result then broadcasts over heads as [B, 1, S, rd])."""
        inv_freq = self.inv_freq.to(positions.device)
        if positions.dim() >= 2:  # M-RoPE: t/h/w frequencies interleaved per mrope_section
            freqs = positions.float()[..., None] * inv_freq
            mixed = freqs[0].clone()
            for dim, offset in ((1, 1), (2, 2)):
                idx = slice(offset, self.s.mrope_section[dim] * 3, 3)
                mixed[..., idx] = freqs[dim, ..., idx]
            emb = torch.cat([mixed, mixed], dim=-1)
            if emb.dim() == 3:
                emb = emb[:, None]
            return emb.cos().to(dtype), emb.sin().to(dtype)
        freqs = positions.float()[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _apply_rope(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        rd = self.s.rotary_dim
        rot, rest = x[..., :rd], x[..., rd:]
        return torch.cat([rot * cos + rotate_half(rot) * sin, rest], dim=-1)

    def _mlp(self, x, layer):
        h = rms(x, layer["post_norm"], self.s.eps)
        gate, up = linear(h, layer["gate_up"]).chunk(2, dim=-1)
        return linear(F.silu(gate) * up, layer["down"])

    def _qkv(self, x, layer, positions):
        """Queries [B, H, S, hd], keys and values [B, Hkv, S, hd] (normed, rotated) and the
        output gate (Qwen3.5) of ``x`` [B, S, d]."""
        s = self.s
        B, S, _ = x.shape
        H, Hkv, hd = s.heads, s.kv_heads, s.head_dim
        q = linear(x, layer["q"])
        gate = None
        if s.hybrid:
            q, gate = q.view(B, S, H, 2 * hd).chunk(2, dim=-1)
            gate = gate.reshape(B, S, H * hd)
        else:
            q = q.view(B, S, H, hd)
        k, v = linear(x, layer["kv"]).view(B, S, 2, Hkv, hd).unbind(2)
        q = rms(q, layer["q_norm"], s.eps).transpose(1, 2)
        k = rms(k, layer["k_norm"], s.eps).transpose(1, 2)
        cos, sin = self._rope(positions, x.dtype)
        return self._apply_rope(q, cos, sin), self._apply_rope(k, cos, sin), v.transpose(1, 2), gate

    def _attention_out(self, o, gate, layer):
        B, _, S, _ = o.shape
        o = o.transpose(1, 2).reshape(B, S, -1)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return linear(o, layer["o"])

    def _attention(self, x, layer, prev, positions, save):
        B, S, _ = x.shape
        q, k, v, gate = self._qkv(x, layer, positions)
        P = 0
        if prev is not None:
            pk, pv = prev
            P = pk.shape[2]
            k = torch.cat([pk.expand(B, -1, -1, -1), k], dim=2)
            v = torch.cat([pv.expand(B, -1, -1, -1), v], dim=2)
        gqa = self.s.kv_heads != self.s.heads
        if P == 0:  # plain causal attention: SDPA's own causal kernel, no mask tensor
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            # query i sees the whole prefix and suffix keys up to itself; an additive float mask
            # (a boolean one sends CPU SDPA to a much slower path)
            hide = torch.full((S, P + S), float("-inf"), dtype=q.dtype, device=x.device).triu(diagonal=P + 1)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=hide, enable_gqa=gqa)
        return self._attention_out(o, gate, layer), ((k, v) if save else None)

    def _delta_net(self, x, layer, prev, save):
        s = self.s
        B, S, _ = x.shape
        key_dim, val_dim = s.lin_k_heads * s.lin_k_dim, s.lin_v_heads * s.lin_v_dim
        conv_dim = 2 * key_dim + val_dim
        proj = linear(x, layer["in_proj"])
        mixed, z, b, a = proj.split([conv_dim, val_dim, s.lin_v_heads, s.lin_v_heads], dim=-1)
        K = s.conv_kernel
        inputs = mixed.transpose(1, 2)  # [B, C, S]
        history = prev[0].expand(B, -1, -1) if prev is not None else inputs.new_zeros(B, conv_dim, K - 1)
        window = torch.cat([history, inputs], dim=-1)
        if S <= SHORT_CONV_STEPS:  # decoding steps: a windowed product beats conv1d's setup cost
            conv = F.silu((window.unfold(-1, K, 1) * layer["conv"][:, None, 0, :]).sum(-1))
        else:
            conv = F.silu(F.conv1d(window, layer["conv"], groups=conv_dim))  # causal: no future input
        q, k, v = conv.transpose(1, 2).split([key_dim, key_dim, val_dim], dim=-1)
        q = q.reshape(B, S, s.lin_k_heads, s.lin_k_dim)
        k = k.reshape(B, S, s.lin_k_heads, s.lin_k_dim)
        v = v.reshape(B, S, s.lin_v_heads, s.lin_v_dim)
        beta = b.sigmoid()
        g = layer["neg_A"] * F.softplus(a.float() + layer["dt_bias"])
        initial = prev[1].expand(B, -1, -1, -1) if prev is not None else None
        rule = self.step_rule if (S == 1 and prev is not None) else self.chunk_rule
        core, final = rule(q, k, v, g=g, beta=beta, initial_state=initial,
                           output_final_state=save, use_qk_l2norm_in_kernel=True)
        # gated RMSNorm: normalise in float32, scale, gate with silu(z)
        normed = F.rms_norm(core.float(), (s.lin_v_dim,), None, s.eps).to(core.dtype) * layer["gated_norm"]
        gated = (normed.float() * F.silu(z.reshape(B, S, s.lin_v_heads, s.lin_v_dim).float())).to(x.dtype)
        out = linear(gated.reshape(B, S, val_dim), layer["out"])
        return out, ((window[:, :, -(K - 1):], final) if save else None)

    def forward(self, ids: torch.Tensor, prev: PrefixState | None, save: bool = False,
                image_embeds: torch.Tensor | None = None, image_mask: torch.Tensor | None = None,
                positions: torch.Tensor | None = None):
        """Hidden states [B, S, d] of ``ids`` [B, S] continuing from ``prev`` (shared by all
        rows); with ``save``, also the state at the end of the rows (meaningful for unpadded rows).

        Images (multimodal Qwen3.5): ``image_embeds`` [N, d] replace the token embeddings where
        ``image_mask`` [B, S] is true (row-major order, as transformers' masked_scatter), and
        ``positions`` [3, S] (shared by all rows) or [3, B, S] (per row) are the M-RoPE t/h/w
        positions (``qwen_vision.mrope_positions``). Without ``positions``:
        ``prev.next_position`` onwards, the same on all three rows. The saved state's
        ``next_position`` is computed from row 0 (states are only saved for single rows)."""
        s = self.s
        B, S = ids.shape
        start = prev.length if prev is not None else 0
        start_pos = prev.next_position if prev is not None else 0
        if positions is None:
            positions = torch.arange(start_pos, start_pos + S, device=ids.device)
            next_position = start_pos + S
        else:
            positions = positions.to(ids.device)
            if tuple(positions.shape) not in ((3, S), (3, B, S)):
                raise ValueError(f"positions must be [3, {S}] or [3, {B}, {S}] M-RoPE positions, "
                                 f"got {tuple(positions.shape)}")
            next_position = int((positions if positions.dim() == 2 else positions[:, 0]).max()) + 1
        x = F.embedding(ids, self.w.embed)
        if image_embeds is not None:
            if image_mask is None or int(image_mask.sum()) != image_embeds.shape[0]:
                raise ValueError("image_embeds need an image_mask with one true entry per embedding")
            x = x.masked_scatter(image_mask.to(x.device)[..., None], image_embeds.to(x.device, x.dtype))
        states = []
        for i, layer in enumerate(self.w.layers):
            h = rms(x, layer["in_norm"], s.eps)
            p = prev.layers[i] if prev is not None else None
            if layer["kind"] == "full_attention":
                h, st = self._attention(h, layer, p, positions, save)
            else:
                h, st = self._delta_net(h, layer, p, save)
            x = x + h
            x = x + self._mlp(x, layer)
            states.append(st)
        return x, (PrefixState(states, start + S, next_position) if save else None)

    def logits(self, hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of the final states: the candidate ``rows`` through the fused choice head
        (never ``[B, vocab]``), or the full vocabulary for decoding."""
        if rows is not None:
            return choice_logits(hidden, self.w.final_norm, self.w.lm_head, rows, eps=self.s.eps)
        return F.linear(rms(hidden, self.w.final_norm, self.s.eps), self.w.lm_head).float()


    def decode_step(self, tokens: torch.Tensor, cache: "DecodeCache") -> torch.Tensor:
        """One greedy-decoding step for every row of ``cache``: hidden states [B, d] of
        ``tokens`` [B], each row at its own length and position; the cache advances in place."""
        s = self.s
        B = tokens.shape[0]
        x = F.embedding(tokens[:, None], self.w.embed)
        positions = cache.positions[None, :, None].expand(3, B, 1)
        cache.reserve(1)
        rows = torch.arange(B, device=tokens.device)
        # additive mask: each row sees its own keys only (a float mask keeps SDPA on its fused
        # CPU kernel; a boolean one falls back to a much slower path there)
        hide = None
        if cache.capacity:
            visible = torch.arange(cache.capacity, device=tokens.device)[None, :] <= cache.lengths[:, None]
            hide = torch.zeros(B, 1, 1, cache.capacity, dtype=x.dtype, device=tokens.device)
            hide.masked_fill_(~visible[:, None, None, :], float("-inf"))
        for i, layer in enumerate(self.w.layers):
            h = rms(x, layer["in_norm"], s.eps)
            if layer["kind"] == "full_attention":
                q, k, v, gate = self._qkv(h, layer, positions)
                kb, vb = cache.layers[i]
                kb[rows, :, cache.lengths] = k[:, :, 0]
                vb[rows, :, cache.lengths] = v[:, :, 0]
                o = F.scaled_dot_product_attention(q, kb, vb, attn_mask=hide,
                                                   enable_gqa=s.kv_heads != s.heads)
                h = self._attention_out(o, gate, layer)
            else:
                h, cache.layers[i] = self._delta_net(h, layer, cache.layers[i], True)
            x = x + h
            x = x + self._mlp(x, layer)
        cache.lengths += 1
        cache.positions += 1
        return x[:, 0]


class DecodeCache:
    """Per-row decoding state of a batch: K/V buffers of the full-attention layers (rows of
    different lengths right-padded; a row attends to its own length only) that grow by doubling,
    and the DeltaNet conv/recurrent states stacked over rows."""

    def __init__(self, states: Sequence[PrefixState], shape: QwenShape, room: int, device):
        first = states[0].layers
        self.lengths = torch.tensor([st.length for st in states], device=device)
        self.positions = torch.tensor([st.next_position for st in states], device=device)
        longest = int(self.lengths.max())
        self.layers: list = []
        for i, kind in enumerate(shape.layer_types):
            if kind == "full_attention":
                k0 = first[i][0]
                bufs = [k0.new_zeros(len(states), k0.shape[1], longest + room, k0.shape[3]) for _ in range(2)]
                for b, st in enumerate(states):
                    for buf, t in zip(bufs, st.layers[i]):
                        buf[b, :, : t.shape[2]] = t[0]
                self.layers.append(bufs)
            else:
                self.layers.append(tuple(torch.cat([st.layers[i][j] for st in states]) for j in range(2)))
        self.kinds = shape.layer_types

    @property
    def capacity(self) -> int:
        """Length of the K/V buffers (0 without full-attention layers)."""
        return next((pair[0].shape[2] for kind, pair in zip(self.kinds, self.layers) if kind == "full_attention"), 0)

    def reserve(self, steps: int) -> None:
        """Room for ``steps`` more tokens in every K/V buffer (doubling when short)."""
        need = int(self.lengths.max()) + steps
        for i, kind in enumerate(self.kinds):
            if kind != "full_attention" or self.layers[i][0].shape[2] >= need:
                continue
            self.layers[i] = [torch.cat([b, torch.zeros_like(b)[:, :, : max(need - b.shape[2], b.shape[2])]], dim=2)
                              for b in self.layers[i]]


class TorchQwenBackend:
    """Decoder-only judge backend with exact shared-prefix reuse."""

    kind = "decoder-only"

    def __init__(self, model_dir: str | os.PathLike, device: str = "auto", dtype=None,
                 allow_pickle: bool = False, max_input_tokens: int | None = None,
                 prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES, fp8_gemm: bool | None = None):
        """``fp8_gemm``: run an FP8 checkpoint's quantized projections as FP8 GEMMs
        (``torch._scaled_mm``) instead of dequantizing them at load; default: on CUDA devices
        with FP8 tensor cores (compute capability 8.9+)."""
        from transformers import AutoTokenizer

        from ..runtime.prefix_cache import PrefixCache

        cfg = read_config(model_dir)
        if cfg.get("model_type") not in QWEN_MODEL_TYPES:
            raise CheckpointError(f"{model_dir}: model_type {cfg.get('model_type')!r} is not a Qwen3/3.5 model")
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.shape = QwenShape.from_config(cfg)
        if fp8_gemm is None:
            fp8_gemm = fp8_gemm_supported(self.device)
        state = load_state_dict(model_dir, allow_pickle=allow_pickle, keep_fp8=fp8_gemm)
        self.model = QwenModel(QwenWeights(state, self.shape, self.device, self.dtype), self.shape)
        self.vision = None
        if cfg.get("vision_config"):
            self._init_vision(model_dir, cfg, state)
        del state
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.max_input_tokens = max_input_tokens or self.shape.max_positions
        self.default_batch_tokens = 65536 if self.device.type == "cuda" else 8192
        eos = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.eos_token_ids = {t for t in (eos, self.tokenizer.eos_token_id) if isinstance(t, int) and t >= 0}
        self.pad_token_id = self.tokenizer.pad_token_id or 0
        self.prefix_cache = PrefixCache(prefix_cache_bytes)
        # formatted-prefix tokens by prefix text; bounded, since image-text judges have one
        # prefix per example
        self._prefix_ids: OrderedDict[str, np.ndarray] = OrderedDict()
        self._grammars = None  # runtime.grammar.GrammarCache, built on the first Json request
        self.tokens_computed = 0  # real (non-padding) tokens run through the model
        log.info("fastjudge: loaded %s judge %s on %s (%s)", self.shape.arch, model_dir, self.device,
                 str(self.dtype).replace("torch.", ""))

    def _init_vision(self, model_dir, cfg: dict, state: dict) -> None:
        """The vision tower, image token ids and image preprocessing of a multimodal checkpoint."""
        from fastjudge.kernels.crop_encode import CropEncodeConfig

        from .qwen_vision import QwenVision

        self.vision = QwenVision(cfg, state, self.device, self.dtype)
        self.image_token_id = cfg["image_token_id"]
        self.vision_start_id = cfg["vision_start_token_id"]
        self.vision_end_id = cfg["vision_end_token_id"]
        # Image preprocessing (crop_encode) follows the checkpoint's preprocessor config; a
        # checkpoint without one can still run images given as ready pixel values.
        pre = os.path.join(model_dir, "preprocessor_config.json")
        self.image_config = CropEncodeConfig.from_preprocessor_config(model_dir) if os.path.exists(pre) else None
        self._image_embeds = ImageEmbeddingCache(DEFAULT_IMAGE_CACHE_BYTES)

    @property
    def multimodal(self) -> bool:
        return self.vision is not None

    def image_placeholder(self, grid_thw) -> str:
        """Prompt text standing for one image of this grid: vision start, one image-pad token
        per merged patch, vision end (what the Qwen processor expands an image to)."""
        if self.vision is None:
            raise ValueError("this checkpoint has no vision tower (not a multimodal Qwen3.5)")
        tok = self.tokenizer.convert_ids_to_tokens
        n = image_token_count(grid_thw, self.vision.spatial_merge_size)
        return tok(self.vision_start_id) + tok(self.image_token_id) * n + tok(self.vision_end_id)

    # -- text <-> tokens -------------------------------------------------------------------------
    def format_prompt(self, text: str) -> str:
        """The user turn and an open assistant turn, through the checkpoint's chat template with
        thinking disabled (Qwen3/3.5 templates then open the answer with an empty
        <think></think> block). Without a template: the same turn structure written out."""
        messages = [{"role": "user", "content": text}]
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                      enable_thinking=False)
        return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"

    def _ids(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer(text, add_special_tokens=False).input_ids, dtype=np.int64)

    def encode_prompt(self, text: str) -> np.ndarray:
        return self._ids(self.format_prompt(text))

    def shared_prefix_len(self, ids: np.ndarray, prefix_text: str) -> int:
        """How many leading tokens of ``ids`` (an encoded prompt whose text starts with
        ``prefix_text``) are the shared prefix: the tokens of the formatted prefix that the full
        prompt's tokenization agrees with, leaving at least one token to run per request."""
        if not prefix_text:
            return 0
        cached = self._prefix_ids.get(prefix_text)
        if cached is None:
            formatted = self.format_prompt(prefix_text)
            cut = formatted.rfind(prefix_text)
            cached = self._ids(formatted[: cut + len(prefix_text)])
            self._prefix_ids[prefix_text] = cached
            if len(self._prefix_ids) > PREFIX_TOKENS_MEMO:
                self._prefix_ids.popitem(last=False)
        n = min(len(cached), len(ids) - 1)
        mismatch = np.nonzero(cached[:n] != ids[:n])[0]
        # Exact by construction: the shared part is this prompt's own leading tokens. A prompt
        # whose tokens diverge early at the boundary gets a shorter prefix (another group).
        return int(mismatch[0] if len(mismatch) else n)

    def response_ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    # -- planning hooks ---------------------------------------------------------------------------
    def cost(self, request: Request) -> int:
        return request.num_tokens - request.prefix_len

    def group_key(self, request: Request):
        """Requests that can share one prefix state (the planner never mixes groups): the same
        prefix tokens and, image tokens being the same ids for every image, the same images."""
        ids, images = self._prefix_of(request)
        return ids.tobytes() + b"".join(im.key for im in images)

    # -- images -----------------------------------------------------------------------------------
    def _image_runs(self, ids: np.ndarray) -> list[tuple[int, int]]:
        """(start, end) of each run of image tokens in ``ids``."""
        if self.vision is None:
            return []
        is_image = np.concatenate([[False], ids == self.image_token_id, [False]])
        edges = np.flatnonzero(is_image[1:] != is_image[:-1])
        return list(zip(edges[::2].tolist(), edges[1::2].tolist()))

    def _prefix_of(self, request: Request) -> tuple[np.ndarray, tuple[Image, ...]]:
        """The shared prefix's tokens and the images inside it."""
        ids = request.prompt_ids[: request.prefix_len]
        runs = self._image_runs(request.prompt_ids)
        if len(runs) != len(request.images):
            raise ValueError(f"request {request.index}: {len(runs)} image-token runs but "
                             f"{len(request.images)} images")
        inside = sum(1 for _, end in runs if end <= request.prefix_len)
        if any(start < request.prefix_len < end for start, end in runs):
            raise ValueError(f"request {request.index}: the shared prefix ends inside an image")
        return ids, request.images[:inside]

    @staticmethod
    def _cache_key(ids: np.ndarray, images: Sequence[Image]) -> np.ndarray:
        """Prefix-cache key: the tokens, with each image's identity written in as negative words
        at the end (never a token id), so prefixes with different images never match."""
        if not images:
            return ids
        words = [np.frombuffer(hashlib.blake2b(im.key, digest_size=16).digest(), dtype="<i8")
                 for im in images]
        return np.concatenate([ids] + [-(w & np.int64(0x7FFFFFFFFFFFFFFF)) - 1 for w in words])

    def _embed(self, images: Sequence[Image]) -> torch.Tensor | None:
        """Vision embeddings of ``images`` concatenated in order; images not cached are encoded
        together in one vision-tower call."""
        if not images:
            return None
        missing = list({im.key: im for im in images if im.key not in self._image_embeds}.values())
        if missing:
            pixels = torch.cat([torch.as_tensor(im.pixel_values) for im in missing])
            grids = torch.tensor([im.grid_thw for im in missing], dtype=torch.long)
            embeds = self.vision.encode(pixels, grids)
            counts = [image_token_count(im.grid_thw, self.vision.spatial_merge_size) for im in missing]
            for im, e in zip(missing, embeds.split(counts)):
                self._image_embeds.put(im.key, e)
        return torch.cat([self._image_embeds.get(im.key) for im in images])

    def _positions(self, rows: Sequence[np.ndarray], images: Sequence[Sequence[Image]], start: int,
                   width: int) -> torch.Tensor | None:
        """[3, B, width] M-RoPE positions of right-padded rows continuing from ``start``; None when
        no row has an image (plain positions then)."""
        if not any(images):
            return None
        out = torch.empty(3, len(rows), width, dtype=torch.long)
        for b, (ids, ims) in enumerate(zip(rows, images)):
            grids = [im.grid_thw for im in ims] or None
            pos = mrope_positions(ids, grids, self.vision.spatial_merge_size, self.image_token_id, start)
            out[:, b, : len(ids)] = pos
            tail = int(pos.max()) + 1 if len(ids) else start
            out[:, b, len(ids):] = torch.arange(tail, tail + width - len(ids))
        return out

    # -- execution --------------------------------------------------------------------------------
    def _prefix_state(self, ids: np.ndarray, images: Sequence[Image]) -> tuple[int | None, PrefixState | None]:
        if len(ids) == 0:
            return None, None
        key = self._cache_key(ids, images)
        slot, state = self.prefix_cache.lookup(key)
        if state is None:
            t = torch.from_numpy(ids).to(self.device)[None]
            positions = self._positions([ids], [images], 0, len(ids))
            _, state = self.model.forward(t, None, save=True, image_embeds=self._embed(images),
                                          image_mask=t == self.image_token_id if images else None,
                                          positions=positions)
            self.tokens_computed += len(ids)
            slot = self.prefix_cache.insert(key, state)
        return slot, state

    @torch.inference_mode()
    def run(self, batch: Sequence[Request]) -> list[Output]:
        prefix, images = self._prefix_of(batch[0])
        key = self.group_key(batch[0])
        if any(self.group_key(r) != key for r in batch):
            raise ValueError("a batch must share one prefix")
        slot, state = self._prefix_state(prefix, images)
        try:
            if isinstance(batch[0].spec, Choice):
                return self._run_choice(batch, state)
            return self._generate(batch, state)
        finally:
            if slot is not None:
                self.prefix_cache.release(slot)

    def _suffix(self, request: Request) -> tuple[np.ndarray, tuple[Image, ...]]:
        """Tokens to run after the prefix state (prompt rest + forced response start) and the
        images among them."""
        ids = np.concatenate([request.prompt_ids[request.prefix_len:],
                              np.asarray(request.response_prefix, dtype=np.int64)])
        prefix_images = len(self._prefix_of(request)[1])
        return ids, request.images[prefix_images:]

    def _forward_rows(self, rows: Sequence[np.ndarray], images: Sequence[Sequence[Image]],
                      state: PrefixState | None, save: bool = False):
        """Right-padded rows continuing from ``state``, with their images."""
        S = max(len(x) for x in rows)
        self.tokens_computed += sum(len(x) for x in rows)
        ids = torch.full((len(rows), S), self.pad_token_id, dtype=torch.long)
        for i, x in enumerate(rows):
            ids[i, : len(x)] = torch.from_numpy(x)
        ids = ids.to(self.device)
        flat = [im for ims in images for im in ims]
        start = state.next_position if state is not None else 0
        return self.model.forward(ids, state, save=save, image_embeds=self._embed(flat),
                                  image_mask=ids == self.image_token_id if flat else None,
                                  positions=self._positions(rows, images, start, S))

    def _run_choice(self, batch, state) -> list[Output]:
        suffixes = [self._suffix(r) for r in batch]
        rows = [ids for ids, _ in suffixes]
        hidden, _ = self._forward_rows(rows, [ims for _, ims in suffixes], state)
        last = torch.tensor([len(x) - 1 for x in rows], device=self.device)
        final = hidden[torch.arange(len(batch), device=self.device), last]
        if len({r.spec.token_ids for r in batch}) == 1:
            cand = torch.tensor(batch[0].spec.token_ids, device=self.device)
        else:  # per-row candidate sets (e.g. a rationale's constrained follow-up beside plain rows)
            width = max(len(r.spec.token_ids) for r in batch)
            cand = torch.tensor([list(r.spec.token_ids) + [r.spec.token_ids[0]] * (width - len(r.spec.token_ids))
                                 for r in batch], device=self.device)
        logits = self.model.logits(final, cand).cpu().numpy().astype(np.float64)
        outputs = []
        for r, z in zip(batch, logits):
            z = z[: len(r.spec.token_ids)]
            outputs.append(Output(index=r.index, logits=z, probs=choice_probs(z)))
        return outputs

    def _matcher(self, spec):
        """A grammar matcher for a Json spec (None for Text)."""
        if isinstance(spec, Text):
            return None
        from ..runtime.grammar import GrammarCache


        if self._grammars is None:
            self._grammars = GrammarCache(self.tokenizer, self.shape.vocab_size, self.eos_token_ids)
        return self._grammars.matcher(spec)

    def _generate(self, batch: Sequence[Request], state: PrefixState | None) -> list[Output]:
        """Greedy decoding of a batch that shares one prefix state (and one Text/Json spec):
        each row's suffix runs alone from the prefix state (exact: no padding), then all rows
        decode together, one token per row per step; Json rows under their grammar."""
        spec = batch[0].spec
        matchers = [self._matcher(r.spec) for r in batch]
        last, states = [], []
        for r in batch:
            ids, images = self._suffix(r)
            hidden, st = self._forward_rows([ids], [images], state, save=True)
            last.append(hidden[:, -1])
            states.append(st)
        hidden = torch.cat(last)
        cache = DecodeCache(states, self.shape, min(spec.max_new_tokens, 256), self.device)
        del states, last
        track = torch.tensor(spec.track_ids, device=self.device) if getattr(spec, "track_ids", ()) else None
        tokens = [[] for _ in batch]
        tracked = [[] for _ in batch]
        finished = [False] * len(batch)
        done = [False] * len(batch)
        for _ in range(spec.max_new_tokens):
            logits = self.model.logits(hidden)
            step = []
            for b, matcher in enumerate(matchers):
                if done[b]:
                    step.append(self.pad_token_id)
                    continue
                z = logits[b] if matcher is None else matcher.mask(logits[b])
                token = int(z.argmax())
                if matcher is not None:
                    matcher.accept(token)
                if token in self.eos_token_ids:
                    finished[b] = done[b] = True
                else:
                    tokens[b].append(token)
                    if track is not None:
                        tracked[b].append(logits[b, track])
                    done[b] = len(tokens[b]) == spec.max_new_tokens
                step.append(token)
            if all(done):
                break
            self.tokens_computed += sum(not d for d in done)
            hidden = self.model.decode_step(torch.tensor(step, device=self.device), cache)
        outputs = []
        for b, r in enumerate(batch):
            out = Output(index=r.index, token_ids=tokens[b],
                         finished=matchers[b].finished if matchers[b] is not None else finished[b])
            if track is not None:
                out.tracked_logits = (torch.stack(tracked[b]).cpu().numpy().astype(np.float64) if tracked[b]
                                      else np.zeros((0, len(spec.track_ids))))
            outputs.append(out)
        return outputs


class ImageEmbeddingCache:
    """Vision embeddings by image key, least recently used evicted beyond a byte budget (the
    same image or crop is asked for by many requests: every claim of a caption)."""

    def __init__(self, capacity_bytes: int):
        self.capacity = capacity_bytes
        self.bytes = 0
        self.entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    def __contains__(self, key: bytes) -> bool:
        return key in self.entries

    def get(self, key: bytes) -> torch.Tensor:
        self.entries.move_to_end(key)
        return self.entries[key]

    def put(self, key: bytes, embeds: torch.Tensor) -> None:
        if key in self.entries:
            return
        self.entries[key] = embeds
        self.bytes += embeds.numel() * embeds.element_size()
        while self.bytes > self.capacity and len(self.entries) > 1:
            _, old = self.entries.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()
