"""The roofline of a stage: the machine's measured peaks, a stage's FLOPs and bytes from the
model's shape, and the fastest time those allow.

Peaks are measured, not read from a datasheet: :func:`gemm_rate` times one GEMM shape through
one path (:data:`GEMM_PATHS`: plain ``F.linear``, oneDNN on a prepacked weight, oneDNN on
mkldnn tensors on the CPU; ``torch.mm`` (cuBLAS) and ``F.linear`` on CUDA), and
:func:`bandwidth` the bytes/s of a large copy and of a large sum. A stage's bound is
``max(flops / peak_flops, bytes / bandwidth)``: compute-bound where its GEMMs are large
(encoders, prefill), memory-bound where every weight is read for a few rows (decode steps).

The FLOP counts are those of the standard algorithms (2 per multiply-add): ``2 x params x
tokens`` for the projections, ``4 x context x heads x head_dim`` per query token for attention
(scores and weighted sum), ``6 x key_dim x value_dim`` per token and value head for a Gated
DeltaNet recurrence (decay and update of the state, then its read-out); T5's cross-attention in
the cheaper of its two exact forms for the call's length (:func:`t5_reassociates`). What an
implementation computes beyond that (padding, recomputation) counts against it. The byte counts
are lower bounds: each weight read once per call, each cached key/value or recurrent state read
once per step.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ..backends import dense


@dataclass(frozen=True)
class Cost:
    """A stage's work: floating-point operations and bytes moved (lower bounds)."""

    flops: float
    bytes: float

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.flops + other.flops, self.bytes + other.bytes)

    def scaled(self, k: float) -> "Cost":
        return Cost(self.flops * k, self.bytes * k)


def bound_seconds(cost: Cost, peak_flops: float, bytes_per_s: float) -> tuple[float, str]:
    """The fastest time ``cost`` allows and what bounds it (``"compute"`` or ``"memory"``)."""
    compute, memory = cost.flops / peak_flops, cost.bytes / bytes_per_s
    return (compute, "compute") if compute >= memory else (memory, "memory")


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# -- T5 (encoder-decoder) -------------------------------------------------------------------------
@dataclass(frozen=True)
class T5Dims:
    d_model: int
    heads: int
    inner: int  # heads x d_kv
    d_ff: int
    gated: bool
    encoder_layers: int
    decoder_layers: int
    vocab: int

    @classmethod
    def from_config(cls, cfg: dict) -> "T5Dims":
        gated = bool(cfg.get("is_gated_act")) or str(cfg.get("feed_forward_proj", "")).startswith("gated")
        return cls(cfg["d_model"], cfg["num_heads"], cfg["num_heads"] * cfg["d_kv"], cfg["d_ff"], gated,
                   cfg["num_layers"], cfg.get("num_decoder_layers") or cfg["num_layers"], cfg["vocab_size"])

    @property
    def ff_params(self) -> int:
        return (3 if self.gated else 2) * self.d_model * self.d_ff

    @property
    def encoder_layer_params(self) -> int:
        return 4 * self.d_model * self.inner + self.ff_params

    @property
    def decoder_layer_params(self) -> int:
        """Per decoded token: self-attention q/k/v/o, cross-attention q/o, feed-forward (the
        cross-attention k/v projections apply to encoder tokens, :meth:`cross_kv_params`)."""
        return 6 * self.d_model * self.inner + self.ff_params

    @property
    def cross_kv_params(self) -> int:
        return self.decoder_layers * 2 * self.d_model * self.inner


def t5_encoder_cost(d: T5Dims, lengths: list[int], dtype: torch.dtype, cross_kv: bool = False) -> Cost:
    """The encoder over prompts of ``lengths`` tokens; ``cross_kv``: with the cross-attention keys
    and values of their tokens (a decoder that attends per head over them; a bound that counts
    decoding steps with ``steps`` given spreads that projection over the steps instead)."""
    tokens = sum(lengths)
    params = d.encoder_layers * d.encoder_layer_params + (d.cross_kv_params if cross_kv else 0)
    attn = d.encoder_layers * sum(4 * n * n * d.inner for n in lengths)
    return Cost(2 * params * tokens + attn, params * dtype_bytes(dtype))


def t5_reassociates(d: T5Dims, encoder_len: int, steps: int | None) -> bool:
    """Whether a row decoding ``steps`` steps over ``encoder_len`` encoder states needs fewer
    FLOPs with the cross-attention reassociated (each head's query mapped into model space, its
    scores and weighted sum over the encoder states themselves, the context mapped back) than per
    head over projected keys and values, their projection spread over the steps. ``steps`` None:
    keys and values are projected already (counted with the encoder): per head."""
    if steps is None:
        return False
    per_layer_reassociated = 4 * d.d_model * d.inner + 4 * d.heads * encoder_len * d.d_model
    per_layer_per_head = 4 * encoder_len * d.inner + 4 * encoder_len * d.d_model * d.inner / steps
    return per_layer_reassociated < per_layer_per_head


def t5_decode_step_cost(d: T5Dims, rows: int, encoder_len: int, position: int, dtype: torch.dtype,
                        logits: bool = True, steps: int | None = None) -> Cost:
    """One decoder step of ``rows`` rows at decoded ``position`` (tokens already in the
    self-attention cache) over ``encoder_len`` encoder tokens; ``logits``: the full-vocabulary
    LM head (greedy decoding). The cross-attention in the cheaper of its exact forms for a call of
    ``steps`` steps (:func:`t5_reassociates`): per head, reading the projected keys and values,
    with ``1 / steps`` of their projection (none where ``steps`` is None), or reassociated,
    reading each row's encoder states once and the k/v projections' weights once a step."""
    b, L, context = dtype_bytes(dtype), d.decoder_layers, position + 1
    params = L * d.decoder_layer_params + (d.d_model * d.vocab if logits else 0)
    # per row: the projections, the self-attention over its cached keys and values, then the cross-attention
    flops, reads, weights = 2 * params + L * 4 * context * d.inner, L * 2 * context * d.inner * b, params * b
    if t5_reassociates(d, encoder_len, steps):
        flops += L * (4 * d.d_model * d.inner + 4 * d.heads * encoder_len * d.d_model)
        reads += encoder_len * d.d_model * b
        weights += d.cross_kv_params * b
    else:
        flops += L * 4 * encoder_len * d.inner + (L * 4 * encoder_len * d.d_model * d.inner / steps if steps else 0)
        reads += L * 2 * encoder_len * d.inner * b
    return Cost(rows * flops, weights + rows * reads)


def t5_generation_cost(d: T5Dims, prompt_lengths: list[int], generated: list[int], dtype: torch.dtype) -> Cost:
    """Greedy decoding of ``generated[i]`` tokens for each prompt (after the encoder, which
    projects no cross-attention keys and values): every row-step's FLOPs and its reads, each row's
    cross-attention in its cheaper form for its length (:func:`t5_decode_step_cost` with
    ``steps``), and the decoder's weights read once per step of the longest row (rows of one
    step share them; the k/v projections' once per step of the longest reassociating row)."""
    rows, reassociating = Cost(0.0, 0.0), 0
    for n, steps in zip(prompt_lengths, generated):
        for position in range(steps):
            one = t5_decode_step_cost(d, 1, n, position, dtype, steps=steps)
            rows = rows + Cost(one.flops, one.bytes - t5_decode_step_cost(d, 0, n, position, dtype, steps=steps).bytes)
        if t5_reassociates(d, n, steps):
            reassociating = max(reassociating, steps)
    weights, cross_weights = t5_decode_step_cost(d, 0, 0, 0, dtype).bytes, d.cross_kv_params * dtype_bytes(dtype)
    return rows + Cost(0.0, max(generated, default=0) * weights + reassociating * cross_weights)


def peak_gemm_rate(m: int, k: int, n: int, dtype: torch.dtype, device: torch.device, repeats: int = 3) -> float:
    """The best FLOP/s of ``[m, k] x [k, n]`` over every path the device offers
    (:func:`gemm_paths`)."""
    return max(gemm_rate(m, k, n, dtype, device, make, repeats) for make in gemm_paths(device, dtype).values())


# -- Qwen3.5 (hybrid Gated DeltaNet + gated attention; Qwen3: attention only) ----------------------
@dataclass(frozen=True)
class QwenDims:
    hidden: int
    ff: int
    heads: int
    kv_heads: int
    head_dim: int
    full_layers: int
    linear_layers: int
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int
    vocab: int
    gated_attention: bool

    @classmethod
    def from_config(cls, cfg: dict) -> "QwenDims":
        text = cfg.get("text_config", cfg)
        layers = text.get("layer_types") or ["full_attention"] * text["num_hidden_layers"]
        full = sum(t == "full_attention" for t in layers)
        head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
        return cls(text["hidden_size"], text["intermediate_size"], text["num_attention_heads"],
                   text["num_key_value_heads"], head_dim,
                   full, len(layers) - full, text.get("linear_num_key_heads", 0), text.get("linear_num_value_heads", 0),
                   text.get("linear_key_head_dim", 0), text.get("linear_value_head_dim", 0),
                   text.get("linear_conv_kernel_dim", 0), text["vocab_size"],
                   str(text.get("model_type", cfg.get("model_type", ""))).startswith("qwen3_5"))

    @property
    def attention_params(self) -> int:
        q = self.heads * self.head_dim * (2 if self.gated_attention else 1)  # query (+ output gate)
        return self.hidden * (q + 2 * self.kv_heads * self.head_dim) + self.heads * self.head_dim * self.hidden

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    @property
    def deltanet_params(self) -> int:
        vd = self.value_heads * self.value_dim
        return self.hidden * (self.conv_channels + vd + 2 * self.value_heads) + vd * self.hidden

    @property
    def layer_params(self) -> int:
        """Projection parameters of all layers (what each token multiplies through)."""
        return (self.full_layers * self.attention_params + self.linear_layers * self.deltanet_params
                + (self.full_layers + self.linear_layers) * 3 * self.hidden * self.ff)

    @property
    def recurrent_state_elements(self) -> int:
        return self.linear_layers * self.value_heads * self.key_dim * self.value_dim

    def token_flops(self, context: int) -> float:
        """One token's FLOPs beyond the projections: attention over ``context`` positions, the
        DeltaNet recurrence and its short convolution."""
        attn = self.full_layers * 4 * context * self.heads * self.head_dim
        delta = self.linear_layers * (6 * self.value_heads * self.key_dim * self.value_dim
                                      + 2 * self.conv_channels * self.conv_kernel)
        return attn + delta


def qwen_forward_cost(d: QwenDims, rows: int, new_tokens: int, cached: int, dtype: torch.dtype,
                      logits_rows: int | None = None, shared: int = 0) -> Cost:
    """``rows`` rows each running ``new_tokens`` tokens after ``cached`` cached positions, with
    the full-vocabulary LM head on ``logits_rows`` positions (default one a row; 0 for
    score-only steps, whose few candidate rows of the head are not counted). ``shared`` of the
    cached positions are one prefix's, the same in every row: their keys and values are counted
    once (the least a step must read), not once a row."""
    b = dtype_bytes(dtype)
    logits_rows = rows if logits_rows is None else logits_rows
    proj = 2 * d.layer_params * rows * new_tokens + 2 * d.hidden * d.vocab * logits_rows
    extra = rows * sum(d.token_flops(cached + i + 1) for i in range(new_tokens))
    weights = (d.layer_params + (d.hidden * d.vocab if logits_rows else 0)) * b
    columns = shared + rows * (cached - shared + new_tokens)
    kv = d.full_layers * 2 * d.kv_heads * d.head_dim * columns * b
    state = rows * d.recurrent_state_elements * 4 * 2  # float32 state, read and written
    return Cost(proj + extra, weights + kv + state)


# -- vision tower and its preprocessing -----------------------------------------------------------
@dataclass(frozen=True)
class VisionDims:
    hidden: int
    ff: int
    depth: int
    patch_dim: int  # channels x temporal x patch x patch
    merge: int
    out_hidden: int

    @classmethod
    def from_config(cls, cfg: dict) -> "VisionDims":
        v = cfg["vision_config"]
        patch_dim = v.get("in_channels", 3) * v.get("temporal_patch_size", 2) * v["patch_size"] ** 2
        return cls(v["hidden_size"], v["intermediate_size"], v["depth"], patch_dim,
                   v.get("spatial_merge_size", 2), v.get("out_hidden_size", v["hidden_size"]))


def vision_cost(d: VisionDims, patches_per_image: list[int], dtype: torch.dtype) -> Cost:
    """The tower over images of ``patches_per_image`` patches: patch embedding, ``depth``
    blocks (attention within each image), the patch merger."""
    n = sum(patches_per_image)
    merged = d.hidden * d.merge ** 2
    per_patch = d.patch_dim * d.hidden + d.depth * (4 * d.hidden ** 2 + 2 * d.hidden * d.ff)
    per_merged = merged * merged + merged * d.out_hidden
    proj = 2 * (per_patch * n + per_merged * n // d.merge ** 2)
    attn = d.depth * sum(4 * p * p * d.hidden for p in patches_per_image)
    weights = (per_patch + per_merged) * dtype_bytes(dtype)
    return Cost(proj + attn, weights)


def crop_encode_cost(crop_pixels: int, channels: int, patches: int, patch_dim: int) -> Cost:
    """Crop, resize, normalize and patchify: memory-bound; the uint8 crop regions read and the
    float32 patch rows written (the resampling's few FLOPs a pixel are not counted)."""
    return Cost(0.0, crop_pixels * channels + patches * patch_dim * 4)


# -- measured peaks ---------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    """Waits for the device's queued work (CUDA); nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], device: torch.device, repeats: int, min_seconds: float = 0.0) -> float:
    """Median wall seconds of ``fn()`` after one warm-up call; each sample repeats ``fn`` until
    it has run ``min_seconds`` (so fast calls are not timed at the clock's resolution)."""
    fn()
    sync(device)
    samples = []
    for _ in range(repeats):
        calls, start = 0, time.perf_counter()
        while True:
            fn()
            calls += 1
            sync(device)
            spent = time.perf_counter() - start
            if spent >= min_seconds:
                break
        samples.append(spent / calls)
    return statistics.median(samples)


def _plain(w: torch.Tensor) -> Callable:
    return lambda x: F.linear(x, w)


def _cublas(w: torch.Tensor) -> Callable:
    wt = w.t()
    return lambda x: torch.mm(x, wt)


def _onednn_packed(w: torch.Tensor) -> Callable:
    packed = dense.pack(w)
    return lambda x: dense.packed_linear(x, packed)


def _onednn_tensors(w: torch.Tensor) -> Callable:
    wm = w.to_mkldnn()
    return lambda x: torch._C._nn.mkldnn_linear(x.to_mkldnn(), wm, None).to_dense()


def _engine_panels(w: torch.Tensor) -> Callable:
    panels = dense.pack_panels(w)
    return lambda x: dense.engine_linear(x, panels, w.shape[0])


def gemm_paths(device: torch.device, dtype: torch.dtype) -> dict[str, Callable]:
    """Each way of computing ``x @ w.T`` this device offers: name -> ``make(w)`` returning
    ``f(x)`` (the weight prepared once, as a backend would at load)."""
    if device.type == "cuda":
        return {"cuBLAS torch.mm": _cublas, "F.linear": _plain}
    paths = {"F.linear": _plain}
    if dense.packing_available(dtype) and dtype in dense.PACKED_DTYPES:
        paths["oneDNN packed"] = _onednn_packed
    if dense.takes_panels(torch.empty(1, 1, dtype=dtype)):
        paths["engine panels"] = _engine_panels
    # (oneDNN's bfloat16 path needs AVX-512 or AVX-NE-CONVERT)
    if torch.backends.mkldnn.is_available() and (dtype != torch.bfloat16 or dense.packing_available(dtype)):
        paths["oneDNN mkldnn tensors"] = _onednn_tensors
    return paths


def gemm_rate(m: int, k: int, n: int, dtype: torch.dtype, device: torch.device, make: Callable,
              repeats: int = 5) -> float:
    """FLOP/s of ``[m, k] x [k, n]`` through the path ``make`` (from :func:`gemm_paths`)."""
    g = torch.Generator(device="cpu").manual_seed(m * 31 + n)
    x = torch.randn(m, k, generator=g).to(device, dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(device, dtype)
    fn = make(w)
    return 2 * m * k * n / median_seconds(lambda: fn(x), device, repeats, min_seconds=0.05)


def bandwidth(device: torch.device, nbytes: int = 1 << 28, repeats: int = 5) -> dict[str, float]:
    """Bytes/s of a copy (read + write counted) and of a sum (read) of ``nbytes`` of float32."""
    a = torch.ones(nbytes // 4, device=device)
    b = torch.empty_like(a)
    copy = 2 * nbytes / median_seconds(lambda: b.copy_(a), device, repeats)
    total = nbytes / median_seconds(lambda: a.sum(), device, repeats)
    return {"copy": copy, "sum": total}
