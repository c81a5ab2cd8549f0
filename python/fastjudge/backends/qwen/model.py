"""Qwen3.5 (hybrid Gated DeltaNet + gated attention) and Qwen3 (dense) language models in plain
PyTorch: one ``forward`` for everything the engine runs -- a prefix prefill, score-only
suffixes, decoding steps of one token or of a forced run -- each row continuing from its slot
of the state pool (``pool``) and writing its new state there, in place; the logits; and
:func:`run_step`, which runs a forward compiled on a shape bucket or eagerly.

Every operation is causal (attention under a causal mask, the causal depthwise conv, the delta
rule), so what follows a row's last real token never reaches that token's output.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from fastjudge.kernels.choice_head import choice_logits

from ..compiled import row_bucket, width_bucket
from ..cpu_memory import keep_freed_memory
from ..dense import Dense
from .attention import FOLD_QUERY_STEPS, SHARED_PREFIX_MIN_KEYS, SHARED_PREFIX_MIN_ROWS
from .engine_step import ENGINE_SHARED_MIN_KEYS, ENGINE_SHARED_MIN_ROWS, engine_step
from .layers import Step, as_float, build_layers, rms
from .pool import SharedPrefix, StatePool, StateView
from .shape import QwenShape

# a forward's MLPs run on its real tokens alone (gathered, then scattered back) when at least this
# share of its B x k tokens is padding: suffixes of different lengths in one pass
PACK_MIN_PADDING = 0.1


class QwenModel(torch.nn.Module):
    """The language model as a module: parameters and buffers registered (``state_dict``,
    ``.to()``, hooks and compilers see them), the layers modules with their own forward."""

    def __init__(self, state: dict[str, torch.Tensor], shape: QwenShape, device, dtype):
        super().__init__()
        self.s = shape
        embed, lm_head, final_norm, layers = build_layers(state, shape, device, dtype)
        self.embed = torch.nn.Parameter(embed, requires_grad=False)
        # a tied head is the embedding itself (one tensor, registered once)
        self.lm_head = self.embed if lm_head is None else torch.nn.Parameter(lm_head, requires_grad=False)
        # decoding's full-vocabulary head as a GEMM of its own over that same parameter (a Dense,
        # prepared at load: a 16-row step's head on the CPU 0.26 ms through F.linear); decoding
        # steps only, so one packed copy of this large weight
        self.head = Dense(self.lm_head, prompts=False)
        self.head.weight = self.lm_head
        self.register_buffer("final_norm", final_norm)
        self.layers = torch.nn.ModuleList(layers)
        self.has_attention = "full_attention" in shape.layer_types
        self.has_deltanet = "linear_attention" in shape.layer_types
        self._rope_tables(shape, embed.device)
        self.engine_step_cache = None  # engine_step.engine_step's decoder for the last pool
        if embed.device.type == "cpu":  # every forward's temporaries reuse the last one's pages
            keep_freed_memory()

    def _rope_tables(self, shape: QwenShape, device) -> None:
        """The rotary tables :meth:`_rope` reads: per head dim ``i``, a signed frequency (rotate-
        half's ``-sin`` on the first half of the rotary dims is ``sin`` of a negated angle; 0
        past ``rotary_dim``: cos 1, sin 0), per M-RoPE row (t/h/w: which position drives each
        frequency, interleaved per ``mrope_section``; the other rows hold 0, so their products
        add exact zeros)."""
        rd, hd, half = shape.rotary_dim, shape.head_dim, shape.rotary_dim // 2
        inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd))
        row = torch.zeros(half, dtype=torch.long)  # the M-RoPE row of each frequency pair
        for dim, offset in ((1, 1), (2, 2)):
            row[offset:shape.mrope_section[dim] * 3:3] = dim
        freq = torch.zeros(hd)
        freq[:rd] = torch.cat([-inv_freq, inv_freq])
        by_row = torch.zeros(3, hd)
        for r in range(3):
            by_row[r, :rd] = torch.where(torch.cat([row, row]) == r, freq[:rd], 0.0)
        self.register_buffer("rope_freq", freq.to(device), persistent=False)
        self.register_buffer("rope_freq_rows", by_row.view(3, 1, 1, 1, hd).to(device), persistent=False)

    def _rope(self, positions: torch.Tensor, dtype, mrope: bool):
        """(cos, sin, half) for :func:`layers.rotate`: cos/sin [B, k, 1, head_dim] of the
        positions [B, k] (text: the three M-RoPE rows are equal, which is plain RoPE) or, with
        ``mrope``, of the M-RoPE ``positions`` [3, B, k]."""
        if mrope:
            angle = (positions.float()[..., None, None] * self.rope_freq_rows).sum(0)
        else:
            angle = positions.float()[..., None, None] * self.rope_freq
        cos, sin = angle.cos(), angle.sin()
        if dtype != torch.float32:
            cos, sin = cos.to(dtype), sin.to(dtype)
        return cos, sin, self.s.rotary_dim // 2

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor, state: StatePool | StateView, width: int,
                fresh: bool = False, positions: torch.Tensor | None = None,
                image_embeds: torch.Tensor | None = None, image_mask: torch.Tensor | None = None,
                shared: SharedPrefix | None = None) -> torch.Tensor:
        """Hidden states [B, k, d] of ``tokens`` [B, k] (row ``b``: ``counts[b]`` real tokens,
        then right padding) continuing from the first B slots of ``state``, whose lengths and
        positions advance by each row's count; attention reads the first ``width`` columns.

        ``fresh``: every row starts empty (a prefix prefill, or whole prompts right-padded to the
        longest; no state is read): attention is causal over the new tokens alone, since under a
        causal mask a real token never sees the padding that follows it. Images:
        ``image_embeds`` [N, d] replace the embeddings where ``image_mask`` [B, k] is true
        (row-major, as transformers' masked_scatter) and ``positions`` [3, B, k] are the M-RoPE
        positions (``positions.mrope_positions``); without them each row counts on from its
        slot's next position. ``shared``: K/V columns the rows share by snapshot
        (``StatePool.shared_prefix``), read once per snapshot by attention."""
        B, k = tokens.shape
        device = tokens.device
        steps = torch.arange(k, device=device)
        real = steps[None, :] < counts[:, None]
        lengths, next_pos = state.lengths, state.positions
        if lengths.shape[0] != B:
            lengths, next_pos = lengths[:B], next_pos[:B]
        where = torch.where(real, lengths[:, None] + steps, state.capacity)
        x = F.embedding(tokens, self.embed)
        if image_embeds is not None:
            x = x.masked_scatter(image_mask[..., None], image_embeds.to(x.dtype))
        given = positions is not None
        rope = self._rope(positions if given else next_pos[:, None] + steps, x.dtype, mrope=given)
        mask = None
        if self.has_attention and not fresh:
            # additive mask (a float mask keeps SDPA on its fused CPU kernel; a boolean one falls
            # back to a much slower path there): each token sees its row's keys up to itself
            hidden = torch.arange(width, device=device) > where[:, None, :, None]
            mask = x.new_zeros(B, 1, k, width).masked_fill_(hidden, float("-inf"))
        keep = None
        if self.has_deltanet:  # row b's last kernel - 1 inputs: its conv window rows count_b + j
            K = self.s.conv_kernel
            keep = ((torch.arange(B, device=device) * (K - 1 + k) + counts)[:, None]
                    + torch.arange(K - 1, device=device)).view(-1)
        step = Step(rope, counts, where, torch.arange(B, device=device)[:, None].expand(B, k),
                    mask, width, fresh, real[..., None], keep, shared, lengths, packed_tokens(real))
        for layer, (a, b) in zip(self.layers, state.layers):
            if a.shape[0] != B:  # a pool wider than the rows (compiled buckets); a view is exact
                a, b = a[:B], b[:B]
            x = layer(x, step, (a, b))
        if given:  # M-RoPE: the next position is past the largest one so far
            top = positions.masked_fill(~real, -1).amax(dim=(0, 2)) + 1
            next_pos.copy_(torch.where(counts > 0, top, next_pos))
        else:
            next_pos += counts
        lengths += counts
        return x

    def logits(self, hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of the final states: the candidate ``rows`` through the fused choice head
        (never ``[B, vocab]``), or the full vocabulary for decoding."""
        if rows is not None:
            return choice_logits(hidden, self.final_norm, self.lm_head, rows, eps=self.s.eps)
        return as_float(self.head(rms(hidden, self.final_norm, self.s.eps)))


def packed_tokens(real: torch.Tensor) -> torch.Tensor | None:
    """The flat indices of ``real`` [B, k]'s true entries where at least ``PACK_MIN_PADDING`` of
    the tokens are padding, on the CPU in eager code (``nonzero`` would wait for the device, and
    its size is not static for a traced graph), for steps of more than one token a row (a
    decoding step's gather and scatter would cost more than its padding); else None: every token
    runs."""
    if real.shape[1] == 1 or real.device.type != "cpu" or torch.compiler.is_compiling():
        return None
    flat = real.view(-1)
    packed = flat.nonzero().squeeze(1)
    return packed if len(packed) <= (1 - PACK_MIN_PADDING) * len(flat) else None


def run_step(model: QwenModel, pool: StatePool, start: int, tokens: torch.Tensor, counts: Sequence[int],
             compiled=None, **images) -> torch.Tensor:
    """:meth:`QwenModel.forward` of right-padded ``tokens`` [B, k] (``counts`` on the host) on
    slots ``start ..`` of ``pool``: hidden states [B, k, d]; the host mirror of the lengths
    advances too.

    ``compiled`` (a ``compiled.CompiledFunction`` of the forward) runs text rows in the leading
    slots on a shape bucket: rows padded to a bucket with free slots that feed nothing, tokens
    to a power-of-two width, keys over the whole capacity, so that a handful of shapes serve
    every step and the pool's buffers are the same tensors in every call. Otherwise the forward
    runs eagerly over the live extent only; rows that all start empty take the fresh path
    (causal attention over the new tokens, padded or not: a masked attention over the pool's
    columns computes every padded row and column in full, 7.5 -> 6.0 ms a layer at 16 x 240
    tokens, bfloat16). On the CPU, a continuing step of few new tokens runs as one engine call
    (``engine_step``) where the engine takes it. Rows that share prefix columns by snapshot
    (``StatePool.shared_prefix``) read those columns once per snapshot, in the engine's step or
    the tensor ops' attention."""
    B, k = tokens.shape
    held = pool.held[start:start + B]
    host_counts = np.asarray(counts, dtype=np.int64)
    rows = row_bucket(B)
    if _compiled_runs(compiled, pool, start, B, images):
        wide = width_bucket(k)
        full = tokens.new_zeros(rows, wide)
        full[:B, :k] = tokens
        n = torch.tensor(np.pad(host_counts, (0, rows - B))).to(tokens.device, non_blocking=True)
        x = compiled((rows, wide, pool.capacity), full, n, pool, pool.capacity)[:B, :k]
    else:
        fresh, engine, shared = _eager_route(model, pool, start, tokens, held, images)
        if engine is not None:
            x = engine(tokens, host_counts, start, int(held.max()) + k, shared)
        else:
            width = int((held + host_counts).max()) if B else 0
            n = torch.tensor(host_counts).to(tokens.device, non_blocking=True)
            x = model(tokens, n, pool.view(start, start + B), width, fresh=fresh, shared=shared, **images)
    held += host_counts
    return x


def run_pick_step(model: QwenModel, pool: StatePool, start: int, tokens: torch.Tensor, counts: Sequence[int],
                  hidden: torch.Tensor, compiled=None, room: Sequence[int] | None = None, stops=(),
                  steps: int = 1, track: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray] | None:
    """:func:`run_step` of text rows that then pick their next tokens greedily, where the engine
    runs the step and holds the model's head (``engine_step.EngineStep.run_picks``): one engine
    call writes each row's last real hidden state into ``hidden[:B]`` and returns the picks
    (int64 [B, n] on the host: what ``model.logits`` of those states and an argmax give) and the
    ``track`` ids' logits (float32 [B, n, K]), with up to ``steps - 1`` more steps in it, each
    feeding the picks of the one before, until a row picks one of ``stops`` or as many tokens as
    its ``room`` (default one each). Else None, and nothing has run: :func:`run_step` then."""
    B, k = tokens.shape
    held = pool.held[start:start + B]
    if _compiled_runs(compiled, pool, start, B, {}):
        return None
    _, engine, shared = _eager_route(model, pool, start, tokens, held, {})
    if engine is None or not engine.picks:
        return None
    host_counts = np.asarray(counts, dtype=np.int64)
    room = np.ones(B, dtype=np.int64) if room is None else np.asarray(room, dtype=np.int64)
    picks, tracked = engine.run_picks(tokens, host_counts, start, int(held.max()) + k, hidden[:B], room, stops,
                                      steps, track, shared)
    held += host_counts + (picks.shape[1] - 1)
    return picks, tracked


def _compiled_runs(compiled, pool: StatePool, start: int, B: int, images: dict) -> bool:
    # whether run_step takes the compiled forward: text rows in the leading slots, in a bucket
    return compiled is not None and start == 0 and not images and row_bucket(B) <= pool.slots


def _eager_route(model: QwenModel, pool: StatePool, start: int, tokens: torch.Tensor, held: torch.Tensor,
                 images: dict) -> tuple[bool, object, SharedPrefix | None]:
    """How an eager step of ``tokens`` on slots ``start ..`` runs (``run_step``'s notes):
    whether its rows start empty, the engine's step (or None: the tensor ops) and the prefix
    columns its rows share by snapshot (or None), which either reads once per snapshot."""
    B, k = tokens.shape
    fresh = not held.any()
    engine = None if fresh or images else engine_step(model, pool, B, k)
    shared = None
    if not fresh and model.has_attention and tokens.device.type == "cpu":
        # the engine's attention (the whole step's, or a suffix pass's) reads shared columns once
        # from two rows a snapshot; the tensor ops' few-token attention from its own thresholds
        engine_attends = engine is not None or k > FOLD_QUERY_STEPS
        shared = pool.shared_prefix(start, start + B, *((ENGINE_SHARED_MIN_KEYS, ENGINE_SHARED_MIN_ROWS)
                                                        if engine_attends
                                                        else (SHARED_PREFIX_MIN_KEYS, SHARED_PREFIX_MIN_ROWS)))
    return bool(fresh), engine, shared
