"""T5 v1.1 / Flan-T5 judge backend in plain PyTorch.

The model (packed encoder, fused projections, reassociated cross-attention, the one decoder
forward) is ``model``, its state ``pool``, greedy decoding with early exit and refill
``decode``; this module ties them to requests: loading, planning hooks, encoder packs, rows
grouped by candidate set, outputs, the pool's size. A bidirectional encoder allows no exact
prefix reuse, so no prefix state is kept.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Sequence

import numpy as np
import torch
from torch.profiler import record_function

from ...codec import open_codec
from ...engine_options import EngineOptions
from ...runtime.requests import Choice, Output, Request, choice_probs
from ..compiled import ROW_BUCKETS, CompiledFunction, compile_enabled, round_capacity, row_bucket
from ..dense import prepare_dense
from ..loading import load_state_dict, place_checkpoint
from ..profiling import PREFILL_LABEL
from .decode import decode_greedy, projection_step, run_step
from .model import T5Model
from .pool import T5Pool, attention_dtype, cross_row_bytes, row_bytes
from .shape import T5Shape

log = logging.getLogger("fastjudge")

T5_MODEL_TYPES = ("t5", "mt5", "umt5")


class TorchT5Backend:
    """Runs :class:`Request` batches on a T5-family checkpoint."""

    kind = "encoder-decoder"

    def __init__(self, model_dir: str | os.PathLike, engine: EngineOptions | None = None, **options):
        """``engine``: the :class:`EngineOptions` it runs under (fields may also be given as
        keywords). Of them: ``decode_cache_bytes`` bounds the state pool (rows' encoder states
        and self-attention K/V; default 1 GiB on CPU, 16 GiB on CUDA), which sets how many rows
        decode together; ``max_decode_rows`` caps those rows; ``compile`` runs the decoder
        forward through ``torch.compile`` (CUDA graphs on CUDA; ``compiled``)."""
        self.options = engine = (engine or EngineOptions()).with_(**options)
        cfg, self.device, self.dtype, keep_fp8 = place_checkpoint(model_dir, T5_MODEL_TYPES, "a T5 model",
                                                                  engine.device, engine.dtype, engine.fp8_gemm)
        self.shape = T5Shape.from_config(cfg)
        state = load_state_dict(model_dir, allow_pickle=engine.allow_pickle, keep_fp8=keep_fp8)
        self.model = T5Model(state, self.shape, self.device, self.dtype)
        prepare_dense(self.model)  # each projection's GEMM chosen once for its device and dtype
        del state
        self.codec = open_codec(model_dir, cfg, self.kind, eos_token_id=self.shape.eos_token_id)
        # T5 uses relative positions, so no architectural length limit exists; the default cap
        # bounds memory and is far above LAVE prompts (~1k tokens with 8 demonstrations).
        self.max_input_tokens = engine.max_input_tokens or 4096
        # Planner budget (rows x longest prompt) of one call. The backend bounds its own memory
        # below it: the encoder runs in packs of ``encode_tokens`` (large enough for full GEMMs,
        # small enough that activations stay cache-friendly on CPU) and decoding holds the
        # state of the pool's rows, refilled as rows finish.
        cuda = self.device.type == "cuda"
        self.default_batch_tokens = 65536
        self.encode_tokens = 65536 if cuda else 8192
        self.decode_cache_bytes = engine.decode_cache_bytes or (2**34 if cuda else 2**30)
        self.max_decode_rows = engine.max_decode_rows
        self.compile = engine.compile
        # the step from which greedy decoding's cross-attention reads projected K/V:
        # "auto" (``decode.projection_step`` of the call's budget), a step, or None (never)
        self.project_at: int | str | None = "auto"
        self.pool: T5Pool | None = None
        self.pool_allocations = 0
        self._compiled = None
        if compile_enabled(engine.compile, self.device):
            self._compiled = CompiledFunction(self.model.forward, self.device, "the T5 decoder forward")
        log.info("fastjudge: loaded T5 judge %s on %s (%s)", model_dir, self.device,
                 str(self.dtype).replace("torch.", ""))

    @property
    def compile_seconds(self) -> float:
        """Seconds spent compiling (and recording CUDA graphs) so far."""
        return self._compiled.seconds if self._compiled is not None else 0.0

    def _pool(self, enc_capacity: int, capacity: int, cross_rows: int = 0) -> T5Pool:
        """The state pool, with room for prompts of ``enc_capacity`` tokens and ``capacity``
        decoder positions, and projected cross-attention K/V for ``cross_rows`` rows. Allocated
        once; replaced only when a call needs more (the short side then doubles; K/V rows only
        as many as the call that replaces it wants), with as many slots as the budget left by
        the K/V rows allows (a bucket size when compiled)."""
        pool = self.pool
        if (pool is not None and pool.enc_capacity >= enc_capacity and pool.capacity >= capacity
                and pool.cross_slots >= cross_rows):
            return pool
        if pool is not None:
            enc_capacity = max(enc_capacity, pool.enc_capacity * (2 if enc_capacity > pool.enc_capacity else 1))
            capacity = max(capacity, pool.capacity * (2 if capacity > pool.capacity else 1))
        enc_capacity, capacity = round_capacity(enc_capacity), round_capacity(capacity)
        size = torch.empty((), dtype=self.dtype).element_size()
        per_row = row_bytes(self.shape, enc_capacity, capacity, size, self._attention_size)
        budget = self.decode_cache_bytes - cross_rows * cross_row_bytes(self.shape, enc_capacity, self._attention_size)
        slots = max(1, min(self.options.max_batch_size, budget // per_row))
        if self._compiled is not None:
            slots = max(b for b in ROW_BUCKETS if b <= slots)
        self.model.decoder_bias(capacity)  # the bias table the forward reads, grown here
        self.pool = None  # the old pool's memory goes before the new one is allocated
        self.pool = T5Pool(self.shape, slots, enc_capacity, capacity, self.device, self.dtype, cross_rows)
        self.pool_allocations += 1
        log.info("fastjudge: T5 state pool of %d slots x (%d prompt, %d decoder) tokens, %d with cross-attention "
                 "K/V", slots, enc_capacity, capacity, self.pool.cross_slots)
        return self.pool

    @property
    def _attention_size(self) -> int:
        """Bytes per element of the pool's attention K/V (``pool.attention_dtype``)."""
        return torch.empty((), dtype=attention_dtype(self.device, self.dtype)).element_size()

    def _cross_rows(self, rows: int, enc_capacity: int, capacity: int) -> int:
        """Rows of projected cross-attention K/V a call of ``rows`` decoding rows needs: ``rows``
        where their K/V fit the budget with the pool's own slots for them, else 0."""
        if self._compiled is not None:
            rows = row_bucket(rows)  # a compiled step runs on the padded row count
        enc_capacity, capacity = round_capacity(enc_capacity), round_capacity(capacity)
        size = torch.empty((), dtype=self.dtype).element_size()
        need = rows * (cross_row_bytes(self.shape, enc_capacity, self._attention_size)
                       + row_bytes(self.shape, enc_capacity, capacity, size, self._attention_size))
        return rows if need <= self.decode_cache_bytes else 0

    # -- execution ---------------------------------------------------------------------------
    def cost(self, request: Request) -> int:
        """Tokens a request occupies in a batch (the planner's length)."""
        return len(request.prompt_ids)

    def group_key(self, request: Request) -> None:
        """One group: no prefix state is kept (a bidirectional encoder allows no exact reuse)."""
        return None

    @torch.inference_mode()
    def run(self, batch: Sequence[Request]) -> list[Output]:
        specs = {type(r.spec) for r in batch}
        if len(specs) != 1:
            raise ValueError("a batch must hold one kind of output spec")
        # Identical requests (prompt, output spec, forced prefix) run once: rows are computed
        # independently of each other, so a repeat's output is the first one's.
        first: dict[tuple, int] = {}
        source = [first.setdefault((r.prompt_ids.dtype.str, r.prompt_ids.tobytes(), r.spec,
                                    tuple(r.response_prefix)), i) for i, r in enumerate(batch)]
        outputs = dict(zip(first.values(), self._run_unique([batch[i] for i in first.values()])))
        return [outputs[i] if source[i] == i else replace(outputs[source[i]], index=r.index)
                for i, r in enumerate(batch)]

    def _run_unique(self, batch: Sequence[Request]) -> list[Output]:
        if not isinstance(batch[0].spec, Choice):
            return self._run_text(batch)
        outputs = []
        for pack in self._encoder_packs(batch):
            lengths = [len(r.prompt_ids) for r in pack]
            packed = torch.from_numpy(np.concatenate([r.prompt_ids for r in pack])).to(self.device)
            with record_function(PREFILL_LABEL):
                enc = self.model.encode(packed, lengths)
            outputs += self._run_choice(pack, enc, lengths)
        return outputs

    def _encoder_packs(self, batch: Sequence[Request]) -> list[list[Request]]:
        """Consecutive runs of ``batch`` of at most ``encode_tokens`` prompt tokens (a longer
        prompt alone)."""
        packs, total = [[]], 0
        for r in batch:
            if packs[-1] and total + len(r.prompt_ids) > self.encode_tokens:
                packs.append([])
                total = 0
            packs[-1].append(r)
            total += len(r.prompt_ids)
        return packs

    def _run_choice(self, batch, enc, lengths) -> list[Output]:
        """Score-only rows: each row's decoder start and forced prefix in one batched forward
        over its encoder states in the pool, read at its last token through its candidates."""
        if any(r.spec.full_vocab for r in batch):
            # no judge of an encoder-decoder checkpoint reads full-vocabulary probabilities
            raise NotImplementedError("full-vocabulary Choice probabilities are implemented for "
                                      "decoder-only judges only (the torch Qwen backend)")
        decoder = [[self.shape.decoder_start_token_id, *r.response_prefix] for r in batch]
        pool = self._pool(max(lengths), max(len(d) for d in decoder))
        starts = np.concatenate([[0], np.cumsum(lengths)])
        states = [enc[int(starts[i]):int(starts[i + 1])] for i in range(len(batch))]
        final = []
        for first in range(0, len(batch), pool.slots):
            rows = decoder[first:first + pool.slots]
            pool.load(0, states[first:first + pool.slots])
            counts = [len(d) for d in rows]
            ids = torch.tensor([d + [0] * (max(counts) - len(d)) for d in rows], device=self.device)
            hidden = run_step(self.model, pool, ids, counts, self._compiled)
            last = torch.tensor(counts, device=self.device) - 1
            final.append(hidden[torch.arange(len(rows), device=self.device), last])
        final = torch.cat(final)
        if len({r.spec.token_ids for r in batch}) == 1:
            cand = torch.tensor(batch[0].spec.token_ids, device=self.device)
        else:  # per-row candidate sets, padded with a row's first candidate
            width = max(len(r.spec.token_ids) for r in batch)
            cand = torch.tensor([list(r.spec.token_ids) + [r.spec.token_ids[0]] * (width - len(r.spec.token_ids))
                                 for r in batch], device=self.device)
        logits = self.model.logits(final, cand).cpu().numpy().astype(np.float64)
        return [Output(index=r.index, logits=logits[i, :len(r.spec.token_ids)],
                       probs=choice_probs(logits[i, :len(r.spec.token_ids)])) for i, r in enumerate(batch)]

    def _run_text(self, batch) -> list[Output]:
        spec = batch[0].spec
        if any(r.spec != spec for r in batch):
            raise ValueError("a generation batch must share one Text spec")
        if any(r.response_prefix for r in batch):
            raise ValueError("forced response prefixes are supported for Choice requests only")
        track = torch.tensor(spec.track_ids, device=self.device) if spec.track_ids else None
        prompts = [r.prompt_ids for r in batch]
        longest = max(len(p) for p in prompts)
        rows = min(self.options.max_batch_size, self.max_decode_rows or len(prompts), len(prompts))
        at = projection_step(self.shape, spec.max_new_tokens) if self.project_at == "auto" else self.project_at
        cross = 0 if at is None else self._cross_rows(rows, longest, spec.max_new_tokens)
        pool = self._pool(longest, spec.max_new_tokens, cross)
        rows = min(pool.slots, rows)
        tokens, finished, tracked = decode_greedy(
            self.model, pool, prompts, spec.max_new_tokens, track, max_rows=rows,
            encode_tokens=self.encode_tokens, compiled=self._compiled,
            project_at=at if cross and rows <= pool.cross_slots else None)
        return [Output(index=r.index, token_ids=tok, finished=fin,
                       tracked_logits=tr if track is not None else None)
                for r, tok, fin, tr in zip(batch, tokens, finished, tracked)]
