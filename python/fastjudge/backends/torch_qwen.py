"""The Qwen3.5 (hybrid Gated DeltaNet + gated attention) and Qwen3 (dense) judge backend in plain
PyTorch, with exact shared-prefix reuse.

Requests that share a prompt prefix (LAVE: task description + demonstrations) run the prefix
once. Its state is kept in a byte-budgeted cache indexed by a C++ radix tree: the K/V of every
full-attention layer and, for every Gated DeltaNet layer, the convolution state (last
``kernel - 1`` inputs) and the recurrent state at the prefix end. Suffixes then continue from it
in batches. A score-only batch may also hold rows whose prefixes are the same tokens over
different images of one grid (several images, each with its captions): each image's prefix
runs once, and every row continues from its own image's state.

Exactness with batching: suffixes are right-padded and each row is read at its own last token.
Every operation is causal (attention with a causal mask, causal depthwise conv, the chunked
delta rule), so padding placed after a row's last token never reaches that token's output, and
the padded rows' final states are never kept.

The model math is ``qwen_model``, greedy decoding ``qwen_decode``, the vision tower
``qwen_vision``; this module ties them to requests: loading, planning hooks, prefix states,
batched rows, image embeddings.
"""

from __future__ import annotations

import logging
import os
from typing import Sequence

import numpy as np
import torch

from ..codec import open_codec
from ..kernels.choice_head import choice_head
from ..runtime.requests import Choice, Image, Output, Request, Text, choice_probs
from .caches import ImageEmbeddingCache, prefix_cache_key
from .compiled import CompiledFunction, compile_enabled, round_capacity, row_bucket, width_bucket
from .loading import load_state_dict, place_checkpoint
from .qwen_decode import decode_greedy
from .qwen_model import PrefixState, QwenModel, QwenShape
from .qwen_slots import SlotCache
from .qwen_vision import mrope_positions

log = logging.getLogger("fastjudge")

QWEN_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3")
DEFAULT_PREFIX_CACHE_BYTES = 2 << 30  # 2 GiB: thousands of LAVE prefixes of a small judge
DEFAULT_IMAGE_CACHE_BYTES = 512 << 20  # vision embeddings of recent images and crops


class TorchQwenBackend:
    """Decoder-only judge backend with exact shared-prefix reuse."""

    kind = "decoder-only"

    def __init__(self, model_dir: str | os.PathLike, device: str = "auto", dtype=None,
                 allow_pickle: bool = False, max_input_tokens: int | None = None,
                 prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES, fp8_gemm: bool | None = None,
                 jump_forward: bool = True, max_decode_rows: int | None = None, compile: str = "auto"):
        """``fp8_gemm``: run an FP8 checkpoint's quantized projections as FP8 GEMMs
        (``torch._scaled_mm``) instead of dequantizing them at load; default: on CUDA devices
        with FP8 tensor cores (compute capability 8.9+). ``jump_forward``: accept the tokens a
        grammar forces without a model step each (exact; see ``qwen_decode``); off, every
        token takes its own step. ``max_decode_rows``: the most rows of a batch decoding at
        once, the others joining as rows finish (default: all rows of the batch). ``compile``:
        ``"on"`` / ``"off"`` / ``"auto"`` (on for CUDA): the decoding step and the score-only
        forward run through ``torch.compile`` on shape buckets, CUDA graphs on CUDA (see
        ``compiled``)."""
        from ..runtime.prefix_cache import PrefixCache

        cfg, self.device, self.dtype, keep_fp8 = place_checkpoint(model_dir, QWEN_MODEL_TYPES, "a Qwen3/3.5 model",
                                                                  device, dtype, fp8_gemm)
        self.shape = QwenShape.from_config(cfg)
        state = load_state_dict(model_dir, allow_pickle=allow_pickle, keep_fp8=keep_fp8)
        self.model = QwenModel(state, self.shape, self.device, self.dtype)
        self.vision = None
        if cfg.get("vision_config"):
            self._init_vision(model_dir, cfg, state)
        del state
        self.codec = open_codec(model_dir, cfg, self.kind)
        self.max_input_tokens = max_input_tokens or self.shape.max_positions
        self.default_batch_tokens = 65536 if self.device.type == "cuda" else 8192
        self.prefix_cache = PrefixCache(prefix_cache_bytes)
        self._grammars = None  # runtime.grammar.GrammarCache, built on the first Json request
        self.tokens_computed = 0  # real (non-padding) tokens run through the model
        self.jump_forward = bool(jump_forward)
        if max_decode_rows is not None and max_decode_rows < 1:
            raise ValueError(f"max_decode_rows must be positive, got {max_decode_rows}")
        self.max_decode_rows = max_decode_rows
        self.compile = compile
        self._compiled_step = self._compiled_forward = None
        if compile_enabled(compile, self.device):
            self._compiled_step = CompiledFunction(self.model.step_core, self.device, "the Qwen decoding step")
            self._compiled_forward = CompiledFunction(self.model.forward, self.device, "the Qwen score-only forward",
                                                      dynamic=None)
        self.reset_decode_stats()
        log.info("fastjudge: loaded %s judge %s on %s (%s)", self.shape.arch, model_dir, self.device,
                 str(self.dtype).replace("torch.", ""))

    def _init_vision(self, model_dir, cfg: dict, state: dict) -> None:
        """The vision tower and the image embedding cache of a multimodal checkpoint."""
        from .qwen_vision import QwenVision

        self.vision = QwenVision(cfg, state, self.device, self.dtype)
        self.image_token_id = cfg["image_token_id"]
        self._image_embeds = ImageEmbeddingCache(DEFAULT_IMAGE_CACHE_BYTES)

    @property
    def compile_seconds(self) -> float:
        """Seconds spent compiling (and recording CUDA graphs) so far."""
        return sum(f.seconds for f in (self._compiled_step, self._compiled_forward) if f is not None)

    def reset_decode_stats(self) -> None:
        """Zero :attr:`decode_stats`: cumulative ``tokens_computed`` (tokens chosen from logits),
        ``tokens_forced`` (tokens jump-forward accepted without their own model step) and
        ``decode_steps`` (model calls while decoding); stop tokens count as tokens."""
        self.decode_stats = {"tokens_computed": 0, "tokens_forced": 0, "decode_steps": 0}

    # -- planning hooks ---------------------------------------------------------------------------
    def cost(self, request: Request) -> int:
        return request.num_tokens - request.prefix_len

    def group_key(self, request: Request):
        """Requests that can share one prefix state (the planner never mixes groups): the same
        prefix tokens and, image tokens being the same ids for every image, the same images.
        Choice rows need no single shared state: prefixes of the same tokens and image grids
        but different images go together, each row with its own image's state
        (``_row_prefix_states``). Generation rows need none either: each row's suffix runs
        alone from its own prefix state and the decode cache holds a state per row, so rows of
        any prefixes decode together (the scheduler still keeps one spec per batch)."""
        if not isinstance(request.spec, Choice):
            return b""
        ids, images = self._prefix_of(request)
        return ids.tobytes() + np.asarray([im.grid_thw for im in images], dtype=np.int64).tobytes()

    # -- images -----------------------------------------------------------------------------------
    @staticmethod
    def _prefix_of(request: Request) -> tuple[np.ndarray, tuple[Image, ...]]:
        """The shared prefix's tokens and the images inside it."""
        return request.prompt_ids[: request.prefix_len], request.images[: request.prefix_images]

    def _embed(self, images: Sequence[Image]) -> torch.Tensor | None:
        """Vision embeddings of ``images`` concatenated in order; images not cached are encoded
        together in one vision-tower call (each image's pixels as they are: no concatenation)."""
        if not images:
            return None
        missing = list({im.key: im for im in images if im.key not in self._image_embeds}.values())
        if missing:
            embeds = self.vision.encode_images([(im.pixel_values, im.grid_thw) for im in missing])
            for im, e in zip(missing, embeds):
                self._image_embeds.put(im.key, e)
        return torch.cat([self._image_embeds.get(im.key) for im in images])

    def _positions(self, rows: Sequence[np.ndarray], images: Sequence[Sequence[Image]], start: int,
                   width: int) -> torch.Tensor | None:
        """[3, B, width] M-RoPE positions of right-padded rows continuing from ``start``; None when
        no row has an image (plain positions then)."""
        if not any(images):
            return None
        out = torch.empty(3, len(rows), width, dtype=torch.long)
        for b, (ids, ims) in enumerate(zip(rows, images)):
            grids = [im.grid_thw for im in ims] or None
            pos = mrope_positions(ids, grids, self.vision.spatial_merge_size, self.image_token_id, start)
            out[:, b, : len(ids)] = pos
            tail = int(pos.max()) + 1 if len(ids) else start
            out[:, b, len(ids):] = torch.arange(tail, tail + width - len(ids))
        return out

    # -- execution --------------------------------------------------------------------------------
    def _prefix_state(self, ids: np.ndarray, images: Sequence[Image]) -> tuple[int | None, PrefixState | None]:
        if len(ids) == 0:
            return None, None
        key = prefix_cache_key(ids, images)
        slot, state = self.prefix_cache.lookup(key)
        if state is None:
            t = torch.from_numpy(ids).to(self.device)[None]
            positions = self._positions([ids], [images], 0, len(ids))
            _, state = self.model.forward(t, None, save=True, image_embeds=self._embed(images),
                                          image_mask=t == self.image_token_id if images else None,
                                          positions=positions)
            self.tokens_computed += len(ids)
            slot = self.prefix_cache.insert(key, state)
        return slot, state

    @torch.inference_mode()
    def run(self, batch: Sequence[Request]) -> list[Output]:
        key = self.group_key(batch[0])
        if any(self.group_key(r) != key for r in batch):
            raise ValueError("a batch must share one prefix")
        choice = isinstance(batch[0].spec, Choice)
        slots, state = self._row_prefix_states(batch) if choice else self._generation_prefix_states(batch)
        try:
            if choice:
                return self._run_choice(batch, state)
            return self._generate(batch, state)
        finally:
            for slot in slots:
                if slot is not None:
                    self.prefix_cache.release(slot)

    def _generation_prefix_states(self, batch: Sequence[Request]) -> tuple[list, dict]:
        """Each distinct prefix of a generation batch run (or found cached) once: the cache
        slots to release, and each request's prefix state by ``id(request)`` (None without a
        prefix)."""
        slots, by_prefix, states = [], {}, {}
        for r in batch:
            ids, images = self._prefix_of(r)
            name = prefix_cache_key(ids, images).tobytes() if len(ids) else b""
            if name not in by_prefix:
                slot, by_prefix[name] = self._prefix_state(ids, images)
                slots.append(slot)
            states[id(r)] = by_prefix[name]
        return slots, states

    def _row_prefix_states(self, batch: Sequence[Request]) -> tuple[list, PrefixState | None]:
        """The prefix state of a Choice batch whose rows share prefix tokens and image grids but
        maybe not images (one image, several captions: the image's prompt runs once): the
        cache slots to release, and a state of one row (all rows share one prefix) or of one
        row per request, each its own images' state. States not cached are computed together,
        rows of equal length (no padding: each row's saved state is exact)."""
        prefix = self._prefix_of(batch[0])[0]
        if len(prefix) == 0:
            return [], None
        names, wanted = [], {}
        for r in batch:
            images = self._prefix_of(r)[1]
            key = prefix_cache_key(prefix, images)
            names.append(key.tobytes())
            wanted.setdefault(names[-1], (key, images))
        slots, states, missing = [], {}, []
        for name, (key, _) in wanted.items():
            slot, state = self.prefix_cache.lookup(key)
            if state is None:
                missing.append(name)
            else:
                slots.append(slot)
                states[name] = state
        if missing:
            images = [wanted[name][1] for name in missing]
            flat = [im for ims in images for im in ims]
            ids = torch.from_numpy(prefix).to(self.device)[None].expand(len(missing), -1)
            _, joint = self.model.forward(ids, None, save=True, image_embeds=self._embed(flat),
                                          image_mask=ids == self.image_token_id if flat else None,
                                          positions=self._positions([prefix] * len(missing), images, 0, len(prefix)))
            self.tokens_computed += len(prefix) * len(missing)
            for b, name in enumerate(missing):
                state = joint if len(missing) == 1 else PrefixState(
                    [tuple(t[b:b + 1].clone() for t in pair) for pair in joint.layers], joint.length,
                    joint.next_position)
                slots.append(self.prefix_cache.insert(wanted[name][0], state))
                states[name] = state
        if len(wanted) == 1:
            return slots, states[names[0]]
        rows = [states[name] for name in names]
        layers = [tuple(torch.cat(parts) for parts in zip(*(st.layers[i] for st in rows)))
                  for i in range(len(rows[0].layers))]
        return slots, PrefixState(layers, rows[0].length, rows[0].next_position)

    def _suffix(self, request: Request) -> tuple[np.ndarray, tuple[Image, ...]]:
        """Tokens to run after the prefix state (prompt rest + forced response start) and the
        images among them."""
        ids = np.concatenate([request.prompt_ids[request.prefix_len:],
                              np.asarray(request.response_prefix, dtype=np.int64)])
        prefix_images = request.prefix_images
        return ids, request.images[prefix_images:]

    def _forward_rows(self, rows: Sequence[np.ndarray], images: Sequence[Sequence[Image]],
                      state: PrefixState | None, save: bool = False):
        """Right-padded rows continuing from ``state``, with their images."""
        S = max(len(x) for x in rows)
        self.tokens_computed += sum(len(x) for x in rows)
        ids = torch.full((len(rows), S), self.codec.pad_token_id, dtype=torch.long)
        for i, x in enumerate(rows):
            ids[i, : len(x)] = torch.from_numpy(x)
        ids = ids.to(self.device)
        flat = [im for ims in images for im in ims]
        if self._compiled_forward is not None and not flat and not save:
            # text rows, states not kept: compiled, right-padded to a power-of-two width
            # (causal: padding after a row's last token never reaches it)
            wide = torch.full((len(rows), width_bucket(S)), self.codec.pad_token_id, dtype=torch.long,
                              device=self.device)
            wide[:, :S] = ids
            hidden, _ = self._compiled_forward(("forward", len(rows), wide.shape[1]), wide, state)
            return hidden[:, :S], None
        start = state.next_position if state is not None else 0
        return self.model.forward(ids, state, save=save, image_embeds=self._embed(flat),
                                  image_mask=ids == self.image_token_id if flat else None,
                                  positions=self._positions(rows, images, start, S))

    def _run_choice(self, batch, state) -> list[Output]:
        suffixes = [self._suffix(r) for r in batch]
        rows = [ids for ids, _ in suffixes]
        hidden, _ = self._forward_rows(rows, [ims for _, ims in suffixes], state)
        last = torch.tensor([len(x) - 1 for x in rows], device=self.device)
        final = hidden[torch.arange(len(batch), device=self.device), last]
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
            z = logits[i, :k]
            outputs.append(Output(index=r.index, logits=z, probs=choice_probs(z),
                                  logprobs=logprobs[i, :k] if r.spec.full_vocab else None))
        return outputs

    def _matcher(self, spec):
        """A grammar matcher for a Json spec (None for Text)."""
        if isinstance(spec, Text):
            return None
        return self._grammar_cache().matcher(spec)

    def _grammar_cache(self):
        from ..runtime.grammar import GrammarCache

        if self._grammars is None:
            self._grammars = GrammarCache(self.codec.tokenizer, self.shape.vocab_size, self.codec.eos_token_ids)
        return self._grammars

    def _generate(self, batch: Sequence[Request], states: dict) -> list[Output]:
        """Greedy decoding of a batch of one Text/Json spec, ``states`` the prefix state of
        each request: each row's suffix runs alone from its prefix state (exact: no padding),
        then the rows decode together (``qwen_decode``) on a static cache sized from the
        requests' token budgets; Json rows under their grammar."""
        from ..runtime.token_mask import TokenMask

        matchers = [self._matcher(r.spec) for r in batch]
        slots = min(self.max_decode_rows or len(batch), len(batch))
        capacity = max(r.num_tokens + r.spec.max_new_tokens for r in batch)
        if self._compiled_step is not None:  # room for the shape buckets
            slots, capacity = row_bucket(slots), round_capacity(capacity)
        cache = SlotCache(self.shape, slots, capacity, self.device, self.dtype)
        mask = None
        if matchers[0] is not None:
            mask = TokenMask(slots, self.shape.vocab_size, self.device, self._grammar_cache().apply_backend)
        outputs, decoded = decode_greedy(self.model, batch, matchers, cache,
                                         lambda rows, cache, start: self._prefill_suffixes(rows, states, cache, start),
                                         self.codec.eos_token_ids, jump_forward=self.jump_forward, mask=mask,
                                         stats=self.decode_stats, compiled=self._compiled_step)
        self.tokens_computed += decoded
        return outputs

    def _prefill_suffixes(self, batch: Sequence[Request], states: dict, cache: SlotCache, start: int) -> torch.Tensor:
        """Each row's suffix run from its prefix state (``states[id(request)]``) into slots
        ``start ..`` of ``cache``: the final hidden states [B, d].

        Text-only suffixes after a prefix run together as one multi-token step
        (``QwenModel.step``) on the slots loaded with their prefix states: each row continues
        at its own length and position, and its padding never reaches its state, so this
        equals each row alone. A suffix with images (M-RoPE positions of its own) or a row
        without a prefix runs alone, and its state is loaded into its slot."""
        suffixes = [self._suffix(r) for r in batch]
        prefixes = [states[id(r)] for r in batch]
        if all(st is not None for st in prefixes) and all(len(ids) and not images for ids, images in suffixes):
            for b, st in enumerate(prefixes):
                cache.load(start + b, st)
            counts = [len(ids) for ids, _ in suffixes]
            ids = torch.full((len(batch), max(counts)), self.codec.pad_token_id, dtype=torch.long)
            for i, (row, _) in enumerate(suffixes):
                ids[i, : len(row)] = torch.from_numpy(row)
            hidden = self.model.step(ids.to(self.device), counts, cache.window(start, start + len(batch)),
                                     compiled=self._compiled_step)
            self.tokens_computed += sum(counts)
            return hidden[torch.arange(len(batch), device=self.device), torch.tensor(counts, device=self.device) - 1]
        last = []
        for b, (r, (ids, images)) in enumerate(zip(batch, suffixes)):
            hidden, st = self._forward_rows([ids], [images], states[id(r)], save=True)
            last.append(hidden[:, -1])
            cache.load(start + b, st)
        return torch.cat(last)
