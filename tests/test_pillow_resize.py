"""Whole images are preprocessed pixel for pixel as the references do, for every size.

* VQAScore (t2v_metrics' Qwen3-VL / Qwen3.5 model): qwen-vl-utils' ``fetch_image`` resizes the
  image with Pillow (``Image.resize``, bicubic), then the image processor runs without
  resizing (``do_resize=False``).
* VisExMEM: the checkpoint's image processor (transformers'
  ``Qwen2VLImageProcessorPil``, which resizes with Pillow too).

Pillow 13 runs the height pass first for some sizes (``pillow_height_first``); the sizes below
take each order, wide and tall, shrinking and growing, and are checked against Pillow's own
output. The host path resamples with Pillow itself (exact); the torch reference and the Triton
kernel (float32 weights) follow Pillow's pass order and stay within two uint8 steps of it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from fastjudge.kernels import crop_encode as ce

# (width, height) -> (out width, out height): each pass order, both aspect ratios, up and down
SIZES = [
    ((500, 375), (504, 364)),   # wide, height shrinks, width grows: height first (Pillow 13)
    ((640, 480), (644, 476)),   # wide, height first
    ((999, 600), (1008, 588)),  # wide, height first
    ((375, 500), (364, 504)),   # tall, width shrinks: width first
    ((300, 1000), (180, 500)),  # tall, both shrink, height by more than twice: height first
    ((1000, 300), (500, 180)),  # wide, both shrink: width first
    ((100, 50), (300, 140)),    # wide, both grow: width first
    ((50, 100), (140, 300)),    # tall, both grow: width first
    ((285, 198), (258, 144)),   # height shrinks exactly twice the width's loss: width first
    ((284, 198), (258, 144)),   # one pixel more of width loss... still width first
    ((285, 199), (258, 144)),   # one pixel more of height loss: height first
    ((120, 40), (96, 64)),      # height grows: width first
]


def _noise(w: int, h: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _pillow_order(array: np.ndarray, out: tuple[int, int], resample=Image.BICUBIC) -> str:
    """The pass order Pillow took, read from its output: a one-axis resize has no order, so
    width-then-height and height-then-width are both Pillow's own passes."""
    img = Image.fromarray(array)
    (w, h), (ow, oh) = img.size, out
    full = np.asarray(img.resize(out, resample))
    width_first = np.asarray(img.resize((ow, h), resample).resize(out, resample))
    height_first = np.asarray(img.resize((w, oh), resample).resize(out, resample))
    if np.array_equal(full, width_first) and not np.array_equal(full, height_first):
        return "width"
    if np.array_equal(full, height_first) and not np.array_equal(full, width_first):
        return "height"
    return "either"


@pytest.mark.parametrize("size, out", SIZES)
def test_pass_order_rule_is_pillows(size, out):
    order = _pillow_order(_noise(*size), out)
    assert order != "either"  # noise tells the orders apart
    assert ce.pillow_height_first(*size, *out) == (order == "height")


def test_pass_order_rule_on_random_sizes():
    rng = np.random.default_rng(1)
    for resample in (Image.BICUBIC, Image.BILINEAR):
        for w, h, ow, oh in rng.integers(4, 320, (60, 4)).tolist():
            order = _pillow_order(_noise(w, h, w * h), (ow, oh), resample)
            if order != "either":
                assert ce.pillow_height_first(w, h, ow, oh) == (order == "height"), (w, h, ow, oh)


def test_older_pillow_goes_width_first():
    assert ce.pillow_height_first(500, 375, 504, 364, version=(13, 0))
    assert not ce.pillow_height_first(500, 375, 504, 364, version=(12, 3))


# Whole images (width, height, processor min_pixels, max_pixels) and the size the processor's
# smart_resize gives them with patch 2, merge 2 (factor 4): each order, wide and tall, growing
# and shrinking.
WHOLE = [
    ((502, 373), 16, 10**8, (504, 372), "height"),     # wide; height shrinks, width grows
    ((643, 481), 16, 10**8, (644, 480), "height"),     # wide
    ((373, 502), 16, 10**8, (372, 504), "width"),      # tall; width shrinks, height grows
    ((150, 301), 16, 10**8, (152, 300), "height"),     # tall
    ((1000, 300), 16, 90000, (544, 164), "width"),     # wide, both shrink
    ((300, 1000), 16, 90000, (164, 544), "height"),    # tall, both shrink
    ((800, 600), 16, 200000, (516, 384), "width"),     # wide, both shrink
    ((101, 51), 42000, 10**8, (292, 148), "width"),    # wide, both grow
    ((51, 101), 42000, 10**8, (148, 292), "width"),    # tall, both grow
]


def _case_config(min_pixels: int, max_pixels: int) -> ce.CropEncodeConfig:
    return ce.CropEncodeConfig(patch_size=2, merge_size=2, temporal_patch_size=2,
                               min_pixels=min_pixels, max_pixels=max_pixels,
                               image_mean=(0.5,) * 3, image_std=(0.5,) * 3)


def _whole(array: np.ndarray, cfg: ce.CropEncodeConfig, impl: str = "auto") -> tuple[torch.Tensor, tuple]:
    h, w = array.shape[:2]
    pixels = torch.from_numpy(array).permute(2, 0, 1).contiguous()
    values, grid = ce.crop_encode(pixels, [[0, 0, w, h]], cfg, impl=impl)
    return values, tuple(grid[0].tolist())


@pytest.mark.parametrize("size, lo, hi, out, order", WHOLE)
def test_cases_take_the_stated_order(size, lo, hi, out, order):
    oh, ow = ce.smart_resize(size[1], size[0], 4, lo, hi)
    assert (ow, oh) == out
    assert _pillow_order(_noise(*size), out) == order


def _processor(cfg: ce.CropEncodeConfig, **overrides):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        patch_size=cfg.patch_size, merge_size=cfg.merge_size,
        temporal_patch_size=cfg.temporal_patch_size, image_mean=list(cfg.image_mean),
        image_std=list(cfg.image_std),
        size={"shortest_edge": cfg.min_pixels, "longest_edge": cfg.max_pixels}, **overrides)


def _assert_same_pixels(got: torch.Tensor, want: torch.Tensor) -> None:
    """The same uint8 pixels under the normalization (mean = std = 0.5): identical integers
    back, and values apart only by float rounding of the normalization itself (the processor
    rescales and normalizes in two steps, ours in one), far below one step (0.0078)."""
    assert torch.equal(torch.round(got * 127.5 + 127.5), torch.round(want * 127.5 + 127.5))
    assert (got - want).abs().max() <= 1e-6


@pytest.mark.parametrize("size, lo, hi, out, order", WHOLE)
def test_vqascore_whole_image_equals_pillow_resize_then_processor(size, lo, hi, out, order):
    """t2v_metrics' path: ``Image.resize`` (qwen-vl-utils' ``fetch_image``), then the processor
    with ``do_resize=False``: the same numbers, exactly."""
    array = _noise(*size, seed=3)
    cfg = _case_config(lo, hi)
    resized = Image.fromarray(array).resize(out, Image.BICUBIC)
    want = _processor(cfg)(images=[resized], do_resize=False, return_tensors="pt")
    got, grid = _whole(array, cfg)
    assert grid == tuple(want["image_grid_thw"][0].tolist())
    _assert_same_pixels(got, want["pixel_values"].float())


@pytest.mark.parametrize("size, lo, hi, out, order", WHOLE)
def test_visexmem_whole_image_equals_the_checkpoints_processor(size, lo, hi, out, order):
    array = _noise(*size, seed=4)
    cfg = _case_config(lo, hi)
    want = _processor(cfg)(images=[Image.fromarray(array)], return_tensors="pt")
    got, grid = _whole(array, cfg)
    assert grid == tuple(want["image_grid_thw"][0].tolist())
    _assert_same_pixels(got, want["pixel_values"].float())


@pytest.mark.parametrize("size, lo, hi, out, order", WHOLE)
def test_torch_reference_follows_pillows_order(size, lo, hi, out, order):
    """The float32-weight reference (the kernel's oracle) within two uint8 steps of Pillow for
    every size, where the other pass order is many steps off."""
    array = _noise(*size, seed=5)
    cfg = _case_config(lo, hi)
    exact, _ = _whole(array, cfg, impl="pillow")
    ours, _ = _whole(array, cfg, impl="torch")
    step = 1 / (255 * 0.5)
    d = (ours - exact).abs()
    assert d.max() <= 2 * step + 1e-6 and d.mean() < 0.01 * step
    img, (w, h) = Image.fromarray(array), size
    first = (w, out[1]) if order == "width" else (out[0], h)  # the other order's first pass
    other = np.asarray(img.resize(first, Image.BICUBIC).resize(out, Image.BICUBIC)).astype(int)
    assert np.abs(other - np.asarray(img.resize(out, Image.BICUBIC)).astype(int)).max() >= 5


def test_float_images_keep_the_torch_reference():
    img = torch.rand(3, 21, 30) * 255
    cfg = _case_config(16, 10**8)
    auto, _ = ce.crop_encode(img, [[0, 0, 30, 20]], cfg)
    assert torch.equal(auto, ce.crop_encode_reference(img, [[0, 0, 30, 20]], cfg)[0])
    with pytest.raises(ValueError, match="Pillow"):
        ce.crop_encode_reference(img, [[0, 0, 30, 20]], cfg, resampler="pillow")
