"""ONNX export of the Qwen3.5 vision tower (for a TensorRT or ONNX Runtime vision encoder).

The graph is the tower's tensor math only; everything that depends on the images' grid sizes
(data-dependent loops in transformers' forward) is computed on the host by
:func:`vision_inputs` and fed in, so one graph serves any number of images of any size.

Inputs (``N`` = total patches of all images, dynamic axis ``patches``):

* ``pixel_values`` float ``[N, C*T*p*p]``: the image processor's / ``kernels.crop_encode``'s
  patches;
* ``pos_indices`` int64 ``[N, 4]`` and ``pos_weights`` float ``[N, 4]``: bilinear taps into the
  learned position-embedding grid (transformers' ``get_vision_interpolation_indices_and_weights``);
* ``rope_positions`` int64 ``[N, 2]``: (row, column) of each patch for the 2-D rotary embedding;
* ``segment_ids`` int64 ``[N]``: which image (frame) each patch belongs to; attention stays
  within a segment, as transformers' per-image attention does.

Output: ``image_embeds`` float ``[N / merge**2, out_hidden]`` (dynamic axis ``tokens``), the rows
that replace the ``<|image_pad|>`` tokens -- ``QwenVision.encode``'s output.

Opset 18 by default (``--onnx-opset``). Exported with the TorchScript-based exporter
(``torch.onnx.export(..., dynamo=False)``) and ``dynamic_axes``; checked with
``onnx.checker.check_model`` and, when ONNX Runtime is installed, against ``QwenVision.encode``.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from . import DEFAULT_ONNX_OPSET as DEFAULT_OPSET

INPUT_NAMES = ["pixel_values", "pos_indices", "pos_weights", "rope_positions", "segment_ids"]
OUTPUT_NAMES = ["image_embeds"]
DYNAMIC_AXES = {"pixel_values": {0: "patches"}, "pos_indices": {0: "patches"}, "pos_weights": {0: "patches"},
                "rope_positions": {0: "patches"}, "segment_ids": {0: "patches"}, "image_embeds": {0: "tokens"}}


class VisionGraph(torch.nn.Module):
    """Our vision tower (``QwenVision.model``) as a graph of host-computed index inputs: the same
    modules and weights, attention over all patches with a same-segment mask."""

    def __init__(self, visual):
        super().__init__()
        self.visual = visual

    def forward(self, pixel_values, pos_indices, pos_weights, rope_positions, segment_ids):
        from fastjudge.backends.qwen.vision import rotate

        v = self.visual
        h = v.patch_embed(pixel_values)
        h = h + (v.pos_embed(pos_indices) * pos_weights[:, :, None]).sum(1).to(h.dtype)
        cos, sin = (c[:, None] for c in v.rotary(rope_positions[:, 0], rope_positions[:, 1]))
        same = segment_ids[:, None] == segment_ids[None, :]
        n = h.shape[0]
        for blk in v.blocks:
            a = blk.attn
            q, k, val = a.qkv(blk.norm1(h)).reshape(n, 3, a.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), val.transpose(0, 1),
                                               attn_mask=same, scale=a.scaling)
            h = h + a.proj(o.transpose(0, 1).reshape(n, -1))
            h = h + blk.mlp(blk.norm2(h))
        return v.merger(h)


def _grid_index_helpers():
    """transformers' vision index helpers where this transformers has them (``vision_utils``
    arrived after 5.5), else the equivalents below: the export must not need one release."""
    try:
        from transformers.vision_utils import (
            get_vision_cu_seqlens,
            get_vision_interpolation_indices_and_weights,
            get_vision_position_ids,
        )
    except ImportError:
        return _cu_seqlens, _interpolation_taps, _rope_positions
    return get_vision_cu_seqlens, get_vision_interpolation_indices_and_weights, get_vision_position_ids


def _cu_seqlens(grid: torch.Tensor) -> torch.Tensor:
    """Segment boundaries: every frame (h * w patches) attends only to itself."""
    per_frame = torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0])
    return torch.cat([per_frame.new_zeros(1), per_frame.cumsum(0)]).to(torch.int32)


def _merge_order(h: int, w: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of each patch of an h x w frame, listed merge-block by merge-block (the
    order the vision tower emits patches in)."""
    rows = torch.arange(h)[:, None].expand(h, w)
    cols = torch.arange(w)[None, :].expand(h, w)
    shape = (h // merge, merge, w // merge, merge)
    return (rows.reshape(shape).transpose(1, 2).flatten(), cols.reshape(shape).transpose(1, 2).flatten())


def _rope_positions(grid: torch.Tensor, merge: int) -> torch.Tensor:
    """``[patches, 2]`` (row, column) rotary positions, repeated for every frame."""
    parts = []
    for t, h, w in grid.tolist():
        rows, cols = _merge_order(h, w, merge)
        parts.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
    return torch.cat(parts)


def _bilinear_axis(pos: torch.Tensor, size: int, side: int, align_corners: bool):
    """Two source taps and weights on one axis for resampling ``side`` table entries to ``size``."""
    pos = pos.float()
    if align_corners:
        src = pos * (side - 1) / max(size - 1, 1)
    else:
        src = (pos + 0.5) * side / size - 0.5
    low = torch.floor(src)
    frac = src - low
    taps = torch.stack([low, low + 1], dim=-1).long().clamp(0, side - 1)
    return taps, torch.stack([1 - frac, frac], dim=-1)


def _interpolation_taps(grid: torch.Tensor, num_grid_per_side: int, mode: str = "bilinear",
                        align_corners: bool = False, spatial_merge_size: int = 1):
    """``[patches, 4]`` indices into the flattened position-embedding table and their bilinear
    weights, patches in merge-block order."""
    if mode != "bilinear":
        raise ValueError(f"the vision export supports bilinear position interpolation, not {mode!r}")
    side = num_grid_per_side
    indices, weights = [], []
    for t, h, w in grid.tolist():
        rows, cols = _merge_order(h, w, spatial_merge_size)
        rt, rw = _bilinear_axis(rows, h, side, align_corners)
        ct, cw = _bilinear_axis(cols, w, side, align_corners)
        indices.append((rt[:, :, None] * side + ct[:, None, :]).reshape(-1, 4).repeat(t, 1))
        weights.append((rw[:, :, None] * cw[:, None, :]).reshape(-1, 4).repeat(t, 1))
    return torch.cat(indices), torch.cat(weights)


def vision_inputs(visual, grid_thw: torch.Tensor) -> dict[str, torch.Tensor]:
    """The index inputs of :class:`VisionGraph` for images of ``grid_thw`` ``[images, 3]``."""
    get_vision_cu_seqlens, get_vision_interpolation_indices_and_weights, get_vision_position_ids = \
        _grid_index_helpers()
    grid = torch.as_tensor(grid_thw, dtype=torch.long).reshape(-1, 3)
    merge = visual.config.spatial_merge_size
    idx, wts = get_vision_interpolation_indices_and_weights(
        grid, num_grid_per_side=visual.num_grid_per_side, mode=visual.interpolation_mode,
        align_corners=visual.interpolation_align_corners, spatial_merge_size=merge)
    cu = get_vision_cu_seqlens(grid).long()
    seg = torch.repeat_interleave(torch.arange(len(cu) - 1), cu[1:] - cu[:-1])
    return {"pos_indices": idx.long(), "pos_weights": wts.float(),
            "rope_positions": get_vision_position_ids(grid, merge).long(), "segment_ids": seg}


def export_vision_onnx(model_dir: str | os.PathLike, out_path: str | os.PathLike, opset: int = DEFAULT_OPSET,
                       sample_grid=(1, 4, 6)) -> dict:
    """Export the checkpoint's vision tower (float32) to ``out_path``; returns a description
    (opset, inputs, dynamic axes, checks) that the builder records and writes next to it."""
    import onnx

    from fastjudge.backends.qwen.vision import QwenVision

    vision = QwenVision.from_pretrained(model_dir, device="cpu", dtype=torch.float32)
    graph = VisionGraph(vision.model).eval()
    grid = torch.tensor([sample_grid])
    cfg = vision.config
    dim = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
    pixels = torch.randn(int(grid.prod()), dim, generator=torch.Generator().manual_seed(0))
    inputs = {"pixel_values": pixels, **vision_inputs(vision.model, grid)}
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("ignore")
        torch.onnx.export(graph, tuple(inputs[n] for n in INPUT_NAMES), str(out_path), input_names=INPUT_NAMES,
                          output_names=OUTPUT_NAMES, dynamic_axes=DYNAMIC_AXES, opset_version=opset,
                          dynamo=False)
    onnx.checker.check_model(str(out_path), full_check=True)
    info = {"file": out_path.name, "opset": opset, "exporter": "torch.onnx.export (TorchScript, dynamic_axes)",
            "inputs": {n: {"shape": list(DYNAMIC_AXES[n].values())[:1] + list(inputs[n].shape[1:]),
                           "dtype": str(inputs[n].dtype).replace("torch.", "")} for n in INPUT_NAMES},
            "outputs": {"image_embeds": {"shape": ["tokens", int(cfg.out_hidden_size)], "dtype": "float32"}},
            "dynamic_axes": DYNAMIC_AXES, "spatial_merge_size": int(cfg.spatial_merge_size),
            "onnx_checker": "passed", "host_inputs": "builders.vision_onnx.vision_inputs(grid_thw)"}
    info["onnxruntime_check"] = check_with_onnxruntime(out_path, vision)
    (out_path.with_suffix(".json")).write_text(json.dumps(info, indent=2))
    return info


def check_with_onnxruntime(path: Path, vision, grids=((1, 4, 6), (1, 6, 4), (1, 2, 2))) -> dict | None:
    """Max |ONNX Runtime - QwenVision.encode| on random patches of several images of different
    sizes in one call (None when ONNX Runtime is not installed)."""
    try:
        import onnxruntime as ort
    except ImportError:
        return None
    cfg = vision.config
    grid = torch.tensor(grids)
    dim = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
    pixels = torch.randn(int(grid.prod(1).sum()), dim, generator=torch.Generator().manual_seed(1))
    feeds = {"pixel_values": pixels, **vision_inputs(vision.model, grid)}
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = torch.from_numpy(session.run(None, {k: v.numpy() for k, v in feeds.items()})[0])
    ref = vision.encode(pixels, grid).float()
    return {"grids": [list(g) for g in grids], "max_abs_diff": float((got - ref).abs().max()),
            "max_abs_ref": float(ref.abs().max())}
