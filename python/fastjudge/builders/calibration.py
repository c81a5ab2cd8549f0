"""Judge prompts for FP8 calibration and for the agreement check.

FP8 scales are set from the activations the judge will actually see, so calibration runs the
exact prompts fastjudge builds: LAVE prompts (task description, demonstrations, test item; chat
template for decoder-only judges) from a user JSONL in the ``fastjudge lave`` layout, or from the
bundled 40-item sample. A fixed, seeded split keeps part of the items out of calibration; the
agreement report runs on that held-out part only.

For Qwen3.5 vision-language checkpoints, image-caption pairs (JSONL rows ``{"image": path,
"caption": text}``, paths relative to the file) add image+text prompts, so the language model's
activation ranges include image embeddings. The vision tower itself stays in its checkpoint
dtype (it is exported to ONNX instead).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from fastjudge.judges.lave import VQAExample

from . import DEFAULT_HELDOUT_FRACTION

# Yes/no question for image-caption calibration prompts (the holistic judge's kind of question).


@dataclass
class CalibrationSet:
    """Items for calibration and the held-out items for the agreement report."""

    source: str
    calibration: list[VQAExample]
    heldout: list[VQAExample]


def load_examples(path: str | os.PathLike | None = None) -> tuple[list[VQAExample], str]:
    """LAVE items from a JSONL file (``fastjudge lave`` input layout; malformed lines skipped)
    or, without a path, the bundled sample. Returns the items and a description of the source."""
    if path is None:
        from fastjudge.demo import sample_rows

        rows, source = sample_rows(), "bundled sample_vqa.jsonl"
    else:
        from fastjudge.io.jsonl import read_jsonl

        rows = [line.item for line in read_jsonl(path) if line.error is None and isinstance(line.item, dict)]
        source = str(path)
    examples = [VQAExample(question=r.get("question"), references=r.get("references"),
                           prediction=r.get("prediction"), caption=r.get("caption"),
                           id=r.get("id", f"line-{i + 1}")) for i, r in enumerate(rows)]
    if not examples:
        raise ValueError(f"{source}: no calibration items")
    return examples, source


def split_examples(examples: Sequence[VQAExample], source: str, heldout_fraction: float = DEFAULT_HELDOUT_FRACTION,
                   max_calibration: int = 512, max_heldout: int = 256, seed: int = 0) -> CalibrationSet:
    """A seeded random split: ``heldout_fraction`` of the items (at least one when there are two
    or more) are held out of calibration, each part capped."""
    if not 0 <= heldout_fraction < 1:
        raise ValueError("heldout_fraction must be in [0, 1)")
    order = np.random.default_rng(seed).permutation(len(examples))
    n_held = int(round(len(examples) * heldout_fraction))
    if heldout_fraction > 0 and len(examples) > 1:
        n_held = max(1, n_held)
    held = [examples[i] for i in order[:n_held]][:max_heldout]
    calib = [examples[i] for i in order[n_held:]][:max_calibration]
    if not calib:
        raise ValueError(f"{source}: no items left for calibration")
    return CalibrationSet(source=source, calibration=calib, heldout=held)


def judge_prompts(judge, examples: Sequence[VQAExample]) -> list[np.ndarray]:
    """The model input ids the judge builds for ``examples`` (items the judge rejects or that
    exceed the backend's input limit are left out, as the judge would leave them unscored)."""
    prompts = []
    backend = judge.backend
    for example in examples:
        try:
            ids = np.asarray(judge.codec.encode_prompt(judge.build_prompt(example)), dtype=np.int64)
        except (ValueError, TypeError, AttributeError):
            continue
        if 0 < len(ids) <= backend.max_input_tokens:
            prompts.append(ids)
    return prompts


def prompts_sha256(prompts: Sequence[Sequence[int]], extra: Sequence[bytes] = ()) -> str:
    """Content hash of a prompt set (token ids in order, plus e.g. image hashes): the manifest's
    record of exactly what calibration saw."""
    h = hashlib.sha256()
    for p in prompts:
        arr = np.asarray(p, dtype="<i8")
        h.update(len(arr).to_bytes(8, "little"))
        h.update(arr.tobytes())
    for blob in extra:
        h.update(hashlib.sha256(blob).digest())
    return h.hexdigest()


@dataclass
class ImagePrompt:
    """One image-caption calibration prompt for a Qwen3.5 vision-language judge."""

    ids: np.ndarray
    pixel_values: object  # torch.Tensor [patches, patch_dim]
    grid_thw: object  # torch.Tensor [1, 3]
    key: bytes


def load_image_captions(path: str | os.PathLike) -> list[tuple[Path, str]]:
    """``(image path, caption)`` pairs from a JSONL file of ``{"image", "caption"}`` rows; image
    paths are relative to the file's folder."""
    path = Path(path)
    pairs = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not (isinstance(row, dict) and isinstance(row.get("image"), str) and isinstance(row.get("caption"), str)):
            raise ValueError(f"{path}:{n}: expected {{\"image\": path, \"caption\": text}}")
        image = Path(row["image"])
        pairs.append((image if image.is_absolute() else path.parent / image, row["caption"]))
    if not pairs:
        raise ValueError(f"{path}: no image-caption pairs")
    return pairs


def image_prompts(backend, model_dir: str | os.PathLike, pairs: Sequence[tuple[Path, str]]) -> list[ImagePrompt]:
    """The holistic judge's chat prompts (intro, the image, a yes/no question about the caption)
    with the image's pixel values (whole image through the checkpoint's image preprocessing)."""
    import torch
    from PIL import Image as PILImage

    from fastjudge.judges.holistic import holistic_prompt
    from fastjudge.kernels.crop_encode import crop_encode
    from fastjudge.runtime.requests import Image

    config = backend.codec.image_config
    if config is None:
        raise ValueError(f"{model_dir}: image-caption calibration needs a vision-language checkpoint "
                         "with a preprocessor_config.json")
    out = []
    for image_path, caption in pairs:
        with PILImage.open(image_path) as img:
            pixels = torch.from_numpy(np.asarray(img.convert("RGB")).copy()).permute(2, 0, 1).contiguous()
        h, w = int(pixels.shape[1]), int(pixels.shape[2])
        pixel_values, grid = crop_encode(pixels, torch.tensor([[0, 0, w, h]]), config, impl="torch")
        key = hashlib.sha256(pixels.numpy().tobytes()).digest()
        image = Image(pixel_values, tuple(int(v) for v in grid[0]), key)
        ids = backend.codec.encode(*holistic_prompt(image, caption)).ids
        out.append(ImagePrompt(ids=ids, pixel_values=pixel_values, grid_thw=grid, key=key))
    return out
