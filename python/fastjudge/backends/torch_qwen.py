"""Qwen3.5 (hybrid Gated DeltaNet + gated attention) and Qwen3 (dense) judges in plain PyTorch,
with exact shared-prefix reuse.

Requests that share a prompt prefix (LAVE: task description + demonstrations) run the prefix
once. Its state is kept in a byte-budgeted cache indexed by a C++ radix tree: the K/V of every
full-attention layer and, for every Gated DeltaNet layer, the convolution state (last
``kernel - 1`` inputs) and the recurrent state at the prefix end. Suffixes then continue from it
in batches.

Exactness with batching: suffixes are right-padded and each row is read at its own last token.
Every operation is causal (attention with a causal mask, causal depthwise conv, the chunked
delta rule), so padding placed after a row's last token never reaches that token's output, and
the padded rows' final states are never kept.

The Gated DeltaNet math (chunked and recurrent gated delta rule) is transformers' reference
implementation, called as a function; the engine owns batching, masking, state and heads.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from fastjudge.kernels.choice_head import choice_logits

from ..runtime.requests import Choice, Output, Request, Text, choice_probs
from .loading import CheckpointError, load_state_dict, read_config, resolve_device, resolve_dtype

log = logging.getLogger("fastjudge")

QWEN_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3")
DEFAULT_PREFIX_CACHE_BYTES = 2 << 30  # 2 GiB: thousands of LAVE prefixes of a small judge


@dataclass(frozen=True)
class QwenShape:
    arch: str
    vocab_size: int
    hidden: int
    num_layers: int
    heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    eps: float
    layer_types: tuple[str, ...]
    hybrid: bool  # Qwen3.5: zero-centred norms, gated attention output, DeltaNet layers
    max_positions: int
    lin_k_heads: int = 0
    lin_v_heads: int = 0
    lin_k_dim: int = 0
    lin_v_dim: int = 0
    conv_kernel: int = 0
    # M-RoPE (multimodal Qwen3.5): rotary frequency pairs taken from the t/h/w position rows,
    # interleaved (transformers' default when the config names none)
    mrope_section: tuple[int, ...] = (11, 11, 10)

    @classmethod
    def from_config(cls, cfg: dict) -> "QwenShape":
        model_type = cfg.get("model_type")
        text = cfg.get("text_config", cfg) if model_type == "qwen3_5" else cfg
        hybrid = model_type in ("qwen3_5", "qwen3_5_text")
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
        partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0))
        if rope.get("rope_type", "default") not in ("default",) and not rope.get("mrope_section"):
            raise CheckpointError(f"rope type {rope.get('rope_type')!r} is not supported")
        n = text["num_hidden_layers"]
        layer_types = tuple(text.get("layer_types") or ["full_attention"] * n)
        return cls(
            arch=model_type, vocab_size=text["vocab_size"], hidden=text["hidden_size"],
            num_layers=n, heads=text["num_attention_heads"], kv_heads=text["num_key_value_heads"],
            head_dim=head_dim, rotary_dim=int(head_dim * partial),
            rope_theta=rope.get("rope_theta", text.get("rope_theta", 10000.0)),
            eps=text.get("rms_norm_eps", 1e-6), layer_types=layer_types, hybrid=hybrid,
            max_positions=text.get("max_position_embeddings", 32768),
            lin_k_heads=text.get("linear_num_key_heads", 0),
            lin_v_heads=text.get("linear_num_value_heads", 0),
            lin_k_dim=text.get("linear_key_head_dim", 0),
            lin_v_dim=text.get("linear_value_head_dim", 0),
            conv_kernel=text.get("linear_conv_kernel_dim", 0),
            mrope_section=tuple(rope.get("mrope_section") or (11, 11, 10)),
        )


def _delta_rule():
    """transformers' reference gated-delta-rule functions (chunked for prefill, recurrent for
    one-token steps)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    return m.torch_chunk_gated_delta_rule, m.torch_recurrent_gated_delta_rule


class QwenWeights:
    def __init__(self, state: dict[str, torch.Tensor], shape: QwenShape, device, dtype):
        prefix = "model.language_model." if any(k.startswith("model.language_model.") for k in state) \
            else "model."

        def take(name: str, full: bool = False) -> torch.Tensor:
            key = name if full else prefix + name
            if key not in state:
                raise CheckpointError(f"checkpoint lacks tensor {key!r}")
            return state[key].to(device=device, dtype=dtype)

        def norm(name: str) -> torch.Tensor:
            # Kept in float32: norms are computed in float32 as transformers does. Qwen3.5's
            # norms are zero-centred (scale = 1 + w).
            w = state[prefix + name].to(device=device, dtype=torch.float32)
            return 1.0 + w if shape.hybrid else w

        self.embed = take("embed_tokens.weight")
        self.lm_head = take("lm_head.weight", full=True) if "lm_head.weight" in state else self.embed
        self.final_norm = norm("norm.weight")
        self.layers = []
        for i, kind in enumerate(shape.layer_types):
            p = f"layers.{i}."
            layer = {"kind": kind, "in_norm": norm(p + "input_layernorm.weight"),
                     "post_norm": norm(p + "post_attention_layernorm.weight"),
                     "gate_up": torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]),
                     "down": take(p + "mlp.down_proj.weight")}
            if kind == "full_attention":
                a = p + "self_attn."
                layer.update(q=take(a + "q_proj.weight"),
                             kv=torch.cat([take(a + "k_proj.weight"), take(a + "v_proj.weight")]),
                             o=take(a + "o_proj.weight"), q_norm=norm(a + "q_norm.weight"),
                             k_norm=norm(a + "k_norm.weight"))
            elif kind == "linear_attention":
                a = p + "linear_attn."
                layer.update(
                    in_proj=torch.cat([take(a + f"in_proj_{n}.weight") for n in ("qkv", "z", "b", "a")]),
                    conv=take(a + "conv1d.weight"), dt_bias=take(a + "dt_bias"),
                    neg_A=-state[prefix + a + "A_log"].to(device=device, dtype=torch.float32).exp(),
                    gated_norm=state[prefix + a + "norm.weight"].to(device=device, dtype=dtype),
                    out=take(a + "out_proj.weight"))
            else:
                raise CheckpointError(f"unsupported layer type {kind!r}")
            self.layers.append(layer)


def rms(x: torch.Tensor, weight_f32: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x.float(), (x.shape[-1],), weight_f32, eps).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class PrefixState:
    """Model state at the end of a prefix: per layer (k, v) or (conv_state, recurrent_state).

    ``length`` counts tokens; ``next_position`` is the rotary position of the next token, which
    differs from ``length`` after an image (M-RoPE: text after an image continues from the
    largest position so far + 1). It defaults to ``length``."""

    def __init__(self, layers: list[tuple[torch.Tensor, torch.Tensor]], length: int,
                 next_position: int | None = None):
        self.layers = layers
        self.length = length
        self.next_position = length if next_position is None else next_position

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.layers for t in pair)


class QwenModel:
    def __init__(self, weights: QwenWeights, shape: QwenShape):
        self.w = weights
        self.s = shape
        self.chunk_rule, self.step_rule = _delta_rule() if shape.hybrid else (None, None)
        rd = shape.rotary_dim
        self.inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd))

    def _rope(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 2:  # M-RoPE [3, S]: t/h/w frequencies interleaved per mrope_section
            freqs = positions.float()[..., None] * self.inv_freq.to(positions.device)
            mixed = freqs[0].clone()
            for dim, offset in ((1, 1), (2, 2)):
                idx = slice(offset, self.s.mrope_section[dim] * 3, 3)
                mixed[..., idx] = freqs[dim, ..., idx]
            emb = torch.cat([mixed, mixed], dim=-1)
            return emb.cos().to(dtype), emb.sin().to(dtype)
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _apply_rope(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        rd = self.s.rotary_dim
        rot, rest = x[..., :rd], x[..., rd:]
        return torch.cat([rot * cos + rotate_half(rot) * sin, rest], dim=-1)

    def _attention(self, x, layer, prev, positions, save):
        s = self.s
        B, S, _ = x.shape
        H, Hkv, hd = s.heads, s.kv_heads, s.head_dim
        q = F.linear(x, layer["q"])
        if s.hybrid:
            q, gate = q.view(B, S, H, 2 * hd).chunk(2, dim=-1)
            gate = gate.reshape(B, S, H * hd)
        else:
            q = q.view(B, S, H, hd)
        k, v = F.linear(x, layer["kv"]).view(B, S, 2, Hkv, hd).unbind(2)
        q = rms(q, layer["q_norm"], s.eps).transpose(1, 2)
        k = rms(k, layer["k_norm"], s.eps).transpose(1, 2)
        v = v.transpose(1, 2)
        cos, sin = self._rope(positions, x.dtype)
        q, k = self._apply_rope(q, cos, sin), self._apply_rope(k, cos, sin)
        P = 0
        if prev is not None:
            pk, pv = prev
            P = pk.shape[2]
            k = torch.cat([pk.expand(B, -1, -1, -1), k], dim=2)
            v = torch.cat([pv.expand(B, -1, -1, -1), v], dim=2)
        # query i sees the whole prefix and suffix keys up to itself
        allowed = torch.ones(S, P + S, dtype=torch.bool, device=x.device).tril(diagonal=P)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=Hkv != H)
        o = o.transpose(1, 2).reshape(B, S, H * hd)
        if s.hybrid:
            o = o * torch.sigmoid(gate)
        return F.linear(o, layer["o"]), ((k, v) if save else None)

    def _delta_net(self, x, layer, prev, save):
        s = self.s
        B, S, _ = x.shape
        key_dim, val_dim = s.lin_k_heads * s.lin_k_dim, s.lin_v_heads * s.lin_v_dim
        conv_dim = 2 * key_dim + val_dim
        proj = F.linear(x, layer["in_proj"])
        mixed, z, b, a = proj.split([conv_dim, val_dim, s.lin_v_heads, s.lin_v_heads], dim=-1)
        K = s.conv_kernel
        inputs = mixed.transpose(1, 2)  # [B, C, S]
        history = prev[0].expand(B, -1, -1) if prev is not None else inputs.new_zeros(B, conv_dim, K - 1)
        window = torch.cat([history, inputs], dim=-1)
        conv = F.silu(F.conv1d(window, layer["conv"], groups=conv_dim))  # causal: no future input
        q, k, v = conv.transpose(1, 2).split([key_dim, key_dim, val_dim], dim=-1)
        q = q.reshape(B, S, s.lin_k_heads, s.lin_k_dim)
        k = k.reshape(B, S, s.lin_k_heads, s.lin_k_dim)
        v = v.reshape(B, S, s.lin_v_heads, s.lin_v_dim)
        beta = b.sigmoid()
        g = layer["neg_A"] * F.softplus(a.float() + layer["dt_bias"])
        initial = prev[1].expand(B, -1, -1, -1) if prev is not None else None
        rule = self.step_rule if (S == 1 and prev is not None) else self.chunk_rule
        core, final = rule(q, k, v, g=g, beta=beta, initial_state=initial,
                           output_final_state=save, use_qk_l2norm_in_kernel=True)
        # gated RMSNorm: normalise in float32, scale, gate with silu(z)
        normed = F.rms_norm(core.float(), (s.lin_v_dim,), None, s.eps).to(core.dtype) * layer["gated_norm"]
        gated = (normed.float() * F.silu(z.reshape(B, S, s.lin_v_heads, s.lin_v_dim).float())).to(x.dtype)
        out = F.linear(gated.reshape(B, S, val_dim), layer["out"])
        return out, ((window[:, :, -(K - 1):], final) if save else None)

    def forward(self, ids: torch.Tensor, prev: PrefixState | None, save: bool = False,
                image_embeds: torch.Tensor | None = None, image_mask: torch.Tensor | None = None,
                positions: torch.Tensor | None = None):
        """Hidden states [B, S, d] of ``ids`` [B, S] continuing from ``prev`` (shared by all
        rows); with ``save``, also the state at the end of the rows (meaningful for unpadded rows).

        Images (multimodal Qwen3.5): ``image_embeds`` [N, d] replace the token embeddings where
        ``image_mask`` [B, S] is true (in order, as transformers' masked_scatter), and
        ``positions`` [3, S] (shared by all rows) are the M-RoPE t/h/w positions
        (``qwen_vision.mrope_positions``). Without ``positions``: ``prev.next_position`` onwards,
        the same on all three rows."""
        s = self.s
        B, S = ids.shape
        start = prev.length if prev is not None else 0
        start_pos = prev.next_position if prev is not None else 0
        if positions is None:
            positions = torch.arange(start_pos, start_pos + S, device=ids.device)
            next_position = start_pos + S
        else:
            positions = positions.to(ids.device)
            if positions.dim() == 1 or tuple(positions.shape) != (3, S):
                raise ValueError(f"positions must be [3, {S}] M-RoPE positions, got {tuple(positions.shape)}")
            next_position = int(positions.max()) + 1
        x = F.embedding(ids, self.w.embed)
        if image_embeds is not None:
            if image_mask is None or int(image_mask.sum()) != image_embeds.shape[0]:
                raise ValueError("image_embeds need an image_mask with one true entry per embedding")
            x = x.masked_scatter(image_mask.to(x.device)[..., None], image_embeds.to(x.device, x.dtype))
        states = []
        for i, layer in enumerate(self.w.layers):
            h = rms(x, layer["in_norm"], s.eps)
            p = prev.layers[i] if prev is not None else None
            if layer["kind"] == "full_attention":
                h, st = self._attention(h, layer, p, positions, save)
            else:
                h, st = self._delta_net(h, layer, p, save)
            x = x + h
            h = rms(x, layer["post_norm"], s.eps)
            gate, up = F.linear(h, layer["gate_up"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer["down"])
            states.append(st)
        return x, (PrefixState(states, start + S, next_position) if save else None)

    def logits(self, hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of the final states: the candidate ``rows`` through the fused choice head
        (never ``[B, vocab]``), or the full vocabulary for decoding."""
        if rows is not None:
            return choice_logits(hidden, self.w.final_norm, self.w.lm_head, rows, eps=self.s.eps)
        return F.linear(rms(hidden, self.w.final_norm, self.s.eps), self.w.lm_head).float()


class TorchQwenBackend:
    """Decoder-only judge backend with exact shared-prefix reuse."""

    kind = "decoder-only"

    def __init__(self, model_dir: str | os.PathLike, device: str = "auto", dtype=None,
                 allow_pickle: bool = False, max_input_tokens: int | None = None,
                 prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES):
        from transformers import AutoTokenizer

        from ..runtime.prefix_cache import PrefixCache

        cfg = read_config(model_dir)
        if cfg.get("model_type") not in QWEN_MODEL_TYPES:
            raise CheckpointError(f"{model_dir}: model_type {cfg.get('model_type')!r} is not a Qwen3/3.5 model")
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.shape = QwenShape.from_config(cfg)
        state = load_state_dict(model_dir, allow_pickle=allow_pickle)
        self.model = QwenModel(QwenWeights(state, self.shape, self.device, self.dtype), self.shape)
        del state
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.max_input_tokens = max_input_tokens or self.shape.max_positions
        self.default_batch_tokens = 65536 if self.device.type == "cuda" else 8192
        eos = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.eos_token_ids = {t for t in (eos, self.tokenizer.eos_token_id) if isinstance(t, int) and t >= 0}
        self.pad_token_id = self.tokenizer.pad_token_id or 0
        self.prefix_cache = PrefixCache(prefix_cache_bytes)
        self._prefix_ids: dict[str, np.ndarray] = {}
        self.tokens_computed = 0  # real (non-padding) tokens run through the model
        log.info("fastjudge: loaded %s judge %s on %s (%s)", self.shape.arch, model_dir, self.device,
                 str(self.dtype).replace("torch.", ""))

    # -- text <-> tokens -------------------------------------------------------------------------
    def format_prompt(self, text: str) -> str:
        """The user turn and an open assistant turn, through the checkpoint's chat template with
        thinking disabled (Qwen3/3.5 templates then open the answer with an empty
        <think></think> block). Without a template: the same turn structure written out."""
        messages = [{"role": "user", "content": text}]
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                      enable_thinking=False)
        return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"

    def _ids(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer(text, add_special_tokens=False).input_ids, dtype=np.int64)

    def encode_prompt(self, text: str) -> np.ndarray:
        return self._ids(self.format_prompt(text))

    def shared_prefix_len(self, ids: np.ndarray, prefix_text: str) -> int:
        """How many leading tokens of ``ids`` (an encoded prompt whose text starts with
        ``prefix_text``) are the shared prefix: the tokens of the formatted prefix that the full
        prompt's tokenization agrees with, leaving at least one token to run per request."""
        if not prefix_text:
            return 0
        cached = self._prefix_ids.get(prefix_text)
        if cached is None:
            formatted = self.format_prompt(prefix_text)
            cut = formatted.rfind(prefix_text)
            cached = self._ids(formatted[: cut + len(prefix_text)])
            self._prefix_ids[prefix_text] = cached
        n = min(len(cached), len(ids) - 1)
        mismatch = np.nonzero(cached[:n] != ids[:n])[0]
        # Exact by construction: the shared part is this prompt's own leading tokens. A prompt
        # whose tokens diverge early at the boundary gets a shorter prefix (another group).
        return int(mismatch[0] if len(mismatch) else n)

    def response_ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    # -- planning hooks ---------------------------------------------------------------------------
    def cost(self, request: Request) -> int:
        return request.num_tokens - request.prefix_len

    def group_key(self, request: Request):
        """Requests that can share one prefix state (the planner never mixes groups)."""
        return request.prompt_ids[: request.prefix_len].tobytes()

    # -- execution --------------------------------------------------------------------------------
    def _prefix_state(self, ids: np.ndarray) -> tuple[int | None, PrefixState | None]:
        if len(ids) == 0:
            return None, None
        slot, state = self.prefix_cache.lookup(ids)
        if state is None:
            t = torch.from_numpy(ids).to(self.device)[None]
            _, state = self.model.forward(t, None, save=True)
            self.tokens_computed += len(ids)
            slot = self.prefix_cache.insert(ids, state)
        return slot, state

    @torch.inference_mode()
    def run(self, batch: Sequence[Request]) -> list[Output]:
        prefix_len = batch[0].prefix_len
        prefix = batch[0].prompt_ids[:prefix_len]
        if any(r.prefix_len != prefix_len or not np.array_equal(r.prompt_ids[:prefix_len], prefix)
               for r in batch):
            raise ValueError("a batch must share one prefix")
        slot, state = self._prefix_state(prefix)
        try:
            if isinstance(batch[0].spec, Choice):
                return self._run_choice(batch, state)
            return [self._generate(r, state) for r in batch]
        finally:
            if slot is not None:
                self.prefix_cache.release(slot)

    def _run_choice(self, batch, state) -> list[Output]:
        suffixes = [np.concatenate([r.prompt_ids[r.prefix_len:], np.asarray(r.response_prefix, dtype=np.int64)])
                    for r in batch]
        S = max(len(x) for x in suffixes)
        self.tokens_computed += sum(len(x) for x in suffixes)
        ids = torch.full((len(batch), S), self.pad_token_id, dtype=torch.long)
        for i, x in enumerate(suffixes):
            ids[i, : len(x)] = torch.from_numpy(x)
        hidden, _ = self.model.forward(ids.to(self.device), state)
        last = torch.tensor([len(x) - 1 for x in suffixes], device=self.device)
        final = hidden[torch.arange(len(batch), device=self.device), last]
        if len({r.spec.token_ids for r in batch}) == 1:
            rows = torch.tensor(batch[0].spec.token_ids, device=self.device)
        else:  # per-row candidate sets (e.g. a rationale's constrained follow-up beside plain rows)
            width = max(len(r.spec.token_ids) for r in batch)
            rows = torch.tensor([list(r.spec.token_ids) + [r.spec.token_ids[0]] * (width - len(r.spec.token_ids))
                                 for r in batch], device=self.device)
        logits = self.model.logits(final, rows).cpu().numpy().astype(np.float64)
        outputs = []
        for r, z in zip(batch, logits):
            z = z[: len(r.spec.token_ids)]
            outputs.append(Output(index=r.index, logits=z, probs=choice_probs(z)))
        return outputs

    def _generate(self, request: Request, state: PrefixState | None) -> Output:
        """Greedy decoding for one row, continuing from the prefix state (exact: no padding)."""
        spec: Text = request.spec
        suffix = torch.from_numpy(request.prompt_ids[request.prefix_len:]).to(self.device)[None]
        hidden, st = self.model.forward(suffix, state, save=True)
        self.tokens_computed += suffix.shape[1]
        track = torch.tensor(spec.track_ids, device=self.device) if spec.track_ids else None
        tokens, tracked, finished = [], [], False
        for _ in range(spec.max_new_tokens):
            logits = self.model.logits(hidden[:, -1])[0]
            token = int(logits.argmax())
            if token in self.eos_token_ids:
                finished = True
                break
            tokens.append(token)
            if track is not None:
                tracked.append(logits[track])
            if len(tokens) == spec.max_new_tokens:
                break
            hidden, st = self.model.forward(torch.tensor([[token]], device=self.device), st, save=True)
        return Output(index=request.index, token_ids=tokens, finished=finished,
                      tracked_logits=torch.stack(tracked).cpu().numpy().astype(np.float64)
                      if tracked else (np.zeros((0, len(spec.track_ids))) if track is not None else None))
