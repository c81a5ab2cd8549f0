"""Image+text prompts through our Qwen3.5 path (vision tower + image embeddings + M-RoPE) against
transformers' Qwen3_5ForConditionalGeneration on the same tiny random checkpoint (float32).

The vision tower is our own code (``backends/qwen/vision.py``); its reference is transformers'
``Qwen3_5VisionModel.forward`` and ``Qwen3_5Model.get_image_features`` (``pooler_output``), in
``transformers/models/qwen3_5/modeling_qwen3_5.py`` (transformers 5.x as installed), with the index
helpers of ``transformers/vision_utils.py``.

pixel_values / grid_thw come from our ``kernels.crop_encode`` on the full-image box (the same
tensors are given to both sides, so the comparison is of the models, not of preprocessing)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastjudge.backends.loading import CheckpointError
from fastjudge.backends.qwen import vision as qwen_vision
from fastjudge.backends.qwen.backend import TorchQwenBackend
from fastjudge.backends.qwen.model import run_step
from fastjudge.backends.qwen.pool import StatePool
from fastjudge.backends.qwen.positions import image_block, mrope_positions
from fastjudge.backends.qwen.vision import QwenVision
from fastjudge.checkpoints import build_random_qwen_vl
from fastjudge.demo import tokenizer_corpus
from fastjudge.kernels.crop_encode import CropEncodeConfig, crop_encode

TOL = 1e-4
# max |ours - transformers| of the vision embeddings (float32), relative to the reference's max |value|
VISION_TOL = 1e-5
H, W = 80, 120  # -> smart-resized 84 x 112, grid (1, 6, 8), 12 image tokens


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import Qwen3_5ForConditionalGeneration

    d = build_random_qwen_vl(tmp_path_factory.mktemp("qwen3_5_vl"), tokenizer_corpus(), seed=5)
    backend = TorchQwenBackend(d, device="cpu", dtype="float32")
    vision = QwenVision.from_pretrained(d, device="cpu", dtype="float32")
    hf = Qwen3_5ForConditionalGeneration.from_pretrained(str(d), dtype=torch.float32).eval()
    img = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (3, H, W), dtype=np.uint8))
    pixel_values, grid_thw = crop_encode(img, torch.tensor([[0, 0, W, H]]),
                                         CropEncodeConfig.from_preprocessor_config(d), impl="torch")
    return dict(dir=d, backend=backend, vision=vision, hf=hf, pv=pixel_values, grid=grid_thw,
                tok=backend.codec.tokenizer, cfg=hf.config)


def ids_of(tok, text):
    return list(tok(text, add_special_tokens=False).input_ids)


def prompt_parts(s, caption="A photo of a red bus parked on a street.", claim="The bus is red."):
    tok, cfg = s["tok"], s["cfg"]
    block = image_block(s["grid"][0], cfg.vision_config.spatial_merge_size, cfg.vision_start_token_id,
                        cfg.image_token_id, cfg.vision_end_token_id)
    prefix = (ids_of(tok, "<|im_start|>system\nYou check claims about images.<|im_end|>\n<|im_start|>user\n")
              + block + ids_of(tok, "\nCaption: " + caption + "\nClaim:"))
    suffix = ids_of(tok, " " + claim + "\nIs the claim true?<|im_end|>\n<|im_start|>assistant\n")
    return prefix, suffix


def candidates(s):
    return [ids_of(s["tok"], w)[0] for w in ("yes", "no", " yes", " no")] + [5, 17]


@torch.inference_mode()
def hf_logits(s, ids, cands):
    t = torch.tensor([ids])
    out = s["hf"](input_ids=t, pixel_values=s["pv"], image_grid_thw=s["grid"],
                  mm_token_type_ids=(t == s["cfg"].image_token_id).int())
    return out.logits[0, -1, cands]


@torch.inference_mode()
def forward(model, t, pool=None, **images):
    """Hidden states of unpadded prompt rows ``t`` [B, k] through the engine's one forward,
    continuing the leading slots of ``pool`` (default: a fresh pool of empty slots)."""
    if pool is None:
        pool = StatePool(model.s, t.shape[0], 512, t.device, model.embed.dtype)
    return run_step(model, pool, 0, t, [t.shape[1]] * t.shape[0], **images)


def snapshot(pool):
    return pool.snapshot(0, int(pool.positions[0]))


@torch.inference_mode()
def our_logits(s, ids, cands):
    model, image_id = s["backend"].model, s["cfg"].image_token_id
    t = torch.tensor([ids])
    emb = s["vision"].encode(s["pv"], s["grid"])
    pos = mrope_positions(ids, s["grid"], s["vision"].spatial_merge_size, image_id)
    hidden = forward(model, t, image_embeds=emb, image_mask=t == image_id, positions=pos[:, None])
    return model.logits(hidden[:, -1], torch.tensor(cands))[0]


def encoded(s, h, w, seed=0):
    """``crop_encode`` patches and grid of a random ``3 x h x w`` image (the processor's layout)."""
    img = torch.from_numpy(np.random.default_rng(seed).integers(0, 256, (3, h, w), dtype=np.uint8))
    return crop_encode(img, torch.tensor([[0, 0, w, h]]), CropEncodeConfig.from_preprocessor_config(s["dir"]),
                       impl="torch")


@pytest.mark.parametrize("h, w", [(80, 120), (60, 60), (120, 90), (200, 150), (30, 300)])
def test_vision_encode_matches_transformers(setup, h, w):
    """One image (square, landscape, portrait, a long strip) against transformers'
    ``Qwen3_5Model.get_image_features`` (pooler_output) and ``Qwen3_5VisionModel.forward``."""
    s = setup
    pv, grid = (s["pv"], s["grid"]) if (h, w) == (H, W) else encoded(s, h, w, seed=h + w)
    ours = s["vision"].encode(pv, grid)
    with torch.inference_mode():
        ref = torch.cat(s["hf"].model.get_image_features(pv, grid).pooler_output)
        ref_tower = s["hf"].model.visual(pv, grid_thw=grid).pooler_output
    assert ours.shape == (int(grid.prod()) // 4, s["cfg"].text_config.hidden_size)
    err = (ours - ref).abs().max().item()
    print(f"vision {h}x{w} grid {grid[0].tolist()}: max |ours - transformers| {err:.1e} "
          f"(max |ref| {ref.abs().max().item():.2f})")
    scale = ref.abs().max().item()
    assert err <= VISION_TOL * scale and (ours - ref_tower).abs().max().item() <= VISION_TOL * scale


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_attention_on_the_engine_matches_sdpa(setup, dtype, monkeypatch):
    """On the CPU the tower's attention runs on the engine (``cpu_engine.attend_all_in_engine``);
    the same tower with SDPA instead (the path CUDA takes) agrees, over images of three grid sizes
    and a two-frame one (frames of one size in one call)."""
    s = setup
    vision = QwenVision.from_pretrained(s["dir"], device="cpu", dtype=dtype)
    images = [encoded(s, h, w, seed=i) for i, (h, w) in enumerate(((80, 120), (60, 60), (120, 90)))]
    pv, grid = images[0]
    images.append((torch.cat([pv, pv + 0.25]), grid * torch.tensor([[2, 1, 1]])))
    items = [(p.to(vision.dtype), g[0].tolist()) for p, g in images]
    calls = []
    real = qwen_vision.attend_all_in_engine
    monkeypatch.setattr(qwen_vision, "attend_all_in_engine", lambda *a, **k: calls.append(1) or real(*a, **k))
    engine = vision.encode_images(items)
    assert calls
    monkeypatch.setattr(qwen_vision, "engine_attends", lambda q, k: False)
    sdpa = vision.encode_images(items)
    tol = 1e-5 if dtype == "float32" else 3e-2
    for a, b in zip(engine, sdpa):
        scale = b.float().abs().max().item()
        assert (a.float() - b.float()).abs().max().item() <= tol * scale


def test_vision_is_a_module_with_the_checkpoint_weights(setup):
    """``QwenVision`` registers the tower's parameters: its state dict holds every vision tensor
    of the checkpoint under the same names (``model.`` for ``model.visual.``) and values, and
    calling the module is ``encode``."""
    from safetensors.torch import load_file

    s = setup
    vision = s["vision"]
    assert isinstance(vision, torch.nn.Module)
    raw = {k[len("model.visual."):]: v for f in s["dir"].glob("*.safetensors")
           for k, v in load_file(str(f)).items() if k.startswith("model.visual.")}
    state = {k[len("model."):]: v for k, v in vision.state_dict().items()}
    assert raw and set(state) == set(raw)
    assert all(torch.equal(state[k], raw[k].float()) for k in raw)
    assert vision.device == torch.device("cpu") and vision.dtype == torch.float32
    torch.testing.assert_close(vision(s["pv"], s["grid"]), vision.encode(s["pv"], s["grid"]), rtol=0, atol=0)


def test_several_images_of_mixed_sizes_match_transformers(setup):
    """``QwenVision.encode_images`` (frames of one grid size attend as one batched call, pixels
    never concatenated) against transformers' ``Qwen3_5Model.get_image_features`` on the
    concatenated pixels with ``cu_seqlens`` per frame; sizes interleaved (so grouping reorders
    them), a two-frame image (t = 2, as a video's grid) and ``encode`` of them all in one call."""
    s = setup
    images = [encoded(s, h, w, seed=i) for i, (h, w) in enumerate(((80, 120), (60, 60), (80, 120), (120, 90),
                                                                     (60, 60)))]
    pv, grid = images[2]
    images.append((torch.cat([pv, pv + 0.25]), grid * torch.tensor([[2, 1, 1]])))  # t = 2
    items = [(p, g[0].tolist()) for p, g in images]
    ours = s["vision"].encode_images(items)
    all_pv, all_grid = torch.cat([p for p, _ in images]), torch.cat([g for _, g in images])
    with torch.inference_mode():
        ref = s["hf"].model.get_image_features(all_pv, all_grid).pooler_output
    assert len(ours) == len(ref) == 6 and len({tuple(g[1:]) for _, g in items}) == 3
    errs = [(a - b).abs().max().item() for a, b in zip(ours, ref)]
    print(f"six images in one call: max |ours - transformers| per image {[f'{e:.1e}' for e in errs]}")
    scale = max(r.abs().max().item() for r in ref)
    assert max(errs) <= VISION_TOL * scale
    assert (s["vision"].encode(all_pv, all_grid) - torch.cat(ref)).abs().max().item() <= VISION_TOL * scale
    with pytest.raises(ValueError, match="expected"):
        s["vision"].encode_images([(pv[1:], grid[0].tolist())])
    with pytest.raises(ValueError, match="multiples"):
        s["vision"].encode_images([(pv[: 6 * 3], [1, 6, 3])])


@pytest.mark.parametrize("gemm", ["engine", "onednn-packed"])
def test_the_backends_prepared_tower_matches_transformers(setup, gemm, monkeypatch):
    """The tower as the backend runs it (``prepare_dense``: each biased projection on the
    engine's panels, or, with the size thresholds lowered so the test model's small weights
    take it, on oneDNN's packed GEMM alone, the bias and the MLP's activation in its epilogue,
    but for a float32 MLP's first projection, whose tanh GELU the engine applies on its panels)
    against transformers' ``Qwen3_5Model.get_image_features`` on images of mixed sizes."""
    from fastjudge.backends import dense

    s = setup
    if gemm == "onednn-packed":
        if not dense.packing_available():
            pytest.skip("oneDNN's packed linear is not in this build")
        for name in ("PACK_MIN_ELEMENTS", "PACK_MANY_ROWS_MIN_ELEMENTS"):
            monkeypatch.setattr(dense, name, 1)
        monkeypatch.setattr(dense, "ENGINE_MAX_ROWS", {torch.float32: 0, torch.bfloat16: 0})
    vision = s["backend"].vision
    paths = dense.prepare_dense(vision)
    # one copy a weight: no decoding step runs the tower, so packed weights keep no engine panels;
    # a float32 MLP input projection whose activation the engine applies keeps its panels alone
    engine_mlps = sum(isinstance(m, dense.Dense) and m.activation in dense.ENGINE_ACTIVATIONS
                      and m.weight.dtype == torch.float32 for m in vision.modules())
    want = {gemm: 4 * vision.config.depth + 3}
    if gemm == "onednn-packed" and engine_mlps:
        want = {gemm: 4 * vision.config.depth + 3 - engine_mlps, "engine": engine_mlps}
    assert paths == want
    images = [encoded(s, h, w, seed=i) for i, (h, w) in enumerate(((80, 120), (60, 60), (200, 150)))]
    ours = vision.encode_images([(p, g[0].tolist()) for p, g in images])
    with torch.inference_mode():
        ref = s["hf"].model.get_image_features(torch.cat([p for p, _ in images]),
                                               torch.cat([g for _, g in images])).pooler_output
    scale = max(r.abs().max().item() for r in ref)
    assert max((a - b).abs().max().item() for a, b in zip(ours, ref)) <= VISION_TOL * scale
    monkeypatch.undo()
    dense.prepare_dense(vision)


def test_vision_tower_is_our_code(setup, monkeypatch):
    """No module of the tower is transformers', the patch embedding never calls a convolution
    (transformers' ``Qwen3_5VisionPatchEmbed`` is a Conv3d with kernel == stride: ours is the
    same linear over the flattened patch), and the tower loads and encodes with transformers'
    Qwen3.5 model code and vision helpers made unimportable."""
    import sys

    s = setup
    assert all(type(m).__module__.startswith(("fastjudge.", "torch.")) for m in s["vision"].modules())
    real, calls = torch.nn.functional.conv3d, []
    monkeypatch.setattr(torch.nn.functional, "conv3d", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.inference_mode():
        rows = s["vision"].model.patch_embed(s["pv"])
        assert not calls
        ref_rows = s["hf"].model.visual.patch_embed(s["pv"])
    assert calls and (rows - ref_rows).abs().max().item() <= VISION_TOL * ref_rows.abs().max().item()
    expected = s["vision"].encode(s["pv"], s["grid"])
    for name in ("transformers.models.qwen3_5.modeling_qwen3_5", "transformers.vision_utils"):
        monkeypatch.setitem(sys.modules, name, None)  # importing it now fails
    alone = QwenVision.from_pretrained(s["dir"], device="cpu", dtype="float32")
    assert torch.equal(alone.encode(s["pv"], s["grid"]), expected)


def test_grid_tables_keep_the_last_sizes(setup, monkeypatch):
    """Per-grid position taps and rotary tables: computed once per size, the last GRID_TABLES
    sizes kept, dropped when the tower moves (``.to``); results unchanged either way."""
    s = setup
    vision = QwenVision.from_pretrained(s["dir"], device="cpu", dtype="float32")
    monkeypatch.setattr(qwen_vision, "GRID_TABLES", 2)
    images = [encoded(s, h, w) for h, w in ((60, 60), (80, 120), (120, 90))]
    first = [vision.encode(p, g) for p, g in images]
    assert list(vision.model._tables) == [tuple(g[0, 1:].tolist()) for _, g in images[1:]]  # the last two
    vision.to(torch.float32)
    assert not vision.model._tables
    for (p, g), e in zip(images, first):
        assert torch.equal(vision.encode(p, g), e)


def test_vision_checkpoint_checks(setup):
    """Tensors whose shapes do not match vision_config, missing or extra tensors and impossible
    configs are refused with a CheckpointError naming the problem."""
    from safetensors.torch import load_file

    s = setup
    cfg = s["hf"].config.to_dict()
    state = {k: v for f in s["dir"].glob("*.safetensors") for k, v in load_file(str(f)).items()}
    QwenVision(cfg, state)  # as saved: loads
    bad = dict(state, **{"model.visual.blocks.0.attn.qkv.weight": torch.zeros(64, 32)})
    with pytest.raises(CheckpointError, match="blocks.0.attn.qkv.weight.*implies"):
        QwenVision(cfg, bad)
    with pytest.raises(CheckpointError, match="missing.*merger.norm.bias"):
        QwenVision(cfg, {k: v for k, v in state.items() if k != "model.visual.merger.norm.bias"})
    with pytest.raises(CheckpointError, match="unexpected.*blocks.1"):
        QwenVision(cfg, dict(state, **{"model.visual.blocks.1.norm1.weight": torch.ones(32)}))
    for change, match in (({"num_heads": 3}, "num_heads"), ({"hidden_act": "tanh"}, "hidden_act"),
                          ({"num_position_embeddings": 2000}, "square"), ({"depth": 0}, "depth"),
                          ({"deepstack_visual_indexes": [0]}, "DeepStack")):
        with pytest.raises(CheckpointError, match=match):
            QwenVision(dict(cfg, vision_config={**cfg["vision_config"], **change}), state)
    with pytest.raises(CheckpointError, match="vision_config"):
        QwenVision({k: v for k, v in cfg.items() if k != "vision_config"}, state)


def test_mrope_positions_match_get_rope_index(setup):
    s = setup
    cfg, merge = s["cfg"], s["cfg"].vision_config.spatial_merge_size
    grids = torch.tensor([[1, 6, 8], [1, 4, 2]])
    blocks = [image_block(g, merge, cfg.vision_start_token_id, cfg.image_token_id, cfg.vision_end_token_id)
              for g in grids]
    ids = [7, 8, 9] + blocks[0] + [10, 11] + blocks[1] + [12, 13, 14]
    t = torch.tensor([ids])
    ref, _ = s["hf"].model.get_rope_index(t, mm_token_type_ids=(t == cfg.image_token_id).int(),
                                          image_grid_thw=grids)
    ours = mrope_positions(ids, grids, merge, cfg.image_token_id)
    assert torch.equal(ours, ref[:, 0])
    with pytest.raises(ValueError):  # an image run without its grid
        mrope_positions(ids, grids[:1], merge, cfg.image_token_id)
    with pytest.raises(ValueError):  # a run whose length does not fit its grid
        mrope_positions(ids, torch.tensor([[1, 6, 8], [1, 4, 4]]), merge, cfg.image_token_id)


def test_image_prompt_logits_match_transformers(setup):
    s = setup
    prefix, suffix = prompt_parts(s)
    cands = candidates(s)
    ours, ref = our_logits(s, prefix + suffix, cands), hf_logits(s, prefix + suffix, cands)
    diff = (ours - ref).abs().max().item()
    print(f"image prompt: max |diff| vs transformers {diff:.2e}")
    assert diff < TOL
    # the image matters: without its embeddings the logits differ
    text_only = s["backend"].model.logits(forward(s["backend"].model, torch.tensor([prefix + suffix]))[:, -1],
                                          torch.tensor(cands))[0]
    assert (text_only - ref).abs().max().item() > 1e-3
    # and so do the M-RoPE rows: plain 1-D positions, or h and w swapped, are off
    model, image_id = s["backend"].model, s["cfg"].image_token_id
    ids = torch.tensor([prefix + suffix])
    emb = s["vision"].encode(s["pv"], s["grid"])
    pos = mrope_positions(prefix + suffix, s["grid"], s["vision"].spatial_merge_size, image_id)
    for wrong in (torch.arange(ids.shape[1]).expand(3, -1), pos[[0, 2, 1]]):
        h = forward(model, ids, image_embeds=emb, image_mask=ids == image_id, positions=wrong[:, None])
        assert (model.logits(h[:, -1], torch.tensor(cands))[0] - ref).abs().max().item() > 1e-4


@torch.inference_mode()
def test_prefix_reuse_across_image(setup):
    s = setup
    model, image_id = s["backend"].model, s["cfg"].image_token_id
    cands = candidates(s)
    claims = ["The bus is red.", "There are two dogs on the grass.", "No.", "A person is holding a blue umbrella."]
    prefix, _ = prompt_parts(s)
    suffixes = [prompt_parts(s, claim=c)[1] for c in claims]

    t = torch.tensor([prefix])
    emb = s["vision"].encode(s["pv"], s["grid"])
    pos = mrope_positions(prefix, s["grid"], s["vision"].spatial_merge_size, image_id)
    pool = StatePool(model.s, len(claims), 512, t.device, model.embed.dtype)
    forward(model, t, pool, image_embeds=emb, image_mask=t == image_id, positions=pos[:, None])
    state = snapshot(pool)
    assert state.length == len(prefix) and state.next_position == int(pos.max()) + 1 < len(prefix)

    S = max(len(x) for x in suffixes)
    batch = torch.zeros(len(suffixes), S, dtype=torch.long)
    for i, x in enumerate(suffixes):
        batch[i, : len(x)] = torch.tensor(x)
    for b in range(len(suffixes)):
        pool.load(b, state)
    hidden = run_step(model, pool, 0, batch, [len(x) for x in suffixes])
    last = torch.tensor([len(x) - 1 for x in suffixes])
    reused = model.logits(hidden[torch.arange(len(suffixes)), last], torch.tensor(cands))
    worst_alone, worst_hf = 0.0, 0.0
    for i, suffix in enumerate(suffixes):
        alone = our_logits(s, prefix + suffix, cands)
        worst_alone = max(worst_alone, (reused[i] - alone).abs().max().item())
        worst_hf = max(worst_hf, (reused[i] - hf_logits(s, prefix + suffix, cands)).abs().max().item())
    print(f"prefix reuse: max |diff| vs full prompt {worst_alone:.2e}, vs transformers {worst_hf:.2e}")
    assert worst_alone < TOL and worst_hf < TOL

    # one-token continuation from a saved suffix state keeps counting from next_position
    pool.load(0, state)
    forward(model, torch.tensor([suffixes[0]]), pool)
    assert snapshot(pool).next_position == state.next_position + len(suffixes[0])
    nxt = cands[0]
    h1 = forward(model, torch.tensor([[nxt]]), pool)
    step = model.logits(h1[:, -1], torch.tensor(cands))[0]
    full = our_logits(s, prefix + suffixes[0] + [nxt], cands)
    assert (step - full).abs().max().item() < TOL
