"""The fused choice head's Triton kernels (the math, the launcher and the torch reference:
``choice_head.py``). Imported on first use: importing it imports Triton."""

import triton
import triton.language as tl


@triton.jit
def rounded(x, like, BF16_RNE: tl.constexpr):
    """``x`` (float32) rounded to ``like``'s dtype and back: by hand to nearest even for bfloat16
    (the interpreter's bf16 cast truncates)."""
    if BF16_RNE:
        u = x.to(tl.uint32, bitcast=True)
        x = (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).to(tl.float32, bitcast=True)
    return x.to(like.dtype).to(tl.float32)


@triton.jit
def normed(x, rstd, nw, scale, like, BF16_RNE: tl.constexpr, T5_NORM: tl.constexpr):
    """The normalised states times the norm weight and ``scale``, in float32; with T5_NORM rounded
    to ``like``'s dtype where transformers' T5 rounds (after the norm, after the weight). The
    caller rounds the result."""
    if T5_NORM:
        return rounded(rounded(x * rstd, like, BF16_RNE) * nw, like, BF16_RNE) * scale
    return x * rstd * nw * scale


@triton.jit
def vocab_lse_kernel(x_ptr, nw_ptr, w_ptr, part_ptr, B, H, V, stride_xb, stride_wv, scale, eps,
                     num_splits, n_tiles,
                     BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                     DOT_F32: tl.constexpr, IEEE: tl.constexpr, BF16_RNE: tl.constexpr, T5_NORM: tl.constexpr):
    """Per (row block, vocabulary split): running max and sum-exp of the logits over the
    vocabulary tiles pid_s, pid_s + S, ... -> part[0, pid_s, rows], part[1, pid_s, rows]."""
    pid_b = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = (pid_b * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)
    row_mask = rows < B
    hh = tl.arange(0, BLOCK_H)
    ss = tl.zeros([BLOCK_B], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + hh
        x = tl.load(x_ptr + rows[:, None] * stride_xb + cols[None, :],
                    mask=row_mask[:, None] & (cols < H)[None, :], other=0.0).to(tl.float32)
        ss += tl.sum(x * x, axis=1)
    rstd = 1.0 / tl.sqrt(ss / H + eps)
    vv = tl.arange(0, BLOCK_V)
    m = tl.full([BLOCK_B], float("-inf"), dtype=tl.float32)
    s = tl.zeros([BLOCK_B], dtype=tl.float32)
    for t in range(pid_s, n_tiles, num_splits):
        vocab = t * BLOCK_V + vv
        v_mask = vocab < V
        acc = tl.zeros([BLOCK_B, BLOCK_V], dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + hh
            h_mask = cols < H
            x = tl.load(x_ptr + rows[:, None] * stride_xb + cols[None, :],
                        mask=row_mask[:, None] & h_mask[None, :], other=0.0).to(tl.float32)
            nw = tl.load(nw_ptr + cols, mask=h_mask, other=0.0)
            w = tl.load(w_ptr + vocab.to(tl.int64)[:, None] * stride_wv + cols[None, :],  # V*H may pass 2**31
                        mask=v_mask[:, None] & h_mask[None, :], other=0.0)
            # rounded as the eager path's matmul input
            xn = rounded(normed(x, rstd[:, None], nw[None, :], scale, w, BF16_RNE, T5_NORM), w, BF16_RNE).to(w.dtype)
            if DOT_F32:
                # float32 inputs, or the interpreter (whose bf16 dot is wrong): exact products.
                acc += tl.dot(xn.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
            elif IEEE:
                acc += tl.dot(xn, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(xn, tl.trans(w))  # bf16/fp16 operands, float32 accumulation
        acc = tl.where(v_mask[None, :], acc, float("-inf"))
        m_new = tl.maximum(m, tl.max(acc, axis=1))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(acc - m_new[:, None]), axis=1)
        m = m_new
    tl.store(part_ptr + pid_s * B + rows, m, mask=row_mask)
    tl.store(part_ptr + (num_splits + pid_s) * B + rows, s, mask=row_mask)


@triton.jit
def candidate_chunk(x_ptr, nw_ptr, w_ptr, ids_ptr, b, k0, H, V, K, stride_xb, stride_wv, stride_ib, rstd, scale,
                    BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, BF16_RNE: tl.constexpr, T5_NORM: tl.constexpr):
    """Logits of candidates k0 .. k0 + BLOCK_K of row b (NaN for an id outside [0, V))."""
    hh = tl.arange(0, BLOCK_H)
    k = k0 + tl.arange(0, BLOCK_K)
    k_mask = k < K
    ids = tl.load(ids_ptr + b * stride_ib + k, mask=k_mask, other=0)
    valid = k_mask & (ids >= 0) & (ids < V)
    acc = tl.zeros([BLOCK_K], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + hh
        h_mask = cols < H
        x = tl.load(x_ptr + b * stride_xb + cols, mask=h_mask, other=0.0).to(tl.float32)
        nw = tl.load(nw_ptr + cols, mask=h_mask, other=0.0)
        w = tl.load(w_ptr + ids[:, None] * stride_wv + cols[None, :],
                    mask=valid[:, None] & h_mask[None, :], other=0.0)
        xn = rounded(normed(x, rstd, nw, scale, w, BF16_RNE, T5_NORM), w, BF16_RNE)
        acc += tl.sum(w.to(tl.float32) * xn[None, :], axis=1)
    return tl.where(valid, acc, float("nan")), k, k_mask


@triton.jit
def choice_kernel(x_ptr, nw_ptr, w_ptr, ids_ptr, logits_ptr, logp_ptr, part_ptr,
                  B, H, V, K, stride_xb, stride_wv, stride_ib, scale, eps, num_splits,
                  BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
                  ONE_CHUNK: tl.constexpr, FULL_VOCAB: tl.constexpr, BF16_RNE: tl.constexpr,
                  T5_NORM: tl.constexpr):
    """One program per row: candidate logits by gathering K rows of the LM head, then the
    log-normalizer over the K candidates or from the vocabulary partials. With more than
    BLOCK_K candidates the chunks are computed twice (never stored and re-read: a program's
    global stores are not ordered before its own later loads by other threads)."""
    b = tl.program_id(0).to(tl.int64)
    hh = tl.arange(0, BLOCK_H)
    ss = tl.zeros([BLOCK_H], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + hh
        x = tl.load(x_ptr + b * stride_xb + cols, mask=cols < H, other=0.0).to(tl.float32)
        ss += x * x
    rstd = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / H + eps)
    logits, k, k_mask = candidate_chunk(x_ptr, nw_ptr, w_ptr, ids_ptr, b, 0, H, V, K, stride_xb, stride_wv,
                                        stride_ib, rstd, scale, BLOCK_K, BLOCK_H, BF16_RNE, T5_NORM)
    z = tl.where(k_mask, logits, float("-inf"))
    m = tl.max(z, axis=0)
    s = tl.sum(tl.exp(z - m), axis=0)
    if not ONE_CHUNK:
        tl.store(logits_ptr + b * K + k, logits, mask=k_mask)
        for k0 in range(BLOCK_K, K, BLOCK_K):
            lg, kc, kc_mask = candidate_chunk(x_ptr, nw_ptr, w_ptr, ids_ptr, b, k0, H, V, K, stride_xb, stride_wv,
                                              stride_ib, rstd, scale, BLOCK_K, BLOCK_H, BF16_RNE, T5_NORM)
            tl.store(logits_ptr + b * K + kc, lg, mask=kc_mask)
            z = tl.where(kc_mask, lg, float("-inf"))
            m_new = tl.maximum(m, tl.max(z, axis=0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
            m = m_new
    if FULL_VOCAB:
        sp = tl.arange(0, BLOCK_S)
        s_mask = sp < num_splits
        pm = tl.load(part_ptr + sp * B + b, mask=s_mask, other=float("-inf"))
        ps = tl.load(part_ptr + (num_splits + sp) * B + b, mask=s_mask, other=0.0)
        m = tl.max(pm, axis=0)
        s = tl.sum(ps * tl.exp(pm - m), axis=0)
    lse = m + tl.log(s)
    if ONE_CHUNK:
        tl.store(logits_ptr + b * K + k, logits, mask=k_mask)
        tl.store(logp_ptr + b * K + k, logits - lse, mask=k_mask)
    else:
        for k0 in range(0, K, BLOCK_K):
            lg, kc, kc_mask = candidate_chunk(x_ptr, nw_ptr, w_ptr, ids_ptr, b, k0, H, V, K, stride_xb, stride_wv,
                                              stride_ib, rstd, scale, BLOCK_K, BLOCK_H, BF16_RNE, T5_NORM)
            tl.store(logp_ptr + b * K + kc, lg - lse, mask=kc_mask)
