"""The engine's whole decoding step (``fastjudge._engine.QwenDecoder``, engine/qwen_step.cpp,
taken by ``model.run_step`` through ``backends/qwen/engine_step.py``) against transformers'
forward over the whole sequence (``Qwen3_5ForCausalLM.forward`` /
``Qwen3ForCausalLM.forward``: transformers/models/qwen3_5/modeling_qwen3_5.py and
transformers/models/qwen3/modeling_qwen3.py), and against the model's own tensor-op step
(``QwenModel.forward``) on the same pool: hidden states, every layer's state, lengths and
positions; which steps take it; refusals."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from fastjudge import _engine
from fastjudge.backends.dense import prepare_dense
from fastjudge.backends.qwen import model as qwen_model
from fastjudge.backends.qwen.backend import TorchQwenBackend
from fastjudge.backends.qwen.engine_step import ENGINE_STEP_MAX_TOKENS, engine_step
from fastjudge.backends.qwen.pool import StatePool
from fastjudge.checkpoints import build_random_qwen
from fastjudge.demo import tokenizer_corpus

ARCHS = ("qwen3_5", "qwen3")
CAPACITY = 160


@pytest.fixture(scope="module", params=ARCHS)
def model_dir(request, tmp_path_factory):
    return build_random_qwen(tmp_path_factory.mktemp(f"step_{request.param}"), tokenizer_corpus(),
                             arch=request.param, seed=5)


def backend(model_dir, dtype="float32"):
    if dtype == "bfloat16" and not _engine.bf16_dense_available():
        pytest.skip("bfloat16 steps need AVX512-BF16")
    return TorchQwenBackend(model_dir, device="cpu", dtype=dtype)


def prompts(rng, rows, vocab):
    lengths = rng.integers(3, 40, size=rows)
    tokens = torch.tensor(rng.integers(5, vocab, size=(rows, int(lengths.max()))))
    return tokens, lengths


def filled_pool(model, rng, rows, vocab):
    pool = StatePool(model.s, rows + 2, CAPACITY, "cpu", model.embed.dtype)
    tokens, lengths = prompts(rng, rows, vocab)
    qwen_model.run_step(model, pool, 0, tokens, lengths.tolist())
    return pool, tokens, lengths


def tensor_ops(monkeypatch):
    """The model's tensor-op step from here on (``run_step`` never takes the engine)."""
    monkeypatch.setattr(qwen_model, "engine_step", lambda *args: None)


@torch.inference_mode()
def test_steps_match_transformers(model_dir):
    """Prefill, then engine steps of one to eight tokens a row with padding (attention reads the
    cached keys in place up to four, packs them past that), each real token's logits against
    transformers' forward over the whole sequence."""
    from transformers import AutoModelForCausalLM

    b = backend(model_dir)
    model, vocab = b.model, b.model.embed.shape[0]
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    rng = np.random.default_rng(0)
    rows = 5
    pool, tokens, lengths = filled_pool(model, rng, rows, vocab)
    sequences = [tokens[r, :lengths[r]].tolist() for r in range(rows)]
    for width in (1, 3, 8, 1):
        counts = rng.integers(1, width + 1, size=rows)
        counts[0] = width
        new = torch.tensor(rng.integers(5, vocab, size=(rows, width)))
        assert engine_step(model, pool, rows, width) is not None
        hidden = qwen_model.run_step(model, pool, 0, new, counts.tolist())
        for r in range(rows):
            sequences[r] += new[r, :counts[r]].tolist()
            ours = model.logits(hidden[r, :counts[r]])
            theirs = hf(input_ids=torch.tensor([sequences[r]])).logits[0, -counts[r]:]
            torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)
    assert pool.lengths[:rows].tolist() == [len(s) for s in sequences]


def random_steps(model_dir, dtype, rows, width, steps=3):
    """The backend's model, a pool filled with ``rows`` random prompts and, for each of
    ``steps`` steps, each row's real token count (1 to ``width``) and the step's tokens [rows,
    width]."""
    model = backend(model_dir, dtype).model
    vocab = model.embed.shape[0]
    rng = np.random.default_rng(rows * 10 + width)
    pool, _, _ = filled_pool(model, rng, rows, vocab)
    inputs = [(rng.integers(1, width + 1, size=rows).tolist(), torch.tensor(rng.integers(5, vocab, size=(rows, width))))
              for _ in range(steps)]
    return model, pool, inputs


def step_both_ways(model, pool, new, counts, monkeypatch):
    """The same step by the engine on ``pool`` and by the tensor ops on a copy of it: (engine
    hidden, tensor-op hidden, the two pools)."""
    other = copy.deepcopy(pool)
    other.held = pool.held.copy()
    ours = qwen_model.run_step(model, pool, 0, new, counts)
    with monkeypatch.context() as m:
        tensor_ops(m)
        theirs = qwen_model.run_step(model, other, 0, new, counts)
    return ours, theirs, pool, other


def assert_same_state(pool, other, exact):
    assert torch.equal(pool.lengths, other.lengths) and torch.equal(pool.positions, other.positions)
    for kind, pair, twin in zip(pool.kinds, pool.layers, other.layers):
        for ours, theirs in zip(pair, twin):
            if kind == "full_attention":  # the scratch column (padding's K/V) is never read
                ours, theirs = ours[:, :, :CAPACITY], theirs[:, :, :CAPACITY]
            if exact:
                assert torch.equal(ours, theirs)
            else:
                torch.testing.assert_close(ours.float(), theirs.float(), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("rows,width", [(1, 1), (4, 2), (9, 3), (16, 1), (3, 8)])
def test_engine_step_equals_tensor_ops_float32(model_dir, rows, width, monkeypatch):
    model, pool, inputs = random_steps(model_dir, "float32", rows, width)
    for counts, new in inputs:
        ours, theirs, pool, other = step_both_ways(model, pool, new, counts, monkeypatch)
        real = torch.arange(width)[None, :] < torch.tensor(counts)[:, None]
        torch.testing.assert_close(ours[real], theirs[real], atol=1e-6, rtol=1e-5)
        assert_same_state(pool, other, exact=False)
        pool.held = other.held  # both advanced alike


@pytest.mark.parametrize("rows,width", [(6, 3), (5, 4), (9, 2)])
def test_padding_runs_through_no_layer(model_dir, rows, width):
    """The step packs its rows' real tokens (engine/qwen_step.cpp): each row's outputs and state
    are, bit for bit, what that row's step alone gives (its real tokens, no padding, nothing of
    the other rows), and the output holds zeros at padding."""
    model = backend(model_dir).model
    vocab = model.embed.shape[0]
    rng = np.random.default_rng(rows + width)
    pool, _, _ = filled_pool(model, rng, rows, vocab)
    alone = copy.deepcopy(pool)
    alone.held = pool.held.copy()
    counts = rng.integers(1, width + 1, size=rows)
    counts[0], counts[-1] = width, 1
    new = torch.tensor(rng.integers(5, vocab, size=(rows, width)))
    ours = engine_step(model, pool, rows, width)(new, counts, 0, CAPACITY)
    for b, count in enumerate(counts.tolist()):
        one = engine_step(model, alone, 1, count)(new[b:b + 1, :count], np.array([count]), b, CAPACITY)
        assert torch.equal(ours[b, :count], one[0])
        assert not ours[b, count:].any()
    assert_same_state(pool, alone, exact=True)


def test_engine_step_bfloat16_same_bits_as_tensor_ops(model_dir, monkeypatch):
    """From 8 rows the tensor-op step runs the engine's own kernels (projections, norms,
    few-token attention, the DeltaNet step) op by op; the whole step then gives the same bits."""
    b = backend(model_dir, "bfloat16")
    model, vocab = b.model, b.model.embed.shape[0]
    rng = np.random.default_rng(7)
    rows = 12
    pool, _, _ = filled_pool(model, rng, rows, vocab)
    for _ in range(3):
        new = torch.tensor(rng.integers(5, vocab, size=(rows, 1)))
        ours, theirs, pool, other = step_both_ways(model, pool, new, [1] * rows, monkeypatch)
        assert ours.dtype == torch.bfloat16 and torch.equal(ours, theirs)
        assert_same_state(pool, other, exact=True)
        pool.held = other.held


def test_threads_give_the_same_bits(model_dir):
    b = backend(model_dir)
    model, vocab = b.model, b.model.embed.shape[0]
    rng = np.random.default_rng(3)
    pool, _, _ = filled_pool(model, rng, 6, vocab)
    new = torch.tensor(rng.integers(5, vocab, size=(6, 2)))
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 4):
            torch.set_num_threads(n)
            trial = copy.deepcopy(pool)
            trial.held = pool.held.copy()
            results.append(qwen_model.run_step(model, trial, 0, new, [2, 1, 2, 2, 1, 2]))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(results[0], r) for r in results[1:])


def test_which_steps_take_the_engine(model_dir):
    b = backend(model_dir)
    model = b.model
    pool = StatePool(model.s, 4, CAPACITY, "cpu", torch.float32)
    step = engine_step(model, pool, 4, 1)
    assert step is not None and engine_step(model, pool, 2, ENGINE_STEP_MAX_TOKENS) is step  # kept
    assert engine_step(model, pool, 4, ENGINE_STEP_MAX_TOKENS + 1) is None
    assert engine_step(model, pool, 300, 1) is None  # past ENGINE_STEP_MAX_ROWS tokens
    other = StatePool(model.s, 4, CAPACITY, "cpu", torch.float32)
    assert engine_step(model, other, 4, 1) not in (None, step)  # bound to that pool's buffers
    prepare_dense(model, enabled=False)  # no panels: the tensor ops
    assert engine_step(model, other, 4, 1) is None
    prepare_dense(model)
    assert engine_step(model, other, 4, 1) is not None


def test_refusals_write_nothing(model_dir):
    b = backend(model_dir)
    model, vocab = b.model, b.model.embed.shape[0]
    rng = np.random.default_rng(4)
    pool, _, _ = filled_pool(model, rng, 3, vocab)
    step = engine_step(model, pool, 3, 1)
    before = copy.deepcopy(pool)
    for tokens, counts, message in (
            (torch.tensor([[5], [vocab], [6]]), [1, 1, 1], "vocabulary"),
            (torch.tensor([[5], [-1], [6]]), [1, 1, 1], "vocabulary"),
            (torch.tensor([[5], [6], [7]]), [1, 2, 1], "counts")):
        with pytest.raises(ValueError, match=message):
            step(tokens, np.array(counts), 0, CAPACITY)
    with pytest.raises(ValueError, match="slots"):
        step(torch.tensor([[5], [6], [7]]), np.array([1, 1, 1]), pool.slots - 2, CAPACITY)
    pool.lengths[1] = CAPACITY
    with pytest.raises(ValueError, match="capacity"):
        step(torch.tensor([[5], [6], [7]]), np.array([1, 1, 1]), 0, CAPACITY)
    pool.lengths[1] = before.lengths[1]
    for ours, theirs in zip(pool.state_dict().values(), before.state_dict().values()):
        assert torch.equal(ours, theirs)


def step_and_pick_both_ways(model, pool, new, counts):
    """The same step as one engine call with its greedy pick (``run_pick_step``) on ``pool`` and
    as ``run_step`` then ``model.logits`` and ``argmax`` on a copy of it: (picks, hidden, the
    step's hidden at each row's last real token, its logits' argmax, the two pools)."""
    other = copy.deepcopy(pool)
    other.held = pool.held.copy()
    hidden = torch.empty(len(new) + 2, model.s.hidden, dtype=model.embed.dtype)  # wider, as the loop's
    picks = qwen_model.run_pick_step(model, pool, 0, new, counts, hidden)[0][:, 0]
    out = qwen_model.run_step(model, other, 0, new, counts)
    last = out[torch.arange(len(new)), torch.tensor(counts) - 1]
    return picks, hidden[:len(new)], last, model.logits(last).argmax(-1), pool, other


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows,width", [(1, 1), (5, 1), (16, 1), (4, 3)])
def test_pick_step_gives_the_argmax_of_the_models_logits(model_dir, dtype, rows, width):
    """``EngineStep.pick`` (one engine call: the step, the final norm, the head, the argmax)
    against the step, ``QwenModel.logits`` and ``torch.argmax`` run apart: the same hidden
    states bit for bit, the same tokens, the same pool."""
    model, pool, inputs = random_steps(model_dir, dtype, rows, width)
    for counts, new in inputs:
        picks, hidden, last, argmax, pool, other = step_and_pick_both_ways(model, pool, new, counts)
        assert picks is not None and picks.dtype == np.int64
        assert torch.equal(hidden, last) and picks.tolist() == argmax.tolist()
        assert_same_state(pool, other, exact=True)
        assert pool.held.tolist() == other.held.tolist()


def test_pick_takes_the_first_of_equal_logits_and_the_first_nan(model_dir):
    """The engine's greedy pick breaks ties and meets NaN as ``torch.argmax`` does (the first
    of equal maxima; the first NaN), on a head made to give them: rows of the head repeated
    (ties), and rows of infinities of both signs (inf - inf: NaN)."""
    from fastjudge.backends.dense import engine_linear, pack_panels
    from fastjudge.backends.qwen.engine_step import EngineStep

    b = backend(model_dir)
    model, vocab = b.model, b.model.embed.shape[0]
    d = model.s.hidden
    rng = np.random.default_rng(11)
    for case in ("ties", "nan"):
        pool, _, _ = filled_pool(model, rng, 3, vocab)
        head = torch.randn(70, d)
        if case == "ties":  # every logit 0 but outputs 3 and 40-69, equal: the largest are ties
            head.zero_()
            head[3] = head[40:] = torch.randn(d)
        else:
            head[[9, 33]] = torch.where(torch.arange(d) % 2 == 0, torch.inf, -torch.inf)
        step = EngineStep(model, pool)
        step.decoder.set_head(model.final_norm.numpy(), pack_panels(head), head.shape[0])
        new = torch.tensor(rng.integers(5, vocab, size=(3, 1)))
        hidden = torch.empty(3, d)
        picks = step.pick(new, np.ones(3, dtype=np.int64), 0, CAPACITY, hidden)
        normed = torch.empty_like(hidden)
        _engine.rms_norm(hidden.numpy()[:, None], model.final_norm.numpy()[None], normed.numpy()[:, None],
                         model.s.eps, 1)
        logits = engine_linear(normed, pack_panels(head), head.shape[0])
        assert picks.tolist() == logits.argmax(-1).tolist()
        if case == "nan":
            assert logits[:, 9].isnan().all() and picks.tolist() == [9, 9, 9]
        else:  # the first zero or the first of the equal outputs
            assert (logits[:, 40:] == logits[:, 3:4]).all() and set(picks.tolist()) <= {0, 3}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_run_of_picking_steps_is_the_steps_one_call_each(model_dir, dtype):
    """``run_pick_step`` given room for several steps (``EngineStep.run_picks``: the steps back
    to back in one engine call, each feeding the picks of the one before) against one picking
    step a call, feeding the picks: the same picks at every step, the tracked ids' logits the
    host's ``model.logits`` gives each step's states, the same last hidden states and pool, bit
    for bit; the run stops after the step where a row's room runs out, or where a row picks a
    stop token (a token the steps pick, made a stop), and at its step limit."""
    b = backend(model_dir, dtype)
    model, vocab = b.model, b.model.embed.shape[0]
    rng = np.random.default_rng(4)
    rows = 5
    start, _, _ = filled_pool(model, rng, rows, vocab)
    first = torch.tensor(rng.integers(5, vocab, size=(rows, 1)))
    ones = [1] * rows

    def copied(pool):
        twin = copy.deepcopy(pool)
        twin.held = pool.held.copy()
        return twin

    track = [3, 7, 11]

    def one_a_call(pool, steps):
        hidden = torch.empty(rows, model.s.hidden, dtype=model.embed.dtype)
        fed, columns, tracked = first, [], []
        for _ in range(steps):
            columns.append(qwen_model.run_pick_step(model, pool, 0, fed, ones, hidden)[0][:, 0])
            tracked.append(model.logits(hidden)[:, track].numpy())
            fed = torch.tensor(columns[-1])[:, None]
        return np.stack(columns, 1), hidden, np.stack(tracked, 1)

    theirs, _, _ = one_a_call(copied(start), 6)
    stop = int(theirs[2, 3])  # the run ends at the first step any row picks it
    stopped = 1 + min(s for s in range(4) if stop in theirs[:, s])
    for room, stops, limit, ran in [([9, 7, 9, 9, 9], (), 8, 7), ([9] * rows, (), 4, 4),
                                    ([9] * rows, (stop,), 9, stopped), ([1] * rows, (), 8, 1)]:
        ours, other = copied(start), copied(start)
        hidden = torch.empty(rows + 2, model.s.hidden, dtype=model.embed.dtype)
        picks, logits = qwen_model.run_pick_step(model, ours, 0, first, ones, hidden, room=room, stops=stops,
                                                 steps=limit, track=track)
        assert picks.shape == (rows, ran) and picks.dtype == np.int64
        expected, last, expected_logits = one_a_call(other, ran)
        assert np.array_equal(logits, expected_logits)
        assert picks.tolist() == expected.tolist() and torch.equal(hidden[:rows], last)
        assert_same_state(ours, other, exact=True)
        assert ours.held.tolist() == other.held.tolist()


@pytest.mark.parametrize("track", [(), (3, 10, 11)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_text_decoding_with_and_without_the_picking_step(model_dir, dtype, track, monkeypatch):
    """Text rows decoded with the step's own pick (runs of steps in one call) give the tokens
    decoding with the host's pick gives (``model.logits`` of the hidden states, ``argmax``, one
    copy), and with ``track`` ids (LAVE's rationale rows) the same tracked logits at every
    step: rows stopping at stop tokens on different steps, rows joining as others leave
    (``max_decode_rows``), the decode counters alike."""
    from fastjudge.backends.qwen import backend as qwen_backend
    from fastjudge.runtime.requests import Request, Text

    b = backend(model_dir, dtype)
    vocab = b.model.embed.shape[0]
    rng = np.random.default_rng(2)
    prefix = rng.integers(5, vocab, size=30)
    prompts = [np.concatenate([prefix, rng.integers(5, vocab, size=int(n))]) for n in rng.integers(2, 9, size=7)]
    picked = []

    def counting(*args, **kwargs):
        picks = real(*args, **kwargs)
        picked.append(picks is not None)
        return picks

    def decode():
        b.reset_decode_stats()
        outs = b.run([Request(i, p, Text(12, track_ids=track), prefix_len=len(prefix))
                      for i, p in enumerate(prompts)])
        return [(o.token_ids, None if o.tracked_logits is None else o.tracked_logits.tolist()) for o in outs], \
            dict(b.decode_stats)

    real = qwen_backend.run_pick_step
    b.max_decode_rows = 3
    first, _ = decode()
    # stop tokens that rows meet at different steps: a token some row picks early
    stops = {tokens[k] for (tokens, _), k in zip(first, (2, 5, 8)) if len(tokens) > k}
    monkeypatch.setattr(b.codec, "eos_token_ids", frozenset(stops))
    monkeypatch.setattr(qwen_backend, "run_pick_step", counting)
    ours, our_stats = decode()
    monkeypatch.setattr(qwen_backend, "run_pick_step", lambda *args, **kwargs: None)
    theirs, their_stats = decode()
    assert ours == theirs and our_stats == their_stats
    assert any(picked) and all(picked)
    assert len({len(t) for t, _ in ours}) > 1  # rows left on different steps
    assert all((kept is None) == (not track) for _, kept in ours)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows,width", [(5, 1), (12, 1), (4, 2), (6, 8)])
def test_shared_prefix_columns_read_once_give_the_same_bits(model_dir, dtype, rows, width):
    """An engine step whose rows share their first columns by snapshot (two snapshots, rows
    interleaved), read once per snapshot (``EngineStep`` given a ``SharedPrefix``), against the
    same step with every row reading its own copy: the same hidden states, picks and pool, bit
    for bit. Decoding steps (a row's queries of a key head at most four) read only their
    snapshots' first rows: the other copies are spoiled with NaN there. Steps of more tokens (8:
    packed once per run of rows, each thread's first row packing its own) keep the copies."""
    from fastjudge.backends.qwen.pool import SharedPrefix

    b = backend(model_dir, dtype)
    model, vocab = b.model, b.model.embed.shape[0]
    rng = np.random.default_rng(rows + width)
    pool, _, lengths = filled_pool(model, rng, rows, vocab)
    columns = int(lengths.min())
    firsts = (0, 1)
    for kind, (keys, values) in zip(pool.kinds, pool.layers):
        if kind == "full_attention":  # each row's first columns: its snapshot's
            for t in (keys, values):
                t[:rows, :, :columns] = t[torch.arange(rows) % 2, :, :columns]
    shared = SharedPrefix(columns, [(first, torch.arange(first, rows, 2)) for first in firsts])
    other = copy.deepcopy(pool)
    attention_buffers = [t for kind, pair in zip(pool.kinds, pool.layers) if kind == "full_attention" for t in pair]
    for t in attention_buffers if model.s.heads // model.s.kv_heads * width <= 4 else ():
        t[2:rows, :, :columns] = float("nan")
    step, twin = engine_step(model, pool, rows, width), engine_step(model, other, rows, width)
    counts = rng.integers(1, width + 1, size=rows)
    new = torch.tensor(rng.integers(5, vocab, size=(rows, width)))
    ours = step(new, counts, 0, CAPACITY, shared)
    theirs = twin(new, counts, 0, CAPACITY)
    assert torch.equal(ours, theirs)
    twins = [t for kind, pair in zip(other.kinds, other.layers) if kind == "full_attention" for t in pair]
    for t, u in zip(attention_buffers, twins):
        t[2:rows, :, :columns] = u[2:rows, :, :columns]
    assert_same_state(pool, other, exact=True)
    hidden, hidden_twin = (torch.empty(rows, model.s.hidden, dtype=model.embed.dtype) for _ in range(2))
    new = torch.tensor(rng.integers(5, vocab, size=(rows, 1)))
    ones = np.ones(rows, dtype=np.int64)
    picks = engine_step(model, pool, rows, 1).pick(new, ones, 0, CAPACITY, hidden, shared)
    assert picks.tolist() == engine_step(model, other, rows, 1).pick(new, ones, 0, CAPACITY, hidden_twin).tolist()
    assert torch.equal(hidden, hidden_twin)
    assert_same_state(pool, other, exact=True)
