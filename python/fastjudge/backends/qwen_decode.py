"""Greedy decoding of a batch of Qwen rows, optionally constrained by a grammar (Json specs): the
rows decode together, each attending to its own length only, until every row has met a stop
token or its token limit. Three things keep every row of every model step doing real work:

* **Jump-forward** (``jump_forward=True``): where the grammar allows exactly one token next,
  greedy decoding must pick it whatever the logits (the masked argmax has one finite entry), so
  it is accepted without a model step; the run of forced tokens and the token chosen before it
  then go through the model in one multi-token step (``QwenModel.extend``). Only this
  single-allowed-token rule is used, because it is exact by construction; a jump-forward
  *string* would have to be re-tokenized, and its tokens need not be the ones greedy decoding
  picks. A forced stop token ends the row the same way. Rows force different numbers of
  tokens: the step right-pads them and masks the pads out of every row's state (see
  ``extend``), so one step serves the whole batch.
* **Early exit**: a row that finishes (stop token, grammar terminated, token budget) leaves the
  batch at once; its rows of the :class:`DecodeCache` are dropped, not padded along.
* **Refill**: with ``max_rows``, at most that many rows decode at once; waiting rows are
  prefilled (their suffix from the prefix state) and join the cache as others leave.

With ``jump_forward=False`` every step feeds one token per row (``QwenModel.decode_step``), as
plain greedy decoding does; early exit and refill apply either way. None of the three changes
an output beyond float rounding of a different batch shape.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from ..runtime.requests import Output, Request
from .qwen_model import PrefixState, QwenModel, QwenShape

DECODE_ROOM = 256  # K/V room allocated for new tokens up front; longer outputs double the buffers


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

    def keep(self, rows: torch.Tensor) -> None:
        """Only ``rows`` (indices, in this order) stay: finished rows leave the batch."""
        self.lengths = self.lengths[rows]
        self.positions = self.positions[rows]
        self.layers = [[t.index_select(0, rows) for t in pair] for pair in self.layers]

    def merge(self, other: "DecodeCache") -> None:
        """``other``'s rows join after this cache's rows (K/V buffers padded to one length)."""
        width = max(self.capacity, other.capacity)

        def fit(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t, t.new_zeros(*t.shape[:2], width - t.shape[2], t.shape[3])], dim=2)

        for i, kind in enumerate(self.kinds):
            pairs = zip(self.layers[i], other.layers[i])
            if kind == "full_attention":
                self.layers[i] = [torch.cat([fit(a), fit(b)]) for a, b in pairs]
            else:
                self.layers[i] = [torch.cat([a, b]) for a, b in pairs]
        self.lengths = torch.cat([self.lengths, other.lengths])
        self.positions = torch.cat([self.positions, other.positions])


@dataclass
class _Row:
    request: Request
    matcher: object  # runtime.grammar.JsonMatcher, or None for Text
    tokens: list[int] = field(default_factory=list)
    # per token, the tracked logits, or (forced tokens) the position in this step's feed whose
    # predecessor's hidden state gives them, filled in after the step
    tracked: list = field(default_factory=list)
    finished: bool = False  # a stop token was chosen (Text rows)
    done: bool = False


class _Step:
    """Choosing one step's tokens for every live row: the fed tokens of each and the counters."""

    def __init__(self, jump_forward: bool, eos_token_ids: set[int], limit: int, track, stats: dict):
        self.jump_forward = jump_forward
        self.eos = eos_token_ids
        self.limit = limit
        self.track = track
        self.stats = stats

    def feed(self, row: _Row, logits: torch.Tensor) -> list[int]:
        """The tokens ``row`` feeds the model next: the forced run where the grammar forces
        the very next token (at the start of a row); else the token chosen from ``logits`` and
        the forced run after it. Empty when the row ended on a stop token."""
        fed: list[int] = []
        if self.jump_forward:
            self._force(row, fed, logits)
        if fed or row.done:
            return fed
        z = logits if row.matcher is None else row.matcher.mask(logits)
        token = int(z.argmax())
        self.stats["tokens_computed"] += 1
        if row.matcher is not None:
            row.matcher.accept(token)
        if token in self.eos:
            row.finished = row.done = True
            return fed
        self._append(row, token, logits[self.track] if self.track is not None else None)
        fed.append(token)
        if self.jump_forward:
            self._force(row, fed, logits)
        return fed

    def _force(self, row: _Row, fed: list[int], logits: torch.Tensor) -> None:
        while not row.done and row.matcher is not None:
            token = row.matcher.forced_token()
            if token is None:
                return
            row.matcher.accept(token)
            self.stats["tokens_forced"] += 1
            if token in self.eos:
                row.done = True
                return
            if self.track is None:
                tracked = None
            else:  # first in the feed: the logits at hand; later: from the step's hidden states
                tracked = logits[self.track] if not fed else len(fed)
            self._append(row, token, tracked)
            fed.append(token)

    def _append(self, row: _Row, token: int, tracked) -> None:
        row.tokens.append(token)
        if self.track is not None:
            row.tracked.append(tracked)
        row.done = len(row.tokens) == self.limit


def decode_greedy(model: QwenModel, batch: Sequence[Request], matchers: Sequence,
                  prefill: Callable[[Sequence[Request]], tuple[torch.Tensor, DecodeCache]],
                  eos_token_ids: set[int], jump_forward: bool = False, max_rows: int | None = None,
                  stats: dict | None = None) -> tuple[list[Output], int]:
    """Greedy decoding of ``batch`` (one Text/Json spec). ``matchers``: per row, a grammar
    matcher (Json) or None (Text). ``prefill(requests)``: the rows' final prompt hidden states
    [n, d] and their decode cache. ``max_rows``: the most rows decoding at once (default: all).
    ``stats``: counters ``tokens_computed`` (tokens chosen from logits), ``tokens_forced``
    (tokens accepted by jump-forward) and ``decode_steps`` (model calls), stop tokens included,
    added to in place. Returns the outputs and the number of tokens run through the model."""
    spec = batch[0].spec
    stats = {"tokens_computed": 0, "tokens_forced": 0, "decode_steps": 0} if stats is None else stats
    track_ids = getattr(spec, "track_ids", ())
    device = None
    rows = [_Row(r, m) for r, m in zip(batch, matchers)]
    waiting = deque(range(len(rows)))
    width = max_rows or len(rows)
    live: list[int] = []  # indices into rows, in cache order
    hidden, cache = None, None
    fed_total = 0
    chooser = None
    while waiting or live:
        if waiting and len(live) < width:  # refill: newcomers join at the end of the cache
            new = [waiting.popleft() for _ in range(min(width - len(live), len(waiting)))]
            h, c = prefill([rows[i].request for i in new])
            if cache is None:
                hidden, cache, device = h, c, h.device
                track = torch.tensor(track_ids, device=device) if track_ids else None
                chooser = _Step(jump_forward, eos_token_ids, spec.max_new_tokens, track, stats)
            else:
                hidden = torch.cat([hidden, h])
                cache.merge(c)
            live += new
        logits = model.logits(hidden)
        feeds = [chooser.feed(rows[i], logits[j]) for j, i in enumerate(live)]
        # a finished row still takes this step only to fill tracked logits of forced tokens
        stay = [j for j, i in enumerate(live) if not rows[i].done
                or any(isinstance(t, int) for t in rows[i].tracked)]
        if len(stay) < len(live):  # early exit
            index = torch.tensor(stay, device=device, dtype=torch.long)
            cache.keep(index)
            hidden = hidden[index]
            live, feeds = [live[j] for j in stay], [feeds[j] for j in stay]
        if not live:
            continue
        counts = [len(f) for f in feeds]
        fed_total += sum(counts)
        stats["decode_steps"] += 1
        if max(counts) == 1:
            hidden = model.decode_step(torch.tensor([f[0] for f in feeds], device=device), cache)
        else:
            padded = torch.tensor([f + [f[-1]] * (max(counts) - len(f)) for f in feeds], device=device)
            n = torch.tensor(counts, device=device)
            out = model.extend(padded, n, cache)
            hidden = out[torch.arange(len(live), device=device), n - 1]
            if track_ids:
                _fill_tracked(model, [rows[i] for i in live], out, chooser.track)
        stay = [j for j, i in enumerate(live) if not rows[i].done]
        if len(stay) < len(live):  # rows that stayed only for their tracked logits
            index = torch.tensor(stay, device=device, dtype=torch.long)
            cache.keep(index)
            hidden, live = hidden[index], [live[j] for j in stay]
    return [_output(r, track_ids) for r in rows], fed_total


def _fill_tracked(model: QwenModel, rows: Sequence[_Row], out: torch.Tensor, track: torch.Tensor) -> None:
    """Tracked logits of the tokens forced after a step's first: from the hidden state of the
    token before each, at its feed position - 1."""
    for b, row in enumerate(rows):
        for t, item in enumerate(row.tracked):
            if isinstance(item, int):
                row.tracked[t] = model.logits(out[b, item - 1][None])[0, track]


def _output(row: _Row, track_ids) -> Output:
    out = Output(index=row.request.index, token_ids=row.tokens,
                 finished=row.matcher.finished if row.matcher is not None else row.finished)
    if track_ids:
        out.tracked_logits = (torch.stack(row.tracked).cpu().numpy().astype(np.float64) if row.tracked
                              else np.zeros((0, len(track_ids))))
    return out
