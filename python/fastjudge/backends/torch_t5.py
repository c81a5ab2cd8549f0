"""T5 v1.1 / Flan-T5 judge backend in plain PyTorch.

The model math (packed encoder, fused projections, the reassociated cross-attention) is
``t5_model`` and greedy decoding with early exit and refill ``t5_decode``; this module ties them
to requests: loading, planning hooks, packing a batch into encoder packs, grouping rows by
candidate set, outputs. A bidirectional encoder allows no exact prefix reuse, so no prefix
state is kept.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Sequence

import numpy as np
import torch

from ..codec import open_codec
from ..runtime.requests import Choice, Output, Request, choice_probs
from .compiled import CompiledFunction, compile_enabled
from .loading import load_state_dict, place_checkpoint
from .t5_decode import decode_greedy, row_bytes, step_core
from .t5_model import T5Model, T5Shape, T5Weights

log = logging.getLogger("fastjudge")

T5_MODEL_TYPES = ("t5", "mt5", "umt5")


class TorchT5Backend:
    """Runs :class:`Request` batches on a T5-family checkpoint."""

    kind = "encoder-decoder"

    def __init__(self, model_dir: str | os.PathLike, device: str = "auto", dtype=None,
                 allow_pickle: bool = False, max_input_tokens: int | None = None,
                 fp8_gemm: bool | None = None, decode_cache_bytes: int | None = None,
                 max_decode_rows: int | None = None, compile: str = "auto"):
        """``fp8_gemm``: run an FP8 checkpoint's encoder projections as FP8 GEMMs
        (``torch._scaled_mm``) instead of dequantizing them at load; default: on CUDA devices
        with FP8 tensor cores (compute capability 8.9+). ``decode_cache_bytes``: the decoding
        state (rows' encoder states and self-attention K/V) that greedy decoding may hold at
        once (default 1 GiB on CPU, 16 GiB on CUDA), which sets how many rows decode together;
        ``max_decode_rows`` caps those rows (more rows of a batch join as others finish).
        ``compile``: ``"on"`` / ``"off"`` / ``"auto"`` (on for CUDA): the decoder step and the
        score-only step run through ``torch.compile``, CUDA graphs on CUDA (``compiled``)."""
        cfg, self.device, self.dtype, keep_fp8 = place_checkpoint(model_dir, T5_MODEL_TYPES, "a T5 model",
                                                                  device, dtype, fp8_gemm)
        self.shape = T5Shape.from_config(cfg)
        state = load_state_dict(model_dir, allow_pickle=allow_pickle, keep_fp8=keep_fp8)
        self.model = T5Model(T5Weights(state, self.shape, self.device, self.dtype))
        del state
        self.codec = open_codec(model_dir, cfg, self.kind, eos_token_id=self.shape.eos_token_id)
        # T5 uses relative positions, so no architectural length limit exists; the default cap
        # bounds memory and is far above LAVE prompts (~1k tokens with 8 demonstrations).
        self.max_input_tokens = max_input_tokens or 4096
        # Planner budget (rows x longest prompt) of one call. The backend bounds its own memory
        # below it: the encoder runs in packs of ``encode_tokens`` (large enough for full GEMMs,
        # small enough that activations stay cache-friendly on CPU) and decoding holds the
        # state of a bounded number of rows, refilled as rows finish; so a call
        # may hold many rows, and one call's rows decode in one batch.
        cuda = self.device.type == "cuda"
        self.default_batch_tokens = 65536
        self.encode_tokens = 65536 if cuda else 8192
        self.decode_cache_bytes = decode_cache_bytes or (2**34 if cuda else 2**30)
        self.max_decode_rows = max_decode_rows
        self.compile = compile
        self._compiled_step = self._compiled_choice = None
        if compile_enabled(compile, self.device):
            # dynamic=None: the prompt width differs between batches (a dimension seen with two
            # sizes is compiled once more as symbolic)
            self._compiled_step = CompiledFunction(step_core, self.device, "the T5 decoder step", dynamic=None)
            self._compiled_choice = CompiledFunction(self.model.choice_core, self.device, "the T5 score-only step",
                                                     dynamic=None)
        log.info("fastjudge: loaded T5 judge %s on %s (%s)", model_dir, self.device,
                 str(self.dtype).replace("torch.", ""))

    @property
    def compile_seconds(self) -> float:
        """Seconds spent compiling (and recording CUDA graphs) so far."""
        return sum(f.seconds for f in (self._compiled_step, self._compiled_choice) if f is not None)

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
            outputs += self._run_choice(pack, self.model.encode(packed, lengths), lengths)
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

    def decode_rows(self, longest_prompt: int, max_new_tokens: int) -> int:
        """Rows that decode together: the decoding budget over one row's state."""
        rows = max(1, self.decode_cache_bytes // row_bytes(self.model, longest_prompt, max_new_tokens))
        return min(rows, self.max_decode_rows) if self.max_decode_rows else rows

    def _run_choice(self, batch, enc, lengths) -> list[Output]:
        if any(r.spec.full_vocab for r in batch):
            # no judge of an encoder-decoder checkpoint reads full-vocabulary probabilities
            raise NotImplementedError("full-vocabulary Choice probabilities are implemented for "
                                      "decoder-only judges only (the torch Qwen backend)")
        start = self.shape.decoder_start_token_id
        # Rows of one batch may ask for different candidate sets; group rows that share one.
        by_candidates: dict[tuple[int, ...], list[int]] = {}
        for i, r in enumerate(batch):
            by_candidates.setdefault(r.spec.token_ids, []).append(i)
        results: dict[int, Output] = {}
        starts = np.concatenate([[0], np.cumsum(lengths)])
        for cand, rows in by_candidates.items():
            sub_enc = torch.cat([enc[int(starts[i]):int(starts[i + 1])] for i in rows]) \
                if len(rows) != len(batch) else enc
            sub_len = [lengths[i] for i in rows]
            dec_ids = [[start, *batch[i].response_prefix] for i in rows]
            cand_t = torch.tensor(cand, device=enc.device)
            logits = self.model.decode_choice(sub_enc, sub_len, dec_ids, cand_t,
                                              compiled=self._compiled_choice).cpu().numpy()
            for row, z in zip(rows, logits):
                results[row] = Output(index=batch[row].index, logits=z.astype(np.float64),
                                      probs=choice_probs(z))
        return [results[i] for i in range(len(batch))]

    def _run_text(self, batch) -> list[Output]:
        spec = batch[0].spec
        if any(r.spec != spec for r in batch):
            raise ValueError("a generation batch must share one Text spec")
        if any(r.response_prefix for r in batch):
            raise ValueError("forced response prefixes are supported for Choice requests only")
        track = torch.tensor(spec.track_ids, device=self.device) if spec.track_ids else None
        prompts = [r.prompt_ids for r in batch]
        tokens, finished, tracked = decode_greedy(
            self.model, prompts, spec.max_new_tokens, track,
            max_rows=self.decode_rows(max(len(p) for p in prompts), spec.max_new_tokens),
            encode_tokens=self.encode_tokens, compiled=self._compiled_step)
        return [Output(index=r.index, token_ids=tok, finished=fin,
                       tracked_logits=tr if track is not None else None)
                for r, tok, fin, tr in zip(batch, tokens, finished, tracked)]
