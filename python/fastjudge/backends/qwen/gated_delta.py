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

a unit lower-triangular system ``(I + L) U = beta V - (beta exp(G) K) M0``. Solving it once per
chunk for the two right-hand sides gives ``U = W - P M0`` with ``W`` and ``P`` independent of
``M0``; then every output and the state at the end of the chunk are matrix products:

    o_i  = exp(G_i) M0^T q_i + sum_{j<=i} exp(G_i - G_j) (q_i . k_j) u_j
    M_C  = exp(G_C) M0 + sum_j exp(G_C - G_j) k_j u_j^T

Everything but the last two lines runs for all chunks at once; only the hand-over of ``M``
from chunk to chunk is sequential (a Python loop over the static number of chunks).

In-place form. :func:`recurrent_gated_delta_rule_` is the recurrent rule as a decoding step runs it:
on the state pool's memory itself (no copy of the state in or out), with each key head read once
for the value heads it serves (no repeated keys), in the fewest ops.

The two functions above take the engine's layout: queries and keys [B, S, Hk, dk], values [B, S, Hv, dv]
(Hv a multiple of Hk: each key head serves Hv // Hk consecutive value heads), ``g`` and ``beta``
[B, S, Hv]; an optional initial state [B, Hv, dk, dv]. They return the outputs [B, S, Hv, dv] in
the queries' dtype and, when asked, the final state [B, Hv, dk, dv] in float32. All math runs in
float32. There is no data-dependent Python control flow and no host read of a tensor value, so
both trace under ``torch.compile`` and CUDA graph capture.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

L2_EPS = 1e-6  # inside the square root, as the reference kernels normalise keys and queries


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
    ``dk ** -0.5``), values [B, S, Hv, dv], ``g`` and ``beta`` [B, S, Hv], all float32. Returns
    the outputs [B, S, Hv, dv] (float32); ``memory`` holds the final state."""
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


def chunk_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           g: torch.Tensor, beta: torch.Tensor, chunk_size: int = 64,
                           initial_state: torch.Tensor | None = None,
                           output_final_state: bool = False,
                           use_qk_l2norm_in_kernel: bool = False, **unused):
    """The gated delta rule over ``chunk_size``-token chunks (prefill, multi-token steps). The
    sequence is right-padded to whole chunks with ``beta = 0``, ``g = 0`` steps, which leave the
    state unchanged, and the padded outputs are dropped."""
    out_dtype = query.dtype
    q, k, v, g, beta = _heads_first(query, key, value, g, beta, use_qk_l2norm_in_kernel)
    B, H, S, dk = k.shape
    dv = v.shape[-1]
    C = chunk_size
    n = -(-S // C)
    pad = n * C - S
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    q, k, v = q.reshape(B, H, n, C, dk), k.reshape(B, H, n, C, dk), v.reshape(B, H, n, C, dv)
    G = g.reshape(B, H, n, C).cumsum(-1)  # running log-decay inside each chunk
    beta = beta.reshape(B, H, n, C, 1)

    # decay from token j to token i of a chunk (i >= j); the upper triangle is masked before the
    # exponential, where G_i - G_j > 0 could overflow
    later = torch.ones(C, C, dtype=torch.bool, device=k.device).triu(1)
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(later, float("-inf")).exp()

    # the corrections' triangular system; its diagonal is the identity (unitriangular solve)
    system = (beta * k) @ k.transpose(-1, -2) * decay
    start_decay = G.exp()[..., None]  # exp(G_i): how much of M0 token i still sees
    rhs = torch.cat([beta * v, beta * start_decay * k], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    fresh, from_start = solved.split([dv, dk], dim=-1)  # U = fresh - from_start @ M0

    scores = q @ k.transpose(-1, -2) * decay  # causal within-chunk attention, diagonal included
    q_start = q * start_decay  # reads M0 with the decay since the chunk's start
    to_end = (G[..., -1:] - G).exp()[..., None]  # exp(G_C - G_j)
    k_end = (k * to_end).transpose(-1, -2)  # [B, H, n, dk, C]: writes into the end state
    chunk_decay = G[..., -1].exp()[..., None, None]  # [B, H, n, 1, 1]

    memory = _start_state(initial_state, v, dk)
    outputs = []
    for c in range(n):
        u = fresh[:, :, c] - from_start[:, :, c] @ memory
        outputs.append(q_start[:, :, c] @ memory + scores[:, :, c] @ u)
        memory = memory * chunk_decay[:, :, c] + k_end[:, :, c] @ u
    out = torch.stack(outputs, dim=2).view(B, H, n * C, dv)[:, :, :S]
    out = out.transpose(1, 2).contiguous().to(out_dtype)
    return out, (memory if output_final_state else None)
