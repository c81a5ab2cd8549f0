"""Greedy decoding of a batch of Qwen rows, optionally constrained by a grammar (Json specs): the
rows decode together, each attending to its own length only, until every row has met a stop
token or its token limit.

Every step is one batched operation whatever the row count: the model runs once over all live
rows (``model.run_step`` on the leading slots of the state pool); the grammar's next-token masks
of all rows are filled on the host into one ``[rows, ceil(V/32)]`` bitmask
(``runtime.grammar.TokenMask``) and applied to the batch's logits in one call; one argmax picks
every row's token; and **one** device-to-host copy brings the chosen ids (with the tracked
logits, when the spec tracks any) to the host. Everything else -- grammar state, stop tokens,
budgets, which rows leave -- is decided on the host from that copy. Text rows, where the CPU
engine runs the step, have the step pick their next tokens in its own call (``pick_step``: final
norm, head and argmax there, the same tokens, with any tracked ids' logits), and the host gets the
ids without a logits tensor; such steps run back to back in that call, each feeding the picks of the
one before, until a row ends (or the next step is for waiting rows to join). Three things keep
every row of every model step doing real work:

* **Jump-forward** (``jump_forward=True``): where the grammar allows exactly one token next,
  greedy decoding must pick it whatever the logits (the masked argmax has one finite entry), so
  it is accepted without a model step; the run of forced tokens and the token chosen before it
  then go through the model in one multi-token step. Only this single-allowed-token rule is
  used, because it is exact by construction; a jump-forward *string* would have to be
  re-tokenized, and its tokens need not be the ones greedy decoding picks. A forced stop token
  ends the row the same way. Rows force different numbers of tokens: the step right-pads them
  and keeps the pads out of every row's state, so one step serves the whole batch.
* **Early exit**: a row that finishes (stop token, grammar terminated, token budget) frees its
  slot at once: the last live row moves into it, so live rows stay a leading slice.
* **Refill**: with ``max_rows``, at most that many rows decode at once; waiting rows are
  prefilled (their suffix from the prefix state) into free slots as others leave.

With ``jump_forward=False`` every step feeds one token per row, as plain greedy decoding does;
early exit and refill apply either way. None of the three changes an output beyond float
rounding of a different batch shape.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch
from torch.profiler import record_function

from ...runtime.requests import Output, Request
from ..profiling import DECODE_LABEL, STEP_LABEL, count_run_steps, to_host
from ..slots import compact
from .model import QwenModel
from .pool import StatePool


@dataclass
class _Row:
    request: Request
    matcher: object  # runtime.grammar.JsonMatcher, or None for Text
    tokens: list[int] = field(default_factory=list)
    # per token, its tracked logits: a host list, or a (block, index) pair into a device tensor
    # of tracked logits computed after a step (forced tokens), brought over once at the end
    tracked: list = field(default_factory=list)
    finished: bool = False  # a stop token was chosen (Text rows)
    done: bool = False
    mask_slot: int | None = None  # the slot whose bitmask row holds this row's current mask


class _Chooser:
    """Choosing one step's tokens for every live row: the tokens each row feeds the model next,
    the counters, and where each tracked value comes from."""

    def __init__(self, jump_forward: bool, eos_token_ids: set[int], limit: int, track, mask, stats: dict):
        self.jump_forward = jump_forward
        self.eos = eos_token_ids
        self.limit = limit
        self.track = track  # device tensor of tracked ids, or None
        self.mask = mask  # runtime.grammar.TokenMask, or None for Text
        self.stats = stats

    def choose(self, rows: Sequence[_Row], logits: torch.Tensor | None,
               picked: np.ndarray | None = None) -> list[list[int]]:
        """The tokens each row (in slot order) feeds the model next: where the grammar forces
        the very next token, the forced run; else the token chosen from its row of ``logits``
        [rows, V] (float32, masked in place), or ``picked`` (host [rows, 1 + K]: text rows whose
        step picked them already, each row's pick then its K tracked ids' logits; no logits
        given), and the forced run after it. Empty when the row ended on a stop token."""
        feeds: list[list[int]] = [[] for _ in rows]
        choosing, from_logits = [], []  # rows choosing; (row, token index, slot) tracked from logits
        for j, row in enumerate(rows):
            if row.matcher is not None:
                self._force(row, j, feeds[j], from_logits)  # also fills the row's mask
            if not feeds[j] and not row.done:
                choosing.append(j)
        if not choosing and not from_logits:
            return feeds
        if picked is not None:
            host = picked.tolist()
        else:
            tracked = logits[:, self.track] if self.track is not None else None  # before masking
            if self.mask is not None:
                self.mask.apply(logits)
            best = logits.argmax(-1, keepdim=True).to(logits.dtype)  # ids exact in float32 (< 2**24)
            host = to_host(torch.cat([best, tracked], 1) if tracked is not None else best).tolist()
        for row, t, j in from_logits:
            row.tracked[t] = host[j][1:]
        for j in choosing:
            row = rows[j]
            token = int(host[j][0])
            self.stats["tokens_computed"] += 1
            if row.matcher is not None:
                row.matcher.accept(token)
                row.mask_slot = None
            if token in self.eos:
                row.finished = row.done = True
                continue
            self._append(row, token, host[j][1:] if self.track is not None else None)
            feeds[j].append(token)
            if row.matcher is not None and self.jump_forward:
                self._force(row, j, feeds[j], from_logits)
        return feeds

    def accept_run(self, rows: Sequence[_Row], run: np.ndarray, tracked: np.ndarray) -> None:
        """Tokens ``run`` [rows, n] (host int64) that a run of steps picked and fed on to the next
        step of the run (``pick_step``: text rows, none of them a stop token or past a row's
        limit), each row's in order, with the tracked ids' logits at each ([rows, n, K])."""
        for row, tokens, kept in zip(rows, run.tolist(), tracked.tolist()):
            row.tokens += tokens
            if self.track is not None:
                row.tracked += kept
        self.stats["tokens_computed"] += run.size

    def _force(self, row: _Row, j: int, fed: list[int], from_logits: list) -> None:
        """Fill row ``j``'s mask; with jump-forward, accept the tokens the grammar forces, each
        followed by a fresh fill. The row's mask is left as the grammar's next step allows (a
        row whose mask in slot ``j`` is already that needs nothing)."""
        while not row.done and not row.matcher.finished and row.mask_slot != j:
            self.mask.fill(j, row.matcher)
            row.mask_slot = j
            if not self.jump_forward:
                return
            token = self.mask.forced(j)
            if token is None:
                return
            row.matcher.accept(token)
            row.mask_slot = None
            self.stats["tokens_forced"] += 1
            if token in self.eos:
                row.done = True
                return
            tracked = None
            if self.track is not None:
                if not fed:  # first in the feed: this step's logits, copied with the picks
                    from_logits.append((row, len(row.tokens), j))
                else:  # later: from the hidden state of the token before it, after the step
                    tracked = len(fed)
            self._append(row, token, tracked)
            fed.append(token)

    def _append(self, row: _Row, token: int, tracked) -> None:
        row.tokens.append(token)
        if self.track is not None:
            row.tracked.append(tracked)
        row.done = len(row.tokens) == self.limit


def decode_greedy(model: QwenModel, batch: Sequence[Request], matchers: Sequence, pool: StatePool, max_rows: int,
                  prefill: Callable[[Sequence[Request], int], torch.Tensor],
                  step: Callable[[torch.Tensor, list[int]], torch.Tensor],
                  eos_token_ids: set[int], jump_forward: bool = False, mask=None,
                  stats: dict | None = None,
                  pick_step: Callable[[torch.Tensor, list[int], torch.Tensor, list[int], Sequence[int],
                                       Sequence[int]], tuple[np.ndarray, np.ndarray] | None] | None = None
                  ) -> tuple[list[Output], int]:
    """Greedy decoding of ``batch`` (one Text/Json spec). ``matchers``: per row, a grammar
    matcher (Json) or None (Text); ``mask``: the batch's ``TokenMask`` (Json). ``pool``: the
    state pool; at most ``max_rows`` rows decode at once (its leading slots), the others
    joining as rows finish. ``prefill(requests, first_slot)``: writes the rows' states into
    slots ``first_slot ..`` and returns their final prompt hidden states [n, d]. ``step(tokens,
    counts)``: one model step of the live rows (``model.run_step`` on the leading slots). ``stats``: counters
    ``tokens_computed`` (tokens chosen from logits), ``tokens_forced`` (tokens accepted by
    jump-forward) and ``decode_steps`` (model calls), stop tokens included, added to in place.
    ``pick_step(tokens, counts, hidden, room, stops, track)``: for Text rows, the same step with
    the next tokens' greedy pick in it (``model.run_pick_step``), then maybe more such steps in
    the same call, each feeding the picks of the one before, until a row picks one of ``stops``
    or as many tokens as its ``room``; it writes the rows' last hidden states into ``hidden`` and
    returns the picks ([rows, steps run]) and the ``track`` ids' logits at each ([rows, steps
    run, K]), or None where it does not run (``step`` then). Returns the outputs and the number
    of tokens run through the model."""
    with record_function(DECODE_LABEL):
        return _decode(model, batch, matchers, pool, max_rows, prefill, step, eos_token_ids, jump_forward, mask,
                       {"tokens_computed": 0, "tokens_forced": 0, "decode_steps": 0} if stats is None else stats,
                       pick_step)


def _decode(model, batch, matchers, pool, max_rows, prefill, step, eos_token_ids, jump_forward, mask, stats,
            pick_step):
    spec = batch[0].spec
    track_ids = getattr(spec, "track_ids", ())
    rows = [_Row(r, m) for r, m in zip(batch, matchers)]
    waiting = deque(range(len(rows)))
    live: list[int] = []  # the row in each live slot
    hidden = None  # [slots, d]: each live slot's last hidden state
    blocks: list[torch.Tensor] = []  # tracked logits of forced tokens, on the device
    chooser = None
    fed_total = 0
    # text rows may have their next tokens picked by the step itself
    picking = pick_step if mask is None else None
    stops = sorted(eos_token_ids)
    picks = None  # host [rows, 1 + K]: each live row's pick by the last step, its tracked logits; or None
    while waiting or live:
        if waiting and len(live) < max_rows:  # refill: newcomers take the free slots
            new = [waiting.popleft() for _ in range(min(max_rows - len(live), len(waiting)))]
            h = prefill([rows[i].request for i in new], len(live))
            if hidden is None:
                hidden = h.new_empty(max_rows, h.shape[-1])
                track = torch.tensor(track_ids, device=h.device) if track_ids else None
                chooser = _Chooser(jump_forward, eos_token_ids, spec.max_new_tokens, track, mask, stats)
            hidden[len(live): len(live) + len(new)] = h
            live += new
            picks = None  # every live row picks from its logits, in one batch as before
        live_rows = [rows[i] for i in live]
        feeds = chooser.choose(live_rows, None, picks) if picks is not None else \
            chooser.choose(live_rows, model.logits(hidden[: len(live)]))
        # a finished row still takes this step only to fill tracked logits of forced tokens
        _leave(pool, hidden, live, feeds, lambda row: row.done and not _awaits_step(row), rows)
        if not live:
            continue
        counts = [len(f) for f in feeds]
        fed_total += sum(counts)
        stats["decode_steps"] += 1
        width = max(counts)
        tokens = torch.tensor([f + [f[-1]] * (width - len(f)) for f in feeds]).to(hidden.device)
        with record_function(STEP_LABEL):
            picks = None
            if picking is not None:
                # a row's room: the tokens it may pick before the host sees them. One each where
                # rows wait for a free slot: the next step is theirs to join
                room = [1] * len(live) if waiting and len(live) < max_rows else \
                    [spec.max_new_tokens - len(rows[i].tokens) for i in live]
                picks = picking(tokens, counts, hidden, room, stops, track_ids)
            if picks is None:
                out = step(tokens, counts)
        if picks is not None:
            run, kept = picks
            if run.shape[1] > 1:  # a run of steps: all but its last picks fed on within it
                count_run_steps(run.shape[1] - 1)
                chooser.accept_run([rows[i] for i in live], run[:, :-1], kept[:, :-1])
                fed_total += run[:, 1:].size
                stats["decode_steps"] += run.shape[1] - 1
            picks = np.concatenate([run[:, -1:], kept[:, -1]], 1)  # each row's last pick, its tracked logits
        else:
            last = torch.tensor(counts).to(out.device) - 1
            hidden[: len(live)] = out[torch.arange(len(live), device=out.device), last]
            if track_ids and width > 1:
                _track_forced(model, [rows[i] for i in live], out, chooser.track, blocks)
        origin = _leave(pool, hidden, live, feeds, lambda row: row.done, rows)
        if picks is not None:
            picks = picks[origin]
    _bring_tracked(rows, blocks)
    return [_output(r, track_ids) for r in rows], fed_total


def _awaits_step(row: _Row) -> bool:
    """Whether some tracked logits of ``row`` come from the next step's hidden states."""
    return any(isinstance(t, int) for t in row.tracked)


def _leave(pool: StatePool, hidden: torch.Tensor, live: list[int], feeds: list, gone, rows) -> list[int]:
    """Rows for which ``gone(row)`` holds free their slots; the last live rows take them
    (``slots.compact``), their states and last hidden states moved in one batch. Returns, for
    each live slot now, the slot it was in."""
    origin = compact(len(live), [j for j, i in enumerate(live) if gone(rows[i])])
    live[:], feeds[:] = [live[i] for i in origin], [feeds[i] for i in origin]
    moves = [(src, dst) for dst, src in enumerate(origin) if src != dst]
    if moves:
        pool.move(*(list(x) for x in zip(*moves)), hidden)
    return origin


def _track_forced(model: QwenModel, rows: Sequence[_Row], out: torch.Tensor, track: torch.Tensor,
                  blocks: list) -> None:
    """Tracked logits of the tokens forced after a step's first, all rows at once: from the
    hidden state of the token before each (its feed position - 1), kept on the device."""
    where = [(b, t, item - 1) for b, row in enumerate(rows) for t, item in enumerate(row.tracked)
             if isinstance(item, int)]
    if not where:
        return
    b, _, pos = zip(*where)
    block = model.logits(out[torch.tensor(b).to(out.device), torch.tensor(pos).to(out.device)])[:, track]
    blocks.append(block)
    for k, (bi, t, _) in enumerate(where):
        rows[bi].tracked[t] = (len(blocks) - 1, k)


def _bring_tracked(rows: Sequence[_Row], blocks: list) -> None:
    """The forced tokens' tracked logits to the host in one copy."""
    if not blocks:
        return
    sizes = [len(b) for b in blocks]
    flat = to_host(torch.cat(blocks)).tolist()
    starts = np.concatenate([[0], np.cumsum(sizes)])
    for row in rows:
        row.tracked = [flat[int(starts[t[0]]) + t[1]] if isinstance(t, tuple) else t for t in row.tracked]


def _output(row: _Row, track_ids) -> Output:
    out = Output(index=row.request.index, token_ids=row.tokens,
                 finished=row.matcher.finished if row.matcher is not None else row.finished)
    if track_ids:
        out.tracked_logits = (np.asarray(row.tracked, dtype=np.float32).astype(np.float64) if row.tracked
                              else np.zeros((0, len(track_ids))))
    return out
