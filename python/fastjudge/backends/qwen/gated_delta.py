"""The gated delta rule of Gated DeltaNet (Qwen3.5's linear-attention layers), in two forms that
give the same result: a chunked one for prefill and multi-token steps, a recurrent one for
one-token steps.

Per value head the layer keeps a state ``M`` [dk, dv] (a key -> value memory). Token ``t`` with
key ``k``, value ``v``, query ``q`` (keys and queries L2-normalised, queries also scaled by
``dk ** -0.5``), log-decay ``g <= 0`` and write strength ``beta`` in [0, 1] does

    M <- exp(g) * M                      forget a little of everything
    u  = beta * (v - M^T k)              the part of v the memory does not predict yet
    M <- M + k u^T                       write that correction under key k
    o  = M^T q                           read the updated memory

so a step with ``beta = 0`` and ``g = 0`` leaves ``M`` unchanged (the engine's pad steps).

Chunked form. Inside a chunk of C tokens that starts from ``M0``, write ``G_i`` for the running
sum of the log-decays up to token i (decay between tokens j <= i is ``exp(G_i - G_j)``). The
corrections depend on each other only through earlier tokens of the chunk:

    u_i + sum_{j<i} beta_i exp(G_i - G_j) (k_i . k_j) u_j = beta_i v_i - beta_i exp(G_i) M0^T k_i

a unit lower-triangular system ``(I + L) U = beta V - (beta exp(G) K) M0``. Its inverse ``T``
(:func:`unit_lower_inverse`: on the CPU the engine's own forward substitution over 16 chunks at
a time, elsewhere block inversion, a handful of batched products instead of a triangular solve
per chunk) gives ``U = W - P M0`` with ``W = T beta V`` and ``P = T beta exp(G)
K`` independent of ``M0``; then every output and the state at the end of the chunk are matrix
products:

    o_i  = exp(G_i) M0^T q_i + sum_{j<=i} exp(G_i - G_j) (q_i . k_j) u_j
    M_C  = exp(G_C) M0 + sum_j exp(G_C - G_j) k_j u_j^T

Everything but the hand-over of ``M`` from chunk to chunk runs for all chunks at once; the
hand-over is a Python loop over the static number of chunks, four ops a chunk: one product of
the chunk's start state with the rows that read it (``P`` and the decayed queries, stacked),
``U``, and the next state. The outputs of all chunks are one batched product after it.

In-place forms. The layers run both rules on the state pool's memory itself (no copy of the
state in or out): :func:`recurrent_gated_delta_rule_` as a decoding step runs it, with each key
head read once for the value heads it serves (no repeated keys), in the fewest ops;
:func:`chunk_gated_delta_rule_` for prompts and multi-token steps, in a chunk-major layout where
products with queries and keys run once per key head. :func:`chunk_gated_delta_rule` and
:func:`recurrent_gated_delta_rule` keep transformers' signatures (and the tests compare them with
its reference functions).

All take the engine's layout: queries and keys [B, S, Hk, dk], values [B, S, Hv, dv] (Hv a
multiple of Hk: each key head serves Hv // Hk consecutive value heads), ``g`` and ``beta``
[B, S, Hv]; the state is [B, Hv, dk, dv] in float32. All math runs in float32. There is no
data-dependent Python control flow and no host read of a tensor value, so every form traces
under ``torch.compile`` and CUDA graph capture (a traced CPU graph takes the tensor-op forms:
the engine's kernels work on host memory, outside torch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ... import _engine
from ..cpu_engine import engine_takes

L2_EPS = 1e-6  # inside the square root, as the reference kernels normalise keys and queries
# Decays are exponentials of sums of log-decays, which strong-forgetting heads drive far below
# zero within a chunk. exp() below this gives a denormal or 0 in float32, which ATen's vectorised
# exp computes up to 10x slower (200,704 values in [-103, 0]: 0.64 against 0.1 ms): the chunked
# rule clamps its decay exponents here, so such a term is 1.2e-38 instead of a denormal or 0,
# under float32's resolution beside any normal term it is summed with.
EXP_FLOOR = -87.33


def _heads_first(query, key, value, g, beta, normalise: bool):
    """float32 tensors with heads before time: q, k [B, Hv, S, dk] (key heads repeated for their
    value heads, normalised and scaled), v [B, Hv, S, dv], g and beta [B, Hv, S]."""
    groups = value.shape[2] // key.shape[2]
    if groups != 1:
        query = query.repeat_interleave(groups, dim=2)
        key = key.repeat_interleave(groups, dim=2)
    q, k, v = (t.transpose(1, 2).float() for t in (query, key, value))
    g, beta = g.transpose(1, 2).float(), beta.transpose(1, 2).float()
    if normalise:
        q = q * torch.rsqrt(q.square().sum(-1, keepdim=True) + L2_EPS)
        k = k * torch.rsqrt(k.square().sum(-1, keepdim=True) + L2_EPS)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def _start_state(initial_state, v: torch.Tensor, dk: int) -> torch.Tensor:
    """The memory at the first token: ``initial_state`` in float32, or zeros."""
    B, H, dv = v.shape[0], v.shape[1], v.shape[-1]
    if initial_state is None:
        return v.new_zeros(B, H, dk, dv)
    return initial_state.to(device=v.device, dtype=torch.float32)


def recurrent_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               g: torch.Tensor, beta: torch.Tensor,
                               initial_state: torch.Tensor | None = None,
                               output_final_state: bool = False,
                               use_qk_l2norm_in_kernel: bool = False, **unused):
    """The gated delta rule one token at a time (cheapest for one or a few tokens)."""
    out_dtype = query.dtype
    q, k, v, g, beta = _heads_first(query, key, value, g, beta, use_qk_l2norm_in_kernel)
    memory = _start_state(initial_state, v, k.shape[-1])
    outputs = []
    for t in range(v.shape[2]):
        memory = memory * g[:, :, t, None, None].exp()
        k_t = k[:, :, t, None, :]  # [B, H, 1, dk]
        predicted = k_t @ memory  # [B, H, 1, dv]
        correction = (v[:, :, t, None, :] - predicted) * beta[:, :, t, None, None]
        memory = memory + k_t.transpose(-1, -2) @ correction
        outputs.append(q[:, :, t, None, :] @ memory)
    out = torch.cat(outputs, dim=2).transpose(1, 2).contiguous().to(out_dtype)
    return out, (memory if output_final_state else None)


def recurrent_gated_delta_rule_(memory: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                                value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """The gated delta rule one token at a time, in place on ``memory`` [B, Hv, dk, dv] (float32,
    contiguous): queries and keys [B, S, Hk, dk] already L2-normalised (queries also scaled by
    ``dk ** -0.5``), values [B, S, Hv, dv], ``g`` and ``beta`` [B, S, Hv] (float32; ``beta``
    may come in the model's dtype). Returns the outputs [B, S, Hv, dv] (float32); ``memory``
    holds the final state.

    On the CPU, outside a traced graph, the engine runs it (``_engine.recurrent_delta_rule``:
    each head's state read and written once a token, where the four tensor ops of
    :func:`recurrent_gated_delta_rule_ops` stream it four times; 64 rows of 16 heads of 128 x
    128, a layer: 13-14 -> 3-5 ms, two threads); elsewhere those ops."""
    if not engine_takes(memory) or not memory.is_contiguous():
        return recurrent_gated_delta_rule_ops(memory, query, key, value, g, beta)
    B, S, Hk, dk = key.shape
    Hv, dv = value.shape[2:]
    out = memory.new_empty(B, S, Hv, dv)
    rows = (as_float(t).numpy() for t in (query, key, value))  # read in place, strided as they come
    gates = (as_float(t).contiguous().numpy() for t in (g.exp(), beta))
    _engine.recurrent_delta_rule(memory.numpy(), *rows, *gates, out.numpy(), torch.get_num_threads())
    return out


def recurrent_gated_delta_rule_ops(memory: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                                   value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """:func:`recurrent_gated_delta_rule_` as tensor ops (CUDA, traced graphs), one iteration
    of four ops a token."""
    B, S, Hk, dk = key.shape
    Hv, dv = value.shape[2:]
    G = Hv // Hk  # value heads per key head, grouped: [B, Hk, G, ...]
    q, k = _tokens(query, Hk, 1, 1, dk), _tokens(key, Hk, 1, 1, dk)
    v = _tokens(value, Hk, G, 1, dv)
    decay, beta = _tokens(g.exp(), Hk, G, 1, 1), _tokens(beta, Hk, G, 1, 1)
    mem = memory.view(B, Hk, G, dk, dv)
    out = []
    for t in range(S):
        mem.mul_(decay[t])  # forget
        u = (v[t] - k[t] @ mem).mul_(beta[t])  # what the memory does not predict yet
        mem.addcmul_(k[t].transpose(-1, -2), u)  # write it under the key
        out.append(q[t] @ mem)  # read: [B, Hk, G, 1, dv]
    return (out[0] if S == 1 else torch.stack(out, 1)).view(B, S, Hv, dv)


def _tokens(x: torch.Tensor, *shape: int) -> list[torch.Tensor] | tuple[torch.Tensor, ...]:
    """``x`` [B, S, ...] per token, each viewed as [B, *shape]: one view for one token."""
    B, S = x.shape[:2]
    return [x.view(B, *shape)] if S == 1 else x.view(B, S, *shape).unbind(1)


def unit_lower_inverse(system: torch.Tensor) -> torch.Tensor:
    """``(I + L)^-1`` for ``L`` the strictly lower triangle of ``system`` [..., C, C] (its
    diagonal and upper triangle are not read). A float32 system on the CPU, outside a traced
    graph, takes the engine's forward substitution (``_engine.unit_lower_inverse``: the reference
    row loop's recurrence, 16 matrices a vector op; 64 systems of 51 x 51, two threads:
    0.8-1.5 ms -> 0.17 ms); anything else :func:`unit_lower_inverse_blocks`."""
    C = system.shape[-1]
    if not engine_takes(system) or system.dtype != torch.float32 or C > _engine.unit_lower_inverse_max_size:
        return unit_lower_inverse_blocks(system)
    system = system.contiguous()
    out = torch.empty_like(system, memory_format=torch.contiguous_format)
    _engine.unit_lower_inverse(system.numpy(), out.numpy(), torch.get_num_threads())
    return out


def unit_lower_inverse_blocks(system: torch.Tensor) -> torch.Tensor:
    """``(I + L)^-1`` for ``L`` the strictly lower triangle of ``system`` [..., C, C] (its
    diagonal and upper triangle are not read), by block inversion, exactly:

        [[A, 0], [B, D]]^-1 = [[A^-1, 0], [-D^-1 B A^-1, D^-1]]

    applied bottom-up: with the inverses of all diagonal blocks of size b known, one level
    finishes those of size 2b with two batched products on b x b blocks. The first level
    (b = 1) is ``-L`` itself, so C = 2^m costs m - 1 levels of two small products, where a
    triangular solve (LAPACK, one call per matrix) or transformers' row-by-row loop costs C
    steps. Every strictly lower entry is written by exactly one level, after the blocks it
    reads are final. A C that is not a power of two is padded with identity rows and columns
    (the inverse of a block-diagonal matrix is block-diagonal: the leading C x C block is
    exact)."""
    *batch, C, _ = system.shape
    P = 1 << max(C - 1, 0).bit_length()  # the next power of two >= C
    lower = system.reshape(-1, C, C).tril(-1)
    if P != C:
        lower = F.pad(lower, (0, P - C, 0, P - C))
    inverse = torch.eye(P, dtype=lower.dtype, device=lower.device) - lower  # level b = 1 done
    N, b = inverse.shape[0], 1
    while 2 * b < P:
        b *= 2

        def blocks(t: torch.Tensor, row: int, col: int, b=b) -> torch.Tensor:
            # the b x b blocks at (row, col) of every 2b x 2b diagonal block, as one view of a
            # contiguous [N, P, P] tensor of its own (storage offset 0)
            return t.as_strided((N, P // (2 * b), b, b), (P * P, 2 * b * (P + 1), P, 1), row * P + col)

        first, second = blocks(inverse, 0, 0), blocks(inverse, b, b)  # A^-1, D^-1
        blocks(inverse, b, 0).copy_(-(second @ (blocks(lower, b, 0) @ first)))
    inverse = inverse if P == C else inverse[:, :C, :C]
    return inverse.reshape(*batch, C, C)


def chunk_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           g: torch.Tensor, beta: torch.Tensor, chunk_size: int = 64,
                           initial_state: torch.Tensor | None = None,
                           output_final_state: bool = False,
                           use_qk_l2norm_in_kernel: bool = False, **unused):
    """The gated delta rule over ``chunk_size``-token chunks (prefill, multi-token steps), with
    transformers' signature: :func:`chunk_gated_delta_rule_` on a copy of the initial state."""
    B, _, Hk, dk = key.shape
    Hv, dv = value.shape[2:]
    if initial_state is None:
        memory = value.new_empty(B, Hv, dk, dv, dtype=torch.float32)
    else:
        memory = initial_state.to(device=value.device, dtype=torch.float32, copy=True).contiguous()
    out = chunk_gated_delta_rule_(memory, query, key, value, g, beta, chunk_size, fresh=initial_state is None,
                                  normalise=use_qk_l2norm_in_kernel)
    return out.to(query.dtype), (memory if output_final_state else None)


def chunk_gated_delta_rule_(memory: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            g: torch.Tensor, beta: torch.Tensor, chunk_size: int, fresh: bool,
                            normalise: bool = True) -> torch.Tensor:
    """The gated delta rule over ``chunk_size``-token chunks, in place on ``memory`` [B, Hv, dk,
    dv] (float32, contiguous): the initial state (zeros when ``fresh``: its contents are not
    read), and the final state on return. Returns the outputs [B, S, Hv, dv] in float32.
    ``normalise``: L2-normalise queries and keys here (transformers' ``use_qk_l2norm_in_kernel``).

    On the CPU, outside a traced graph, the engine runs it (``_engine.chunked_delta_rule``: each
    key head's chunk held in cache by one thread, its products register-blocked, the corrections
    by forward substitution; a layer of 4 x 512 tokens, 4 value heads of 64, two threads: 7.3-7.6
    -> 1.9-2.1 ms); elsewhere :func:`chunk_gated_delta_rule_ops`."""
    B, S, Hk, dk = key.shape
    Hv, dv = value.shape[2:]
    if (not engine_takes(memory) or not memory.is_contiguous() or dv % 16
            or chunk_size > _engine.chunked_delta_rule_max_chunk):
        return chunk_gated_delta_rule_ops(memory, query, key, value, g, beta, chunk_size, fresh, normalise)
    out = memory.new_empty(B, S, Hv, dv)
    rows = (as_float(t).numpy() for t in (query, key, value))  # read in place, strided as they come
    gates = (as_float(t).contiguous().numpy() for t in (g, beta))
    _engine.chunked_delta_rule(memory.numpy(), *rows, *gates, out.numpy(), chunk_size, fresh, normalise, L2_EPS,
                               EXP_FLOOR, torch.get_num_threads())
    return out


def chunk_gated_delta_rule_ops(memory: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               g: torch.Tensor, beta: torch.Tensor, chunk_size: int, fresh: bool,
                               normalise: bool = True) -> torch.Tensor:
    """:func:`chunk_gated_delta_rule_` as tensor ops (CUDA, traced graphs). The sequence is
    right-padded to whole chunks with ``beta = 0``, ``g = 0`` steps, which leave the state
    unchanged, and the padded outputs are dropped. Layout: chunk-major ``[n, B, Hk, G, C,
    ...]`` (G value heads per key head), so that a chunk's tensors are contiguous for the
    sequential hand-over, the batch dims of every product fold into one, and products with keys
    or queries (the same for the G value heads of a key head) run once per key head."""
    B, S, Hk, dk = key.shape
    Hv, dv = value.shape[2:]
    G, C = Hv // Hk, chunk_size
    n = -(-S // C)
    pad = n * C - S
    q, k, v, g, beta = (as_float(t) for t in (query, key, value, g, beta))
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
        g, beta = F.pad(g, (0, 0, 0, pad)), F.pad(beta, (0, 0, 0, pad))
    q, k = _chunk_rows(q, n, C, dk ** -0.5, normalise), _chunk_rows(k, n, C, 1.0, normalise)
    v = v.view(B, n, C, Hk, G, dv).permute(1, 0, 3, 4, 2, 5)
    # per value head [n, B, Hk, G, C]; G_i: the running log-decay inside each chunk
    g = g.view(B, n, C, Hk, G).permute(1, 0, 3, 4, 2).cumsum(-1)
    beta = beta.view(B, n, C, Hk, G).permute(1, 0, 3, 4, 2)

    # decay from token j to token i of a chunk (i >= j); above the diagonal G_i - G_j > 0 could
    # overflow, so it is clamped to 0 before the exponential and zeroed after: the same values as
    # exp of -inf there, but the exponential's fast path (an -inf input takes a slower one:
    # 0.77 -> 0.51 ms at [8, 16, 2, 2, 32, 32]); below, EXP_FLOOR
    later = torch.ones(C, C, dtype=torch.bool, device=k.device).triu(1)
    decay = (g[..., :, None] - g[..., None, :]).clamp_(EXP_FLOOR, 0).exp_().masked_fill_(later, 0.0)
    kk = (k @ k.transpose(-1, -2)).unsqueeze(3)  # [n, B, Hk, 1, C, C]: shared by the G value heads
    # the corrections' unit lower-triangular system (I + L) U = beta V - (beta exp(G) K) M0,
    # inverted once per chunk (T); the betas scale T's columns rather than V's and K's rows
    inverse = unit_lower_inverse(kk * decay * beta[..., None]) * beta[..., None, :]
    # U = W - P M0 with W = T beta V and P = T beta exp(G) K; the keys are the same for a key
    # head's G value heads, so P is one product of G * C rows per key head
    fresh_part = inverse @ v
    # per chunk and value head, the rows that read the chunk's start state M_c: P (its part of
    # the corrections) over q_i exp(G_i) (its part of the outputs), one product with M_c. A fresh
    # first chunk starts from zeros: it reads nothing (its U is W, its outputs' M_c part 0), so
    # its rows are not built (a whole prompt of up to ONE_CHUNK_STEPS tokens builds none).
    first = 1 if fresh else 0
    BH = B * Hv
    start_decay = g[first:].clamp(min=EXP_FLOOR).exp_()  # exp(G_i): how much of M_c token i still sees
    weights = (inverse[first:] * start_decay[..., None, :]).view(n - first, B, Hk, G * C, C)
    reads = torch.cat([(weights @ k[first:]).view(n - first, B, Hk, G, C, dk),
                       q[first:].unsqueeze(3) * start_decay[..., None]], dim=-2)

    scores = (q @ k.transpose(-1, -2)).unsqueeze(3) * decay  # causal attention in the chunk
    to_end = (g[..., -1:] - g).clamp_(min=EXP_FLOOR).exp_()  # exp(G_C - G_j)
    k_end = (k.unsqueeze(3) * to_end[..., None]).transpose(-1, -2)  # writes into the end state
    chunk_decay = g[..., -1].exp()  # [n, B, Hk, G]

    # the hand-over from chunk to chunk, the only sequential part: U_c = W_c - P_c M_c,
    # M_{c+1} = exp(G_C) M_c + K_end U_c; the batch (B, Hk, G) folded into B * Hv
    W, reads = fresh_part.reshape(n, BH, C, dv), reads.view(n - first, BH, 2 * C, dk)
    k_end, chunk_decay = k_end.reshape(n, BH, dk, C), chunk_decay.reshape(n, BH, 1, 1)
    scores = scores.reshape(n, BH, C, C)
    M = memory.view(BH, dk, dv)
    # of the chunks that read their start state (all but a fresh first one): [P_c M_c ; exp(G)
    # q M_c], and U_c
    read = M.new_empty(n - first, BH, 2 * C, dv)
    corrections = M.new_empty(n - first, BH, C, dv)
    out = M.new_empty(n, BH, C, dv)
    if fresh:  # chunk 0 from zeros: U_0 = W_0, its outputs' own part only, M_1 from U_0
        torch.bmm(scores[0], W[0], out=out[0])
        torch.bmm(k_end[0], W[0], out=M)
    for c in range(first, n):
        r, u = read[c - first], corrections[c - first]
        torch.bmm(reads[c - first], M, out=r)
        torch.sub(W[c], r[:, :C], out=u)
        M.mul_(chunk_decay[c]).baddbmm_(k_end[c], u)
    # every such chunk's outputs at once: o_i = exp(G_i) q_i M_c + sum_{j<=i} decay (q_i . k_j) u_j
    if n > first:
        m = (n - first) * BH
        torch.baddbmm(read[:, :, C:].reshape(m, C, dv), scores[first:].reshape(m, C, C),
                      corrections.view(m, C, dv), out=out[first:].view(m, C, dv))
    out = out.view(n, B, Hv, C, dv).permute(1, 0, 3, 2, 4).reshape(B, n * C, Hv, dv)
    return out if pad == 0 else out[:, :S]


def as_float(x: torch.Tensor) -> torch.Tensor:
    # a float32 tensor as it is: even a no-op ``.float()`` is one more dispatched op per call
    return x if x.dtype == torch.float32 else x.float()


def _chunk_rows(x: torch.Tensor, n: int, C: int, scale: float, normalise: bool) -> torch.Tensor:
    """Queries or keys [B, n * C, Hk, d] as [n, B, Hk, C, d] (contiguous: the batched products
    fold their batch dims without a copy), L2-normalised (``normalise``) and scaled by
    ``scale``, in one pass that also makes the chunk-major copy."""
    B, _, Hk, d = x.shape
    x = x.view(B, n, C, Hk, d).permute(1, 0, 3, 2, 4)
    factor = x.new_full((), scale) if not normalise else \
        torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_().add_(L2_EPS).rsqrt_().mul_(scale)
    return torch.mul(x, factor, out=x.new_empty(x.shape))
