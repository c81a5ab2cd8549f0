"""Image+text prompts through our Qwen3.5 path (vision tower + image embeddings + M-RoPE) against
transformers' Qwen3_5ForConditionalGeneration on the same tiny random checkpoint (float32).

pixel_values / grid_thw come from our ``kernels.crop_encode`` on the full-image box (the same
tensors are given to both sides, so the comparison is of the models, not of preprocessing)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastjudge.backends.qwen.backend import TorchQwenBackend
from fastjudge.backends.qwen.vision import PatchEmbedLinear, QwenVision, image_block, mrope_positions
from fastjudge.checkpoints import build_random_qwen_vl
from fastjudge.demo import tokenizer_corpus
from fastjudge.kernels.crop_encode import CropEncodeConfig, crop_encode

TOL = 1e-4
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
def our_logits(s, ids, cands):
    model, image_id = s["backend"].model, s["cfg"].image_token_id
    t = torch.tensor([ids])
    emb = s["vision"].encode(s["pv"], s["grid"])
    pos = mrope_positions(ids, s["grid"], s["vision"].spatial_merge_size, image_id)
    hidden, _ = model.forward(t, None, image_embeds=emb, image_mask=t == image_id, positions=pos)
    return model.logits(hidden[:, -1], torch.tensor(cands))[0]


def test_vision_encode_matches_transformers(setup):
    s = setup
    ours = s["vision"].encode(s["pv"], s["grid"])
    with torch.inference_mode():
        ref = torch.cat(s["hf"].model.get_image_features(s["pv"], s["grid"]).pooler_output)
    assert ours.shape == (12, s["cfg"].text_config.hidden_size)
    assert torch.allclose(ours, ref, atol=1e-6, rtol=0)



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


def test_several_images_of_mixed_sizes_match_transformers(setup, monkeypatch):
    """``QwenVision.encode_images`` (our ``GroupedTower``: frames of one grid size attend as one
    batched call, pixels never concatenated) against transformers'
    ``Qwen3_5Model.get_image_features`` on the concatenated pixels with ``cu_seqlens`` per frame;
    sizes interleaved (so grouping reorders them) and one two-frame image. Also the fallback
    through transformers' own forward where the index helpers are missing."""
    s = setup
    cfg = CropEncodeConfig.from_preprocessor_config(s["dir"])
    rng = np.random.default_rng(3)
    images = []
    for h, w in ((80, 120), (60, 60), (80, 120), (120, 90), (60, 60)):
        img = torch.from_numpy(rng.integers(0, 256, (3, h, w), dtype=np.uint8))
        images.append(crop_encode(img, torch.tensor([[0, 0, w, h]]), cfg, impl="torch"))
    pv, grid = images[2]
    images.append((torch.cat([pv, pv + 0.25]), grid * torch.tensor([[2, 1, 1]])))  # t = 2
    items = [(p, g[0].tolist()) for p, g in images]
    ours = s["vision"].encode_images(items)
    with torch.inference_mode():
        ref = s["hf"].model.get_image_features(torch.cat([p for p, _ in images]),
                                               torch.cat([g for _, g in images])).pooler_output
    assert s["vision"]._tower is not None
    assert len(ours) == len(ref) == 6 and len({tuple(g[1:]) for _, g in items}) == 3
    for a, b in zip(ours, ref):
        assert torch.allclose(a, b, atol=1e-5, rtol=0)
    monkeypatch.setattr(s["vision"], "_tower", None)
    for a, b in zip(s["vision"].encode_images(items), ref):
        assert torch.allclose(a, b, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="expected"):
        s["vision"].encode_images([(pv[1:], grid[0].tolist())])

def test_patch_embedding_runs_as_a_matmul(setup, monkeypatch):
    """transformers' Qwen3_5VisionPatchEmbed (models/qwen3_5/modeling_qwen3_5.py,
    Qwen3_5VisionPatchEmbed.forward) is a Conv3d with kernel == stride over patch rows viewed as
    [N, C, T, p, p]; ours runs it as a linear over the flattened rows (no conv3d call) and gives
    transformers' own, unpatched vision model's embeddings."""
    s = setup
    visual, hf_visual = s["vision"].model, s["hf"].model.visual
    assert isinstance(visual.patch_embed.proj, PatchEmbedLinear)
    assert isinstance(hf_visual.patch_embed.proj, torch.nn.Conv3d)
    ours_sd, ref_sd = visual.state_dict(), hf_visual.state_dict()
    assert set(ours_sd) == set(ref_sd) and all(torch.equal(ours_sd[k], ref_sd[k]) for k in ref_sd)
    real, calls = torch.nn.functional.conv3d, []
    monkeypatch.setattr(torch.nn.functional, "conv3d", lambda *a, **k: calls.append(1) or real(*a, **k))
    pv = s["pv"] + torch.randn(s["pv"].shape, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ours, ours_rows = s["vision"].encode(pv, s["grid"]), visual.patch_embed(pv)
        assert not calls
        ref, ref_rows = hf_visual(pv, grid_thw=s["grid"]).pooler_output, hf_visual.patch_embed(pv)
    assert calls  # the counter sees transformers' convolution
    for a, b in ((ours_rows, ref_rows), (ours, ref)):
        assert a.shape == b.shape
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()


def test_patch_embedding_keeps_other_convolutions(setup, monkeypatch):
    """Only a convolution that is exactly a matmul over whole patches is replaced."""
    conv = torch.nn.Conv3d(3, 8, (2, 4, 4), stride=(2, 4, 4))
    assert PatchEmbedLinear.applies_to(conv)
    x = torch.randn(5, 3, 2, 4, 4)
    with torch.inference_mode():
        torch.testing.assert_close(PatchEmbedLinear(conv)(x), conv(x), rtol=1e-5, atol=1e-6)
    for other in (torch.nn.Conv3d(3, 8, (2, 4, 4), stride=(1, 4, 4)),
                  torch.nn.Conv3d(3, 8, (2, 4, 4), stride=(2, 4, 4), padding=1),
                  torch.nn.Conv3d(3, 8, (2, 4, 4), stride=(2, 4, 4), dilation=(1, 2, 2)),
                  torch.nn.Conv3d(4, 8, (2, 4, 4), stride=(2, 4, 4), groups=2)):
        assert not PatchEmbedLinear.applies_to(other)
    # a vision model whose convolution does not qualify keeps it, with the same embeddings
    s = setup
    monkeypatch.setattr(PatchEmbedLinear, "applies_to", staticmethod(lambda conv: False))
    kept = QwenVision.from_pretrained(s["dir"], device="cpu", dtype="float32")
    assert isinstance(kept.model.patch_embed.proj, torch.nn.Conv3d)
    torch.testing.assert_close(kept.encode(s["pv"], s["grid"]), s["vision"].encode(s["pv"], s["grid"]),
                               rtol=1e-5, atol=1e-6)


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
    text_only = s["backend"].model.logits(s["backend"].model.forward(torch.tensor([prefix + suffix]), None)[0][:, -1],
                                          torch.tensor(cands))[0]
    assert (text_only - ref).abs().max().item() > 1e-3
    # and so do the M-RoPE rows: plain 1-D positions, or h and w swapped, are off
    model, image_id = s["backend"].model, s["cfg"].image_token_id
    ids = torch.tensor([prefix + suffix])
    emb = s["vision"].encode(s["pv"], s["grid"])
    pos = mrope_positions(prefix + suffix, s["grid"], s["vision"].spatial_merge_size, image_id)
    for wrong in (torch.arange(ids.shape[1]).expand(3, -1), pos[[0, 2, 1]]):
        with torch.inference_mode():
            h, _ = model.forward(ids, None, image_embeds=emb, image_mask=ids == image_id, positions=wrong)
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
    _, state = model.forward(t, None, save=True, image_embeds=emb, image_mask=t == image_id, positions=pos)
    assert state.length == len(prefix) and state.next_position == int(pos.max()) + 1 < len(prefix)

    S = max(len(x) for x in suffixes)
    batch = torch.zeros(len(suffixes), S, dtype=torch.long)
    for i, x in enumerate(suffixes):
        batch[i, : len(x)] = torch.tensor(x)
    hidden, _ = model.forward(batch, state)
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
    _, st = model.forward(torch.tensor([suffixes[0]]), state, save=True)
    assert st.next_position == state.next_position + len(suffixes[0])
    nxt = cands[0]
    h1, _ = model.forward(torch.tensor([[nxt]]), st)
    step = model.logits(h1[:, -1], torch.tensor(cands))[0]
    full = our_logits(s, prefix + suffixes[0] + [nxt], cands)
    assert (step - full).abs().max().item() < TOL
