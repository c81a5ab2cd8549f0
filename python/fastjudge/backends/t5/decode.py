"""The T5 decoder step, and greedy rationale decoding with early exit and refill.

Rows are independent, so which rows share a step changes no row's tokens. That allows:

* **Early exit.** Live rows sit in the leading slots of the state pool (``pool``). Rows that
  meet EOS or their budget leave at once: the last live rows move into the freed slots in one
  batched copy, so no finished row is carried along.
* **Refill.** With more rows than slots, waiting rows are encoded as slots free up and join at
  their first step (rows of one step sit at different positions; each attends to its own
  length through its own mask row).
* **Only live extents.** Eagerly, a step attends over the longest live row's encoder states and
  the furthest live decoder position, not the buffers' full widths (masked keys have weight
  exactly 0, so leaving them out changes nothing).
* **Cross-attention K/V once they pay.** Steps start in the reassociated form over the encoder
  states (``model``). A call whose budget leaves room for it (:func:`projection_step`) projects
  its live rows' encoder states to every layer's cross-attention K/V once the rows have run as
  many steps as the projection costs, and from then on steps attend per head over those (rows
  joining later are projected as they join): rows that stop early never pay for a projection,
  rows that go on pay at most twice the best choice made knowing their length. Both forms are
  exact; they differ in cost only.

Argmax runs on the device and each step moves one small tensor to the host. Where the CPU engine
runs the step and holds the head (:func:`run_pick_steps`), the pick (and the tracked logits) is
in the engine's call, and steps run back to back there until a row ends.
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

import numpy as np
import torch
from torch.profiler import record_function

from ..compiled import row_bucket, width_bucket
from ..profiling import DECODE_LABEL, PREFILL_LABEL, STEP_LABEL, count_run_steps, to_host
from ..slots import compact
from .engine_step import ENGINE_RUN_MAX_STEPS, engine_step
from .model import T5Model
from .pool import T5Pool
from .shape import T5Shape

# The cost estimate behind the choice of cross-attention form, in time per encoder token and
# decoder layer, counted in FLOPs at the rate of the projections' GEMMs. Measured with torch 2.13
# on a 2-core AVX-512 CPU, float32, Flan-T5-small's shape, 16 rows x ~1,100 encoder tokens, two
# threads, both forms in the engine (``model.attend_encoder``): the reassociated form (heads x
# positions query rows over the d_model-wide encoder states, each row's states read once, and
# the two einsums around it) ~2.3x slower per FLOP than those GEMMs, the per-head form's
# one-token attention (bound by reading float32 K/V, 1.5x the encoder states' bytes per layer)
# ~10x slower. For that shape the projection pays for itself in 61 steps (whole calls of 100 new
# tokens: projecting from the first step 7.97 s, never 8.38 s, a step 23.9 against 33.2 ms).
# (With SDPA for both forms they were 4x and 14x: 29 steps.)
REASSOCIATED_SLOWDOWN = 2.3
PER_HEAD_SLOWDOWN = 10.0


def break_even_steps(shape: T5Shape) -> int | None:
    """The one-token steps over projected K/V that pay for projecting them: projecting costs
    ``4 * inner * d_model`` FLOPs per encoder token and layer (at the GEMM rate), a step saves
    ``4 * heads * d_model`` at :data:`REASSOCIATED_SLOWDOWN` less ``4 * inner`` at
    :data:`PER_HEAD_SLOWDOWN` (rows and prompt lengths scale both sides alike). None when a step
    saves nothing."""
    inner, d = shape.num_heads * shape.d_kv, shape.d_model
    saving = 4 * shape.num_heads * d * REASSOCIATED_SLOWDOWN - 4 * inner * PER_HEAD_SLOWDOWN
    return None if saving <= 0 else -(-4 * inner * d // int(saving))


def projection_step(shape: T5Shape, max_new_tokens: int) -> int | None:
    """The step from which a greedy call with budget ``max_new_tokens`` decodes over projected
    K/V: after :func:`break_even_steps` steps in the reassociated form (what a projection costs
    is spent on steps first, so rows that stop before never pay it), when the budget leaves at
    least as many steps again for the projection to pay back; else None (never)."""
    steps = break_even_steps(shape)
    return steps if steps is not None and max_new_tokens >= 2 * steps else None


def run_step(model: T5Model, pool: T5Pool, tokens: torch.Tensor, counts: Sequence[int], compiled=None) -> torch.Tensor:
    """:meth:`T5Model.forward` of right-padded decoder ``tokens`` [B, P] (``counts`` on the
    host) on the leading slots of ``pool``: hidden states [B, P, d]. ``compiled`` (a
    ``compiled.CompiledFunction`` of the forward) runs it on a shape bucket -- rows padded with
    free slots that feed nothing, tokens to a power-of-two width, keys over the whole pool -- so
    that a handful of shapes serve every call and the pool's buffers are the same tensors in
    each; eagerly, only the live extents are read."""
    B, P = tokens.shape
    host_counts = np.asarray(counts, dtype=np.int64)
    rows = row_bucket(B)
    if compiled is not None and rows <= (pool.cross_slots if pool.projected else pool.slots):
        full = tokens.new_zeros(rows, width_bucket(P))
        full[:B, :P] = tokens
        n = torch.tensor(np.pad(host_counts, (0, rows - B))).to(tokens.device, non_blocking=True)
        x = compiled((rows, full.shape[1], pool.capacity, pool.enc_capacity), full, n, pool, pool.capacity,
                     pool.enc_capacity)[:B, :P]
    else:
        n = torch.tensor(host_counts).to(tokens.device, non_blocking=True)
        width = int((pool.dec_held[:B] + host_counts).max())
        x = model(tokens, n, pool.view(0, B), width, int(pool.enc_held[:B].max()))
    pool.dec_held[:B] += host_counts
    return x


def run_pick_steps(model: T5Model, pool: T5Pool, tokens: torch.Tensor, room: Sequence[int], stops, steps: int,
                   track: Sequence[int], compiled=None) -> tuple[np.ndarray, np.ndarray] | None:
    """:func:`run_step` of one token a row that then picks greedily, where the engine runs the
    step and holds the head (``engine_step.EngineStep.run_picks``): up to ``steps`` such steps
    in one engine call, each feeding the picks of the one before, until a row picks one of
    ``stops`` or as many tokens as its ``room``. Returns the picks (int64 [B, n] on the host)
    and the ``track`` ids' logits at each (float32 [B, n, K]): what ``model.logits`` of each
    step's states gives. Else None, and nothing has run: :func:`run_step` then."""
    B = tokens.shape[0]
    if compiled is not None and row_bucket(B) <= (pool.cross_slots if pool.projected else pool.slots):
        return None
    engine = engine_step(model, pool, tokens)
    if engine is None or not engine.picks:
        return None
    picks, tracked = engine.run_picks(tokens, 0, pool.projected, np.asarray(room, dtype=np.int64), stops, steps,
                                      track)
    pool.dec_held[:B] += picks.shape[1]
    return picks, tracked


def _pick(logits: torch.Tensor, track: torch.Tensor | None) -> list[list[float]]:
    """Per row: [greedy token, tracked logits...], in one transfer to the host (token ids are
    exact in float32: vocabularies are far below 2**24)."""
    token = logits.argmax(-1, keepdim=True).to(logits.dtype)
    return to_host(torch.cat([token, logits[:, track]] if track is not None else [token], 1)).tolist()


def decode_greedy(model: T5Model, pool: T5Pool, prompts: Sequence[np.ndarray], max_new_tokens: int,
                  track: torch.Tensor | None, max_rows: int, encode_tokens: int, compiled=None,
                  project_at: int | None = None):
    """Greedy decoding of ``prompts`` (token ids per row) until EOS or ``max_new_tokens``.

    At most ``max_rows`` rows decode at a time (the leading slots of ``pool``); rows are encoded
    in packs of about ``encode_tokens`` tokens as room frees up. Cross-attention is reassociated
    until step ``project_at`` (None: throughout), then per head over projected K/V
    (``max_rows`` within ``pool.cross_slots``). Returns per row: generated ids (EOS excluded),
    whether EOS ended it, and the tracked logits [steps, K] of every kept step (None without
    ``track``)."""
    if project_at is not None and max_rows > pool.cross_slots:
        raise ValueError(f"{max_rows} rows with projected K/V in a pool with room for {pool.cross_slots}")
    pool.projected = False
    try:
        with record_function(DECODE_LABEL):
            return _decode(model, pool, prompts, max_new_tokens, track, max_rows, encode_tokens, compiled,
                           project_at)
    finally:
        pool.projected = False


def _decode(model, pool, prompts, max_new_tokens, track, max_rows, encode_tokens, compiled, project_at):
    s = model.s
    dev = model.embed.device
    n_rows = len(prompts)
    tokens: list[list[int]] = [[] for _ in range(n_rows)]
    tracked: list[list[list[float]]] = [[] for _ in range(n_rows)]
    finished = [False] * n_rows
    todo = deque(range(n_rows))
    ready: deque[tuple[int, torch.Tensor]] = deque()  # encoded rows waiting for a slot
    taken = 0  # steps run
    live: list[int] = []  # the request row in each live slot
    feed: list[int] = []  # each live row's next input token
    tracked_ids = [] if track is None else track.tolist()

    def encode_more() -> None:
        pack, total = [], 0
        while todo and (not pack or total + len(prompts[todo[0]]) <= encode_tokens):
            pack.append(todo.popleft())
            total += len(prompts[pack[-1]])
        lengths = [len(prompts[i]) for i in pack]
        with record_function(PREFILL_LABEL):
            enc = model.encode(torch.from_numpy(np.concatenate([prompts[i] for i in pack])).to(dev), lengths)
        starts = np.concatenate([[0], np.cumsum(lengths)])
        ready.extend((i, enc[int(starts[k]):int(starts[k + 1])]) for k, i in enumerate(pack))

    while todo or ready or live:
        while todo and len(ready) < max_rows - len(live):
            encode_more()
        joining = [ready.popleft() for _ in range(min(len(ready), max_rows - len(live)))]
        first = len(live)
        if joining:
            pool.load(first, [st for _, st in joining])
            live += [i for i, _ in joining]
            feed += [s.decoder_start_token_id] * len(joining)
        if project_at is not None and not pool.projected and taken >= project_at:
            first, pool.projected = 0, True  # from here on, every live row over its K/V
        if pool.projected and first < len(live):
            with record_function(PREFILL_LABEL):  # a row's own work, once, like its encoding
                model.project_cross(pool, first, len(live))
        # a run of steps in one engine call goes at most to where the cross-attention's form changes
        steps = ENGINE_RUN_MAX_STEPS if project_at is None or pool.projected else \
            min(ENGINE_RUN_MAX_STEPS, project_at - taken)
        tokens_in = torch.tensor(feed, device=dev)[:, None]
        with record_function(STEP_LABEL):
            run = run_pick_steps(model, pool, tokens_in, [max_new_tokens - len(tokens[i]) for i in live],
                                 (s.eos_token_id,), steps, tracked_ids, compiled)
            if run is None:
                hidden = run_step(model, pool, tokens_in, [1] * len(live), compiled)
        if run is None:
            last = _pick(model.logits(hidden[:, 0]), track)
            taken += 1
        else:  # every step of the run but its last: a token each row keeps, fed on to the next
            picks, logits = run
            count_run_steps(picks.shape[1] - 1)
            for j, row in enumerate(live):
                tokens[row] += picks[j, :-1].tolist()
                tracked[row] += logits[j, :-1].tolist()
            last = np.concatenate([picks[:, -1:], logits[:, -1]], 1).tolist()
            taken += picks.shape[1]
        gone = []
        for j, picked in enumerate(last):
            row, token = live[j], int(picked[0])
            if token == s.eos_token_id:
                finished[row] = True
            else:
                tokens[row].append(token)
                tracked[row].append(picked[1:])
            feed[j] = token
            if finished[row] or len(tokens[row]) >= max_new_tokens:
                gone.append(j)
        _leave(pool, live, feed, gone)
    if track is None:
        return tokens, finished, [None] * n_rows
    return tokens, finished, [np.asarray(t, dtype=np.float64).reshape(len(t), len(track)) for t in tracked]


def _leave(pool: T5Pool, live: list[int], feed: list[int], gone: list[int]) -> None:
    """The rows in slots ``gone`` leave; the last live rows take their slots (``slots.compact``),
    moved in one batch."""
    origin = compact(len(live), gone)
    live[:], feed[:] = [live[i] for i in origin], [feed[i] for i in origin]
    moves = [(src, dst) for dst, src in enumerate(origin) if src != dst]
    if moves:
        pool.move(*(list(x) for x in zip(*moves)))
