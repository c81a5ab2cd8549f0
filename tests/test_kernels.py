"""Kernels against their torch references: the Triton kernels run under the Triton interpreter on
CPU (small shapes), outputs poisoned with NaN beforehand, fresh random inputs in every test.
The references are checked against the math the backends and transformers use."""

from __future__ import annotations

import importlib.util
import json
import os
import zlib

# The kernels import Triton lazily and read TRITON_INTERPRET when first built: set it before.
os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch
import torch.nn.functional as F

from fastjudge.kernels import choice_head as ch
from fastjudge.kernels import crop_encode as ce
from fastjudge.kernels import triton_available

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed: the interpreter tests "
                                  "need it (pip install triton)")


@pytest.fixture
def gen(request):
    # fresh inputs per test, reproducible per test id
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


# ----------------------------------------------------------------------------------------------
# choice head
# ----------------------------------------------------------------------------------------------
def _head_inputs(gen, B=5, H=48, V=700, K=3, dtype=torch.float32, per_row=False):
    hidden = (torch.randn(B, H, generator=gen) * 3).to(dtype)
    norm_w = 1 + 0.2 * torch.randn(H, generator=gen)
    lm_head = (torch.randn(V, H, generator=gen) * 0.5).to(dtype)
    shape = (B, K) if per_row else (K,)
    ids = torch.randint(0, V, shape, generator=gen)
    return hidden, norm_w, lm_head, ids


def _gather(x, ids):
    return x.gather(1, ids if ids.dim() == 2 else ids.expand(x.shape[0], -1))


@pytest.mark.parametrize("per_row", [False, True])
def test_choice_reference_is_the_backends_math(gen, per_row):
    hidden, w, W, ids = _head_inputs(gen, per_row=per_row)
    eps = 1e-6
    # Qwen: rms in float32 with the effective multiplier, cast back, K rows of the LM head
    qwen = F.linear(F.rms_norm(hidden.float(), (48,), w, eps).to(hidden.dtype), W).float()
    ref = ch.choice_head_reference(hidden, w, W, ids, eps=eps)
    torch.testing.assert_close(ref.logits, _gather(qwen, ids), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(ref.logprobs, ref.logits.log_softmax(-1), rtol=1e-6, atol=1e-6)
    # T5 with tied embeddings: T5 RMSNorm then * d_model ** -0.5
    s = 48 ** -0.5
    t5 = F.linear(F.rms_norm(hidden, (48,), w, eps) * s, W)
    torch.testing.assert_close(ch.choice_logits(hidden, w, W, ids, eps, scale=s, impl="torch"), _gather(t5, ids),
                               rtol=1e-6, atol=1e-5)
    # full vocabulary: the tiled online log-sum-exp equals the materializing oracle
    full = ch.choice_logprobs(hidden, w, W, ids, eps, full_vocab=True, impl="torch")
    torch.testing.assert_close(full, _gather(qwen.log_softmax(-1), ids), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(full, ch.full_vocab_logprobs_naive(hidden, w, W, ids, eps), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("scale", [1.0, 48 ** -0.5])
def test_choice_reference_t5_norm_rounds_as_t5(gen, scale):
    """``t5_norm=True``: the LM head's input is what transformers' T5 hands its ``lm_head``,
    bit for bit: ``T5LayerNorm.forward`` (transformers/models/t5/modeling_t5.py: the normalised
    states cast to the weight's dtype, then times the weight) and, for tied embeddings,
    ``T5ForConditionalGeneration.forward``'s ``sequence_output * model_dim ** -0.5``, each a
    bfloat16 tensor. The one-rounding form differs from it; in float32 the two agree."""
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    hidden, w, W, ids = _head_inputs(gen, B=64, dtype=torch.bfloat16)
    norm = t5.T5LayerNorm(48, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(w)
        theirs = norm(hidden)
    theirs = theirs * scale if scale != 1.0 else theirs
    ours = ch.normed_hidden(hidden, norm.weight, 1e-6, scale, torch.bfloat16, t5_norm=True)
    assert ours.dtype == torch.bfloat16 and torch.equal(ours, theirs)
    assert not torch.equal(ch.normed_hidden(hidden, norm.weight, 1e-6, scale, torch.bfloat16), theirs)
    got = ch.choice_logits(hidden, norm.weight, W, ids, 1e-6, scale, impl="torch", t5_norm=True)
    torch.testing.assert_close(got, F.linear(theirs.float(), W.float())[:, ids], rtol=1e-6, atol=1e-5)
    h32, w32 = hidden.float(), norm.weight.float()
    torch.testing.assert_close(ch.normed_hidden(h32, w32, 1e-6, scale, torch.float32, t5_norm=True),
                               ch.normed_hidden(h32, w32, 1e-6, scale, torch.float32), rtol=1e-6, atol=1e-6)


def test_reference_vocab_tiles(gen):
    x = torch.randn(4, 32, generator=gen) * 4
    W = torch.randn(333, 32, generator=gen)
    want = torch.logsumexp(x @ W.T, dim=-1)
    for tile in (1, 64, 100, 333, 4096):
        torch.testing.assert_close(ch.vocab_logsumexp_reference(x, W, tile=tile), want, rtol=1e-6, atol=1e-5)


def test_choice_reference_bf16_close_to_float32(gen):
    hidden, w, W, ids = _head_inputs(gen)
    lo = ch.choice_head_reference(hidden.bfloat16(), w, W.bfloat16(), ids, full_vocab=True)
    hi = ch.choice_head_reference(hidden.bfloat16().float(), w, W.bfloat16().float(), ids, full_vocab=True)
    # only the rounding of the normalized hidden state to bf16 differs
    assert (lo.logprobs - hi.logprobs).abs().max() < 0.1


def test_choice_head_rejects_bad_inputs(gen):
    hidden, w, W, ids = _head_inputs(gen)
    with pytest.raises(ValueError, match="lie in"):
        ch.choice_logits(hidden, w, W, torch.tensor([0, 700]))
    with pytest.raises(ValueError, match="lie in"):
        ch.choice_logits(hidden, w, W, torch.tensor([-1]))
    with pytest.raises(ValueError, match="hidden"):
        ch.choice_logits(hidden[None], w, W, ids)
    with pytest.raises(ValueError, match="lm_head"):
        ch.choice_logits(hidden, w, W[:, :10], ids)
    with pytest.raises(ValueError, match="norm_weight"):
        ch.choice_logits(hidden, w[:10], W, ids)
    with pytest.raises(ValueError, match="token_ids"):
        ch.choice_logits(hidden, w, W, torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="token_ids"):
        ch.choice_logits(hidden, w, W, torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match="impl"):
        ch.choice_logits(hidden, w, W, ids, impl="cuda")


def test_workspace_is_o_b_s():
    # [2, S, B] float32 partials against 4*B*V bytes of materialized logits
    B, V, S = 256, 151_936, 264
    assert ch.workspace_bytes(B, S, full_vocab=True) == 2 * S * B * 4
    assert ch.workspace_bytes(B, S, full_vocab=True) < 4 * B * V / 250
    assert ch.workspace_bytes(B, S, full_vocab=False) == 0


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("full_vocab", [False, True])
def test_choice_triton_matches_reference(gen, dtype, per_row, full_vocab):
    B = 19 if full_vocab else 5  # 19 > BLOCK_B = 16: two row blocks, the second ragged
    hidden, w, W, ids = _head_inputs(gen, B=B, dtype=dtype, per_row=per_row)
    scale = 0.7
    out = (torch.full((B, 3), float("nan")), torch.full((B, 3), float("nan")))
    got, ws = ch.choice_head_triton(hidden, w, W, ids, full_vocab=full_vocab, scale=scale, out=out,
                                    num_splits=3 if full_vocab else None, _return_workspace=True)
    assert got.logits is out[0] and got.logprobs is out[1]
    assert not torch.isnan(got.logits).any() and not torch.isnan(got.logprobs).any()
    ref = ch.choice_head_reference(hidden, w, W, ids, full_vocab=full_vocab, scale=scale)
    tol = dict(rtol=1e-6, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got.logits, ref.logits, **tol)
    torch.testing.assert_close(got.logprobs, ref.logprobs, **tol)
    if full_vocab:
        torch.testing.assert_close(got.logprobs, ch.full_vocab_logprobs_naive(hidden, w, W, ids, scale=scale), **tol)
        assert ws.shape == (2, 3, B) and ws.dtype == torch.float32
        assert ws.numel() * ws.element_size() == ch.workspace_bytes(B, 3, True)
    else:
        assert ws is None


@needs_triton
@pytest.mark.parametrize("full_vocab", [False, True])
def test_choice_triton_t5_norm_matches_reference(gen, full_vocab):
    """The kernels' T5 roundings (``T5_NORM``) against the reference's: the same bfloat16 inputs to
    the LM head, so the logits agree to float32 summation order, closer than the one-rounding
    form comes to them."""
    B = 19 if full_vocab else 40
    hidden, w, W, ids = _head_inputs(gen, B=B, dtype=torch.bfloat16)
    w = w.bfloat16()
    scale = 48 ** -0.5
    got = ch.choice_head_triton(hidden, w, W, ids, full_vocab=full_vocab, scale=scale, t5_norm=True,
                                num_splits=3 if full_vocab else None)
    ref = ch.choice_head_reference(hidden, w, W, ids, full_vocab=full_vocab, scale=scale, t5_norm=True)
    once = ch.choice_head_reference(hidden, w, W, ids, full_vocab=full_vocab, scale=scale)
    tol = dict(rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got.logits, ref.logits, **tol)
    torch.testing.assert_close(got.logprobs, ref.logprobs, **tol)
    assert (once.logits - ref.logits).abs().max() > 1e-3


@needs_triton
def test_choice_triton_many_candidates_and_ragged_hidden(gen):
    # K = 40 > BLOCK_K (two candidate chunks), H = 300 > BLOCK_H (a ragged hidden chunk)
    hidden, w, W, ids = _head_inputs(gen, B=3, H=300, V=257, K=40)
    ref = ch.choice_head_reference(hidden, w, W, ids, full_vocab=True)
    got = ch.choice_head_triton(hidden, w, W, ids, full_vocab=True)
    torch.testing.assert_close(got.logprobs, ref.logprobs, rtol=1e-6, atol=1e-5)
    got = ch.choice_head_triton(hidden, w, W, ids)
    torch.testing.assert_close(got.logprobs, ref.logits.log_softmax(-1), rtol=1e-6, atol=1e-5)


@needs_triton
def test_choice_dispatch_forced_triton(gen, monkeypatch):
    hidden, w, W, ids = _head_inputs(gen)
    calls = []
    real = ch.choice_head_triton
    monkeypatch.setattr(ch, "choice_head_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    ch.choice_logits(hidden, w, W, ids)
    assert not calls  # CPU tensors: the torch reference by default
    monkeypatch.setenv("FASTJUDGE_FORCE_TRITON", "1")
    got = ch.choice_logprobs(hidden, w, W, ids, full_vocab=True)
    assert calls
    torch.testing.assert_close(got, ch.choice_logprobs(hidden, w, W, ids, full_vocab=True, impl="torch"),
                               rtol=1e-6, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# crop encode
# ----------------------------------------------------------------------------------------------
SMALL = ce.CropEncodeConfig(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=8 * 8 * 2,
                            max_pixels=8 * 8 * 12, image_mean=(0.5, 0.4, 0.3), image_std=(0.5, 0.3, 0.2))


def _cfg(**kw) -> ce.CropEncodeConfig:
    d = {k: getattr(SMALL, k) for k in ("patch_size", "merge_size", "temporal_patch_size", "min_pixels",
                                        "max_pixels", "image_mean", "image_std", "rescale_factor", "resample",
                                        "uint8_mode")}
    d.update(kw)
    return ce.CropEncodeConfig(**d)


# (h, w, factor, min_pixels, max_pixels) -> transformers 5.24 Qwen2-VL smart_resize
SMART_RESIZE = [((1, 1, 32, 65536, 16777216), (256, 256)), ((1, 150, 28, 3136, 1003520), (28, 700)),
                ((480, 640, 28, 3136, 1003520), (476, 644)), ((3000, 4000, 28, 3136, 1003520), (840, 1148)),
                ((7, 33, 8, 128, 768), (8, 32)), ((40, 50, 8, 128, 768), (24, 24)), ((1, 1, 8, 128, 768), (16, 16)),
                ((17, 480, 32, 65536, 16777216), (64, 1376)), ((600, 40, 32, 65536, 16777216), (992, 96)),
                ((1080, 1920, 32, 65536, 1048576), (768, 1344)), ((29, 29, 28, 3136, 12845056), (56, 56)),
                ((14, 2790, 28, 3136, 1003520), (28, 812))]


@pytest.mark.parametrize("args,want", SMART_RESIZE)
def test_smart_resize_matches_transformers(args, want):
    assert ce.smart_resize(*args) == want


def test_smart_resize_refuses_extreme_aspect():
    with pytest.raises(ValueError, match="aspect ratio"):
        ce.smart_resize(1, 201, 28, 3136, 1003520)


def test_config_from_preprocessor_config(tmp_path):
    qwen3vl = {"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16,
               "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
               "image_std": [0.5, 0.5, 0.5], "resample": 3, "rescale_factor": 0.00392156862745098,
               "image_processor_type": "Qwen2VLImageProcessorFast"}
    c = ce.CropEncodeConfig.from_preprocessor_config(qwen3vl)
    assert (c.patch_size, c.merge_size, c.temporal_patch_size) == (16, 2, 2)
    assert (c.min_pixels, c.max_pixels, c.resample, c.patch_dim) == (65536, 16777216, "bicubic", 1536)
    # older Qwen2-VL files: top-level min/max_pixels override size
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "resample": 2,
         "size": {"shortest_edge": 1, "longest_edge": 2}}))
    c = ce.CropEncodeConfig.from_preprocessor_config(tmp_path)
    assert (c.min_pixels, c.max_pixels, c.resample, c.factor) == (3136, 12845056, "bilinear", 28)
    assert c == ce.CropEncodeConfig.from_preprocessor_config(tmp_path / "preprocessor_config.json")
    c = ce.CropEncodeConfig.from_preprocessor_config({"do_normalize": False, "do_rescale": False})
    assert c.image_mean == (0.0, 0.0, 0.0) and c.image_std == (1.0, 1.0, 1.0) and c.rescale_factor == 1.0
    with pytest.raises(ValueError, match="resample"):
        ce.CropEncodeConfig.from_preprocessor_config({"resample": 1})


def test_reference_patch_layout_is_the_processors(gen):
    """Row r of the output is merge block (r // m², row-major over the grid), patch (r % m²)
    row-major inside it; column (c, t, py, px); every temporal copy equal."""
    cfg = _cfg(image_mean=(0.0, 0.0, 0.0), image_std=(1.0, 1.0, 1.0), rescale_factor=1.0)
    img = torch.rand(3, 16, 24, generator=gen) * 255  # 16x24 is already a multiple of 8: no resize
    pv, grid = ce.crop_encode_reference(img, [[0, 0, 24, 16]], cfg)
    assert grid.tolist() == [[1, 4, 6]]
    p, m, T = 4, 2, 2
    gh, gw = 4, 6
    r = 0
    for by in range(gh // m):
        for bx in range(gw // m):
            for my in range(m):
                for mx in range(m):
                    y, x = (by * m + my) * p, (bx * m + mx) * p
                    want = img[:, y:y + p, x:x + p][:, None].expand(3, T, p, p).reshape(-1)
                    torch.testing.assert_close(pv[r], want, rtol=0, atol=1e-4)
                    r += 1
    assert r == pv.shape[0]


def test_crop_encode_rejects_bad_boxes(gen):
    img = torch.randint(0, 256, (3, 20, 30), dtype=torch.uint8, generator=gen)
    for box, msg in [([0, 0, 0, 31, 20], "outside"), ([0, -1, 0, 5, 5], "outside"), ([0, 0, 0, 5, 21], "outside"),
                     ([0, 5, 5, 5, 9], "empty or inverted"), ([0, 9, 5, 3, 9], "empty or inverted"),
                     ([1, 0, 0, 5, 5], "image index"), ([0, 0, 0, 30, 20, 1], "boxes must be")]:
        with pytest.raises(ValueError, match=msg):
            ce.crop_encode(img, [box], SMALL)
    with pytest.raises(ValueError, match="whole pixels"):
        ce.crop_encode(img, torch.tensor([[0, 0.5, 0, 5, 5]]), SMALL)
    with pytest.raises(ValueError, match="aspect ratio"):
        ce.crop_encode(torch.zeros(3, 2, 300, dtype=torch.uint8), [[0, 0, 0, 300, 1]], SMALL)
    with pytest.raises(ValueError, match="channels"):
        ce.crop_encode(img[:2], [[0, 0, 0, 5, 5]], SMALL)
    with pytest.raises(ValueError, match="without an image index"):
        ce.crop_encode([img, img], [[0, 0, 5, 5]], SMALL)


def test_crop_encode_reference_edge_boxes(gen):
    img = torch.randint(0, 256, (2, 3, 40, 50), dtype=torch.uint8, generator=gen)
    boxes = [[0, 0, 0, 50, 40],  # whole image, larger than max_pixels: downscaled
             [1, 49, 39, 50, 40],  # 1-pixel box in the corner: upscaled to min_pixels
             [1, 0, 0, 1, 40]]  # 1-pixel-wide column at the edge
    pv, grid = ce.crop_encode(img, boxes, SMALL, impl="torch")
    assert grid.tolist() == [[1, 6, 6], [1, 4, 4], [1, 18, 2]]
    assert pv.shape == (36 + 16 + 36, SMALL.patch_dim) and torch.isfinite(pv).all()
    # a 1-pixel box is its pixel everywhere
    mean, std = SMALL.fused_mean_std()
    px = img[1, :, 39, 49].float()
    one = pv[36:52].reshape(16, 3, 2, 16)
    torch.testing.assert_close(one, ((px - mean) / std)[None, :, None, None].expand_as(one))


def _every_pass(img, box, cfg):
    """A box's pixel values with every resampling pass run, unchanged axes included: the
    reference's path before it skipped them (F.interpolate, antialiased; uint8 "pil": a pass
    per axis in Pillow's order, each rounded and clipped; uint8 "float": one pass, rounded once;
    float32: one pass)."""
    x0, y0, x1, y1 = box
    crop = img[:, y0:y1, x0:x1].float()[None]
    oh, ow = ce.smart_resize(y1 - y0, x1 - x0, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    kw = dict(mode=cfg.resample, align_corners=False, antialias=True)
    if img.dtype == torch.uint8 and cfg.uint8_mode == "pil":
        first = (oh, x1 - x0) if ce.pillow_height_first(x1 - x0, y1 - y0, ow, oh) else (y1 - y0, ow)
        r = F.interpolate(crop, size=first, **kw).clamp(0, 255).add(0.5).floor()
        r = F.interpolate(r, size=(oh, ow), **kw).clamp(0, 255).add(0.5).floor()
    else:
        r = F.interpolate(crop, size=(oh, ow), **kw)
        if img.dtype == torch.uint8:
            r = r.clamp(0, 255).round()
    mean, std = cfg.fused_mean_std()
    return ce._patchify((r[0] - mean[:, None, None]) / std[:, None, None], cfg), (oh, ow)


@pytest.mark.parametrize("resample", ["bicubic", "bilinear"])
@pytest.mark.parametrize("kind", ["uint8-pil", "uint8-float", "float32"])
def test_reference_skips_unchanged_axes_exactly(gen, monkeypatch, resample, kind):
    """An axis whose size the box keeps is not resampled (the antialiased filter at scale 1 is
    the identity); the pixel values stay bit-identical to running every pass."""
    cfg = _cfg(resample=resample, uint8_mode="float" if kind == "uint8-float" else "pil",
               min_pixels=8 * 8 * 2, max_pixels=8 * 8 * 40)
    img = torch.randint(0, 256, (3, 48, 64), dtype=torch.uint8, generator=gen)
    if kind == "float32":
        img = img.float() + torch.rand(img.shape, generator=gen)
    before = img.clone()
    boxes = {  # (x0, y0, x1, y1): (output size, interpolate calls: "pil" uint8, others)
        (0, 0, 48, 40): ((40, 48), (0, 0)),  # unchanged: no pass at all
        (8, 8, 40, 24): ((16, 32), (0, 0)),
        (0, 0, 13, 16): ((16, 16), (1, 1)),  # width resized only
        (0, 0, 64, 13): ((16, 64), (1, 1)),  # height resized only
        (5, 5, 12, 30): ((24, 8), (2, 1)),  # both
    }
    real, calls = F.interpolate, []
    monkeypatch.setattr(F, "interpolate", lambda *a, **k: calls.append(1) or real(*a, **k))
    for box, (size, passes) in boxes.items():
        want, out_size = _every_pass(img, box, cfg)
        assert out_size == size
        calls.clear()
        got, grid = ce.crop_encode_reference(img, [box], cfg)
        assert len(calls) == passes[0 if kind == "uint8-pil" else 1], box
        assert torch.equal(got, want), box
        assert grid.tolist() == [[1, size[0] // 4, size[1] // 4]]
    assert torch.equal(img, before)  # normalized in place on the encoder's own copy only
    # several boxes in one call: the same rows, in box order
    got, _ = ce.crop_encode_reference(img, [[0, *b] for b in boxes], cfg)
    assert torch.equal(got, torch.cat([_every_pass(img, b, cfg)[0] for b in boxes]))


def _assert_close_or_one_step(got, want, cfg):
    """Equal within 1e-5, except at most 0.1 % of elements one uint8 step apart: a resampled value
    on a rounding tie may land on either side under a different float summation order."""
    step = cfg.rescale_factor / torch.tensor(cfg.image_std)  # one uint8 step after normalization
    d = (got - want).abs()
    off = d > 1e-5
    assert off.float().mean() <= 1e-3, f"{int(off.sum())} elements differ"
    if off.any():
        channel = torch.arange(got.shape[1]).expand_as(got)[off] // (cfg.patch_dim // cfg.channels)
        torch.testing.assert_close(d[off], step[channel], rtol=0, atol=1e-5)


@needs_triton
@pytest.mark.parametrize("resample", ["bicubic", "bilinear"])
@pytest.mark.parametrize("kind", ["float32", "uint8-pil", "uint8-float"])
def test_crop_encode_triton_matches_reference(gen, resample, kind):
    cfg = _cfg(resample=resample, uint8_mode="float" if kind == "uint8-float" else "pil")
    img = torch.randint(0, 256, (2, 3, 40, 50), dtype=torch.uint8, generator=gen)
    if kind == "float32":
        img = img.float() + torch.rand(img.shape, generator=gen)
    boxes = [[0, 0, 0, 50, 40], [1, 3, 5, 4, 6], [1, 10, 2, 30, 39], [0, 49, 39, 50, 40], [1, 0, 0, 7, 33]]
    want, grid = ce.crop_encode_reference(img, boxes, cfg)
    out = torch.full_like(want, float("nan"))
    got, grid2 = ce.crop_encode_triton(img, boxes, cfg, out=out)
    assert got is out and not torch.isnan(got).any()
    assert torch.equal(grid, grid2)
    if kind == "float32":
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    else:
        _assert_close_or_one_step(got, want, cfg)


@needs_triton
@pytest.mark.parametrize("resample", ["bicubic", "bilinear"])
def test_crop_encode_triton_follows_pillows_pass_order(gen, resample):
    """Boxes Pillow resizes height first (wide and tall) beside width-first ones, in one launch:
    the kernel takes each box's order (ce.pillow_height_first, tested against Pillow itself in
    tests/test_pillow_resize.py) as the reference does."""
    cfg = _cfg(patch_size=2, min_pixels=16, max_pixels=10**8, resample=resample)
    img = torch.randint(0, 256, (3, 45, 40), dtype=torch.uint8, generator=gen)
    boxes = [[0, 0, 30, 21], [3, 2, 25, 43], [0, 0, 21, 41], [5, 5, 22, 14], [1, 1, 12, 27],
             [0, 20, 38, 33]]  # w x h: 30x21, 22x41, 21x41, 17x9, 11x26, 38x13
    orders = [ce.pillow_height_first(x1 - x0, y1 - y0, *reversed(ce.smart_resize(
        y1 - y0, x1 - x0, cfg.factor, cfg.min_pixels, cfg.max_pixels))) for x0, y0, x1, y1 in boxes]
    if ce.PILLOW_VERSION >= (13,):
        assert orders == [True, True, False, False, True, True]
    want, _ = ce.crop_encode_reference(img, boxes, cfg)
    got, _ = ce.crop_encode_triton(img, boxes, cfg, rows_per_program=8)
    _assert_close_or_one_step(got, want, cfg)


@needs_triton
def test_crop_encode_triton_image_layouts(gen):
    """A list of differently sized images (packed), a channels-last view (strided), one image."""
    cfg = _cfg(patch_size=2, min_pixels=4 * 4 * 2, max_pixels=4 * 4 * 6)
    a = torch.randint(0, 256, (3, 9, 13), dtype=torch.uint8, generator=gen)
    b = torch.randint(0, 256, (3, 20, 7), dtype=torch.uint8, generator=gen)
    boxes = [[1, 0, 0, 7, 20], [0, 2, 1, 13, 9], [1, 6, 19, 7, 20]]
    want, _ = ce.crop_encode_reference([a, b], boxes, cfg)
    got, _ = ce.crop_encode_triton([a, b], boxes, cfg, rows_per_program=4)
    _assert_close_or_one_step(got, want, cfg)
    hwc = torch.randint(0, 256, (2, 11, 12, 3), dtype=torch.uint8, generator=gen)
    nchw = hwc.permute(0, 3, 1, 2)  # a view: no copy
    boxes = [[1, 0, 0, 12, 11], [0, 5, 5, 9, 6]]
    want, _ = ce.crop_encode_reference(nchw.contiguous(), boxes, cfg)
    got, _ = ce.crop_encode_triton(nchw, boxes, cfg)
    _assert_close_or_one_step(got, want, cfg)
    got, _ = ce.crop_encode_triton(nchw[0], [[5, 5, 9, 6]], cfg)
    _assert_close_or_one_step(got, ce.crop_encode_reference(nchw[0].contiguous(), [[5, 5, 9, 6]], cfg)[0], cfg)


@needs_triton
def test_crop_encode_dispatch_forced_triton(gen, monkeypatch):
    img = torch.randint(0, 256, (3, 12, 12), dtype=torch.uint8, generator=gen)
    calls = []
    real = ce.crop_encode_triton
    monkeypatch.setattr(ce, "crop_encode_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    ce.crop_encode(img, [[0, 0, 12, 12]], SMALL)
    assert not calls
    monkeypatch.setenv("FASTJUDGE_FORCE_TRITON", "1")
    got, _ = ce.crop_encode(img, [[0, 0, 12, 12]], SMALL)
    assert calls
    _assert_close_or_one_step(got, ce.crop_encode(img, [[0, 0, 12, 12]], SMALL, impl="torch")[0], SMALL)


@pytest.mark.skipif(importlib.util.find_spec("PIL") is None, reason="Pillow is not installed: the comparison "
                    "with transformers' PIL image processor needs it")
def test_reference_close_to_transformers_pil_processor(gen):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    cfgd = {"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16, "merge_size": 2,
            "temporal_patch_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "resample": 3}
    cfg = ce.CropEncodeConfig.from_preprocessor_config(cfgd)
    proc = Qwen2VLImageProcessorPil(**{k: v for k, v in cfgd.items() if k != "resample"})
    img = torch.randint(0, 256, (3, 120, 160), dtype=torch.uint8, generator=gen)
    boxes = [[0, 10, 20, 60, 70], [0, 100, 50, 101, 51], [0, 0, 0, 160, 17]]
    want, grid = ce.crop_encode_reference(img, boxes, cfg)
    crops = [img[:, y0:y1, x0:x1].permute(1, 2, 0).numpy() for _, x0, y0, x1, y1 in boxes]
    got = proc(images=crops, return_tensors="pt", input_data_format="channels_last")
    assert torch.equal(got["image_grid_thw"], grid)
    d = (got["pixel_values"].float() - want).abs()
    step = 1 / (255 * 0.5)
    assert d.max() <= 2 * step + 1e-5 and d.mean() < 1e-4
