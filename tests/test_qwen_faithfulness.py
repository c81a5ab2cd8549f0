"""The Qwen backend against transformers on the same checkpoints (float32): Qwen3.5 causal LM
(Gated DeltaNet + gated attention), Qwen3.5 multimodal checkpoint (language model only) and
Qwen3 dense; with and without shared-prefix reuse."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import TEST_DEVICE

from fastjudge import LaveJudge, VQAExample
from fastjudge.backends.qwen.backend import TorchQwenBackend
from fastjudge.checkpoints import build_random_qwen
from fastjudge.demo import sample_rows, tokenizer_corpus
from fastjudge.engine_options import EngineOptions
from fastjudge.runtime.requests import Choice, Request, Text

ARCHS = {"qwen3_5": ("qwen3_5", False), "qwen3_5_vl": ("qwen3_5", True), "qwen3": ("qwen3", False)}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def qwen_dir(request, tmp_path_factory):
    arch, multimodal = ARCHS[request.param]
    return build_random_qwen(tmp_path_factory.mktemp(request.param), tokenizer_corpus(), arch=arch,
                             multimodal=multimodal, seed=len(request.param))


@pytest.fixture(scope="module")
def qwen35_dir(tmp_path_factory):
    return build_random_qwen(tmp_path_factory.mktemp("qwen3_5_only"), tokenizer_corpus(), seed=3)


def hf_model(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    if cfg["model_type"] == "qwen3_5":
        from transformers import Qwen3_5ForConditionalGeneration as cls
    else:
        from transformers import AutoModelForCausalLM as cls
    return cls.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def examples(n=None):
    return [VQAExample(r["question"], r["references"], r["prediction"], r.get("caption"), r["id"])
            for r in sample_rows()[:n]]


def eager_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """transformers' own attention (``eager_attention_forward`` of
    transformers/models/qwen3/modeling_qwen3.py: ``repeat_kv``, softmax in float32) of ``q`` [B,
    H, S, hd] over ``keys``/``values`` [B, kv_heads, W, hd] under the additive ``mask``, in
    float32: [B, S, H, hd]."""
    from transformers.models.qwen3.modeling_qwen3 import eager_attention_forward

    module = torch.nn.Module()
    module.num_key_value_groups, module.training = q.shape[1] // keys.shape[1], False
    out, _ = eager_attention_forward(module, q.float(), keys.float(), values.float(), mask.float(),
                                     scaling=q.shape[-1] ** -0.5)
    return out


@torch.inference_mode()
def hf_next_token_probs(hf, ids, candidates):
    logits = hf(input_ids=torch.tensor([list(ids)])).logits[0, -1, list(candidates)].double()
    return torch.softmax(logits, -1).numpy()


def test_lave_score_only_matches_transformers(qwen_dir):
    judge = LaveJudge(qwen_dir, engine=EngineOptions(device=TEST_DEVICE, dtype="float32", max_batch_size=5))
    hf = hf_model(qwen_dir)
    items = examples(16)
    results = judge.score(items)
    backend = judge.backend
    assert len(backend.prefix_cache) == 2  # general and yes/no demonstration prefixes
    for ex, res in zip(items, results):
        assert res.error is None
        ids = backend.codec.encode_prompt(judge.build_prompt(ex))
        ref = hf_next_token_probs(hf, ids, judge.rating_token_ids)
        np.testing.assert_allclose(res.probs, ref, rtol=1e-4, atol=1e-6)
        assert res.rating == int(np.argmax(ref)) + 1


def test_reuse_equals_full_prompt_alone_for_widely_different_suffixes(qwen35_dir):
    """One shared prefix, suffixes of 1 to ~150 tokens right-padded in one batch: every row
    equals its full prompt run alone, with no reuse, through both engines."""
    backend = TorchQwenBackend(qwen35_dir, device=TEST_DEVICE, dtype="float32")
    hf = hf_model(qwen35_dir)
    rng = np.random.default_rng(0)
    prefix = rng.integers(5, 900, size=70)
    cands = (10, 11, 12)
    suffix_lengths = [1, 3, 150, 17, 64, 65, 2]
    prompts = [np.concatenate([prefix, rng.integers(5, 900, size=n)]) for n in suffix_lengths]
    shared = [Request(i, p, Choice(cands), prefix_len=len(prefix)) for i, p in enumerate(prompts)]
    batched = backend.run(shared)
    assert len(backend.prefix_cache) == 1
    for p, out in zip(prompts, batched):
        alone = backend.run([Request(0, p, Choice(cands))])[0]
        np.testing.assert_allclose(out.probs, alone.probs, rtol=1e-4)
        np.testing.assert_allclose(out.probs, hf_next_token_probs(hf, p, cands), rtol=1e-4)
    # a second batch with the same prefix is served from the cache
    again = backend.run(shared[:2])
    np.testing.assert_allclose(again[0].probs, batched[0].probs, rtol=1e-6)
    assert backend.prefix_cache.hit_rate > 0


def test_long_whole_prompt_batches_match_transformers(qwen_dir):
    """Prompts long enough for the prefill's own paths, for every architecture (transformers'
    ``Qwen3_5ForConditionalGeneration`` and ``Qwen3ForCausalLM`` forwards, transformers/models/
    qwen3_5/modeling_qwen3_5.py and models/qwen3/modeling_qwen3.py, as the references): the delta rule
    over several chunks with a padded last one, the depthwise conv as a channels-last 2-D conv
    (Qwen3.5), causal attention in query blocks (both); once as a fresh batch of equal lengths,
    once right-padded to the longest row (``model.run_step``'s padded whole-prompt path)."""
    backend = TorchQwenBackend(qwen_dir, device=TEST_DEVICE, dtype="float32")
    hf = hf_model(qwen_dir)
    rng = np.random.default_rng(5)
    cands = (10, 11, 12)
    for lengths in ([300, 300, 300], [300, 203, 171]):
        prompts = [rng.integers(5, 900, size=n) for n in lengths]
        outs = backend.run([Request(i, p, Choice(cands)) for i, p in enumerate(prompts)])
        for p, out in zip(prompts, outs):
            np.testing.assert_allclose(out.probs, hf_next_token_probs(hf, p, cands), rtol=1e-4)


def test_greedy_text_matches_generate(qwen_dir):
    backend = TorchQwenBackend(qwen_dir, device=TEST_DEVICE, dtype="float32")
    hf = hf_model(qwen_dir)
    judge = LaveJudge(backend, rationale=True)
    items = examples(3)
    max_new = 12
    for ex in items:
        encoded = backend.codec.encode(*judge._prompt_parts(ex))
        ids = encoded.ids
        assert np.array_equal(ids, backend.codec.encode_prompt(judge.build_prompt(ex)))
        req = encoded.request(0, Text(max_new))
        assert req.prefix_len > 0
        out = backend.run([req])[0]
        gen = hf.generate(torch.tensor([ids.tolist()]), max_new_tokens=max_new, do_sample=False,
                          num_beams=1, eos_token_id=sorted(backend.codec.eos_token_ids))[0, len(ids):].tolist()
        stop = next((i for i, t in enumerate(gen) if t in backend.codec.eos_token_ids), len(gen))
        assert out.token_ids == gen[:stop]


def test_eviction_under_tiny_budget_keeps_results(qwen35_dir):
    """A budget that holds one prefix state: the two LAVE prefixes evict each other, results
    are unchanged, and a state too large to cache at all is used uncached."""
    items = examples(10)
    roomy = LaveJudge(qwen35_dir, engine=EngineOptions(device=TEST_DEVICE, dtype="float32")).score(items)
    probe = TorchQwenBackend(qwen35_dir, device=TEST_DEVICE, dtype="float32")
    probe_judge = LaveJudge(probe)
    probe_judge.score(items[:1])  # LAVE keeps its demonstrations cached even for one item
    one_state = next(iter(probe.prefix_cache.states.values())).nbytes
    for budget in (int(one_state * 1.5), 1):
        backend = TorchQwenBackend(qwen35_dir, device=TEST_DEVICE, dtype="float32", prefix_cache_bytes=budget)
        tight = LaveJudge(backend, engine=EngineOptions(max_batch_size=2)).score(items)
        assert backend.prefix_cache.bytes_used <= budget
        assert len(backend.prefix_cache) <= 1
        for a, b in zip(roomy, tight):
            np.testing.assert_allclose(a.probs, b.probs, rtol=1e-5)


@torch.inference_mode()
def test_padded_suffix_pass_runs_real_tokens_alone(qwen_dir, monkeypatch):
    """A suffix pass whose rows are mostly padding runs its projections and MLPs on the real
    tokens alone (``layers.project_real``, ``model.packed_tokens``): the real tokens' hidden
    states and every layer's state (past the K/V scratch column, where padding goes) have the
    bits of the same pass computing every token."""
    import copy

    from fastjudge.backends.qwen import model as qwen_model
    from fastjudge.backends.qwen.pool import StatePool

    model = TorchQwenBackend(qwen_dir, device="cpu", dtype="float32").model
    rng = np.random.default_rng(4)
    rows, capacity, width = 6, 120, 40
    pool = StatePool(model.s, rows, capacity, "cpu", model.embed.dtype)
    lengths = rng.integers(5, 30, size=rows)
    qwen_model.run_step(model, pool, 0, torch.tensor(rng.integers(5, 900, size=(rows, 30))), lengths.tolist())
    twin = copy.deepcopy(pool)
    counts = [width, 3, 1, 17, 2, 9]
    tokens = torch.tensor(rng.integers(5, 900, size=(rows, width)))
    assert qwen_model.packed_tokens(torch.arange(width)[None, :] < torch.tensor(counts)[:, None]) is not None
    ours = qwen_model.run_step(model, pool, 0, tokens, counts)
    monkeypatch.setattr(qwen_model, "PACK_MIN_PADDING", 1.0)  # nothing packed: every token runs
    theirs = qwen_model.run_step(model, twin, 0, tokens, counts)
    real = torch.arange(width)[None, :] < torch.tensor(counts)[:, None]
    assert torch.equal(ours[real], theirs[real])
    for kind, pair, other in zip(pool.kinds, pool.layers, twin.layers):
        for a, b in zip(pair, other):
            if kind == "full_attention":
                a, b = a[:, :, :capacity], b[:, :, :capacity]
            assert torch.equal(a, b)


def test_chat_template_with_thinking_disabled(qwen35_dir):
    backend = TorchQwenBackend(qwen35_dir, device=TEST_DEVICE, dtype="float32")
    text = backend.codec.format_prompt("Question: x?")
    assert text.startswith("<|im_start|>user\nQuestion: x?<|im_end|>\n<|im_start|>assistant\n")
    assert text.endswith("<think>\n\n</think>\n\n")
    judge = LaveJudge(backend)
    assert [backend.codec.decode([t]) for t in judge.rating_token_ids] == ["1", "2", "3"]


def test_bad_items_and_prompt_limit(qwen35_dir):
    backend = TorchQwenBackend(qwen35_dir, device=TEST_DEVICE, dtype="float32", max_input_tokens=100)
    results = LaveJudge(backend).score([VQAExample("q?", [], "a"), examples(1)[0]])
    assert "references are empty" in results[0].error
    assert "above the model limit of 100" in results[1].error and results[1].score is None


def test_bfloat16_close_to_float32(qwen35_dir):
    items = examples(6)
    f32 = LaveJudge(qwen35_dir, engine=EngineOptions(device=TEST_DEVICE, dtype="float32")).score(items)
    bf16_judge = LaveJudge(qwen35_dir, engine=EngineOptions(device=TEST_DEVICE, dtype="bfloat16"))
    assert bf16_judge.backend.dtype == torch.bfloat16
    bf16 = bf16_judge.score(items)
    diff = max(float(np.max(np.abs(np.subtract(a.probs, b.probs)))) for a, b in zip(f32, bf16))
    assert diff < 0.05


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("new_tokens", [1, 2, 4, 5])
def test_cached_attention_folds_query_heads_exactly(dtype, new_tokens):
    """``attend_cached`` (query heads folded into query rows for few new tokens) against
    transformers' own attention over the same cache: ``eager_attention_forward`` of
    ``transformers/models/qwen3/modeling_qwen3.py`` (``repeat_kv`` + softmax in float32), rows of
    different lengths under the additive mask the model builds."""
    from fastjudge.backends.qwen.attention import attend_cached

    gen = torch.Generator().manual_seed(new_tokens)
    B, H, kv_heads, hd, width = 3, 8, 2, 16, 40
    q = torch.randn(B, new_tokens, H, hd, generator=gen).to(dtype)
    keys, values = (torch.randn(B, kv_heads, width, hd, generator=gen).to(dtype) for _ in range(2))
    ends = torch.tensor([width, 25, 9])  # each row's keys end there; its new tokens are its last ones
    where = ends[:, None] - new_tokens + torch.arange(new_tokens)
    hidden = torch.arange(width) > where[:, None, :, None]
    mask = torch.zeros(B, 1, new_tokens, width, dtype=dtype).masked_fill_(hidden, float("-inf"))

    got = attend_cached(q, keys, values, mask).transpose(1, 2)
    want = eager_attention(q.transpose(1, 2), keys, values, mask)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("tokens", [64, 65, 130, 512])
@pytest.mark.parametrize("kv_heads", [2, 4])
@pytest.mark.parametrize("form", ["attend_causal", "attend_causal_sdpa"])
def test_causal_attention_exactly(tokens, kv_heads, form):
    """Both forms of causal attention over a prompt (the engine's kernel, and SDPA in query
    blocks over the keys up to their last row, for prompts SDPA's CPU kernel would not skip)
    against transformers' ``eager_attention_forward``
    (``transformers/models/qwen3/modeling_qwen3.py``) under a causal additive mask, float32."""
    from fastjudge.backends.qwen import attention

    gen = torch.Generator().manual_seed(tokens)
    B, H, hd = 2, 4, 16
    q = torch.randn(B, H, tokens, hd, generator=gen)
    k, v = (torch.randn(B, kv_heads, tokens, hd, generator=gen) for _ in range(2))
    got = getattr(attention, form)(q, k, v, gqa=kv_heads != H)
    causal = torch.full((tokens, tokens), float("-inf")).triu_(1)[None, None]
    want = eager_attention(q, k, v, causal)
    torch.testing.assert_close(got.transpose(1, 2), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", ["engine", "ops"])
@pytest.mark.parametrize("shape", [(37, 256), (300, 256), (3, 5, 4, 64), (1, 1, 128)])
def test_rms_norm_matches_transformers(shape, form, monkeypatch):
    """``layers.rms`` against transformers' ``Qwen3RMSNorm.forward``
    (``transformers/models/qwen3/modeling_qwen3.py``) in float32, and in bfloat16 against
    ``F.rms_norm`` of the float32 input cast back: the tensor ops (CUDA, traced graphs; one
    float32 buffer normalised in place) bit for bit; the engine's one-pass kernel (the CPU)
    within 1e-6 and one bfloat16 rounding (it sums the squares in another order). The input is
    never written."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from fastjudge.backends.qwen import layers

    if form == "ops":
        monkeypatch.setattr(layers, "rms_norm_in_engine", lambda *args: None)
    gen = torch.Generator().manual_seed(len(shape))
    x = torch.randn(*shape, generator=gen) * 3
    norm = Qwen3RMSNorm(shape[-1], eps=1e-6)
    norm.weight.data = torch.rand(shape[-1], generator=gen) + 0.5
    before = x.clone()
    xb = x.bfloat16()
    got, got_b = layers.rms(x, norm.weight.data, 1e-6), layers.rms(xb, norm.weight.data, 1e-6)
    want = norm(x).detach()
    want_b = torch.nn.functional.rms_norm(xb.float(), (shape[-1],), norm.weight.data, 1e-6).bfloat16()
    if form == "ops":
        assert torch.equal(got, want) and torch.equal(got_b, want_b)
    else:
        assert float((got - want).abs().max() / want.abs().max()) <= 1e-6
        assert float((got_b.float() - want_b.float()).abs().max() / want_b.float().abs().max()) <= 2 ** -8
    assert torch.equal(x, before)
    assert torch.equal(xb, before.bfloat16())
