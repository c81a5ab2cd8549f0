"""Greedy rationale decoding of T5 rows with early exit and refill.

Rows are independent, so which rows share a step batch changes no row's tokens. That allows:

* **Settling short rows without cross-attention K/V.** Every row first takes up to
  ``FAST_STEPS`` steps through the reassociated decoder pass (``T5Model.decode_choice`` with
  full-vocabulary logits), which reads the encoder states directly instead of projecting every
  encoder token to K and V in every decoder layer. A row that meets EOS (or its budget) there is
  done: a score-only LAVE row whose greedy output is a rating followed by EOS costs those
  steps and no K/V. The other rows start over in the cached loop below (the same greedy steps).
* **Early exit.** The cached loop keeps its rows in the leading slots of fixed buffers (decoder
  self-attention K/V, cross-attention K/V, both contiguous). A row that meets EOS or its budget
  leaves at once: the last live row is copied into its slot, so no finished row is carried
  along and no other row's cache is copied.
* **Refill.** With more rows than slots, waiting rows are encoded when slots free up and join
  the batch at their first step (rows of one step batch sit at different positions; each attends
  to its own length through its own mask row).

Argmax runs on the device and each step moves one small tensor to the host.
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .t5_model import T5Model, rms_norm

# Steps taken through the reassociated pass before a row gets cross-attention K/V: enough for a
# rating followed by EOS, also where the rating is written as two pieces ("▁" and a digit).
# Each such step re-runs the decoder prefix, but with a handful of positions that costs far
# less than projecting the encoder states to K/V in every layer.
FAST_STEPS = 3


class Slots:
    """Decoding state of up to ``capacity`` rows; live rows fill slots ``0 .. live - 1``.

    One buffer per kind holds every layer's K and V, ``[slot, layer, k/v, head, position,
    d_kv]``, so moving a row is one copy per kind. Both start zeroed and only ever receive
    finite values: a masked position's weight is exactly 0, so stale values of a slot's earlier
    row never reach a result and slots are not cleared between rows."""

    def __init__(self, model: T5Model, capacity: int, enc_len: int, max_new_tokens: int, device):
        s, w = model.s, model.w
        dt = w.embed.dtype
        n = len(w.decoder)
        self.self_kv = torch.zeros(capacity, n, 2, s.num_heads, max_new_tokens, s.d_kv, dtype=dt, device=device)
        self.cross_kv = torch.zeros(capacity, n, 2, s.num_heads, enc_len, s.d_kv, dtype=dt, device=device)
        self.enc_len = enc_len
        self.capacity = capacity
        self.live = 0
        self.rows: list[int] = []  # the request row in each live slot
        self.pos: list[int] = []  # each live row's next decoder position
        self.token: list[int] = []  # each live row's next input token
        self.lengths: list[int] = []  # each live row's prompt length
        self._key_mask: torch.Tensor | None = None  # [live, 1, 1, enc_len], rebuilt on change

    def add(self, model: T5Model, rows: Sequence[int], states: Sequence[torch.Tensor], start_token: int) -> None:
        """Move rows in at their first step: cross-attention K/V of their encoder states
        (``[n, d]`` each), computed once for the whole decode, one GEMM per layer and kind."""
        g, j = len(rows), self.live
        h, dk = model.s.num_heads, model.s.d_kv
        mem = states[0].new_zeros(g, self.enc_len, states[0].shape[-1])
        for i, st in enumerate(states):
            mem[i, : st.shape[0]] = st
        for li, layer in enumerate(model.w.decoder):
            for kind, name in enumerate(("x_k", "x_v")):
                self.cross_kv[j: j + g, li, kind] = \
                    F.linear(mem, layer[name]).view(g, self.enc_len, h, dk).transpose(1, 2)
        self.rows += rows
        self.pos += [0] * g
        self.token += [start_token] * g
        self.lengths += [st.shape[0] for st in states]
        self.live += g
        self._key_mask = None

    def remove(self, j: int) -> None:
        """Drop the row in slot ``j``: the last live row moves into it (one row's copy)."""
        last = self.live - 1
        if j != last:
            self.self_kv[j] = self.self_kv[last]
            self.cross_kv[j] = self.cross_kv[last]
            for lst in (self.rows, self.pos, self.token, self.lengths):
                lst[j] = lst[last]
        for lst in (self.rows, self.pos, self.token, self.lengths):
            lst.pop()
        self.live = last
        self._key_mask = None

    def key_mask(self) -> torch.Tensor:
        """0 over each live row's prompt, -inf over its padding."""
        if self._key_mask is None:
            dev = self.cross_kv.device
            keys = torch.arange(self.enc_len, device=dev)
            n = torch.tensor(self.lengths, device=dev)[:, None]
            self._key_mask = torch.zeros(self.live, self.enc_len, dtype=self.cross_kv.dtype, device=dev) \
                .masked_fill(keys >= n, float("-inf")).view(self.live, 1, 1, self.enc_len)
        return self._key_mask


def step(model: T5Model, slots: Slots, self_mask: torch.Tensor) -> torch.Tensor:
    """One greedy step of the live rows: full-vocabulary logits [live, V]."""
    s, b = model.s, slots.live
    h, dk = s.num_heads, s.d_kv
    dev = slots.cross_kv.device
    token = torch.tensor(slots.token, device=dev)
    pos = torch.tensor(slots.pos, device=dev)
    rows = torch.arange(b, device=dev)
    # each row's query position: its bias row, -inf past itself
    mask = self_mask[:, pos].transpose(0, 1).unsqueeze(2)  # [b, H, 1, budget]
    key_mask = slots.key_mask()
    self_kv, cross_kv = slots.self_kv[:b], slots.cross_kv[:b]
    x = F.embedding(token, model.w.embed)[:, None, :]  # [b, 1, d]
    for li, layer in enumerate(model.w.decoder):
        qkv = F.linear(rms_norm(x, layer["norm"], s.eps), layer["qkv"]).view(b, 3, h, dk)
        slots.self_kv[rows, li, :, :, pos] = qkv[:, 1:]  # this step's K and V at each row's position
        o = F.scaled_dot_product_attention(qkv[:, 0, :, None], self_kv[:, li, 0], self_kv[:, li, 1],
                                           attn_mask=mask, scale=1.0)
        x = x + F.linear(o.reshape(b, 1, h * dk), layer["o"])
        xq = F.linear(rms_norm(x, layer["x_norm"], s.eps), layer["x_q"]).view(b, h, 1, dk)
        o = F.scaled_dot_product_attention(xq, cross_kv[:, li, 0], cross_kv[:, li, 1],
                                           attn_mask=key_mask, scale=1.0)
        x = x + F.linear(o.reshape(b, 1, h * dk), layer["x_o"])
        x = model.feed_forward(x, layer)
    return model._logits_rows(x[:, 0], None)


def _pick(logits: torch.Tensor, track: torch.Tensor | None) -> list[list[float]]:
    """Per row: [greedy token, tracked logits...], in one transfer to the host (token ids are
    exact in float32: vocabularies are far below 2**24)."""
    token = logits.argmax(-1, keepdim=True).to(logits.dtype)
    return torch.cat([token, logits[:, track]] if track is not None else [token], 1).tolist()


def decode_greedy(model: T5Model, prompts: Sequence[np.ndarray], max_new_tokens: int,
                  track: torch.Tensor | None, max_rows: int, encode_tokens: int):
    """Greedy decoding of ``prompts`` (token ids per row) until EOS or ``max_new_tokens``.

    At most ``max_rows`` rows hold cross-attention K/V at a time; rows are encoded in packs of
    about ``encode_tokens`` tokens as room frees up. Returns per row: generated ids (EOS
    excluded), whether EOS ended it, and the tracked logits [steps, K] of every kept step
    (None without ``track``)."""
    s = model.s
    dev = model.w.embed.device
    eos, start = s.eos_token_id, s.decoder_start_token_id
    n_rows = len(prompts)
    tokens: list[list[int]] = [[] for _ in range(n_rows)]
    tracked: list[list[list[float]]] = [[] for _ in range(n_rows)]
    finished = [False] * n_rows

    def take(row: int, picked: list[float]) -> bool:
        """Record one greedy step of ``row``; True when the row is done."""
        tok = int(picked[0])
        if tok == eos:
            finished[row] = True
            return True
        tokens[row].append(tok)
        tracked[row].append(picked[1:])
        return len(tokens[row]) >= max_new_tokens

    todo = deque(range(n_rows))
    ready: deque[tuple[int, torch.Tensor]] = deque()  # encoded rows not settled by the fast path

    def encode_more() -> None:
        """Encode the next pack of waiting rows and take their first steps reassociated."""
        pack, total = [], 0
        while todo and (not pack or total + len(prompts[todo[0]]) <= encode_tokens):
            pack.append(todo.popleft())
            total += len(prompts[pack[-1]])
        lengths = [len(prompts[i]) for i in pack]
        packed = torch.from_numpy(np.concatenate([prompts[i] for i in pack])).to(dev)
        enc = model.encode(packed, lengths)
        starts = np.concatenate([[0], np.cumsum(lengths)])
        states = {i: enc[int(starts[k]):int(starts[k + 1])] for k, i in enumerate(pack)}
        prefixes = {i: [start] for i in pack}
        for _ in range(min(FAST_STEPS, max_new_tokens)):
            rows = list(prefixes)
            if not rows:
                break
            logits = model.decode_choice(torch.cat([states[i] for i in rows]),
                                         [len(prompts[i]) for i in rows],
                                         [prefixes[i] for i in rows], None)
            for i, picked in zip(rows, _pick(logits, track)):
                if take(i, picked):
                    del prefixes[i]
                else:
                    prefixes[i].append(int(picked[0]))
        for i in pack:
            if i in prefixes:  # still running: restarts in the cached loop
                tokens[i].clear()
                tracked[i].clear()
                ready.append((i, states[i]))

    enc_len = max(len(p) for p in prompts)
    slots = None
    self_mask = None
    while todo or ready or (slots is not None and slots.live):
        while todo and len(ready) < max_rows - (slots.live if slots else 0):
            encode_more()
        if slots is None:
            if not ready:
                continue  # every row so far settled by the fast path
            slots = Slots(model, max(1, min(max_rows, n_rows)), enc_len, max_new_tokens, dev)
            bias = model.decoder_bias(max_new_tokens)
            causal = torch.ones(max_new_tokens, max_new_tokens, dtype=torch.bool, device=dev).tril()
            self_mask = bias.masked_fill(~causal, float("-inf"))  # [H, budget, budget]
        joining = [ready.popleft() for _ in range(min(len(ready), slots.capacity - slots.live))]
        if joining:
            slots.add(model, [i for i, _ in joining], [st for _, st in joining], start)
        if not slots.live:
            continue
        done = []
        for j, picked in enumerate(_pick(step(model, slots, self_mask), track)):
            row = slots.rows[j]
            if take(row, picked):
                done.append(j)
            else:
                slots.pos[j] += 1
                slots.token[j] = int(picked[0])
        for j in reversed(done):  # highest first: the row moved into a freed slot is live
            slots.remove(j)
    if track is None:
        return tokens, finished, [None] * n_rows
    return tokens, finished, [np.asarray(t, dtype=np.float64).reshape(len(t), len(track))
                              for t in tracked]
