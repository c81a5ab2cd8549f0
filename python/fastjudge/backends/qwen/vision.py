"""Images for the Qwen3.5 judge: the vision tower and multimodal rotary positions.

- ``QwenVision``: a ``torch.nn.Module`` holding transformers' ``Qwen3_5VisionModel`` (patch
  embedding, learned position grid, vision blocks, 2x2 patch merger) built from the checkpoint's
  ``vision_config`` and loaded with its ``model.visual.*`` tensors. Its patch embedding is a
  ``Conv3d`` whose kernel equals its stride: each patch row meets the kernel exactly once, so it
  runs as the matmul it is (:class:`PatchEmbedLinear`, same weights; about 4x faster than the
  convolution on CPU).
  ``encode`` returns the merged embeddings that replace the ``<|image_pad|>`` tokens, one row
  per pad token -- the ``pooler_output`` of transformers' ``get_image_features``. Qwen3.5 has
  no DeepStack features (Qwen3-VL injects intermediate vision features into early decoder
  layers; Qwen3.5 does not): a vision config that asks for them is refused.
- ``QwenVision.encode_images``: many images at once, each given as its own ``(pixel_values,
  grid_thw)``, through our forward of the same modules (:class:`GroupedTower`): the images'
  pixels are never concatenated (each image's patch embeddings are written into one shared
  tensor), and images of one grid size attend as one batched attention call instead of one
  call per image.
- ``mrope_positions``: the ``[3, S]`` t/h/w positions of one prompt, as transformers'
  ``Qwen3_5Model.get_rope_index``.

Image tokens (the Qwen3-VL / Qwen3.5 processor): ``<|vision_start|>`` + ``<|image_pad|>`` * N +
``<|vision_end|>`` with ``N = t * h * w / merge_size**2`` of the image's ``grid_thw``.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Sequence

import torch
import torch.nn.functional as F

from ..loading import CheckpointError, load_state_dict, read_config, resolve_device, resolve_dtype

VISION_PREFIX = "model.visual."
GRID_TABLES = 64  # grid sizes whose position taps and rotary tables GroupedTower keeps


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

    def project_into(self, rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The same linear over ``rows [N, C*T*p*p]`` written into ``out [N, out_channels]``, a
        slice of a larger tensor: several images' embeddings land in one tensor with no
        concatenation (``addmm`` is the kernel ``F.linear`` runs; the result is the same)."""
        w = self.weight.reshape(self.out_channels, -1).t()
        return torch.mm(rows, w, out=out) if self.bias is None else torch.addmm(self.bias, rows, w, out=out)


class GroupedTower:
    """transformers' ``Qwen3_5VisionModel.forward`` (and ``Qwen3_5VisionBlock.forward``,
    ``Qwen3_5VisionAttention.forward``) over a list of images, on the model's own modules, with
    the same math per image:

    * each image's patches are embedded alone, straight into its rows of one embedding tensor
      (:meth:`PatchEmbedLinear.project_into`; a patch embedding left a convolution embeds each
      image and concatenates the embeddings): the pixels are never concatenated;
    * the position-embedding taps and the rotary cos/sin of a frame depend on its grid alone:
      computed once per grid size, the last :data:`GRID_TABLES` sizes kept;
    * attention stays within each frame as transformers' ``cu_seqlens`` split has it, but the
      frames of one grid size attend as one SDPA call ``[frames, heads, h * w, head_dim]``
      instead of one call each (images are grouped by size, input order kept within a size);
    * layer norms, linears, the MLPs and the patch merger run over all patches at once, as there.

    Needs the vision index helpers of ``transformers.vision_utils`` and the model attributes
    its forward reads (:meth:`available`); without them ``QwenVision`` keeps transformers'
    forward."""

    def __init__(self, model):
        from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb_vision
        from transformers.vision_utils import get_vision_interpolation_indices_and_weights, get_vision_position_ids

        self.model = model
        self._rotary = apply_rotary_pos_emb_vision
        self._taps, self._rope_ids = get_vision_interpolation_indices_and_weights, get_vision_position_ids
        self._tables: OrderedDict[tuple[int, int], tuple[torch.Tensor, ...]] = OrderedDict()

    @staticmethod
    def available(model) -> bool:
        try:
            import transformers.vision_utils as vu
        except ImportError:
            return False
        helpers = all(hasattr(vu, n) for n in ("get_vision_interpolation_indices_and_weights",
                                               "get_vision_position_ids"))
        attrs = all(hasattr(model, n) for n in ("num_grid_per_side", "interpolation_mode",
                                                "interpolation_align_corners", "rotary_pos_emb"))
        return helpers and attrs

    def __call__(self, images: Sequence[tuple[torch.Tensor, tuple[int, int, int]]]) -> list[torch.Tensor]:
        """Merged embeddings of each ``(pixel_values [t*h*w, patch_dim], (t, h, w))``, in order."""
        v = self.model
        order = sorted(range(len(images)), key=lambda i: images[i][1][1:])  # stable
        spans = []  # [(h, w), first row, frames] per grid size
        start = 0
        for i in order:
            t, h, w = images[i][1]
            if spans and spans[-1][0] == (h, w):
                spans[-1][2] += t
            else:
                spans.append([(h, w), start, t])
            start += t * h * w
        x = self._embed_patches([images[i][0] for i in order], start)
        tables = [self._grid_tables(hw, x) for hw, _, _ in spans]
        for (hw, s, frames), (idx, wts, _, _) in zip(spans, tables):
            pos = (v.pos_embed(idx) * wts[:, :, None]).sum(1)  # one frame's, as transformers sums it
            n = hw[0] * hw[1]
            x[s: s + frames * n].view(frames, n, -1).add_(pos.to(x.dtype))
        for blk in v.blocks:
            x = x + self._attention(blk.attn, blk.norm1(x), spans, tables)
            x = x + blk.mlp(blk.norm2(x))
        merged = v.merger(x)
        unit = v.config.spatial_merge_size ** 2
        parts = merged.split([images[i][0].shape[0] // unit for i in order])
        out: list[torch.Tensor] = [None] * len(images)  # type: ignore[list-item]
        for i, part in zip(order, parts):
            out[i] = part
        return out

    def _embed_patches(self, pixels: list[torch.Tensor], rows: int) -> torch.Tensor:
        """``[rows, hidden]`` patch embeddings of the images' pixels, in the given order."""
        proj = self.model.patch_embed.proj
        if not isinstance(proj, PatchEmbedLinear):
            embeds = [self.model.patch_embed(p) for p in pixels]
            return embeds[0] if len(embeds) == 1 else torch.cat(embeds)
        x = torch.empty(rows, proj.out_channels, device=pixels[0].device, dtype=proj.weight.dtype)
        start = 0
        for p in pixels:
            proj.project_into(p, x[start: start + p.shape[0]])
            start += p.shape[0]
        return x

    def _attention(self, attn, x: torch.Tensor, spans, tables) -> torch.Tensor:
        """``Qwen3_5VisionAttention.forward`` with each grid size's frames batched."""
        qkv = attn.qkv(x)
        outs = []
        for ((h, w), s, frames), (_, _, cos, sin) in zip(spans, tables):
            n = h * w
            q, k, val = qkv[s: s + frames * n].view(frames, n, 3, attn.num_heads, -1).unbind(2)
            q, k = self._rotary(q, k, cos, sin)  # cos/sin [n, head_dim] broadcast over frames
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), val.transpose(1, 2),
                                               scale=attn.scaling)
            outs.append(o.transpose(1, 2).reshape(frames * n, -1))
        return attn.proj(outs[0] if len(outs) == 1 else torch.cat(outs))

    def _grid_tables(self, hw: tuple[int, int], like: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Position-embedding taps and weights and rotary cos/sin of one ``h x w`` frame
        (transformers' helpers on a one-frame grid; every frame of a grid has the same)."""
        hit = self._tables.pop(hw, None)
        if hit is None:
            v = self.model
            grid = torch.tensor([[1, *hw]], device=like.device)
            idx, wts = self._taps(grid, num_grid_per_side=v.num_grid_per_side, mode=v.interpolation_mode,
                                  align_corners=v.interpolation_align_corners,
                                  spatial_merge_size=v.config.spatial_merge_size)
            cos, sin = v.rotary_pos_emb(like, self._rope_ids(grid, v.config.spatial_merge_size))
            hit = (idx, wts, cos, sin)
            while len(self._tables) >= GRID_TABLES:
                self._tables.popitem(last=False)
        self._tables[hw] = hit
        return hit


class QwenVision(torch.nn.Module):
    """The checkpoint's vision tower as a ``torch.nn.Module``: transformers' tower module,
    registered as ``model`` (its parameters and buffers are this module's: ``state_dict``,
    ``.to(device)``, ``register_forward_hook``), loaded by our code; ``forward`` is :meth:`encode`."""

    def __init__(self, config: dict, state: dict[str, torch.Tensor], device="cpu", dtype=torch.float32):
        super().__init__()
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
        model = model.to(device=torch.device(device))
        for p in model.parameters():  # buffers (rotary inverse frequencies) stay float32
            p.data = p.data.to(dtype)
        if PatchEmbedLinear.applies_to(model.patch_embed.proj):  # any other conv stays a conv
            model.patch_embed.proj = PatchEmbedLinear(model.patch_embed.proj)
        self.model = model.eval()
        self.spatial_merge_size = self.config.spatial_merge_size
        self._tower = GroupedTower(model) if GroupedTower.available(model) else None

    @property
    def device(self) -> torch.device:
        """Where the tower's weights are (images are moved there)."""
        return self.model.patch_embed.proj.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype (images are cast to it)."""
        return self.model.patch_embed.proj.weight.dtype

    def _apply(self, fn, recurse=True):
        # the grouped forward's per-grid tables were computed on the old device and dtype
        if getattr(self, "_tower", None) is not None:
            self._tower._tables.clear()
        return super()._apply(fn, recurse)

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
        concatenating the pixels (:class:`GroupedTower`)."""
        c = self.config
        width, items = c.in_channels * c.temporal_patch_size * c.patch_size ** 2, []
        for pixels, grid in images:
            t, h, w = (int(g) for g in torch.as_tensor(grid).reshape(3).tolist())
            pixels = torch.as_tensor(pixels)
            if tuple(pixels.shape) != (t * h * w, width):
                raise ValueError(f"pixel_values {tuple(pixels.shape)} for grid {(t, h, w)} "
                                 f"(expected {(t * h * w, width)})")
            items.append((pixels.to(self.device, self.dtype), (t, h, w)))
        if not items:
            return []
        if self._tower is not None:
            return self._tower(items)
        # transformers without the helpers GroupedTower reads: its own forward, all images at once
        grid = torch.tensor([g for _, g in items], dtype=torch.long, device=self.device)
        out = self.model(torch.cat([p for p, _ in items]), grid_thw=grid).pooler_output
        return list(out.split([image_token_count(g, self.spatial_merge_size) for _, g in items]))
