"""The Qwen3.5 (hybrid Gated DeltaNet + gated attention) and Qwen3 (dense) judge backend in plain
PyTorch, with exact shared-prefix reuse.

Requests that share a prompt prefix (LAVE: task description + demonstrations; VisExMEM: image +
caption) run the prefix once: it is prefilled into a slot of the state pool and a snapshot of
the slot is kept in a byte-budgeted cache indexed by a C++ radix tree (attention K/V, and for
every Gated DeltaNet layer the conv and recurrent states at the prefix end). A row then copies
its prefix snapshot into its own slot and continues from it: score-only suffixes in one batched
forward, generation rows in the decoding loop (``decode``). Rows of one batch may continue from
different prefixes (other tokens, other images: several images, each with its captions): each
prefix runs once and every row continues from its own snapshot. A prefix that too few requests
share to pay for its own pass runs as part of the whole prompts instead (``routing``).

Exactness with batching: rows are right-padded and each is read at its own last token; every
operation is causal and padding never reaches a row's state (``layers``).

The model is ``model``, its state ``pool``, greedy decoding ``decode``, the vision tower
``vision``; this module ties them to requests: loading, planning hooks, prefix snapshots, image
embeddings, pool sizing.
"""

from __future__ import annotations

import logging
import os
from typing import Sequence

import numpy as np
import torch
from torch.profiler import record_function

from ...codec import open_codec
from ...engine_options import EngineOptions
from ...kernels.choice_head import choice_head
from ...runtime.requests import Choice, Image, Output, Request, Text, choice_probs
from ..compiled import ROW_BUCKETS, CompiledFunction, compile_enabled, round_capacity
from ..dense import prepare_dense
from ..loading import load_state_dict, place_checkpoint
from ..profiling import PREFILL_LABEL, PREFIX_LABEL, VISION_LABEL
from .caches import ImageEmbeddingCache, prefix_cache_key
from .decode import decode_greedy
from .engine_step import ENGINE_RUN_MAX_STEPS
from .model import QwenModel, run_pick_step, run_step
from .pool import PrefixState, StatePool, pool_bytes
from .positions import mrope_positions
from .routing import PASS_TOKENS, route, share_common_prefixes
from .shape import QwenShape

log = logging.getLogger("fastjudge")

QWEN_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3")
DEFAULT_PREFIX_CACHE_BYTES = 2 << 30  # 2 GiB: thousands of LAVE prefixes of a small judge
DEFAULT_IMAGE_CACHE_BYTES = 512 << 20  # vision embeddings of recent images and crops


class TorchQwenBackend:
    """Decoder-only judge backend with exact shared-prefix reuse. ``engine``: the
    :class:`EngineOptions` it runs under (fields may also be given as keywords)."""

    kind = "decoder-only"

    def __init__(self, model_dir: str | os.PathLike, engine: EngineOptions | None = None, **options):
        from ...runtime.prefix_cache import PrefixCache

        self.options = engine = (engine or EngineOptions()).with_(**options)
        cfg, self.device, self.dtype, keep_fp8 = place_checkpoint(model_dir, QWEN_MODEL_TYPES, "a Qwen3/3.5 model",
                                                                  engine.device, engine.dtype, engine.fp8_gemm)
        self.shape = QwenShape.from_config(cfg)
        state = load_state_dict(model_dir, allow_pickle=engine.allow_pickle, keep_fp8=keep_fp8)
        self.model = QwenModel(state, self.shape, self.device, self.dtype)
        prepare_dense(self.model)  # each projection's GEMM chosen once for its device and dtype
        self.vision = None
        if cfg.get("vision_config"):
            from .vision import QwenVision

            self.vision = QwenVision(cfg, state, self.device, self.dtype)
            prepare_dense(self.vision)
            self.image_token_id = cfg["image_token_id"]
            self._image_embeds = ImageEmbeddingCache(DEFAULT_IMAGE_CACHE_BYTES)
        del state
        self.codec = open_codec(model_dir, cfg, self.kind)
        self.max_input_tokens = engine.max_input_tokens or self.shape.max_positions
        cuda = self.device.type == "cuda"
        self.default_batch_tokens = 65536 if cuda else 8192
        self.state_bytes = engine.decode_cache_bytes or (2**34 if cuda else 2**30)
        self.prefix_cache = PrefixCache(engine.prefix_cache_bytes or DEFAULT_PREFIX_CACHE_BYTES)
        self.pass_tokens = PASS_TOKENS.get(self.device.type, PASS_TOKENS["cuda"])  # ``routing``
        self.pool: StatePool | None = None
        self.pool_allocations = 0
        self._grammars = None  # runtime.grammar.GrammarCache, built on the first Json request
        self.tokens_computed = 0  # real (non-padding) tokens run through the model
        self.jump_forward = engine.jump_forward
        self.max_decode_rows = engine.max_decode_rows
        self.compile = engine.compile
        self._compiled = None
        if compile_enabled(engine.compile, self.device):
            self._compile()
        self.reset_decode_stats()
        log.info("fastjudge: loaded %s judge %s on %s (%s)", self.shape.arch, model_dir, self.device,
                 str(self.dtype).replace("torch.", ""))

    @property
    def compile_seconds(self) -> float:
        """Seconds spent compiling (and recording CUDA graphs) so far."""
        return self._compiled.seconds if self._compiled is not None else 0.0

    def _compile(self) -> None:
        self._compiled = CompiledFunction(self.model.forward, self.device, "the Qwen forward")
        self.pool = None  # resized to a row bucket, the compiled steps' shapes

    def _step(self, pool: StatePool, start: int, tokens: torch.Tensor, counts, **images) -> torch.Tensor:
        """One forward of the steps compile speeds up (suffixes, decoding)."""
        return run_step(self.model, pool, start, tokens, counts, self._compiled, **images)

    def reset_decode_stats(self) -> None:
        """Zero :attr:`decode_stats`: cumulative ``tokens_computed`` (tokens chosen from logits),
        ``tokens_forced`` (tokens jump-forward accepted without their own model step) and
        ``decode_steps`` (model calls while decoding); stop tokens count as tokens."""
        self.decode_stats = {"tokens_computed": 0, "tokens_forced": 0, "decode_steps": 0}

    # -- planning hooks ---------------------------------------------------------------------------
    def route(self, requests: Sequence[Request]) -> list[Request]:
        """The requests as they will run: those whose shared prefix is cheaper to run as part
        of the whole prompt (nobody else in the call shares it, it is not cached) with their
        prefix dropped, and those without a prefix that begin like others with that beginning
        as their prefix where running it once pays (``routing``)."""
        def key(r: Request) -> bytes:
            return np.asarray(prefix_cache_key(*self._prefix_of(r)), dtype=np.int64).tobytes()

        routed = route(requests, key, self.prefix_cache, self.pass_tokens)
        return share_common_prefixes(routed, self._text_before_images, self.pass_tokens)

    def _text_before_images(self, request: Request) -> int:
        """How many of a request's first tokens come before its first image."""
        if not request.images:
            return len(request.prompt_ids)
        return int(np.argmax(np.asarray(request.prompt_ids) == self.image_token_id))

    def cost(self, request: Request) -> int:
        return request.num_tokens - request.prefix_len

    def group_key(self, request: Request) -> None:
        """Any requests may share a batch: each row continues from its own prefix snapshot
        (tokens and images) in its own slot."""
        return None

    # -- the state pool -----------------------------------------------------------------------------
    def _pool(self, capacity: int) -> StatePool:
        """The state pool, with at least ``capacity`` tokens a slot. Allocated once; replaced only
        when a row needs more tokens (its capacity then doubles), with as many slots as the
        budget allows at that capacity (at most the batch size, a bucket size when compiled)."""
        if self.pool is not None and self.pool.capacity >= capacity:
            return self.pool
        capacity = round_capacity(max(capacity, 2 * self.pool.capacity if self.pool is not None else 0))
        per_slot = pool_bytes(self.shape, 1, capacity, torch.empty((), dtype=self.dtype).element_size())
        slots = max(1, min(self.options.max_batch_size, self.state_bytes // per_slot))
        if self._compiled is not None:
            slots = max(b for b in ROW_BUCKETS if b <= max(slots, 1))
        self.pool = None  # the old pool's memory goes before the new one is allocated
        self.pool = StatePool(self.shape, slots, capacity, self.device, self.dtype)
        self.pool_allocations += 1
        log.info("fastjudge: state pool of %d slots x %d tokens (%.1f MiB)", slots, capacity, self.pool.nbytes / 2**20)
        return self.pool

    # -- images -----------------------------------------------------------------------------------
    @staticmethod
    def _prefix_of(request: Request) -> tuple[np.ndarray, tuple[Image, ...]]:
        """The shared prefix's tokens and the images inside it."""
        return request.prompt_ids[: request.prefix_len], request.images[: request.prefix_images]

    def _embed(self, images: Sequence[Image]) -> torch.Tensor | None:
        """Vision embeddings of ``images`` concatenated in order; images not cached are encoded
        together in one vision-tower call."""
        if not images:
            return None
        missing = list({im.key: im for im in images if im.key not in self._image_embeds}.values())
        if missing:
            with record_function(VISION_LABEL):
                embeds = self.vision.encode_images([(im.pixel_values, im.grid_thw) for im in missing])
            for im, e in zip(missing, embeds):
                self._image_embeds.put(im.key, e)
        return torch.cat([self._image_embeds.get(im.key) for im in images])

    def _image_inputs(self, tokens: torch.Tensor, rows: Sequence[np.ndarray], images: Sequence[Sequence[Image]],
                      starts: Sequence[int]) -> dict:
        """The forward's image arguments for right-padded ``rows`` whose positions continue from
        ``starts``: embeddings, their mask and [3, B, k] M-RoPE positions ({} without images)."""
        flat = [im for ims in images for im in ims]
        if not flat:
            return {}
        width = tokens.shape[1]
        positions = torch.empty(3, len(rows), width, dtype=torch.long)
        for b, (ids, ims, start) in enumerate(zip(rows, images, starts)):
            pos = mrope_positions(ids, [im.grid_thw for im in ims] or None, self.vision.spatial_merge_size,
                                  self.image_token_id, start)
            positions[:, b, : len(ids)] = pos
            tail = int(pos.max()) + 1 if len(ids) else start
            positions[:, b, len(ids):] = torch.arange(tail, tail + width - len(ids))
        return {"positions": positions.to(self.device), "image_embeds": self._embed(flat),
                "image_mask": tokens == self.image_token_id}

    # -- execution --------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, batch: Sequence[Request]) -> list[Output]:
        held, snapshots = self._prefix_snapshots(batch)
        try:
            if isinstance(batch[0].spec, Choice):
                return self._run_choice(batch, snapshots)
            return self._generate(batch, snapshots)
        finally:
            for slot in held:
                self.prefix_cache.release(slot)

    def _prefix_snapshots(self, batch: Sequence[Request]) -> tuple[list[int], list[PrefixState | None]]:
        """Each request's prefix snapshot (None without a prefix), the cached ones found and the
        others prefilled, those of one length together (one row each, no padding), and the
        cache entries to release after the batch."""
        held, found, missing = [], {}, {}
        names = []
        for r in batch:
            ids, images = self._prefix_of(r)
            key = prefix_cache_key(ids, images) if len(ids) else None
            names.append(None if key is None else key.tobytes())
            if key is None or names[-1] in found or names[-1] in missing:
                continue
            slot, state = self.prefix_cache.lookup(key)
            if state is None:
                missing[names[-1]] = (key, ids, images)
            else:
                held.append(slot)
                found[names[-1]] = state
        with record_function(PREFIX_LABEL):
            self._prefill_prefixes(missing, found, held)
        return held, [None if name is None else found[name] for name in names]

    def _prefill_prefixes(self, missing: dict, found: dict, held: list) -> None:
        """The ``missing`` prefixes run, those of one length together, their snapshots added to
        ``found`` and the cache (``held``: the entries to release)."""
        by_length: dict[int, list[bytes]] = {}
        for name, (_, ids, _) in missing.items():
            by_length.setdefault(len(ids), []).append(name)
        for length, group in by_length.items():
            pool = self._pool(length)
            for first in range(0, len(group), pool.slots):
                part = group[first:first + pool.slots]
                ids = [missing[name][1] for name in part]
                tokens = torch.from_numpy(np.stack(ids)).to(self.device)
                images = [missing[name][2] for name in part]
                pool.load_rows(0, [None] * len(part))
                run_step(self.model, pool, 0, tokens, [length] * len(part),
                         **self._image_inputs(tokens, ids, images, [0] * len(part)))
                self.tokens_computed += length * len(part)
                next_pos = pool.positions[: len(part)].tolist()
                for b, name in enumerate(part):
                    found[name] = pool.snapshot(b, next_pos[b])
                    slot = self.prefix_cache.insert(missing[name][0], found[name])
                    if slot is not None:
                        held.append(slot)

    def _suffix(self, request: Request) -> tuple[np.ndarray, tuple[Image, ...]]:
        """Tokens to run after the prefix (prompt rest + forced response start) and the images
        among them."""
        forced = np.asarray(request.response_prefix, dtype=np.int64)
        ids = np.concatenate([request.prompt_ids[request.prefix_len:], forced])
        return ids, request.images[request.prefix_images:]

    def _prefill(self, batch: Sequence[Request], snapshots: Sequence[PrefixState | None], start: int) -> torch.Tensor:
        """Each row's suffix run from its prefix snapshot, loaded into slots ``start ..``, in one
        batched forward: the hidden states [B, d] at each row's last token."""
        with record_function(PREFILL_LABEL):
            return self._prefill_rows(batch, snapshots, start)

    def _prefill_rows(self, batch, snapshots, start: int) -> torch.Tensor:
        pool = self.pool
        suffixes = [self._suffix(r) for r in batch]
        pool.load_rows(start, list(snapshots))
        rows = [ids for ids, _ in suffixes]
        counts = [len(ids) for ids in rows]
        tokens = torch.full((len(rows), max(counts)), self.codec.pad_token_id, dtype=torch.long)
        for b, ids in enumerate(rows):
            tokens[b, : len(ids)] = torch.from_numpy(ids)
        tokens = tokens.to(self.device)
        starts = [st.next_position if st is not None else 0 for st in snapshots]
        images = self._image_inputs(tokens, rows, [ims for _, ims in suffixes], starts)
        hidden = self._step(pool, start, tokens, counts, **images)
        self.tokens_computed += sum(counts)
        return hidden[torch.arange(len(rows), device=self.device), torch.tensor(counts, device=self.device) - 1]

    def _run_choice(self, batch: Sequence[Request], snapshots) -> list[Output]:
        pool = self._pool(max(r.num_tokens for r in batch))
        final = torch.cat([self._prefill(batch[i:i + pool.slots], snapshots[i:i + pool.slots], 0)
                           for i in range(0, len(batch), pool.slots)])
        if len({r.spec.token_ids for r in batch}) == 1:
            cand = torch.tensor(batch[0].spec.token_ids, device=self.device)
        else:  # per-row candidate sets (e.g. a rationale's constrained follow-up beside plain rows)
            width = max(len(r.spec.token_ids) for r in batch)
            cand = torch.tensor([list(r.spec.token_ids) + [r.spec.token_ids[0]] * (width - len(r.spec.token_ids))
                                 for r in batch], device=self.device)
        logprobs = None
        if any(r.spec.full_vocab for r in batch):
            # the fused head's online log-sum-exp over vocabulary tiles: never [B, vocab]
            head = choice_head(final, self.model.final_norm, self.model.lm_head, cand,
                               eps=self.shape.eps, full_vocab=True)
            logits = head.logits.cpu().numpy().astype(np.float64)
            logprobs = head.logprobs.cpu().numpy().astype(np.float64)
        else:
            logits = self.model.logits(final, cand).cpu().numpy().astype(np.float64)
        outputs = []
        for i, r in enumerate(batch):
            k = len(r.spec.token_ids)
            outputs.append(Output(index=r.index, logits=logits[i, :k], probs=choice_probs(logits[i, :k]),
                                  logprobs=logprobs[i, :k] if r.spec.full_vocab else None))
        return outputs

    def _grammar_cache(self):
        from ...runtime.grammar import GrammarCache

        if self._grammars is None:
            self._grammars = GrammarCache(self.codec.tokenizer, self.shape.vocab_size, self.codec.eos_token_ids)
        return self._grammars

    def _generate(self, batch: Sequence[Request], snapshots) -> list[Output]:
        """Greedy decoding of a batch of one Text/Json spec (``decode``): rows prefilled from
        their snapshots into free slots, then decoded together; Json rows under their grammar."""
        from ...runtime.token_mask import TokenMask

        pool = self._pool(max(r.num_tokens + r.spec.max_new_tokens for r in batch))
        rows = min(self.max_decode_rows or len(batch), len(batch), pool.slots)
        matchers = [None if isinstance(r.spec, Text) else self._grammar_cache().matcher(r.spec) for r in batch]
        mask = None
        if matchers[0] is not None:
            mask = TokenMask(rows, self.shape.vocab_size, self.device, self._grammar_cache().apply_backend)
        by_request = {id(r): st for r, st in zip(batch, snapshots)}
        outputs, decoded = decode_greedy(
            self.model, batch, matchers, pool, rows,
            lambda reqs, start: self._prefill(reqs, [by_request[id(r)] for r in reqs], start),
            lambda tokens, counts: self._step(pool, 0, tokens, counts),
            self.codec.eos_token_ids, jump_forward=self.jump_forward, mask=mask, stats=self.decode_stats,
            pick_step=lambda tokens, counts, hidden, room, stops, track: run_pick_step(
                self.model, pool, 0, tokens, counts, hidden, self._compiled, room, stops, ENGINE_RUN_MAX_STEPS,
                track))
        self.tokens_computed += decoded
        return outputs
