"""Images and evidence boxes for the image-text judges: loading with clear errors, box checking.

An image may be a path (relative paths resolved against ``root``), encoded bytes, a PIL image or
an ``H x W x 3`` uint8 array. It becomes an RGB ``[3, H, W]`` uint8 tensor plus a content key
(a hash of the pixels), so the same picture given twice is encoded once.

Pixel budget: an image of more than ``max_pixels`` pixels (default :data:`MAX_IMAGE_PIXELS`) is
refused with an ``ImageError`` before it is decoded: the size comes from the file's header, so a
decompression bomb (a small file that claims a huge image) costs nothing. The Qwen processors
downscale every image to at most their ``max_pixels`` (about one megapixel by default) before
the model sees it, so a larger image only costs decoding time and memory. PIL's own bomb limit
(``PIL.Image.MAX_IMAGE_PIXELS``) applies as well, also as an ``ImageError``. Decoded inputs (a
PIL image, an array) are held to the same budget, since preprocessing costs grow with it.

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

# 64 Mi pixels (an 8192 x 8192 image, ~200 MB decoded as RGB): room for 8K frames and most
# camera photos, about 64 times what the Qwen processors' default max_pixels (28 * 28 * 1280)
# passes to the model.
MAX_IMAGE_PIXELS = 1 << 26


class ImageError(ValueError):
    """An image that cannot be used (unreadable, corrupt, over the pixel budget, wrong shape or
    type)."""


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


def check_pixel_budget(width: int, height: int, max_pixels: int) -> None:
    """``ImageError`` for an image of more than ``max_pixels`` pixels."""
    if width * height > max_pixels:
        raise ImageError(f"image is {width}x{height} = {width * height} pixels, above the pixel "
                         f"budget of {max_pixels} (max_image_pixels); not decoded")


def _from_pil(img, max_pixels: int) -> np.ndarray:
    check_pixel_budget(*img.size, max_pixels)  # before load(): the header gave the size
    try:
        img.load()
        return np.asarray(img.convert("RGB"))
    except Exception as bad:  # noqa: BLE001 - any failure to decode one image is that image's error
        raise ImageError(f"corrupt image: {bad}") from None


def _decode(source, where: str, max_pixels: int) -> np.ndarray:
    """Pixels of an encoded image (a path or a file object); ``where`` names it in errors."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(source) as img:
            return _from_pil(img, max_pixels)
    except ImageError:
        raise
    except FileNotFoundError:
        raise ImageError(f"image file not found: {where}") from None
    except Image.DecompressionBombError as bad:
        raise ImageError(f"{where} refused as a decompression bomb: {bad}") from None
    except (UnidentifiedImageError, OSError) as bad:
        raise ImageError(f"unreadable image {where}: {bad}") from None
    except Exception as bad:  # noqa: BLE001 - a decoder failing on odd data fails this image only
        raise ImageError(f"unreadable image {where}: {type(bad).__name__}: {bad}") from None


def read_image(image, root: str | os.PathLike | None = None,
               max_pixels: int = MAX_IMAGE_PIXELS) -> tuple[np.ndarray, bytes]:
    """An example's image as a C-contiguous ``H x W x 3`` uint8 array and its content key (what
    :func:`load_image` keys by), without building the tensor: a caller that already holds an
    encoding for this key needs no pixels. The array may be the caller's own (not copied)."""
    if isinstance(image, (str, os.PathLike)):
        path = os.path.join(root, image) if root is not None and not os.path.isabs(image) else image
        array = _decode(path, str(path), max_pixels)
    elif isinstance(image, (bytes, bytearray, memoryview)):
        array = _decode(io.BytesIO(bytes(image)), "bytes", max_pixels)
    elif isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
            raise ImageError(f"an image array must be H x W x 3 uint8, got {image.shape} {image.dtype}")
        check_pixel_budget(image.shape[1], image.shape[0], max_pixels)
        array = image
    elif hasattr(image, "convert") and hasattr(image, "size"):  # a PIL image
        array = _from_pil(image, max_pixels)
    else:
        raise ImageError(f"unsupported image type {type(image).__name__} (use a path, bytes, a PIL "
                         "image or an H x W x 3 uint8 array)")
    if array.shape[0] == 0 or array.shape[1] == 0:
        raise ImageError(f"image has no pixels ({array.shape[1]} x {array.shape[0]})")
    array = np.ascontiguousarray(array)
    # SHA-256 runs on the CPU's SHA instructions (current x86 and Arm) through OpenSSL: about
    # twice BLAKE2b's speed on a decoded image. Hashed in place (no tobytes copy).
    digest = hashlib.sha256(memoryview(array).cast("B"))
    digest.update(np.asarray(array.shape, dtype=np.int64).tobytes())
    return array, digest.digest()


class RecentImages:
    """:func:`read_image` for the examples of one call, where an image's several captions sit
    next to each other (evaluation sets list them so): the last ``size`` sources are kept with
    their arrays and keys, and a source met again is neither decoded nor hashed again (16 pairs,
    4 captions an image, 448 x 336 arrays: 4 ms of a 42 ms call went to hashing). A source is a
    path (by its string, joined with ``root``) or an array or PIL image (by the object itself,
    held here, so no other object can take its ``id`` meanwhile). A source changed in place or
    on disk while the call runs is not read again; bytes are always read."""

    def __init__(self, root: str | os.PathLike | None = None, max_pixels: int = MAX_IMAGE_PIXELS, size: int = 8):
        self.root, self.max_pixels, self.size = root, max_pixels, size
        self._recent: dict = {}  # source -> (object, array, key), oldest first

    def read(self, image) -> tuple[np.ndarray, bytes]:
        if isinstance(image, (str, os.PathLike)):
            source = ("path", os.fspath(image))
        elif isinstance(image, np.ndarray) or (hasattr(image, "convert") and hasattr(image, "size")):
            source = ("object", id(image))
        else:
            return read_image(image, self.root, self.max_pixels)
        hit = self._recent.get(source)
        if hit is not None and (source[0] == "path" or hit[0] is image):
            return hit[1], hit[2]
        array, key = read_image(image, self.root, self.max_pixels)
        self._recent[source] = (image, array, key)
        if len(self._recent) > self.size:
            del self._recent[next(iter(self._recent))]
        return array, key


def image_tensor(array: np.ndarray) -> torch.Tensor:
    """``[3, H, W]`` uint8 tensor of its own memory (a later change to ``array`` does not reach
    it) from an ``H x W x 3`` array: one transposing copy."""
    return torch.from_numpy(np.array(array.transpose(2, 0, 1), order="C", copy=True))


def load_image(image, root: str | os.PathLike | None = None,
               max_pixels: int = MAX_IMAGE_PIXELS) -> LoadedImage:
    """An example's image as RGB uint8 pixels with a content key; ``ImageError`` says what is
    wrong. ``max_pixels``: the pixel budget (see the module docstring)."""
    array, key = read_image(image, root, max_pixels)
    return LoadedImage(image_tensor(array), key)


def encode_region(loaded: LoadedImage, box: tuple[int, int, int, int], config):
    """One region of an image (the whole image: ``(0, 0, width, height)``) encoded for the vision
    tower as a request ``Image``, keyed by the image's content, the box and the preprocessing.
    ``ImageError`` when the region cannot be preprocessed."""
    from fastjudge.kernels.crop_encode import crop_encode

    from ..runtime.requests import Image

    try:
        pixels, grid = crop_encode(loaded.pixels, torch.tensor([box]), config)
    except (ValueError, RuntimeError) as bad:  # e.g. an aspect ratio the processor refuses
        raise ImageError(f"region {list(box)} cannot be preprocessed: {bad}") from None
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
