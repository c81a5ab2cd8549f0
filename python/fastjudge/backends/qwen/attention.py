"""Attention over the Qwen state pool's keys, on the path each shape runs fastest: causal
attention over a prompt (:func:`attend_causal`: the engine's kernel on the CPU), new tokens against the cached keys
(:func:`attend_cached`), and a shared prefix read once per snapshot
(:func:`attend_shared_prefix`). Each computes softmax attention exactly as transformers'
``eager_attention_forward`` defines it, up to rounding; only the split into SDPA calls differs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..cpu_engine import attend_in_engine, engine_attends
from .gated_delta import as_float
from .pool import SharedPrefix

FOLD_QUERY_STEPS = 4  # up to this many new tokens, grouped query heads attend as query rows
# decoding steps (at most FOLD_QUERY_STEPS new tokens) of at least this many rows take the
# engine's few-token kernel. Fewer are as fast or faster through SDPA, whose call costs a few
# microseconds less than the engine's conversions (one row over 464 keys: 22 against 27 us,
# float32). Whole decoding steps of the mini Qwen3.5 (448-token prefix, in-process
# alternation, two threads), SDPA -> engine: float32 2 / 4 / 8 / 16 / 64 rows +2.2 / -1.1 /
# -4.2 / -13.2 / -19.3 %, bfloat16 +2.4 / +2.9 / -1.0 / -15.3 / -12.5 %
ENGINE_FEW_TOKENS_MIN_ROWS = 8
# rows that share at least this many prefix K/V columns, this many rows per snapshot, read them once
# per snapshot in a decoding step (attend_cached); below either the extra calls and conversions
# cost more than the reads they save. The layer alone (benchmarks/bench_attention.py, bfloat16,
# 700 shared of 900 keys, caches warm / flushed, two runs): 4 rows 0.67-0.75x / 0.71-0.80x, 8 rows
# 0.98-1.11x / 0.91-0.98x, 16 rows 1.30-1.54x / 1.27-1.33x; whole calls gain from 8 rows: LAVE
# rationales, 16 items in two snapshots of 6 and 10 rows (mini, bfloat16, in-process
# alternation, two runs), Qwen3 -11.7 % / -6.7 %, Qwen3.5 -8.3 % / -2.3 % against a threshold of 16
SHARED_PREFIX_MIN_KEYS = 512
SHARED_PREFIX_MIN_ROWS = 8
# SDPA's CPU kernel skips only whole 512-key blocks above the causal diagonal: up to
# CAUSAL_SPLIT_TOKENS new tokens, query blocks of CAUSAL_BLOCK rows attend to the keys up to their
# last row instead (see attend_causal_sdpa)
CAUSAL_BLOCK = 64
CAUSAL_SPLIT_TOKENS = 1024


def attend_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool,
                  counts: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of ``q`` [B, H, S, hd] over ``k``, ``v`` [B, kv_heads, S, hd]; returns
    [B, H, S, hd] (a transposed view of a contiguous [B, S, H, hd]: what the layer's output
    projection reads, so transposing back costs nothing). ``counts`` [B]: each row's real
    tokens, where the engine computes nothing for the padding after them (zeros; never read).

    On the CPU in eager code, float32 or bfloat16, the engine runs it
    (``_engine.causal_attention``: each row's keys and values packed once per key head, tiles of
    16 query tokens against the keys up to their last one, an exact softmax in float32; 16 rows
    of 233 tokens, mini's heads, two threads: 8.4-8.7 -> 4.1-4.5 ms a layer); elsewhere
    :func:`attend_causal_sdpa`."""
    if not engine_attends(q, k):
        return attend_causal_sdpa(q, k, v, gqa)
    return attend_in_engine(q.transpose(1, 2), k, v, counts=counts)


def attend_causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool) -> torch.Tensor:
    """:func:`attend_causal` by SDPA (CUDA, traced graphs, other dtypes).

    SDPA's causal CPU kernel takes keys in blocks of 512 and skips only the blocks wholly above
    the diagonal, so up to about a thousand tokens it computes most of the masked half as well.
    There (CPU, ``CAUSAL_BLOCK < S <= CAUSAL_SPLIT_TOKENS``) each block of ``CAUSAL_BLOCK`` query
    rows attends to the keys up to its last row, its own diagonal block under an additive mask:
    the same keys per query row, about half the products (4 x 512 tokens, float32, one thread:
    15.1 -> 9.8 ms a layer). Elsewhere (CUDA kernels skip at a fine grain, longer inputs) it is
    SDPA's causal kernel as is."""
    S = q.shape[2]
    if q.device.type != "cpu" or not CAUSAL_BLOCK < S <= CAUSAL_SPLIT_TOKENS:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    # visible[r, c]: 0 where key c <= S - CAUSAL_BLOCK + r, else -inf; rows of a block ending at
    # ``end`` take its last columns (a view), a last short block its last rows as well
    visible = q.new_full((CAUSAL_BLOCK, S), float("-inf")).triu_(S - CAUSAL_BLOCK + 1)
    parts = []
    for start in range(0, S, CAUSAL_BLOCK):
        end = min(start + CAUSAL_BLOCK, S)
        mask = visible[CAUSAL_BLOCK - (end - start):, S - end:]
        parts.append(F.scaled_dot_product_attention(q[:, :, start:end], k[:, :, :end], v[:, :, :end],
                                                    attn_mask=mask, enable_gqa=gqa))
    return torch.cat(parts, dim=2)


def attend_cached(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                  shared: SharedPrefix | None = None, offsets: torch.Tensor | None = None,
                  counts: torch.Tensor | None = None) -> torch.Tensor:
    """New tokens' queries ``q`` [B, S, H, hd] against the rows' keys and values
    [B, kv_heads, W, hd] under the additive ``mask`` [B, 1, S, W]; returns [B, H, S, hd].

    More than ``FOLD_QUERY_STEPS`` new tokens a row (a suffix pass) on the CPU, given each row's
    cached key count ``offsets`` [B] (the mask is then each real token seeing its row's keys up to
    itself), take the engine's causal attention with those offsets and the rows' real token
    ``counts`` (nothing computed for padding) (:func:`attend_in_engine`;
    a layer, mini's heads, two threads: 16 rows of 130 tokens after 94 cached, SDPA under the mask
    4.2-4.7 ms, the engine 2.3 ms; 64 rows of 40 after 450: 12.6-13.5 -> 8.2-9.0 ms). So do
    decoding steps of ``ENGINE_FEW_TOKENS_MIN_ROWS`` rows or more without a shared prefix (the
    engine's few-token kernel: keys read in place, no packing; 16 rows of one token over 464
    keys, a layer: 0.19 -> 0.12 ms float32, 0.27 -> 0.19 ms bfloat16).

    With grouped-query heads (H = g x kv_heads) and at most ``FOLD_QUERY_STEPS`` new tokens, each
    K/V head's g query heads attend as g x S query rows of one problem, as they share its keys:
    every query row's arithmetic is the same, but SDPA's CPU kernel then runs B x kv_heads
    problems of g x S rows instead of B x H of S rows, and it is much slower on a single query
    row (one-token decode, bfloat16: 3.1 -> 0.5 ms at 16 rows x 900 keys, 4 heads on 2).

    ``shared``: the first ``shared.columns`` keys are the same in every row of a snapshot, so
    they are read once per snapshot: by :func:`attend_shared_prefix` for few new tokens, and for
    a suffix pass in the engine, which packs them once for the rows that share them (the same
    bits as each row packing its own)."""
    B, S, H, hd = q.shape
    kv_heads = keys.shape[1]
    g = H // kv_heads
    if offsets is not None and engine_attends(q, keys) and S > FOLD_QUERY_STEPS:
        return attend_in_engine(q, keys, values, offsets, counts, shared=shared)
    if offsets is not None and engine_attends(q, keys) and (
            B >= ENGINE_FEW_TOKENS_MIN_ROWS and shared is None and hd % 16 == 0):
        return attend_in_engine(q, keys, values, offsets, counts)
    if S > FOLD_QUERY_STEPS or (g == 1 and shared is None):
        return F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=g > 1)
    # query rows in (head, token) order, the mask's token rows repeated for each head (a
    # [B, 1, 1, W] mask broadcasts over them as it is)
    rows = q.reshape(B, S, kv_heads, g, hd).permute(0, 2, 3, 1, 4).reshape(B, kv_heads, g * S, hd)
    if S > 1:
        width = mask.shape[-1]
        mask = mask.unsqueeze(2).expand(B, 1, g, S, width).reshape(B, 1, g * S, width)
    if shared is None:
        o = F.scaled_dot_product_attention(rows, keys, values, attn_mask=mask)
    else:
        o = attend_shared_prefix(rows, keys, values, mask, shared)
    return o.view(B, H, S, hd)


def attend_shared_prefix(rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                         shared: SharedPrefix) -> torch.Tensor:
    """Attention of query ``rows`` [B, kv_heads, R, hd] over ``keys``/``values`` [B, kv_heads, W,
    hd] under ``mask`` [B, 1, R or 1, W], as two parts merged by their log-sum-exp (as cascade
    and flash-decoding kernels merge key blocks): the first ``P = shared.columns`` keys, which
    all rows of a snapshot hold alike, as one problem per snapshot over one row's copy (the
    queries of all its rows against P keys read once), and each row's own keys ``P ..`` under
    the mask. Softmax over the union is ``w * o_prefix + (1 - w) * o_own`` with ``w =
    sigmoid(lse_prefix - lse_own)``. Both parts run in float32 and the result is rounded once:
    in bfloat16 it is closer to a float32 reference than SDPA over the whole row is (max error
    4.8e-4 against 5.4e-4 at 16 rows x 900 keys). CPU only (``model.run_step`` passes ``shared``
    there alone): SDPA's CPU flash kernel returns the log-sum-exp with its output."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    B, kv_heads, R, hd = rows.shape
    P, dtype = shared.columns, rows.dtype
    rows = as_float(rows)
    own, own_lse = flash(rows, as_float(keys[:, :, P:]), as_float(values[:, :, P:]), 0.0, False,
                         attn_mask=as_float(mask[..., P:]))[:2]
    pre = torch.empty_like(own)
    pre_lse = torch.empty_like(own_lse)
    for first, members in shared.groups:
        part = rows if members is None else rows.index_select(0, members)
        n = part.shape[0]
        # the group's queries as one [1, kv_heads, n x R] problem over one copy of the prefix
        o, lse = flash(part.transpose(0, 1).reshape(1, kv_heads, n * R, hd), *shared.float_columns(keys, values, first),
                       0.0, False)[:2]
        o, lse = o.view(kv_heads, n, R, hd).transpose(0, 1), lse.view(kv_heads, n, R).transpose(0, 1)
        if members is None:
            pre.copy_(o), pre_lse.copy_(lse)
        else:
            pre.index_copy_(0, members, o), pre_lse.index_copy_(0, members, lse)
    w = torch.sigmoid(pre_lse - own_lse).unsqueeze(-1)
    return torch.addcmul(own, pre - own, w).to(dtype)
