"""Images for the Qwen3.5 judge: the vision tower and multimodal rotary positions.

- ``QwenVision``: transformers' ``Qwen3_5VisionModel`` (patch embedding, learned position grid,
  vision blocks, 2x2 patch merger) built from the checkpoint's ``vision_config`` and loaded with
  its ``model.visual.*`` tensors. Its patch embedding is a ``Conv3d`` whose kernel equals its
  stride: each patch row meets the kernel exactly once, so it runs as the matmul it is
  (:class:`PatchEmbedLinear`, same weights; about 4x faster than the convolution on CPU).
  ``encode`` returns the merged embeddings that replace the ``<|image_pad|>`` tokens, one row
  per pad token -- the ``pooler_output`` of transformers' ``get_image_features``. Qwen3.5 has
  no DeepStack features (Qwen3-VL injects intermediate vision features into early decoder
  layers; Qwen3.5 does not): a vision config that asks for them is refused.
- ``mrope_positions``: the ``[3, S]`` t/h/w positions of one prompt, as transformers'
  ``Qwen3_5Model.get_rope_index``.

Image tokens (the Qwen3-VL / Qwen3.5 processor): ``<|vision_start|>`` + ``<|image_pad|>`` * N +
``<|vision_end|>`` with ``N = t * h * w / merge_size**2`` of the image's ``grid_thw``.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch
import torch.nn.functional as F

from .loading import CheckpointError, load_state_dict, read_config, resolve_device, resolve_dtype

VISION_PREFIX = "model.visual."


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


class PatchEmbedLinear(torch.nn.Module):
    """A ``Conv3d`` with kernel == stride, no padding, dilation or groups, applied to inputs the
    size of one kernel (``[N, C, T, p, p]``, as transformers' patch embedding views its patch
    rows): ``y[n] = W.reshape(out, -1) @ x[n].reshape(-1) + b`` -- a linear over the flattened
    patch. Holds the convolution's own parameters under the same names, so state dict keys and
    ``weight.dtype`` (read by transformers' forward) are unchanged."""

    def __init__(self, conv: torch.nn.Conv3d):
        super().__init__()
        self.weight, self.bias = conv.weight, conv.bias
        self.out_channels, self.kernel_size = conv.out_channels, tuple(conv.kernel_size)

    @staticmethod
    def applies_to(conv: torch.nn.Module) -> bool:
        """Whether ``conv`` is exactly a matmul over whole patches."""
        return (isinstance(conv, torch.nn.Conv3d) and tuple(conv.kernel_size) == tuple(conv.stride)
                and conv.padding in ((0, 0, 0), "valid") and tuple(conv.dilation) == (1, 1, 1)
                and conv.groups == 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tuple(x.shape[2:]) != self.kernel_size:
            raise ValueError(f"patch embedding expects [N, C, {', '.join(map(str, self.kernel_size))}] "
                             f"inputs, got {tuple(x.shape)}")
        n = x.shape[0]
        y = F.linear(x.reshape(n, -1), self.weight.reshape(self.out_channels, -1), self.bias)
        return y.view(n, self.out_channels, 1, 1, 1)


class QwenVision:
    """The checkpoint's vision tower (transformers' module, our weight loading)."""

    def __init__(self, config: dict, state: dict[str, torch.Tensor], device="cpu", dtype=torch.float32):
        from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

        vcfg = dict(config.get("vision_config") or {})
        if not vcfg:
            raise CheckpointError("checkpoint has no vision_config (not a multimodal Qwen3.5)")
        if vcfg.get("deepstack_visual_indexes"):
            # Qwen3-VL-style DeepStack (vision features added to early decoder layers) is not
            # part of Qwen3.5 and not implemented here.
            raise CheckpointError("vision_config uses DeepStack features (Qwen3-VL); not supported")
        vcfg["model_type"] = "qwen3_5_vision"
        self.config = Qwen3_5VisionConfig(**vcfg)
        self.device, self.dtype = torch.device(device), dtype
        model = Qwen3_5VisionModel(self.config)  # non-persistent buffers (rotary) computed here
        weights = {k[len(VISION_PREFIX):]: v for k, v in state.items() if k.startswith(VISION_PREFIX)}
        if not weights:
            raise CheckpointError(f"checkpoint lacks vision tensors ({VISION_PREFIX}*)")
        expected = set(model.state_dict())
        missing, unexpected = expected - set(weights), set(weights) - expected
        if missing or unexpected:
            raise CheckpointError(f"vision tensors do not match the vision config: missing {sorted(missing)[:5]}, "
                                  f"unexpected {sorted(unexpected)[:5]}")
        model.load_state_dict(weights, strict=True)
        model = model.to(device=self.device)
        for p in model.parameters():  # buffers (rotary inverse frequencies) stay float32
            p.data = p.data.to(dtype)
        if PatchEmbedLinear.applies_to(model.patch_embed.proj):  # any other conv stays a conv
            model.patch_embed.proj = PatchEmbedLinear(model.patch_embed.proj)
        self.model = model.eval()
        self.spatial_merge_size = self.config.spatial_merge_size

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
        grid_thw = torch.as_tensor(grid_thw, dtype=torch.long).reshape(-1, 3).to(self.device)
        out = self.model(pixel_values.to(self.device, self.dtype), grid_thw=grid_thw)
        return out.pooler_output
