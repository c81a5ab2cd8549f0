"""Decoding steps that read a shared prefix's K/V once per snapshot (``attention.attend_shared_prefix``,
``StatePool.shared_prefix``): the attention against transformers' own, the pool's grouping of
rows by snapshot through loads and moves, and greedy decoding against ``generate``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import TEST_DEVICE
from test_qwen_faithfulness import eager_attention, examples, hf_model

from fastjudge import LaveJudge
from fastjudge.backends.qwen import attention, model
from fastjudge.backends.qwen.backend import TorchQwenBackend
from fastjudge.backends.qwen.pool import SharedPrefix, StatePool
from fastjudge.checkpoints import build_random_qwen
from fastjudge.demo import tokenizer_corpus
from fastjudge.runtime.requests import Text


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return build_random_qwen(tmp_path_factory.mktemp("qwen3_shared"), tokenizer_corpus(), arch="qwen3", seed=11)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("new_tokens", [1, 3])
@pytest.mark.parametrize("snapshots", [1, 2])
def test_shared_prefix_attention_matches_transformers(dtype, new_tokens, snapshots):
    """Rows whose first P keys come from one snapshot (two snapshots: interleaved rows), each
    with its own keys after them: ``attend_cached`` with ``shared`` against transformers'
    ``eager_attention_forward`` (``transformers/models/qwen3/modeling_qwen3.py``) over every
    row's whole keys under the model's additive mask."""
    gen = torch.Generator().manual_seed(new_tokens * 10 + snapshots)
    B, H, kv_heads, hd, width, P = 6, 8, 2, 16, 48, 20
    q = torch.randn(B, new_tokens, H, hd, generator=gen).to(dtype)
    keys, values = (torch.randn(B, kv_heads, width, hd, generator=gen).to(dtype) for _ in range(2))
    owner = torch.arange(B) % snapshots  # each row's snapshot
    for t in (keys, values):
        prefixes = torch.randn(snapshots, kv_heads, P, hd, generator=gen).to(dtype)
        t[:, :, :P] = prefixes[owner]
    ends = torch.tensor([width, 31, 25, 40, 24, 37])  # each row's keys end there; its new tokens after P
    where = ends[:, None] - new_tokens + torch.arange(new_tokens)
    hidden = torch.arange(width) > where[:, None, :, None]
    mask = torch.zeros(B, 1, new_tokens, width, dtype=dtype).masked_fill_(hidden, float("-inf"))
    if snapshots == 1:
        groups = [(0, None)]
    else:
        groups = [(s, torch.nonzero(owner == s).flatten()) for s in range(snapshots)]

    shared = SharedPrefix(P, groups)
    got = attention.attend_cached(q, keys, values, mask, shared).transpose(1, 2)
    want = eager_attention(q.transpose(1, 2), keys, values, mask)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    # the next step with the same rows: the prefix columns' float32 copies are reused (one per
    # snapshot), and the rows' own later keys, which do change, are read afresh
    copies = dict(shared._float)
    assert len(copies) == snapshots
    keys[:, :, P:] = torch.randn(B, kv_heads, width - P, hd, generator=gen).to(dtype)
    again = attention.attend_cached(q, keys, values, mask, shared).transpose(1, 2)
    assert all(shared._float[k][0] is copies[k][0] for k in copies)
    want = eager_attention(q.transpose(1, 2), keys, values, mask)
    torch.testing.assert_close(again.float(), want, rtol=tol, atol=tol)


def test_pool_groups_rows_by_snapshot(qwen3_dir):
    """Slots loaded from two snapshots group by snapshot (the shortest one's columns shared),
    and the grouping follows rows that move; an empty slot, too few rows per snapshot or too
    few shared columns give None."""
    backend = TorchQwenBackend(qwen3_dir, device=TEST_DEVICE, dtype="float32")
    pool = StatePool(backend.shape, 8, 40, backend.device, backend.dtype)
    for slot, n in ((0, 10), (1, 12)):
        pool.held[slot] = n
    a, b = pool.snapshot(0, 10), pool.snapshot(1, 12)
    pool.load_rows(0, [a, a, b, a, b, b])

    shared = pool.shared_prefix(0, 6, min_keys=8, min_rows=2)
    assert shared.columns == 10
    assert [(first, members.tolist()) for first, members in shared.groups] == [(0, [0, 1, 3]), (2, [2, 4, 5])]

    pool.move([5, 4], [1, 3])  # rows 1 and 3 leave: the last live rows take their slots
    shared = pool.shared_prefix(0, 4, min_keys=8, min_rows=2)
    assert [(first, members.tolist()) for first, members in shared.groups] == [(0, [0]), (1, [1, 2, 3])]

    assert pool.shared_prefix(0, 4, min_keys=8, min_rows=3) is None  # 2 snapshots x 3 rows > 4 rows
    assert pool.shared_prefix(0, 4, min_keys=11, min_rows=2) is None  # snapshot a holds 10 columns
    one = pool.shared_prefix(1, 4, min_keys=8, min_rows=2)
    assert one.columns == 12 and one.groups[0][1] is None  # every row of one snapshot
    pool.load_rows(2, [None])
    assert pool.shared_prefix(0, 4, min_keys=8, min_rows=1) is None


@pytest.mark.parametrize("path", ["tensor ops", "engine"])
def test_decoding_with_shared_prefix_matches_generate(qwen3_dir, path, monkeypatch):
    """LAVE rationales of items sharing the demonstrations decoded together, their steps
    reading the shared prefix once (thresholds lowered to the test model's size), by the
    tensor ops (``attend_shared_prefix``) or by the engine's step (``EngineStep`` given the
    sharing): every row's tokens are transformers' ``generate`` on its whole prompt, and the
    shared path ran."""
    from fastjudge.backends.qwen.engine_step import EngineStep

    backend = TorchQwenBackend(qwen3_dir, device=TEST_DEVICE, dtype="float32")
    hf = hf_model(qwen3_dir)
    judge = LaveJudge(backend, rationale=True)
    max_new = 10
    encoded = [backend.codec.encode(*judge._prompt_parts(ex)) for ex in examples(6)]
    requests = [e.request(i, Text(max_new)) for i, e in enumerate(encoded)]
    assert all(r.prefix_len > 0 for r in requests)
    calls = []

    def counted(*args):
        calls.append(args[-1].columns)
        return shared_attention(*args)

    def counted_run(self, *args):
        if args[-1] is not None:
            calls.append(args[-1].columns)
        return engine_run(self, *args)

    if path == "engine":
        if TEST_DEVICE != "cpu":
            pytest.skip("the engine's step runs on the CPU")
        engine_run = EngineStep.run_picks
        monkeypatch.setattr(EngineStep, "run_picks", counted_run)
        monkeypatch.setattr(model, "ENGINE_SHARED_MIN_KEYS", 8)
    else:
        shared_attention = attention.attend_shared_prefix
        monkeypatch.setattr(attention, "attend_shared_prefix", counted)
        monkeypatch.setattr(model, "SHARED_PREFIX_MIN_KEYS", 8)
        monkeypatch.setattr(model, "SHARED_PREFIX_MIN_ROWS", 2)
        monkeypatch.setattr(model, "engine_step", lambda *args: None)  # the tensor ops' step
    outs = backend.run(requests)
    assert calls and min(calls) >= min(r.prefix_len for r in requests) - 1
    eos = sorted(backend.codec.eos_token_ids)
    for e, out in zip(encoded, outs):
        gen = hf.generate(torch.tensor([e.ids.tolist()]), max_new_tokens=max_new, do_sample=False, num_beams=1,
                          eos_token_id=eos)[0, len(e.ids):].tolist()
        stop = next((i for i, t in enumerate(gen) if t in backend.codec.eos_token_ids), len(gen))
        assert out.token_ids == gen[:stop]
    assert np.mean([len(o.token_ids) for o in outs]) > 1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_suffix_passes_pack_the_shared_prefix_once(qwen3_dir, dtype, monkeypatch):
    """Score-only LAVE requests sharing the demonstrations: their suffix passes (more than four
    tokens a row) hand the engine's attention the rows' sharing, which packs the shared columns
    once for a run of rows; the logits are bit for bit those of every row packing its own, and
    transformers' forward on each whole prompt agrees with them."""
    from fastjudge import _engine
    from fastjudge.runtime.requests import Choice

    if TEST_DEVICE != "cpu":
        pytest.skip("the engine's attention runs on the CPU")
    if dtype == "bfloat16" and not _engine.bf16_dense_available():
        pytest.skip("needs AVX512-BF16")
    backend = TorchQwenBackend(qwen3_dir, device=TEST_DEVICE, dtype=dtype)
    judge = LaveJudge(backend)
    encoded = [backend.codec.encode(*judge._prompt_parts(ex)) for ex in examples(6)]
    candidates = (7, 8, 9)
    requests = [e.request(i, Choice(candidates)) for i, e in enumerate(encoded)]
    real, seen = attention.attend_in_engine, []

    def sharing(*args, shared=None, **kwargs):
        seen.append(shared)
        return real(*args, shared=shared, **kwargs)

    monkeypatch.setattr(attention, "attend_in_engine", sharing)
    ours = backend.run(requests)
    assert any(s is not None for s in seen)  # the suffix passes were told of the sharing
    monkeypatch.setattr(attention, "attend_in_engine", lambda *args, shared=None, **kwargs: real(*args, **kwargs))
    theirs = backend.run(requests)
    for a, b in zip(ours, theirs):
        assert np.array_equal(a.logits, b.logits)
    if dtype == "float32":
        hf = hf_model(qwen3_dir)
        for e, out in zip(encoded, ours):
            want = hf(torch.tensor([e.ids.tolist()])).logits[0, -1, list(candidates)]
            np.testing.assert_allclose(out.logits, want.detach().numpy(), atol=2e-4, rtol=1e-4)
