"""Linear projections (``x @ W.T``) through the fastest exact GEMM of their device and dtype.

:class:`Dense` holds one projection's weight: a plain ``[out, in]`` tensor (a frozen parameter
named ``weight``) or an :class:`~fastjudge.backends.fp8.Fp8Weight` (a submodule named ``weight``,
applied as before). :func:`prepare_dense`, called once by a backend after loading, picks the
GEMM each one runs:

* CPU, float32, or bfloat16 where the CPU has AVX512-BF16, inputs of up to
  :data:`ENGINE_MAX_ROWS` rows (decoding and few-token steps), and every input where oneDNN has no
  packed copy: the engine's projection kernel (``_engine.dense_product``) on the weight packed
  once into panels of 64 output columns (:func:`pack_panels`), each output its row's dot product
  over the inputs in increasing order (bfloat16: dot products, or AMX tiles where the CPU has
  them; each output rounded once, the bits of ``F.linear``'s oneDNN GEMM up to 32 rows): faster
  than oneDNN's prepacked linear (below) at a decoding step's few rows, where oneDNN's op costs
  ~15 us a call before any work (docs/engine.md has the figures). float32 within 2.4e-6 of
  ``F.linear`` relative to the output's largest value (another summation order).
* CPU, inputs of more rows, weights of at least :data:`PACK_MIN_ELEMENTS`: oneDNN's linear on a
  weight reordered once into its blocked layout
  (``mkldnn._reorder_linear_weight`` then ``mkldnn._linear_pointwise``, the ops inductor's CPU
  weight prepacking emits): 1.2-1.9x ``F.linear`` in float32 (which goes through MKL without
  prepacking), 1.0-2x in bfloat16, identical results in bfloat16. The op has a fixed cost of
  ~15 us per call, so weights below :data:`PACK_MIN_ELEMENTS` take it only for inputs of
  :data:`MANY_ROWS` rows or more, and those below :data:`PACK_MANY_ROWS_MIN_ELEMENTS` (the test
  models' ``64 x 48``) never (the engine runs them where it can).
* CUDA, and everything else: ``F.linear`` (cuBLAS picks its own kernels; nothing to prepare).

A gated projection (``Dense(w, gate=name)``: the gate and up projections of a gated MLP as one
``[2 * inner, in]`` weight, gate rows first; ``name`` one of :data:`ACTIVATIONS`) also has
:meth:`Dense.gated_product`, ``act(gate) * up``. Prepared, its two halves are packed apart and
never write the ``[rows, 2 * inner]`` product or the activation apart: the engine computes each
panel of both halves and writes ``act(gate) * up`` (silu, the tanh GELU as ``g * sigmoid(2 y)``,
relu; the erf GELU takes torch's activation after the engine's two products); oneDNN runs two
linears with fused epilogues (the activation on the gate, times the gate on the up projection).
float32 within 1e-5 of the unfused path; in bfloat16 the gate is no longer rounded before its
activation. In float32 a weight whose activation the engine applies (a gated product's; an
output activation, the vision MLP's tanh GELU) keeps only its panels and runs every row count on
them, the bias and activation applied to each panel in cache: oneDNN's gated pair writes the
gate's product and reads it back, and its tanh-GELU epilogue cost more than its GEMM (AVX2,
2,048-4,096 rows: 0.56-0.81x of oneDNN's time; prompt passes 0.90-0.93x; docs/benchmarks.md).

The packed copies are not parameters or buffers: ``state_dict`` holds ``weight`` alone. Each
costs a copy of the weight in memory, a weight up to two (the engine's panels lie in huge pages
from 2 MiB on: ``cpu_memory``). They are rebuilt after ``.to()`` and ``load_state_dict``, and
bypassed (``F.linear``) when they no longer match the weight's storage or dtype, when the input
needs a gradient, in ``torch.compile``d code (inductor cannot lower the packed op or call the
engine, and compiles ``F.linear``) and under ``torch.jit.trace`` (an ONNX export's graph would
hold the engine's output as a constant).
"""

from __future__ import annotations

import math
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F

from .. import _engine
from .cpu_engine import engine_array
from .cpu_memory import huge_page_empty

# The packed oneDNN linear costs ~15 us a call beyond F.linear's; below about 256 x 512 weights
# F.linear is as fast or faster at every row count measured (1, 16, 256 rows).
PACK_MIN_ELEMENTS = 1 << 17
# Smaller weights down to 256 x 256 are packed too, but take the packed GEMM only for inputs of
# at least MANY_ROWS rows (a prefill): there it is 5-13 % faster in float32 (256 x 256 at 256 and
# 2,048 rows, one thread), while at a decode step's few rows its fixed cost loses.
PACK_MANY_ROWS_MIN_ELEMENTS = 1 << 16
MANY_ROWS = 128
PACKED_DTYPES = (torch.float32, torch.bfloat16)
# inputs of up to this many rows (decoding and few-token steps) take the engine's panels; more
# (prompts) take oneDNN's packed GEMM where the weight has one. float32: in whole models the
# engine took 1.00-1.07 of oneDNN's time on prompts (Qwen prefill 4 x 512, T5 encoder 8 x 490; AVX2,
# split panels) and was 17-22 % faster on decoding steps. bfloat16 on AVX512-BF16 dot products:
# faster up to 16 rows (256 -> 1536: 1 row 39 -> 29 us, 16 rows 68 -> 60 us), mixed at 64; on AMX
# tiles: 0.6-1.0x oneDNN's time at 1-32 rows, 0.7-1.05x at 64 (gated 0.7-0.8x), 1.2-1.3x from 96.
ENGINE_MAX_ROWS = {torch.float32: 256, torch.bfloat16: 64 if _engine.amx_products() else 32}


def packing_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether oneDNN can prepack a ``dtype`` weight here: its bfloat16 reorder refuses CPUs
    without AVX-512 (or AVX-NE-CONVERT), where ``F.linear`` still runs bfloat16."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    return dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def should_pack(weight: torch.Tensor) -> bool:
    """Whether oneDNN's prepacked linear is the faster exact GEMM for this plain weight (at
    least for inputs of :data:`MANY_ROWS` rows, :func:`packed_min_rows`)."""
    return (weight.device.type == "cpu" and weight.dtype in PACKED_DTYPES and weight.dim() == 2
            and weight.numel() >= PACK_MANY_ROWS_MIN_ELEMENTS and packing_available(weight.dtype))


def packed_min_rows(weight: torch.Tensor) -> int:
    """The fewest input rows for which a packed ``weight`` takes the packed GEMM."""
    return 0 if weight.numel() >= PACK_MIN_ELEMENTS else MANY_ROWS


def takes_panels(weight: torch.Tensor) -> bool:
    """Whether the engine's projection kernel runs this plain weight (CPU; float32, or bfloat16
    where the CPU has AVX512-BF16)."""
    return (weight.device.type == "cpu" and weight.dim() == 2
            and (weight.dtype == torch.float32
                 or (weight.dtype == torch.bfloat16 and _engine.bf16_dense_available())))


def pack_panels(weight: torch.Tensor) -> np.ndarray:
    """``weight`` ``[out, in]`` as the engine's panels (a numpy array, as the engine takes them:
    built once, never converted per call): float32 ``[ceil(out / 64), in, 64]``
    (panel ``p`` holds outputs ``64 p ..`` as rows of 64, one per input); bfloat16 ``[ceil(out /
    64), ceil(in / 2), 64]`` 32-bit words, each the weights of two consecutive inputs (the first
    in the low half). Zero past the last output and input."""
    columns = _engine.dense_panel_columns
    out, inputs = weight.shape
    panels = -(-out // columns)
    pairs = weight.dtype == torch.bfloat16
    width = inputs + (inputs % 2 if pairs else 0)
    padded = weight.detach().new_zeros(panels * columns, width)
    padded[:out, :inputs] = weight.detach()
    layout = (padded.view(torch.int32) if pairs else padded).view(panels, columns, -1).transpose(1, 2)
    held = huge_page_empty(tuple(layout.shape), np.int32 if pairs else np.float32)  # read every step
    torch.from_numpy(held).copy_(layout)
    return held


def engine_linear(x: torch.Tensor, panels: np.ndarray, out_features: int, bias: torch.Tensor | None = None,
                  activation: str | None = None) -> torch.Tensor:
    """``act(x @ W.T + bias)`` for any leading shape of ``x`` (CPU, W's dtype) on ``pack_panels(W)``;
    the bias and activation (float32 only; one of :data:`ENGINE_ACTIVATIONS`) in the engine's call."""
    rows = _rows(x)
    out = x.new_empty(rows.shape[0], out_features)
    _engine.dense_product(engine_array(rows), panels, engine_array(out), torch.get_num_threads(),
                          None if bias is None else engine_array(bias),
                          None if activation is None else ENGINE_ACTIVATIONS[activation])
    return out.view(*x.shape[:-1], out_features)


def engine_gated_product(x: torch.Tensor, gate: np.ndarray, up: np.ndarray, activation: str,
                         inner: int) -> torch.Tensor:
    """``act(x @ Wg.T) * (x @ Wu.T)`` on the halves' panels, in one engine call where the engine
    has the activation (``ENGINE_ACTIVATIONS``), else the engine's two products and torch's
    activation."""
    name = ENGINE_ACTIVATIONS.get(activation)
    if name is None:
        return ACTIVATIONS[activation][0](engine_linear(x, gate, inner)).mul_(engine_linear(x, up, inner))
    rows = _rows(x)
    out = x.new_empty(rows.shape[0], inner)
    _engine.gated_dense_product(engine_array(rows), gate, up, engine_array(out), name,
                                torch.get_num_threads())
    return out.view(*x.shape[:-1], inner)


def _rows(x: torch.Tensor) -> torch.Tensor:
    # x as [rows, in] with contiguous rows (a view where its layout allows)
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[out, in]`` reordered into oneDNN's blocked layout for its linear op (no
    batch-size hint: the one layout serves every row count)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None,
                  activation: str | None = None) -> torch.Tensor:
    """``act(x @ W.T + bias)`` for any leading shape of ``x``, on a weight from :func:`pack`: the
    bias and the activation (one of :data:`ACTIVATIONS`) in the GEMM's epilogue."""
    attr, algorithm = ("none", "") if activation is None else ACTIVATIONS[activation][1:]
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, attr, [], algorithm)


# the activations a gated projection applies to its gate: name -> (the torch function, oneDNN's
# post-op and algorithm for the packed GEMM's epilogue)
ACTIVATIONS = {
    "silu": (F.silu, "swish", ""),
    "gelu_new": (partial(F.gelu, approximate="tanh"), "gelu", "tanh"),
    "gelu": (F.gelu, "gelu", "none"),
    "relu": (F.relu, "relu", ""),
}


# the gated activations the engine applies itself: ours -> the engine's name
ENGINE_ACTIVATIONS = {"silu": "silu", "gelu_new": "gelu_tanh", "relu": "relu"}


def packed_gated_product(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(x @ Wg.T) * (x @ Wu.T)`` on the two halves from :func:`pack`, each product with
    its elementwise step fused into oneDNN's epilogue."""
    _, attr, algorithm = ACTIVATIONS[activation]
    g = torch.ops.mkldnn._linear_pointwise(x, gate, None, attr, [], algorithm)
    return torch.ops.mkldnn._linear_pointwise.binary(x, g, up, None, "mul")


def _usable(x: torch.Tensor, weight: torch.Tensor, packed_for) -> bool:
    # the packed copy answers only for the storage and dtype it was made from, and has no
    # autograd formula
    return (packed_for == (weight.data_ptr(), weight.dtype) and x.dtype == weight.dtype
            and not (x.requires_grad and torch.is_grad_enabled()))


_panels_version = 0


def panels_version() -> int:
    """A number that changes whenever any :class:`Dense` packs or drops its engine panels: what
    holds on to panels (``qwen.engine_step``) checks it before each use."""
    return _panels_version


def _panels_changed() -> None:
    global _panels_version
    _panels_version += 1


class Dense(torch.nn.Module):
    """``forward(x) = act(x @ weight.T + bias)``, for ``x`` of any leading shape; with ``gate``
    (a gate/up weight, gate rows first, and the gate's activation) also :meth:`gated_product`.

    ``bias`` (optional, ``[out]``) and ``activation`` (optional, one of :data:`ACTIVATIONS`,
    applied to the output) are fused into oneDNN's packed GEMM as its epilogue, and follow the
    engine's and ``F.linear``'s products as tensor ops; neither goes with ``gate``. A weight of more
    than two dimensions is read as ``[out, in]`` over its flattened trailing dimensions (a
    convolution whose kernel is its stride), and kept in its own shape (the checkpoint's).
    ``prompts=False``: a projection only decoding steps run (a full-vocabulary head), which keeps
    no oneDNN copy where the engine's panels serve it (one copy of a large weight, not two);
    ``steps=False``: one no decoding step runs (the vision tower's, whose inputs are an image's
    patches), which keeps no engine panels where oneDNN's packed copy serves it."""

    def __init__(self, weight: torch.Tensor | torch.nn.Module, gate: str | None = None, prompts: bool = True,
                 bias: torch.Tensor | None = None, activation: str | None = None, steps: bool = True):
        super().__init__()
        if not (prompts or steps):
            raise ValueError("a projection runs prompts, decoding steps or both")
        for name in (gate, activation):
            if name is not None and name not in ACTIVATIONS:
                raise ValueError(f"no activation {name!r} (one of {', '.join(ACTIVATIONS)})")
        if gate is not None and (bias is not None or activation is not None):
            raise ValueError("a gated projection takes no bias or output activation")
        self.gate, self.activation = gate, activation
        self.prompts, self.steps = prompts, steps
        # a module weight is an fp8.Fp8Weight, applied as it is
        if isinstance(weight, torch.nn.Module):
            if bias is not None or activation is not None:
                raise ValueError("an FP8 weight takes no bias or output activation")
            self.weight = weight
        else:
            if weight.dim() < 2:
                raise ValueError(f"Dense wants a [out, in] weight, got shape {tuple(weight.shape)}")
            self.weight = torch.nn.Parameter(weight, requires_grad=False)
        if bias is not None and (bias.dim() != 1 or bias.shape[0] != self.weight.shape[0]):
            raise ValueError(f"bias of shape {tuple(bias.shape)} for {self.weight.shape[0]} outputs")
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self._packed: torch.Tensor | tuple | None = None  # oneDNN's packed weight (halves when gated)
        self._panels: np.ndarray | tuple | None = None  # the engine's panels (halves when gated)
        self._packed_for: tuple | None = None
        self._min_rows = 0
        self.register_load_state_dict_post_hook(_repack_after_load)

    @property
    def in_features(self) -> int:
        return math.prod(self.weight.shape[1:])

    @property
    def matrix(self) -> torch.Tensor:
        """The plain weight as ``[out, in]`` (itself, or a view of a weight of more dims: no op
        on a decoding step's path for the usual 2-D weight)."""
        w = self.weight
        return w if w.dim() == 2 else w.flatten(1)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def path(self) -> str:
        """The GEMMs this projection runs eagerly: ``fp8``, ``engine`` (every input),
        ``engine+onednn-packed`` (the engine up to :data:`ENGINE_MAX_ROWS` rows, oneDNN above),
        ``onednn-packed`` or ``linear``."""
        if isinstance(self.weight, torch.nn.Module):
            return "fp8"
        paths = [name for name, copy in (("engine", self._panels), ("onednn-packed", self._packed)) if copy is not None]
        return "+".join(paths) or "linear"

    @property
    def panels(self) -> np.ndarray | tuple | None:
        """The engine's panels of the weight (:func:`pack_panels`; the gate's and the up
        projection's when gated), or None where the engine does not run this projection."""
        return self._panels

    def prepare(self) -> str:
        """Choose (again) this projection's GEMM for its weight's current device and dtype;
        returns :attr:`path`."""
        _panels_changed()
        self._packed = self._panels = self._packed_for = None
        if isinstance(self.weight, torch.nn.Module):
            return self.path
        w = self.matrix
        # a gated weight packs its halves apart (gated_product), and only those
        if takes_panels(w) and (self.steps or not should_pack(w) or self._panels_serve_prompts(w)):
            self._panels = tuple(pack_panels(half) for half in w.chunk(2)) if self.gate else pack_panels(w)
            self._packed_for = (w.data_ptr(), w.dtype)
        if should_pack(w) and (self.prompts or self._panels is None) and not (
                self._panels is not None and self._panels_serve_prompts(w)):
            self._packed = tuple(pack(half) for half in w.chunk(2)) if self.gate else pack(w)
            self._packed_for = (w.data_ptr(), w.dtype)
            self._min_rows = packed_min_rows(w)
        return self.path

    def _panels_serve_prompts(self, w: torch.Tensor) -> bool:
        # float32, an activation the engine applies: the panels at every row count (docstring)
        return (self.gate or self.activation) in ENGINE_ACTIVATIONS and w.dtype == torch.float32

    def unprepare(self) -> str:
        """Drop the packed copy (``F.linear`` from now on); returns :attr:`path`."""
        _panels_changed()
        self._packed = self._panels = self._packed_for = None
        return self.path

    def _prepared_for_input(self, x: torch.Tensor) -> str | None:
        """Which prepared GEMM runs ``x`` (``engine`` or ``onednn-packed``), or None (``F.linear``
        / the module weight)."""
        if (self._packed_for is None or torch.compiler.is_compiling() or torch.jit.is_tracing()
                or not _usable(x, self.weight, self._packed_for)):
            return None
        rows = x.numel() // max(x.shape[-1], 1)
        if self._panels is not None and (rows <= ENGINE_MAX_ROWS[x.dtype] or self._packed is None):
            return "engine"
        return "onednn-packed" if self._packed is not None and rows >= self._min_rows else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, torch.nn.Module):
            return self.weight(x)
        w = self.matrix
        how = self._prepared_for_input(x)
        if how is None:
            return self._activate(F.linear(x, w, self.bias))
        if how == "engine":
            if self.gate:
                return torch.cat([engine_linear(x, panels, w.shape[0] // 2) for panels in self._panels], dim=-1)
            f32 = x.dtype == torch.float32  # the engine's bias and activation are float32's
            fused = self.activation if f32 and self.activation in ENGINE_ACTIVATIONS else None
            y = engine_linear(x, self._panels, w.shape[0], self.bias if f32 else None, fused)
            y = y if f32 or self.bias is None else y.add_(self.bias)
            return y if fused is not None else self._activate(y)
        if self.gate:
            return torch.cat([packed_linear(x, half) for half in self._packed], dim=-1)
        return packed_linear(x, self._packed, self.bias, self.activation)

    def _activate(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.activation is None else ACTIVATIONS[self.activation][0](y)

    def gated_product(self, x: torch.Tensor) -> torch.Tensor:
        """``act(gate) * up`` of ``x`` (``[rows, inner]``) through a gated weight."""
        if self.gate is None:
            raise ValueError("gated_product needs a Dense built with gate=<activation>")
        how = None if isinstance(self.weight, torch.nn.Module) else self._prepared_for_input(x)
        if how == "engine":
            return engine_gated_product(x, *self._panels, self.gate, self.weight.shape[0] // 2)
        if how is not None:
            return packed_gated_product(x, *self._packed, self.gate)
        gate, up = self(x).chunk(2, dim=-1)
        return ACTIVATIONS[self.gate][0](gate).mul_(up)  # in place: no extra [rows, inner] buffer

    def _apply(self, fn, recurse=True):
        # .to() / .cuda() / .bfloat16(): the packed copy belongs to the old weight; choose again
        # for the new device and dtype once it has moved
        prepared = self._packed_for is not None
        _panels_changed()
        self._packed = self._panels = self._packed_for = None
        super()._apply(fn, recurse)
        if prepared:
            self.prepare()
        return self

    def extra_repr(self) -> str:
        named = (("bias", self.bias is not None), ("activation", self.activation))
        extra = "".join(f", {k}={v}" for k, v in named if v)
        return f"in_features={self.in_features}, out_features={self.out_features}{extra}, path={self.path}"


def _repack_after_load(module: Dense, _incompatible) -> None:
    # load_state_dict copies into the weight in place: same storage, new values
    if module._packed_for is not None:
        module.prepare()


def prepare_dense(root: torch.nn.Module, enabled: bool = True) -> dict[str, int]:
    """Choose the GEMM of every :class:`Dense` under ``root`` (a backend calls it once after
    loading; call it again after changing weights in place); returns how many took each path.
    ``enabled=False`` drops every packed copy instead (all plain weights on ``F.linear``: the
    path before preparation, for comparisons)."""
    counts: dict[str, int] = {}
    for module in root.modules():
        if isinstance(module, Dense):
            path = module.prepare() if enabled else module.unprepare()
            counts[path] = counts.get(path, 0) + 1
    return counts
