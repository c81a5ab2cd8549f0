"""Images and evidence boxes for the image-text judges: loading with clear errors, box checking.

An image may be a path (relative paths resolved against ``root``), encoded bytes, a PIL image or
an ``H x W x 3`` uint8 array. It becomes an RGB ``[3, H, W]`` uint8 tensor plus a content key
(a hash of the pixels), so the same picture given twice is encoded once.

Box policy (documented in the README): boxes are ``(x0, y0, x1, y1)`` pixels. A box that reaches
outside the image is clipped to it, with a warning; a box with no area (inside the image after
clipping) is dropped, with a warning; a box that is not four finite numbers makes the item an
error. Fractional coordinates are widened to whole pixels (floor of x0/y0, ceiling of x1/y1).
"""

from __future__ import annotations

import hashlib
import io
import math
import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch


class ImageError(ValueError):
    """An image that cannot be used (unreadable, corrupt, wrong shape or type)."""


@dataclass(frozen=True)
class LoadedImage:
    pixels: torch.Tensor  # [3, H, W] uint8
    key: bytes  # content hash

    @property
    def height(self) -> int:
        return int(self.pixels.shape[1])

    @property
    def width(self) -> int:
        return int(self.pixels.shape[2])


def _from_pil(img) -> np.ndarray:
    try:
        img.load()
        return np.asarray(img.convert("RGB"))
    except (OSError, ValueError) as bad:  # truncated or corrupt data surfaces on load
        raise ImageError(f"corrupt image: {bad}") from None


def load_image(image, root: str | os.PathLike | None = None) -> LoadedImage:
    """An example's image as RGB uint8 pixels with a content key; ``ImageError`` says what is
    wrong."""
    if isinstance(image, (str, os.PathLike)):
        from PIL import Image, UnidentifiedImageError

        path = os.path.join(root, image) if root is not None and not os.path.isabs(image) else image
        try:
            with Image.open(path) as img:
                array = _from_pil(img)
        except FileNotFoundError:
            raise ImageError(f"image file not found: {path}") from None
        except (UnidentifiedImageError, OSError) as bad:
            raise ImageError(f"unreadable image {path}: {bad}") from None
    elif isinstance(image, (bytes, bytearray, memoryview)):
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(io.BytesIO(bytes(image))) as img:
                array = _from_pil(img)
        except (UnidentifiedImageError, OSError) as bad:
            raise ImageError(f"unreadable image bytes: {bad}") from None
    elif isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
            raise ImageError(f"an image array must be H x W x 3 uint8, got {image.shape} {image.dtype}")
        array = image
    elif hasattr(image, "convert") and hasattr(image, "size"):  # a PIL image
        array = _from_pil(image)
    else:
        raise ImageError(f"unsupported image type {type(image).__name__} (use a path, bytes, a PIL "
                         "image or an H x W x 3 uint8 array)")
    if array.shape[0] == 0 or array.shape[1] == 0:
        raise ImageError(f"image has no pixels ({array.shape[1]} x {array.shape[0]})")
    array = np.ascontiguousarray(array)
    digest = hashlib.blake2b(array.tobytes(), digest_size=16)
    digest.update(np.asarray(array.shape, dtype=np.int64).tobytes())
    return LoadedImage(torch.from_numpy(array.copy() if not array.flags.writeable else array).permute(2, 0, 1).contiguous(), digest.digest())


def encode_region(loaded: LoadedImage, box: tuple[int, int, int, int], config):
    """One region of an image (the whole image: ``(0, 0, width, height)``) encoded for the vision
    tower as a request ``Image``, keyed by the image's content, the box and the preprocessing."""
    from fastjudge.kernels.crop_encode import crop_encode

    from ..runtime.requests import Image

    pixels, grid = crop_encode(loaded.pixels, torch.tensor([box]), config)
    key = loaded.key + np.asarray(box, dtype=np.int64).tobytes() + repr(config).encode()
    return Image(pixels, tuple(int(v) for v in grid[0]), key)


def check_boxes(boxes: Sequence | None, width: int, height: int) -> tuple[list[tuple[int, int, int, int]], list[str]]:
    """Boxes as whole-pixel ``(x0, y0, x1, y1)`` inside the image, and warnings for what was
    clipped or dropped (see the module docstring). ``ImageError`` for malformed boxes."""
    if boxes is None:
        return [], []
    if isinstance(boxes, (str, bytes)) or not isinstance(boxes, Sequence):
        raise ImageError("boxes must be a list of [x0, y0, x1, y1]")
    kept, warnings = [], []
    for i, box in enumerate(boxes, start=1):
        try:
            coords = [float(v) for v in box]
        except (TypeError, ValueError):
            raise ImageError(f"box {i} is not four numbers: {box!r}") from None
        if len(coords) != 4 or not all(math.isfinite(v) for v in coords):
            raise ImageError(f"box {i} is not four finite numbers: {box!r}")
        x0, y0, x1, y1 = math.floor(coords[0]), math.floor(coords[1]), math.ceil(coords[2]), math.ceil(coords[3])
        clipped = (max(0, min(x0, width)), max(0, min(y0, height)), max(0, min(x1, width)), max(0, min(y1, height)))
        if clipped[2] <= clipped[0] or clipped[3] <= clipped[1]:
            warnings.append(f"box {i} {list(box)} has no area inside the {width}x{height} image; dropped")
            continue
        if clipped != (x0, y0, x1, y1):
            warnings.append(f"box {i} {list(box)} reaches outside the {width}x{height} image; "
                            f"clipped to {list(clipped)}")
        kept.append(clipped)
    return kept, warnings


def grid_boxes(width: int, height: int) -> list[tuple[int, int, int, int]]:
    """The deterministic fallback candidates: the image's four quadrants (left to right, top to
    bottom). A side of one pixel is not split."""
    xs = [0, width // 2, width] if width > 1 else [0, width]
    ys = [0, height // 2, height] if height > 1 else [0, height]
    return [(xs[i], ys[j], xs[i + 1], ys[j + 1]) for j in range(len(ys) - 1) for i in range(len(xs) - 1)]


def relative_to_pixels(box: Sequence[int], width: int, height: int, scale: int = 1000) -> tuple[float, ...]:
    """A box in 0..``scale`` relative coordinates (Qwen grounding output) as pixels, corners
    ordered."""
    x0, y0, x1, y1 = (float(v) for v in box)
    x0, x1 = sorted((x0, x1))
    y0, y1 = sorted((y0, y1))
    return (x0 * width / scale, y0 * height / scale, x1 * width / scale, y1 * height / scale)
