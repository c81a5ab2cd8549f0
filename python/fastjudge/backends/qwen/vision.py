"""Images for the Qwen3.5 judge: our vision tower and the multimodal rotary positions.

- ``QwenVision``: the checkpoint's vision tower, our own ``torch.nn.Module`` code
  (:class:`VisionTower`, registered as ``model``, parameters named as the checkpoint's
  ``model.visual.*`` tensors it is loaded from, shapes checked against ``vision_config``). Its
  math is transformers' ``Qwen3_5VisionModel`` (``models/qwen3_5/modeling_qwen3_5.py``), the
  reference ``tests/test_qwen_vision.py`` holds it to in float32: a patch embedding (a Conv3d
  whose kernel is its stride, i.e. a linear over the flattened patch), the learned position grid
  resampled bilinearly to each frame (four taps per patch), a 2-D rotary embedding, pre-LayerNorm
  blocks (fused qkv attention within each frame, an MLP), and a merger of each 2x2 patch block
  into one row of the language model's width. ``encode`` returns those rows, one per
  ``<|image_pad|>`` token (transformers' ``get_image_features().pooler_output``). Qwen3.5 has no
  DeepStack features (Qwen3-VL adds vision features to early decoder layers): a vision config
  asking for them is refused.
- ``QwenVision.encode_images``: many images, each its own ``(pixel_values, grid_thw)``; pixels
  are never concatenated (each image's patch embeddings land in one shared tensor), the frames of
  one grid size attend as one batched call (the engine's on the CPU, else SDPA), everything else
  runs over all patches at once; each grid size's position taps and rotary tables are kept (the
  last :data:`GRID_TABLES`). Every projection is a biased ``Dense``, prepared by the backend:
  oneDNN's packed GEMM, bias and activation in its epilogue (too small to pack: engine panels).

The image tokens and M-RoPE positions of a prompt are ``positions``. Within a frame the patches come merge block by
merge block, row-major inside each block.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch
import torch.nn.functional as F

from ..cpu_engine import attend_all_in_engine, engine_attends, rotate_halves_in_engine
from ..dense import Dense
from ..loading import (
    CheckpointError,
    check_shapes,
    load_state_dict,
    read_config,
    require_ints,
    require_positive,
    resolve_device,
    resolve_dtype,
    shape_from_config,
)

VISION_PREFIX = "model.visual."
GRID_TABLES = 64  # grid sizes whose position taps and rotary tables the tower keeps
NORM_EPS = 1e-6  # the tower's LayerNorms (not in the config)
# the block MLP's hidden_act, by its transformers name: the activation a Dense applies in its
# GEMM's epilogue (dense.ACTIVATIONS), or a function applied after the product
ACTIVATIONS = {
    "gelu_pytorch_tanh": "gelu_new", "gelu_new": "gelu_new", "gelu": "gelu", "silu": "silu", "swish": "silu",
    "relu": "relu", "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


@dataclass(frozen=True)
class VisionShape:
    """The tower's ``vision_config`` (transformers' names and defaults), checked for values no
    model can have (the tensor shapes it implies are those of the :class:`VisionTower` built
    from it)."""

    depth: int = 27
    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0

    @classmethod
    def from_config(cls, cfg: dict) -> "VisionShape":
        return shape_from_config(cls, cfg)

    @classmethod
    def _read(cls, cfg: dict) -> "VisionShape":
        v = cfg.get("vision_config") or {}
        if not v:
            raise CheckpointError("checkpoint has no vision_config (not a multimodal Qwen3.5)")
        if v.get("deepstack_visual_indexes"):
            # Qwen3-VL-style DeepStack (vision features added to early decoder layers) is not
            # part of Qwen3.5 and not implemented here.
            raise CheckpointError("vision_config uses DeepStack features (Qwen3-VL); not supported")
        rope = v.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise CheckpointError(f"vision rope type {rope['rope_type']!r} is not supported (axial only)")
        names = [f for f in cls.__dataclass_fields__ if f != "rope_theta"]
        return cls(**{n: v[n] for n in names if n in v}, rope_theta=rope.get("rope_theta", cls.rope_theta))

    def _validate(self) -> None:
        require_ints({n: getattr(self, n) for n in self.__dataclass_fields__ if n not in ("hidden_act", "rope_theta")})
        require_positive({"vision rope_theta": self.rope_theta})
        if self.hidden_size % self.num_heads or self.head_dim % 4:
            # the rotary embedding gives each axis head_dim / 4 rotated pairs
            raise CheckpointError(f"vision_config: hidden_size {self.hidden_size} / num_heads {self.num_heads} "
                                  "must be a whole multiple of 4")
        if math.isqrt(self.num_position_embeddings) ** 2 != self.num_position_embeddings:
            raise CheckpointError("vision_config: num_position_embeddings must be a square (the position grid)")
        if self.hidden_act not in ACTIVATIONS:
            raise CheckpointError(f"vision_config: unsupported hidden_act {self.hidden_act!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values per patch row: channels x frames x pixels."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2


class Span(NamedTuple):
    """``frames`` consecutive frames of one ``n``-patch grid size, from patch row ``start``, and
    that grid's rotary tables ``[n, 1, 1, head_dim]``."""

    start: int
    frames: int
    n: int
    cos: torch.Tensor
    sin: torch.Tensor


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` [frames, n, ..., head_dim] (element ``i`` paired with ``i +
    head_dim / 2``) in float32, back to ``x``'s dtype: one engine pass on the CPU, same bits."""
    if (done := rotate_halves_in_engine(x, cos, sin)) is not None:
        return done
    xf = x.float()
    half = xf.shape[-1] // 2
    turned = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos + turned * sin).to(x.dtype)


def projection(d_in: int | tuple[int, ...], d_out: int, activation: str | None = None) -> Dense:
    """A biased projection ``[d_out, *d_in]``; its values are the checkpoint's, loaded later."""
    shape = (d_out, *d_in) if isinstance(d_in, tuple) else (d_out, d_in)
    return Dense(torch.empty(shape), bias=torch.empty(d_out), activation=activation, steps=False)


class PatchEmbed(torch.nn.Module):
    """The patch projection: a linear over each flattened patch row (the checkpoint's Conv3d
    weight, kernel == stride, kept in its shape and read as a matrix)."""

    def __init__(self, s: VisionShape):
        super().__init__()
        self.proj = projection((s.in_channels, s.temporal_patch_size, s.patch_size, s.patch_size), s.hidden_size)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:  # [N, patch_dim] -> [N, hidden]
        return self.proj(rows)


class VisionMLP(torch.nn.Module):
    """Two biased projections, the activation in the first one's epilogue where a Dense has it."""

    def __init__(self, d_in: int, d_mid: int, d_out: int, act):
        super().__init__()
        fused = act if isinstance(act, str) else None
        self.linear_fc1, self.linear_fc2 = projection(d_in, d_mid, fused), projection(d_mid, d_out)
        self.act = None if fused else act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear_fc1(x)
        return self.linear_fc2(h if self.act is None else self.act(h))


class VisionAttention(torch.nn.Module):
    """Multi-head self-attention within each frame: one qkv GEMM over all patches, one attention
    call per grid size over its frames, one output GEMM. The attention: on the CPU (eager,
    float32 or bfloat16) the engine's (``cpu_engine.attend_all_in_engine``: each frame's rotated
    queries and keys and its values read in place, the output written as the rows the output
    GEMM reads); elsewhere SDPA over ``[frames, heads, n, head_dim]`` (figures: docs/engine.md,
    "Encoders' attention")."""

    def __init__(self, s: VisionShape):
        super().__init__()
        self.num_heads, self.scaling = s.num_heads, s.head_dim ** -0.5
        self.qkv, self.proj = projection(s.hidden_size, 3 * s.hidden_size), projection(s.hidden_size, s.hidden_size)

    def forward(self, x: torch.Tensor, spans: Sequence[Span]) -> torch.Tensor:
        qkv, outs = self.qkv(x), []
        for sp in spans:
            part = qkv[sp.start: sp.start + sp.frames * sp.n].view(sp.frames, sp.n, 3, self.num_heads, -1)
            turned = rotate(part[:, :, :2], sp.cos, sp.sin)  # [f, n, 2, heads, hd]
            if engine_attends(turned, turned):
                o = torch.empty_like(part[:, :, 2])  # [f, n, heads, hd]
                attend_all_in_engine(turned[:, :, 0], turned[:, :, 1], part[:, :, 2], o, self.scaling)
                outs.append(o.view(sp.frames * sp.n, -1))
                continue
            q, k = turned.transpose(1, 3).unbind(2)  # [f, heads, n, hd]
            o = F.scaled_dot_product_attention(q, k, part[:, :, 2].transpose(1, 2), scale=self.scaling)
            outs.append(o.transpose(1, 2).reshape(sp.frames * sp.n, -1))
        return self.proj(outs[0] if len(outs) == 1 else torch.cat(outs))


class VisionBlock(torch.nn.Module):
    def __init__(self, s: VisionShape):
        super().__init__()
        self.norm1, self.norm2 = (torch.nn.LayerNorm(s.hidden_size, eps=NORM_EPS) for _ in range(2))
        self.attn = VisionAttention(s)
        self.mlp = VisionMLP(s.hidden_size, s.intermediate_size, s.hidden_size, ACTIVATIONS[s.hidden_act])

    def forward(self, x: torch.Tensor, spans: Sequence[Span]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), spans)
        return x + self.mlp(self.norm2(x))


class PatchMerger(VisionMLP):
    """LayerNorm per patch, then each run of ``merge**2`` patches (one merge block) as one row
    through an exact-GELU MLP to the language model's width."""

    def __init__(self, s: VisionShape):
        width = s.hidden_size * s.spatial_merge_size ** 2
        super().__init__(width, width, s.out_hidden_size, "gelu")
        self.norm = torch.nn.LayerNorm(s.hidden_size, eps=NORM_EPS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.norm(x).view(-1, self.linear_fc1.in_features))


class VisionTower(torch.nn.Module):
    """Patch embedding + learned position grid + blocks + merger over a list of images; its
    parameter names are the checkpoint's ``model.visual.*`` names."""

    # how the learned position grid is resampled to a frame's grid (the builders' ONNX export reads these)
    interpolation_mode, interpolation_align_corners = "bilinear", True

    def __init__(self, s: VisionShape):
        super().__init__()
        self.config = s
        self.num_grid_per_side = math.isqrt(s.num_position_embeddings)
        self.patch_embed = PatchEmbed(s)
        self.pos_embed = torch.nn.Embedding(s.num_position_embeddings, s.hidden_size)
        self.blocks = torch.nn.ModuleList(VisionBlock(s) for _ in range(s.depth))
        self.merger = PatchMerger(s)
        self._tables: OrderedDict[tuple[int, int], tuple[torch.Tensor, ...]] = OrderedDict()

    def forward(self, images: Sequence[tuple[torch.Tensor, tuple[int, int, int]]]) -> list[torch.Tensor]:
        """Merged embeddings of each ``(pixel_values [t*h*w, patch_dim], (t, h, w))``, in order."""
        order = sorted(range(len(images)), key=lambda i: images[i][1][1:])  # by grid size, stable
        w0 = self.patch_embed.proj.weight
        x = torch.empty(sum(p.shape[0] for p, _ in images), w0.shape[0], device=w0.device, dtype=w0.dtype)
        groups: list[list] = []  # [(h, w), first row, frames] per grid size
        start = 0
        for i in order:
            pixels, (t, h, w) = images[i]
            # each image's rows embedded apart: the pixels are never concatenated
            x[start: start + pixels.shape[0]] = self.patch_embed(pixels)
            if groups and groups[-1][0] == (h, w):
                groups[-1][2] += t
            else:
                groups.append([(h, w), start, t])
            start += pixels.shape[0]
        spans = []
        for (h, w), first, frames in groups:
            idx, wts, cos, sin = self._grid_tables(h, w)
            pos = (self.pos_embed(idx) * wts[:, :, None]).sum(1)  # one frame's, summed in float32
            x[first: first + frames * h * w].view(frames, h * w, -1).add_(pos.to(x.dtype))
            spans.append(Span(first, frames, h * w, cos, sin))
        for blk in self.blocks:
            x = blk(x, spans)
        unit = self.config.spatial_merge_size ** 2
        parts = self.merger(x).split([images[i][0].shape[0] // unit for i in order])
        out: list[torch.Tensor] = [None] * len(images)  # type: ignore[list-item]
        for i, part in zip(order, parts):
            out[i] = part
        return out

    def patch_coordinates(self, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row and column of each patch of an ``h x w`` frame, in the tower's patch order (merge
        block by merge block, row-major within a block)."""
        m, dev = self.config.spatial_merge_size, self.pos_embed.weight.device
        rows = torch.arange(h, device=dev).view(h // m, 1, m, 1).expand(-1, w // m, -1, m)
        cols = torch.arange(w, device=dev).view(1, w // m, 1, m).expand(h // m, -1, m, -1)
        return rows.flatten(), cols.flatten()

    def rotary(self, rows: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos and sin ``[n, head_dim]`` of patches at ``(rows, cols)``: head_dim / 4
        frequencies per axis, the row angles then the column angles, repeated for both halves."""
        half = self.config.head_dim // 2
        inv_freq = 1.0 / self.config.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float32,
                                                                 device=rows.device) / half)
        angles = torch.cat([rows[:, None].float() * inv_freq, cols[:, None].float() * inv_freq], dim=-1)
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()

    def position_taps(self, rows: torch.Tensor, cols: torch.Tensor, h: int, w: int):
        """``[n, 4]`` indices into the flattened position table and their bilinear weights: the
        ``side x side`` grid resampled to ``h x w`` with corners aligned (edges clamped)."""
        side = self.num_grid_per_side

        def axis(pos: torch.Tensor, size: int):
            src = pos.float() * (side - 1) / max(size - 1, 1)
            low = src.floor()
            frac = src - low
            taps = torch.stack([low, low + 1], dim=-1).long().clamp_(0, side - 1)
            return taps, torch.stack([1 - frac, frac], dim=-1)

        (rt, rw), (ct, cw) = axis(rows, h), axis(cols, w)
        return (rt[:, :, None] * side + ct[:, None, :]).flatten(1), (rw[:, :, None] * cw[:, None, :]).flatten(1)

    def _grid_tables(self, h: int, w: int) -> tuple[torch.Tensor, ...]:
        """Position taps and weights and rotary cos/sin ``[n, 1, 1, head_dim]`` of one ``h x w``
        frame (every frame of that size has the same), the last GRID_TABLES sizes kept."""
        hit = self._tables.pop((h, w), None)
        if hit is None:
            rows, cols = self.patch_coordinates(h, w)
            cos, sin = self.rotary(rows, cols)
            hit = (*self.position_taps(rows, cols, h, w), cos[:, None, None], sin[:, None, None])
            while len(self._tables) >= GRID_TABLES:
                self._tables.popitem(last=False)
        self._tables[(h, w)] = hit
        return hit

    def _apply(self, fn, recurse=True):
        self._tables.clear()  # computed on the old device
        return super()._apply(fn, recurse)


class QwenVision(torch.nn.Module):
    """The checkpoint's vision tower: :class:`VisionTower` registered as ``model`` (its
    parameters are this module's: ``state_dict``, ``.to(device)``, ``register_forward_hook``),
    loaded from the checkpoint's ``model.visual.*`` tensors; ``forward`` is :meth:`encode`."""

    def __init__(self, config: dict, state: dict[str, torch.Tensor], device="cpu", dtype=torch.float32):
        super().__init__()
        shape = VisionShape.from_config(config)
        weights = {k[len(VISION_PREFIX):]: v for k, v in state.items() if k.startswith(VISION_PREFIX)}
        if not weights:
            raise CheckpointError(f"checkpoint lacks vision tensors ({VISION_PREFIX}*)")
        with torch.device("meta"):  # shapes only: no memory, no random init of weights about to be replaced
            tower = VisionTower(shape)
        expected = {k: tuple(v.shape) for k, v in tower.state_dict().items()}
        check_shapes(weights, expected)
        missing, unexpected = expected.keys() - weights.keys(), weights.keys() - expected.keys()
        if missing or unexpected:
            raise CheckpointError(f"vision tensors do not match the vision config: missing {sorted(missing)[:5]}, "
                                  f"unexpected {sorted(unexpected)[:5]}")
        tower.load_state_dict(weights, strict=True, assign=True)
        self.model = tower.requires_grad_(False).to(device=torch.device(device), dtype=dtype).eval()
        self.config, self.spatial_merge_size = shape, shape.spatial_merge_size

    @property
    def device(self) -> torch.device:
        """Where the tower's weights are (images are moved there)."""
        return self.model.patch_embed.proj.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype (images are cast to it)."""
        return self.model.patch_embed.proj.weight.dtype

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        return self.encode(pixel_values, grid_thw)

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike, device: str = "auto", dtype=None,
                        allow_pickle: bool = False) -> "QwenVision":
        dev = resolve_device(device)
        return cls(read_config(model_dir), load_state_dict(model_dir, allow_pickle=allow_pickle), dev,
                   resolve_dtype(dtype, dev))

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Image embeddings ``[N_tokens, hidden]`` (all images, in order) for ``pixel_values``
        ``[patches, C*T*p*p]`` and ``grid_thw [images, 3]`` (the image processor's / our
        ``kernels.crop_encode`` output)."""
        grids = [tuple(g) for g in torch.as_tensor(grid_thw, dtype=torch.long).reshape(-1, 3).tolist()]
        rows = [t * h * w for t, h, w in grids]
        if sum(rows) != pixel_values.shape[0]:
            raise ValueError(f"{pixel_values.shape[0]} patch rows for grids {grids} ({sum(rows)} expected)")
        parts = self.encode_images(list(zip(pixel_values.split(rows), grids)))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    @torch.inference_mode()
    def encode_images(self, images: Sequence[tuple[torch.Tensor, Sequence[int]]]) -> list[torch.Tensor]:
        """Image embeddings ``[tokens_i, hidden]`` of each ``(pixel_values_i, grid_thw_i)`` (one
        image's patch rows and its ``(t, h, w)``), in order, computed together without
        concatenating the pixels."""
        width, merge, items = self.config.patch_dim, self.spatial_merge_size, []
        for pixels, grid in images:
            t, h, w = (int(g) for g in torch.as_tensor(grid).reshape(3).tolist())
            pixels = torch.as_tensor(pixels)
            if tuple(pixels.shape) != (t * h * w, width):
                raise ValueError(f"pixel_values {tuple(pixels.shape)} for grid {(t, h, w)} "
                                 f"(expected {(t * h * w, width)})")
            if min(t, h, w) < 1 or h % merge or w % merge:
                raise ValueError(f"grid {(t, h, w)}: h and w must be positive multiples of {merge}")
            items.append((pixels.to(self.device, self.dtype), (t, h, w)))
        return self.model(items) if items else []
