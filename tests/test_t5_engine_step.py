"""The engine's whole T5 decoder step (``fastjudge._engine.T5Decoder``, engine/t5_step.cpp, taken
by ``T5Model.forward`` through ``backends/t5/engine_step.py``) against transformers' forward over
the whole decoder sequence (``T5ForConditionalGeneration.forward`` with ``decoder_input_ids``:
transformers/models/t5/modeling_t5.py), and against the model's own tensor-op step on the same
pool, in both cross-attention forms: hidden states, every layer's K/V and the decoder lengths;
the few-token attention kernel's position bias against the float64 softmax of ``T5Attention``
(its ``compute_bias`` buckets); which steps take it; refusals."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from conftest import record_runs

from fastjudge import _engine
from fastjudge.backends.dense import prepare_dense
from fastjudge.backends.t5 import decode as t5_decode
from fastjudge.backends.t5 import model as t5_model
from fastjudge.backends.t5.backend import TorchT5Backend
from fastjudge.backends.t5.engine_step import ENGINE_STEP_MAX_TOKENS, engine_step
from fastjudge.backends.t5.pool import T5Pool
from fastjudge.checkpoints import build_random_t5
from fastjudge.demo import tokenizer_corpus

CAPACITY = 24
ENC_CAPACITY = 40


def backend(model_dir, dtype="float32"):
    if dtype == "bfloat16" and not _engine.bf16_dense_available():
        pytest.skip("bfloat16 steps need AVX512-BF16")
    return TorchT5Backend(model_dir, device="cpu", dtype=dtype)


def encoded_pool(model, rng, rows: int, projected: bool = False):
    """A pool of ``rows`` rows (two spare slots) holding random prompts' encoder states, at
    decoder length 0; with ``projected``, their cross-attention K/V projected and read."""
    vocab = model.embed.shape[0]
    lengths = rng.integers(2, ENC_CAPACITY, size=rows)
    prompts = [torch.tensor(rng.integers(5, vocab, size=n)) for n in lengths]
    pool = T5Pool(model.s, rows + 2, ENC_CAPACITY, CAPACITY, "cpu", model.embed.dtype,
                  cross_slots=rows + 2 if projected else 0)
    model.decoder_bias(CAPACITY + 1)
    with torch.inference_mode():
        states = model.encode(torch.cat(prompts), lengths.tolist())
    starts = np.concatenate([[0], np.cumsum(lengths)])
    pool.load(0, [states[starts[i]:starts[i + 1]] for i in range(rows)])
    if projected:
        model.project_cross(pool, 0, rows)
        pool.projected = True
    return pool, prompts


def tensor_ops(monkeypatch):
    """The model's tensor-op step from here on (``T5Model.forward`` never takes the engine)."""
    monkeypatch.setattr(t5_model, "engine_step", lambda *args: None)


def step_both_ways(model, pool, new, counts, monkeypatch):
    """The same step by the engine on ``pool`` and by the tensor ops on a copy of it: (engine
    hidden, tensor-op hidden, the copy)."""
    other = copy.deepcopy(pool)
    other.enc_held, other.dec_held, other.projected = pool.enc_held.copy(), pool.dec_held.copy(), pool.projected
    with torch.inference_mode():
        ours = t5_decode.run_step(model, pool, new, counts)
        with monkeypatch.context() as m:
            tensor_ops(m)
            theirs = t5_decode.run_step(model, other, new, counts)
    return ours, theirs, other


def assert_same_state(pool, other, atol):
    assert torch.equal(pool.dec_lengths, other.dec_lengths)
    # the scratch column (the tensor ops' padding K/V) is never read
    torch.testing.assert_close(pool.kv[..., :CAPACITY, :], other.kv[..., :CAPACITY, :], atol=atol, rtol=1e-5)


@pytest.mark.parametrize("projected", [False, True])
def test_steps_match_transformers(t5_dir, projected):
    """Engine steps of one to four tokens a row with padding, each real token's logits against
    transformers' forward over the prompt and the whole decoder sequence so far."""
    from transformers import T5ForConditionalGeneration

    model = backend(t5_dir).model
    hf = T5ForConditionalGeneration.from_pretrained(str(t5_dir), dtype=torch.float32).eval()
    rng = np.random.default_rng(1)
    rows = 4
    pool, prompts = encoded_pool(model, rng, rows, projected)
    vocab = model.embed.shape[0]
    sequences = [[] for _ in range(rows)]
    for width in (1, 3, 4, 1, 2):
        counts = rng.integers(1, width + 1, size=rows)
        counts[0] = width
        new = torch.tensor(rng.integers(5, vocab, size=(rows, width)))
        assert engine_step(model, pool.view(0, rows), new) is not None
        with torch.inference_mode():
            hidden = t5_decode.run_step(model, pool, new, counts.tolist())
            for r in range(rows):
                sequences[r] += new[r, :counts[r]].tolist()
                ours = model.logits(hidden[r, :counts[r]])
                theirs = hf(input_ids=prompts[r][None], decoder_input_ids=torch.tensor([sequences[r]])).logits
                torch.testing.assert_close(ours, theirs[0, -counts[r]:], atol=2e-5, rtol=1e-4)
    assert pool.dec_lengths[:rows].tolist() == [len(s) for s in sequences]


@pytest.mark.parametrize("projected", [False, True])
@pytest.mark.parametrize("rows,width", [(1, 1), (4, 2), (9, 3), (16, 1), (3, 4)])
def test_engine_step_equals_tensor_ops_float32(t5_dir, rows, width, projected, monkeypatch):
    model = backend(t5_dir).model
    rng = np.random.default_rng(rows * 10 + width)
    pool, _ = encoded_pool(model, rng, rows, projected)
    for _ in range(3):
        counts = rng.integers(1, width + 1, size=rows).tolist()
        new = torch.tensor(rng.integers(5, model.embed.shape[0], size=(rows, width)))
        ours, theirs, other = step_both_ways(model, pool, new, counts, monkeypatch)
        real = torch.arange(width)[None, :] < torch.tensor(counts)[:, None]
        # the attention sums in another order than SDPA: a few ulps of the residual stream
        torch.testing.assert_close(ours[real], theirs[real], atol=5e-6, rtol=1e-5)
        assert_same_state(pool, other, atol=2e-6)


@pytest.mark.parametrize("projected", [False, True])
def test_engine_step_bfloat16_within_its_rounding(t5_dir, projected, monkeypatch):
    """bfloat16: every projection, norm and residual add rounds where the tensor ops round; the
    attention (float32, the pool's K/V) sums in another order, so an output may round one step
    apart."""
    model = backend(t5_dir, "bfloat16").model
    rng = np.random.default_rng(7)
    rows = 12
    pool, _ = encoded_pool(model, rng, rows, projected)
    for width in (1, 2, 1):
        counts = rng.integers(1, width + 1, size=rows).tolist()
        new = torch.tensor(rng.integers(5, model.embed.shape[0], size=(rows, width)))
        ours, theirs, other = step_both_ways(model, pool, new, counts, monkeypatch)
        real = torch.arange(width)[None, :] < torch.tensor(counts)[:, None]
        torch.testing.assert_close(ours[real].float(), theirs[real].float(), atol=3e-2, rtol=2e-2)
        assert_same_state(pool, other, atol=3e-2)


def test_same_bits_on_any_thread_count(t5_dir):
    model = backend(t5_dir).model
    rng = np.random.default_rng(3)
    rows = 9
    pool, _ = encoded_pool(model, rng, rows)
    new = torch.tensor(rng.integers(5, model.embed.shape[0], size=(rows, 2)))
    threads, outs = torch.get_num_threads(), []
    try:
        for n in (1, 2, 4):
            torch.set_num_threads(n)
            twin = copy.deepcopy(pool)
            twin.enc_held, twin.dec_held = pool.enc_held.copy(), pool.dec_held.copy()
            with torch.inference_mode():
                outs.append((t5_decode.run_step(model, twin, new, [2] * rows), twin.kv.clone()))
    finally:
        torch.set_num_threads(threads)
    for hidden, kv in outs[1:]:
        assert torch.equal(hidden, outs[0][0]) and torch.equal(kv, outs[0][1])


def test_position_bias_against_t5_attention():
    """``_engine.causal_attention`` with a bias by distance against the float64 softmax of
    transformers' ``T5Attention`` (``compute_bias``'s causal buckets of a random bias table added
    to the unscaled scores, transformers/models/t5/modeling_t5.py): rows at different cached
    lengths, one to four new tokens each, keys past each row's last poisoned with NaN."""
    from transformers.models.t5.modeling_t5 import T5Attention

    g = torch.Generator().manual_seed(0)
    B, S, W, H, dim, buckets, max_distance = 3, 4, 70, 2, 16, 32, 128
    table = torch.randn(buckets, H, generator=g)
    distance = torch.arange(W)
    bucket = T5Attention._relative_position_bucket(-distance, bidirectional=False, num_buckets=buckets,
                                                   max_distance=max_distance)
    bias = table[bucket].t().contiguous()  # [H, W]: a key n positions back
    q, k, v = (torch.randn(B, n, H, dim, generator=g) for n in (S, W, W))
    offsets = torch.tensor([0, 30, W - S])
    counts = torch.tensor([4, 2, 3])
    for b in range(B):
        k[b, offsets[b] + counts[b]:] = float("nan")
        v[b, offsets[b] + counts[b]:] = float("nan")
    out = torch.empty(B, S, H, dim)
    _engine.causal_attention(q.numpy(), k.numpy(), v.numpy(), out.numpy(), 1.0, offsets=offsets.numpy(),
                             counts=counts.numpy(), bias=bias.numpy(), threads=2)
    for b in range(B):
        for t in range(int(counts[b])):
            last = int(offsets[b]) + t
            keys = torch.arange(last + 1)
            scores = torch.einsum("hd,jhd->hj", q[b, t].double(), k[b, :last + 1].double())
            scores = scores + table[bucket[last - keys]].t().double()
            want = torch.einsum("hj,jhd->hd", torch.softmax(scores, -1), v[b, :last + 1].double())
            torch.testing.assert_close(out[b, t].double(), want, atol=1e-5, rtol=1e-5)
        assert torch.all(out[b, int(counts[b]):] == 0)


def test_which_steps_take_it(t5_dir, t5_tied_dir):
    model = backend(t5_dir).model
    pool, _ = encoded_pool(model, np.random.default_rng(0), 2)
    assert engine_step(model, pool, torch.zeros(2, ENGINE_STEP_MAX_TOKENS, dtype=torch.long)) is not None
    assert engine_step(model, pool, torch.zeros(2, ENGINE_STEP_MAX_TOKENS + 1, dtype=torch.long)) is None
    # ReLU feed-forward without a gate: the tensor ops
    relu = backend(t5_tied_dir).model
    relu_pool, _ = encoded_pool(relu, np.random.default_rng(0), 2)
    assert engine_step(relu, relu_pool, torch.zeros(2, 1, dtype=torch.long)) is None
    # projections on F.linear (no panels): the tensor ops; the decoder is made again once they return
    try:
        prepare_dense(model, enabled=False)
        assert engine_step(model, pool, torch.zeros(2, 1, dtype=torch.long)) is None
    finally:
        prepare_dense(model, enabled=True)
    assert engine_step(model, pool, torch.zeros(2, 1, dtype=torch.long)) is not None


def test_refusals_write_nothing(t5_dir):
    model = backend(t5_dir).model
    rows = 3
    pool, _ = encoded_pool(model, np.random.default_rng(2), rows)
    step = engine_step(model, pool, torch.zeros(rows, 1, dtype=torch.long))
    kv, lengths = pool.kv.clone(), pool.dec_lengths.clone()
    vocab = model.embed.shape[0]
    with pytest.raises(ValueError, match="vocabulary"):
        step(torch.tensor([[5], [vocab], [6]]), torch.ones(rows, dtype=torch.long), pool, False)
    pool.dec_lengths[1] = CAPACITY
    with pytest.raises(ValueError, match="capacity"):
        step(torch.full((rows, 1), 5), torch.ones(rows, dtype=torch.long), pool, False)
    pool.dec_lengths[1] = 0
    with pytest.raises(ValueError, match="projected"):  # a pool without projected K/V
        step(torch.full((rows, 1), 5), torch.ones(rows, dtype=torch.long), pool, True)
    assert torch.equal(pool.kv, kv) and torch.equal(pool.dec_lengths, lengths)


def copied(pool):
    other = copy.deepcopy(pool)
    other.enc_held, other.dec_held, other.projected = pool.enc_held.copy(), pool.dec_held.copy(), pool.projected
    return other


def host_picks(model, pool, first, steps, track):
    """``steps`` engine steps, one call each, every row's token picked on the host from
    ``model.logits`` (argmax) and fed to the next: the picks [B, steps] and the ``track`` ids'
    logits [B, steps, K]."""
    fed, picks, tracked = first, [], []
    with torch.inference_mode():
        for _ in range(steps):
            hidden = t5_decode.run_step(model, pool, fed, [1] * len(fed))
            logits = model.logits(hidden[:, 0])
            picks.append(logits.argmax(-1))
            tracked.append(logits[:, track])
            fed = picks[-1][:, None]
    return torch.stack(picks, 1).numpy(), torch.stack(tracked, 1).numpy()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("projected", [False, True])
@pytest.mark.parametrize("tied", [False, True])
def test_a_run_of_picking_steps_is_the_steps_one_call_each(t5_dir, tmp_path_factory, dtype, projected, tied):
    """``decode.run_pick_steps`` (``EngineStep.run_picks``: the steps back to back in one engine
    call, each picking every row's token -- the final norm, its scale, the head, the argmax -- and
    feeding it to the next) against one engine step a call with the host's ``model.logits`` and
    ``argmax``: the same picks and tracked logits at every step and the same pool, bit for bit;
    the run stops after the step where a row's room runs out, where a row picks a stop token (a
    token the steps pick, made a stop), and at its step limit. ``tied``: a gated checkpoint with
    the head tied to the embeddings, whose final norm's output takes d_model**-0.5."""
    model_dir = build_random_t5(tmp_path_factory.mktemp("t5-gated-tied"), tokenizer_corpus(), shape="tiny",
                                tie_word_embeddings=True, seed=2) if tied else t5_dir
    model = backend(model_dir, dtype).model
    assert (model.s.head_scale != 1.0) == tied
    rng = np.random.default_rng(5)
    rows = 4
    start, _ = encoded_pool(model, rng, rows, projected)
    first = torch.tensor(rng.integers(5, model.embed.shape[0], size=(rows, 1)))
    track = [3, 7, 11]
    theirs, _ = host_picks(model, copied(start), first, 6, track)
    stop = int(theirs[1, 2])  # the run ends at the first step any row picks it
    stopped = 1 + min(s for s in range(3) if stop in theirs[:, s])
    for room, stops, limit, ran in [([9, 6, 9, 9], (), 8, 6), ([9] * rows, (), 3, 3),
                                    ([9] * rows, (stop,), 9, stopped), ([1] * rows, (), 8, 1)]:
        ours, other = copied(start), copied(start)
        with torch.inference_mode():
            picks, logits = t5_decode.run_pick_steps(model, ours, first, room, stops, limit, track)
        assert picks.shape == (rows, ran) and logits.shape == (rows, ran, len(track))
        expected, expected_logits = host_picks(model, other, first, ran, track)
        assert picks.tolist() == expected.tolist() and np.array_equal(logits, expected_logits)
        assert np.array_equal(ours.dec_held, other.dec_held)
        assert_same_state(ours, other, atol=0)
        assert torch.equal(ours.kv, other.kv)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_decoding_with_and_without_runs(t5_dir, dtype, monkeypatch):
    """Rationales decoded with runs of picking steps give what one step a call with the host's
    pick gives: the tokens, whether each row finished and its tracked logits, with rows joining
    as others leave (two slots) and the cross-attention's form changing partway (the runs stop
    there)."""
    from fastjudge.runtime.requests import Request, Text

    b = backend(t5_dir, dtype)
    b.max_decode_rows = 2
    rng = np.random.default_rng(8)
    requests = [Request(i, rng.integers(5, 200, size=int(n)), Text(10, track_ids=(3, 10, 11)))
                for i, n in enumerate(rng.integers(6, 30, size=5))]
    b.project_at = 3
    runs = record_runs(monkeypatch, t5_decode, "run_pick_steps")
    ours = b.run(requests)
    monkeypatch.setattr(t5_decode, "run_pick_steps", lambda *args: None)
    theirs = b.run(requests)
    assert max(runs) > 1
    for a, c in zip(ours, theirs):
        assert a.token_ids == c.token_ids and a.finished == c.finished
        assert np.array_equal(a.tracked_logits, c.tracked_logits)
