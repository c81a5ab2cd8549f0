"""Greedy rationale decoding of T5 rows with early exit and refill.

Rows are independent, so which rows share a step batch changes no row's tokens. That allows:

* **No cross-attention K/V.** Each step's cross-attention is the reassociated form
  (``T5Model.cross_attention``), which reads a row's encoder states directly: a row costs no
  K/V projection of its prompt when it joins, and a step reads fewer bytes per encoder token
  than cached K/V would (``d_model`` against ``2 * heads * d_kv``).
* **Early exit.** Live rows sit in the leading slots of fixed buffers (encoder states and
  decoder self-attention K/V). A row that meets EOS or its budget leaves at once: the last live
  row is copied into its slot, so no finished row is carried along.
* **Refill.** With more rows than slots, waiting rows are encoded when slots free up and join
  the batch at their first step (rows of one step batch sit at different positions; each attends
  to its own length through its own mask row).
* **Only live extents.** A step attends over the longest live row's encoder states and the
  furthest live decoder position, not the buffers' full widths (masked keys have weight
  exactly 0, so leaving them out changes nothing).

Argmax runs on the device and each step moves one small tensor to the host.
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .compiled import row_bucket
from .host_copy import to_host
from .t5_model import T5Model, key_bias, rms_norm


def row_bytes(model: T5Model, enc_len: int, max_new_tokens: int) -> int:
    """Bytes one decoding row holds: its encoder states and its self-attention K/V."""
    s = model.s
    per_token = s.d_model * enc_len + len(model.w.decoder) * 2 * s.num_heads * s.d_kv * max_new_tokens
    return per_token * model.w.embed.element_size()


class Slots:
    """Decoding state of up to ``capacity`` rows; live rows fill slots ``0 .. live - 1``.

    ``mem`` [slot, enc_len, d] holds each row's encoder states, ``self_kv`` [slot, layer, k/v,
    head, position, d_kv] its decoder self-attention K/V. Both start zeroed and only ever
    receive finite values: a masked position's weight is exactly 0, so stale values of a slot's
    earlier row never reach a result and slots are not cleared between rows."""

    def __init__(self, model: T5Model, capacity: int, enc_len: int, max_new_tokens: int, device):
        s, w = model.s, model.w
        dt = w.embed.dtype
        self.mem = torch.zeros(capacity, enc_len, s.d_model, dtype=dt, device=device)
        self.self_kv = torch.zeros(capacity, len(w.decoder), 2, s.num_heads, max_new_tokens, s.d_kv,
                                   dtype=dt, device=device)
        self.capacity = capacity
        self.live = 0
        self.rows: list[int] = []  # the request row in each live slot
        self.pos: list[int] = []  # each live row's next decoder position
        self.token: list[int] = []  # each live row's next input token
        self.lengths: list[int] = []  # each live row's prompt length
        self._key_mask: torch.Tensor | None = None  # [live, 1, 1, longest live], rebuilt on change

    def add(self, model: T5Model, rows: Sequence[int], states: Sequence[torch.Tensor], start_token: int) -> None:
        """Move rows in at their first step with their encoder states (``[n, d]`` each)."""
        for i, st in enumerate(states):
            self.mem[self.live + i, : st.shape[0]] = st
        self.rows += rows
        self.pos += [0] * len(rows)
        self.token += [start_token] * len(rows)
        self.lengths += [st.shape[0] for st in states]
        self.live += len(rows)
        self._key_mask = None

    def remove(self, j: int) -> None:
        """Drop the row in slot ``j``: the last live row moves into it (the written part of its
        state only: what lies beyond is masked)."""
        last = self.live - 1
        if j != last:
            self.mem[j, : self.lengths[last]] = self.mem[last, : self.lengths[last]]
            self.self_kv[j, ..., : self.pos[last], :] = self.self_kv[last, ..., : self.pos[last], :]
            for lst in (self.rows, self.pos, self.token, self.lengths):
                lst[j] = lst[last]
        for lst in (self.rows, self.pos, self.token, self.lengths):
            lst.pop()
        self.live = last
        self._key_mask = None

    def key_mask(self) -> torch.Tensor:
        """0 over each live row's prompt, -inf after it, up to the longest live prompt."""
        if self._key_mask is None:
            self._key_mask = key_bias(self.lengths, max(self.lengths), self.mem.dtype, self.mem.device)
        return self._key_mask


def step(model: T5Model, slots: Slots, self_mask: torch.Tensor, compiled=None) -> torch.Tensor:
    """One greedy step of the live rows: full-vocabulary logits [live, V]. ``compiled`` (a
    ``compiled.CompiledFunction`` of :func:`step_core`): the step runs compiled on a shape
    bucket -- rows padded with free slots (at position 0, their own keys only), keys over the
    whole budget and prompt width -- so that a handful of shapes serve every step."""
    b = slots.live
    dev = slots.mem.device
    if compiled is None or row_bucket(b) > slots.capacity:
        token, pos = torch.tensor([slots.token, slots.pos], device=dev)  # one host->device copy
        width = max(slots.pos) + 1  # decoder positions any live row reads
        key_mask = slots.key_mask()
        return step_core(model, token, pos, self_mask, key_mask, slots.mem[:b, : key_mask.shape[-1]],
                         slots.self_kv[:b], width)
    rows = row_bucket(b)
    pad = rows - b
    token, pos = torch.tensor([slots.token + [0] * pad, slots.pos + [0] * pad], device=dev)
    key_mask = key_bias(slots.lengths + [1] * pad, slots.mem.shape[1], slots.mem.dtype, dev)
    width = slots.self_kv.shape[-2]
    return compiled((rows, width, slots.mem.shape[1]), model, token, pos, self_mask, key_mask, slots.mem[:rows],
                    slots.self_kv[:rows], width)[:b]


def step_core(model: T5Model, token: torch.Tensor, pos: torch.Tensor, self_mask: torch.Tensor,
              key_mask: torch.Tensor, mem: torch.Tensor, self_kv: torch.Tensor, width: int) -> torch.Tensor:
    """:func:`step` on tensors alone (what a compiler takes): ``token`` / ``pos`` [b] each row's
    input and position, ``key_mask`` [b, 1, 1, L] over ``mem`` [b, L, d], ``self_kv`` the rows'
    K/V (written at ``pos`` in place), ``width`` the decoder positions read."""
    s, b = model.s, token.shape[0]
    h, dk = s.num_heads, s.d_kv
    rows = torch.arange(b, device=token.device)
    # each row's query position: its bias row, -inf past itself
    mask = self_mask[:, pos, :width].transpose(0, 1).unsqueeze(2)  # [b, H, 1, width]
    kv = self_kv[..., :width, :]
    x = F.embedding(token, model.w.embed)[:, None, :]  # [b, 1, d]
    for li, layer in enumerate(model.w.decoder):
        qkv = F.linear(rms_norm(x, layer.norm, s.eps), layer.qkv).view(b, 3, h, dk)
        self_kv[rows, li, :, :, pos] = qkv[:, 1:]  # this step's K and V at each row's position
        o = F.scaled_dot_product_attention(qkv[:, 0, :, None], kv[:, li, 0], kv[:, li, 1],
                                           attn_mask=mask, scale=1.0)
        x = x + F.linear(o.reshape(b, 1, h * dk), layer.o)
        xq = F.linear(rms_norm(x, layer.x_norm, s.eps), layer.x_q).view(b, 1, h, dk)
        x = x + F.linear(model.cross_attention(xq, layer, mem, key_mask), layer.x_o)
        x = model.feed_forward(x, layer)
    return model._logits_rows(x[:, 0], None)


def _pick(logits: torch.Tensor, track: torch.Tensor | None) -> list[list[float]]:
    """Per row: [greedy token, tracked logits...], in one transfer to the host (token ids are
    exact in float32: vocabularies are far below 2**24)."""
    token = logits.argmax(-1, keepdim=True).to(logits.dtype)
    return to_host(torch.cat([token, logits[:, track]] if track is not None else [token], 1)).tolist()


def decode_greedy(model: T5Model, prompts: Sequence[np.ndarray], max_new_tokens: int,
                  track: torch.Tensor | None, max_rows: int, encode_tokens: int, compiled=None):
    """Greedy decoding of ``prompts`` (token ids per row) until EOS or ``max_new_tokens``.

    At most ``max_rows`` rows decode at a time; rows are encoded in packs of about
    ``encode_tokens`` tokens as room frees up. ``compiled``: the compiled step function
    (:func:`step`). Returns per row: generated ids (EOS excluded),
    whether EOS ended it, and the tracked logits [steps, K] of every kept step (None without
    ``track``)."""
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
    ready: deque[tuple[int, torch.Tensor]] = deque()  # encoded rows waiting for a slot

    def encode_more() -> None:
        """Encode the next pack of waiting rows."""
        pack, total = [], 0
        while todo and (not pack or total + len(prompts[todo[0]]) <= encode_tokens):
            pack.append(todo.popleft())
            total += len(prompts[pack[-1]])
        lengths = [len(prompts[i]) for i in pack]
        packed = torch.from_numpy(np.concatenate([prompts[i] for i in pack])).to(dev)
        enc = model.encode(packed, lengths)
        starts = np.concatenate([[0], np.cumsum(lengths)])
        ready.extend((i, enc[int(starts[k]):int(starts[k + 1])]) for k, i in enumerate(pack))

    rows = max(1, min(max_rows, n_rows))
    slots = Slots(model, row_bucket(rows) if compiled is not None else rows, max(len(p) for p in prompts),
                  max_new_tokens, dev)
    bias = model.decoder_bias(max_new_tokens)
    causal = torch.ones(max_new_tokens, max_new_tokens, dtype=torch.bool, device=dev).tril()
    self_mask = bias.masked_fill(~causal, float("-inf"))  # [H, budget, budget]
    while todo or ready or slots.live:
        while todo and len(ready) < rows - slots.live:
            encode_more()
        joining = [ready.popleft() for _ in range(min(len(ready), rows - slots.live))]
        if joining:
            slots.add(model, [i for i, _ in joining], [st for _, st in joining], start)
        done = []
        for j, picked in enumerate(_pick(step(model, slots, self_mask, compiled), track)):
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
