"""Qwen3.5 (hybrid Gated DeltaNet + gated attention) and Qwen3 (dense) language models in plain
PyTorch: the model math only (weights, one forward pass over batched rows that continues from a
prefix state, logits, batched decoding steps of one or several tokens per row); the shape is
``qwen_shape``.

Every operation is causal (attention with a causal mask, causal depthwise conv, the chunked delta
rule), so what follows a row's last token never reaches that token's output.

The Gated DeltaNet math (chunked and recurrent gated delta rule) is ``gated_delta``; this module
owns batching, masking, state and heads.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from fastjudge.kernels.choice_head import choice_logits

from .compiled import row_bucket, width_bucket
from .fp8 import linear
from .gated_delta import chunk_gated_delta_rule, recurrent_gated_delta_rule
from .qwen_layers import build_layers
from .qwen_shape import QwenShape

SHORT_CONV_STEPS = 8  # up to this many new tokens, the causal conv runs as a windowed product
# The chunked delta rule pads every chunk to full length: an input of up to ONE_CHUNK_STEPS
# tokens is one chunk of its own length (padding a 30-token suffix to 64 doubles its work);
# longer inputs take DELTA_CHUNK-token chunks (on CPU, 32 beats transformers' 64 for every
# shape measured: the intra-chunk products grow with the square of the chunk).
ONE_CHUNK_STEPS = 64
DELTA_CHUNK = 32
RECURRENT_EXTEND_STEPS = 3  # multi-token decoding steps up to this long use the recurrent rule


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


class QwenModel(torch.nn.Module):
    """The language model as a module: parameters and buffers registered (``state_dict``,
    ``.to()``, hooks and compilers see them), the computation in the methods below."""

    def __init__(self, state: dict[str, torch.Tensor], shape: QwenShape, device, dtype):
        super().__init__()
        self.s = shape
        embed, lm_head, final_norm, layers = build_layers(state, shape, device, dtype)
        self.embed = torch.nn.Parameter(embed, requires_grad=False)
        # a tied head is the embedding itself (one tensor, registered once)
        self.lm_head = self.embed if lm_head is None else torch.nn.Parameter(lm_head, requires_grad=False)
        self.register_buffer("final_norm", final_norm)
        self.layers = torch.nn.ModuleList(layers)
        self.chunk_rule, self.step_rule = chunk_gated_delta_rule, recurrent_gated_delta_rule
        rd = shape.rotary_dim
        self.register_buffer("inv_freq", 1.0 / (shape.rope_theta ** (
            torch.arange(0, rd, 2, dtype=torch.float32, device=embed.device) / rd)), persistent=False)

    def _rope(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for ``positions``: ``[S]`` (text), ``[3, S]`` (M-RoPE, shared by all rows) or
        ``[3, B, S]`` (M-RoPE per row; the result then broadcasts over heads as [B, 1, S, rd])."""
        inv_freq = self.inv_freq
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
        h = rms(x, layer.post_norm, self.s.eps)
        gate, up = linear(h, layer.gate_up).chunk(2, dim=-1)
        return linear(F.silu(gate) * up, layer.down)

    def _qkv(self, x, layer, rope):
        """Queries [B, H, S, hd], keys and values [B, Hkv, S, hd] (normed, rotated by ``rope``,
        the (cos, sin) of ``_rope``, computed once per call for all layers) and the output gate
        (Qwen3.5) of ``x`` [B, S, d]."""
        s = self.s
        B, S, _ = x.shape
        H, Hkv, hd = s.heads, s.kv_heads, s.head_dim
        q = linear(x, layer.q)
        gate = None
        if s.hybrid:
            q, gate = q.view(B, S, H, 2 * hd).chunk(2, dim=-1)
            gate = gate.reshape(B, S, H * hd)
        else:
            q = q.view(B, S, H, hd)
        k, v = linear(x, layer.kv).view(B, S, 2, Hkv, hd).unbind(2)
        q = rms(q, layer.q_norm, s.eps).transpose(1, 2)
        k = rms(k, layer.k_norm, s.eps).transpose(1, 2)
        cos, sin = rope
        return self._apply_rope(q, cos, sin), self._apply_rope(k, cos, sin), v.transpose(1, 2), gate

    def _attention_out(self, o, gate, layer):
        B, _, S, _ = o.shape
        o = o.transpose(1, 2).reshape(B, S, -1)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return linear(o, layer.o)

    def _attention(self, x, layer, prev, rope, save):
        B, S, _ = x.shape
        q, k, v, gate = self._qkv(x, layer, rope)
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

    def _delta_net(self, x, layer, prev, save, counts=None):
        """Gated DeltaNet over ``x`` [B, S, d] from ``prev``. ``counts`` [B] (multi-token decoding
        steps): each row's real tokens, the rest right padding. Pad steps get beta = 0 and g = 0,
        which makes the delta rule's update the identity, so they never enter the recurrent
        state, and the conv state is each row's last ``kernel - 1`` real inputs."""
        s = self.s
        B, S, _ = x.shape
        key_dim, val_dim = s.lin_k_heads * s.lin_k_dim, s.lin_v_heads * s.lin_v_dim
        conv_dim = 2 * key_dim + val_dim
        proj = linear(x, layer.in_proj)
        mixed, z, b, a = proj.split([conv_dim, val_dim, s.lin_v_heads, s.lin_v_heads], dim=-1)
        K = s.conv_kernel
        inputs = mixed.transpose(1, 2)  # [B, C, S]
        history = prev[0].expand(B, -1, -1) if prev is not None else inputs.new_zeros(B, conv_dim, K - 1)
        window = torch.cat([history, inputs], dim=-1)
        if S <= SHORT_CONV_STEPS:  # decoding steps: a windowed product beats conv1d's setup cost
            conv = F.silu((window.unfold(-1, K, 1) * layer.conv[:, None, 0, :]).sum(-1))
        else:
            conv = F.silu(F.conv1d(window, layer.conv, groups=conv_dim))  # causal: no future input
        q, k, v = conv.transpose(1, 2).split([key_dim, key_dim, val_dim], dim=-1)
        q = q.reshape(B, S, s.lin_k_heads, s.lin_k_dim)
        k = k.reshape(B, S, s.lin_k_heads, s.lin_k_dim)
        v = v.reshape(B, S, s.lin_v_heads, s.lin_v_dim)
        beta = b.sigmoid()
        g = layer.neg_A * F.softplus(a.float() + layer.dt_bias)
        initial = prev[1].expand(B, -1, -1, -1) if prev is not None else None
        recurrent = S == 1 and prev is not None
        if counts is not None:
            real = (torch.arange(S, device=x.device)[None, :] < counts[:, None])[..., None]
            beta, g = beta * real, g * real
            # the recurrent rule is one loop iteration per token: cheapest for a few tokens;
            # past that the chunked rule's few batched products win
            recurrent = S <= RECURRENT_EXTEND_STEPS
        if recurrent:
            core, final = self.step_rule(q, k, v, g=g, beta=beta, initial_state=initial,
                                         output_final_state=save, use_qk_l2norm_in_kernel=True)
        else:
            chunk = S if S <= ONE_CHUNK_STEPS else DELTA_CHUNK  # same result, less padding
            core, final = self.chunk_rule(q, k, v, g=g, beta=beta, chunk_size=chunk,
                                          initial_state=initial, output_final_state=save,
                                          use_qk_l2norm_in_kernel=True)
        # gated RMSNorm: normalise in float32, scale, gate with silu(z)
        normed = F.rms_norm(core.float(), (s.lin_v_dim,), None, s.eps).to(core.dtype) * layer.gated_norm
        gated = (normed.float() * F.silu(z.reshape(B, S, s.lin_v_heads, s.lin_v_dim).float())).to(x.dtype)
        out = linear(gated.reshape(B, S, val_dim), layer.out)
        if counts is None:
            conv_state = window[:, :, -(K - 1):]
        else:  # window position n_b + j is row b's j-th input of its last kernel - 1
            last = (counts[:, None] + torch.arange(K - 1, device=x.device))[:, None, :]
            conv_state = window.gather(2, last.expand(B, conv_dim, K - 1))
        return out, ((conv_state, final) if save else None)

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
        x = F.embedding(ids, self.embed)
        if image_embeds is not None:
            if image_mask is None or int(image_mask.sum()) != image_embeds.shape[0]:
                raise ValueError("image_embeds need an image_mask with one true entry per embedding")
            x = x.masked_scatter(image_mask.to(x.device)[..., None], image_embeds.to(x.device, x.dtype))
        rope = self._rope(positions, x.dtype)
        states = []
        for i, layer in enumerate(self.layers):
            h = rms(x, layer.in_norm, s.eps)
            p = prev.layers[i] if prev is not None else None
            if layer.kind == "full_attention":
                h, st = self._attention(h, layer, p, rope, save)
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
            return choice_logits(hidden, self.final_norm, self.lm_head, rows, eps=self.s.eps)
        return F.linear(rms(hidden, self.final_norm, self.s.eps), self.lm_head).float()

    def step(self, tokens: torch.Tensor, counts, cache, compiled=None) -> torch.Tensor:
        """A decoding step of every row of ``cache`` (a ``qwen_slots.SlotCache`` or a window of
        one): row ``b`` of ``tokens`` [B, k] holds ``counts[b]`` new tokens (a host sequence),
        right-padded; returns hidden states [B, k, d] (pad positions meaningless) and advances
        the cache by each row's own count, in place. One batched pass whatever the row count:
        each row's tokens continue at its own length and position and attend causally among
        themselves; pad tokens never reach a row's state: their K/V go to the scratch column
        past every real position and their DeltaNet steps are masked to the identity. A
        one-token step is the same pass with k = 1; k tokens equal k one-token steps (to float
        rounding).

        ``compiled`` (a ``compiled.CompiledFunction`` of :meth:`step_core`): the step runs
        compiled on a shape bucket -- rows padded to a bucket with rows that feed nothing (free
        slots of the pool), tokens to a power-of-two width, keys over the whole capacity -- so
        that a handful of shapes serve every step."""
        B, k = tokens.shape
        padded = cache.widen(row_bucket(B)) if compiled is not None else None
        if padded is None:  # eager: keys up to the furthest live extent (host lengths, no sync)
            n = torch.tensor(counts, dtype=torch.long).to(tokens.device, non_blocking=True)
            width = int(max(cache.held[b] + c for b, c in enumerate(counts))) if B else 0
            x = self.step_core(tokens, n, cache.lengths, cache.positions, cache.layers, cache.capacity, width)
        else:
            rows, wide = padded.slots, width_bucket(k)
            full = tokens.new_zeros(rows, wide)
            full[:B, :k] = tokens
            n = torch.tensor(list(counts) + [0] * (rows - B), dtype=torch.long).to(tokens.device, non_blocking=True)
            x = compiled((rows, wide, cache.capacity), full, n, padded.lengths, padded.positions, padded.layers,
                         cache.capacity, cache.capacity)[:B, :k]
        cache.held += np.asarray(counts, dtype=np.int64)
        return x

    def step_core(self, tokens: torch.Tensor, n: torch.Tensor, lengths: torch.Tensor, positions: torch.Tensor,
                  layers: list, capacity: int, width: int) -> torch.Tensor:
        """:meth:`step` on tensors alone (what a compiler takes): ``n`` [B] the counts,
        ``lengths`` / ``positions`` [B] and ``layers`` the cache rows (updated in place),
        ``capacity`` the scratch column, ``width`` the keys read."""
        s = self.s
        B, k = tokens.shape
        device = tokens.device
        steps = torch.arange(k, device=device)
        x = F.embedding(tokens, self.embed)
        real = steps[None, :] < n[:, None]
        where = torch.where(real, lengths[:, None] + steps, capacity)  # [B, k] K/V column
        rope = self._rope((positions[:, None] + steps).expand(3, B, k), x.dtype)
        hide = None
        if "full_attention" in s.layer_types:
            # additive mask (a float mask keeps SDPA on its fused CPU kernel; a boolean one
            # falls back to a much slower path there): each token sees its row's keys up to itself
            visible = torch.arange(width, device=device)[None, None, :] <= where[:, :, None]
            hide = torch.zeros(B, 1, k, width, dtype=x.dtype, device=device)
            hide.masked_fill_(~visible[:, None], float("-inf"))
        rows = torch.arange(B, device=device)[:, None].expand(B, k)
        for i, layer in enumerate(self.layers):
            h = rms(x, layer.in_norm, s.eps)
            if layer.kind == "full_attention":
                q, kk, v, gate = self._qkv(h, layer, rope)
                kb, vb = layers[i]
                kb[rows, :, where] = kk.transpose(1, 2)
                vb[rows, :, where] = v.transpose(1, 2)
                o = F.scaled_dot_product_attention(q, kb[:, :, :width], vb[:, :, :width], attn_mask=hide,
                                                   enable_gqa=s.kv_heads != s.heads)
                h = self._attention_out(o, gate, layer)
            else:
                conv, recurrent = layers[i]
                h, (new_conv, new_recurrent) = self._delta_net(h, layer, (conv, recurrent), True, counts=n)
                conv.copy_(new_conv)
                recurrent.copy_(new_recurrent)
            x = x + h
            x = x + self._mlp(x, layer)
        lengths += n
        positions += n
        return x
