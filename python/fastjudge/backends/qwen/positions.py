"""Where a Qwen3.5 prompt's images sit: the tokens standing for an image, and the multimodal
rotary (M-RoPE) positions of a prompt with images.

Image tokens (the Qwen3-VL / Qwen3.5 processor): ``<|vision_start|>`` + ``<|image_pad|>`` * N +
``<|vision_end|>`` with ``N = t * h * w / merge_size**2`` of the image's ``grid_thw``.
"""

from __future__ import annotations

from typing import Sequence

import torch


def image_token_count(grid_thw: Sequence[int] | torch.Tensor, spatial_merge_size: int) -> int:
    t, h, w = (int(v) for v in grid_thw)
    return t * h * w // spatial_merge_size ** 2


def image_block(grid_thw, spatial_merge_size: int, vision_start_id: int, image_token_id: int,
                vision_end_id: int) -> list[int]:
    """The prompt tokens standing for one image."""
    return [vision_start_id] + [image_token_id] * image_token_count(grid_thw, spatial_merge_size) + [vision_end_id]


def mrope_positions(input_ids: Sequence[int] | torch.Tensor, grid_thw: torch.Tensor | Sequence[Sequence[int]] | None,
                    spatial_merge_size: int, image_token_id: int, start: int = 0) -> torch.Tensor:
    """``[3, S]`` int64 M-RoPE positions of one prompt (transformers' ``get_rope_index``).

    Text tokens get the same position on all three rows, counting on from the previous token.
    Each run of ``image_token_id`` tokens is one image (the next row of ``grid_thw``): t, h, w
    grid positions (in merged units) offset by the position reached so far; text after it
    continues from ``max + 1``. ``start`` offsets everything (a prompt continuing a prefix whose
    ``next_position`` is ``start``)."""
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1).cpu()
    grids = [] if grid_thw is None else [tuple(int(v) for v in g) for g in torch.as_tensor(grid_thw).reshape(-1, 3)]
    is_image = (ids == image_token_id).tolist()
    out, pos, i, k, S = [], start, 0, 0, len(is_image)
    while i < S:
        j = i
        while j < S and is_image[j] == is_image[i]:
            j += 1
        if not is_image[i]:
            out.append(torch.arange(pos, pos + j - i).expand(3, -1))
            pos += j - i
        else:
            if k >= len(grids):
                raise ValueError("more image-token runs than grid_thw rows")
            t, h, w = grids[k]
            k += 1
            gh, gw = h // spatial_merge_size, w // spatial_merge_size
            if j - i != t * gh * gw:
                raise ValueError(f"image {k - 1}: {j - i} image tokens for grid {grids[k - 1]} "
                                 f"(expected {t * gh * gw})")
            tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
            out.append(torch.stack([tt, hh, ww]).reshape(3, -1) + pos)
            pos += max(h, w) // spatial_merge_size
        i = j
    if k != len(grids):
        raise ValueError(f"{len(grids)} grid_thw rows for {k} image-token runs")
    if not out:
        return torch.zeros(3, 0, dtype=torch.long)
    return torch.cat(out, dim=1).long()
