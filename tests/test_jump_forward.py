"""Jump-forward JSON decoding, early exit and refill in the Qwen decode loop: on random weights
with adversarially biased logits, every VisExMEM schema decodes to the same tokens with
jump-forward on and off, in one batch or a few rows at a time, and (where transformers can be
run the same way) as transformers' greedy decoding under the same grammar mask; a multi-token
step equals as many one-token decoding steps, on the static slot cache."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import pytest
import torch

pytest.importorskip("xgrammar")

import grammar_probe as probe  # noqa: E402
from conftest import TEST_DEVICE  # noqa: E402

from fastjudge import LaveJudge  # noqa: E402
from fastjudge.backends import load_backend  # noqa: E402
from fastjudge.backends.qwen.backend import TorchQwenBackend  # noqa: E402
from fastjudge.backends.qwen.model import run_step  # noqa: E402
from fastjudge.backends.qwen.pool import StatePool, pool_bytes  # noqa: E402
from fastjudge.checkpoints import build_random_qwen  # noqa: E402
from fastjudge.demo import tokenizer_corpus  # noqa: E402
from fastjudge.engine_options import EngineOptions
from fastjudge.judges.visexmem.schemas import (  # noqa: E402
    boxes_schema,
    evidence_schema,
    explanation_schema,
    given_claims_response_schema,
    parts_schema,
    single_response_schema,
)
from fastjudge.runtime.grammar import Json  # noqa: E402
from fastjudge.runtime.requests import Request, Text  # noqa: E402

ARCHS = ("qwen3_5", "qwen3")  # hybrid Gated DeltaNet + attention; dense attention


MAX_NEW = 40  # a token budget below most schemas' bound: short tests, and budget exits too


def visexmem_schemas() -> dict:
    """Every schema the VisExMEM judge decodes under (pipeline and the "Dec." control), with
    small bounds so runaway outputs stay short."""
    parts = parts_schema(max_parts=2, max_text_chars=6)
    parts["properties"]["parts"]["minItems"] = 1  # as VisExJudge._decompose asks
    return {
        "parts": parts,
        "boxes": boxes_schema(2),
        "evidence": evidence_schema(["E1", "E2", "E3"]),
        "no-evidence": evidence_schema([]),
        "explanation": explanation_schema(12),
        "single-response": single_response_schema(["E1", "E2"], max_parts=1, max_text_chars=6,
                                                  max_explanation_chars=6),
        "single-response-no-explain": single_response_schema(["E1"], max_parts=2, max_text_chars=6,
                                                             explain=False),
        "given-claims": given_claims_response_schema(["c1", "c2"], ["E1", "E2"], max_explanation_chars=6),
    }


def json_spec(name: str) -> Json:
    return Json.from_schema(visexmem_schemas()[name], MAX_NEW)


@pytest.fixture(scope="module", params=ARCHS)
def qwen_dir(request, tmp_path_factory):
    return build_random_qwen(tmp_path_factory.mktemp(f"jf-{request.param}"), tokenizer_corpus(),
                             arch=request.param, seed=7)


@pytest.fixture(scope="module")
def backend(qwen_dir):
    return TorchQwenBackend(qwen_dir, device=TEST_DEVICE, dtype="float32")


def adversarial_biases(backend) -> dict[str, torch.Tensor]:
    """Logit biases (as tests/test_grammar.py uses) on the scale of the random model's own
    logits (std ~0.2), so both decide: random noise; and quotes, digits, separators and id
    prefixes pushed while closers of arrays and objects are penalised (long outputs)."""
    tok = backend.codec.tokenizer
    vocab = backend.shape.vocab_size
    text = [tok.decode([i]) for i in range(len(tok))]
    gen = torch.Generator().manual_seed(0)
    noise = torch.randn(vocab, generator=gen) * 0.2
    adversarial = noise.clone()
    adversarial[[i for i, t in enumerate(text) if t[:1] in {'"', ",", " ", "0", "9", "P", "E"}]] += 0.6
    adversarial[[i for i, t in enumerate(text) if any(c in t for c in "]}")]] -= 0.6
    return {"noise": noise, "adversarial": adversarial}


@contextlib.contextmanager
def biased(backend, bias: torch.Tensor):
    """The model's full-vocabulary logits (what greedy decoding reads) plus ``bias``. The bias
    lives in ``model.logits`` on the host, so the CPU engine's steps that pick inside their own
    call (``model.run_pick_step``) step aside meanwhile: every pick then reads the biased logits."""
    from fastjudge.backends.qwen import backend as qwen_backend

    model = backend.model
    original, picking = model.logits, qwen_backend.run_pick_step
    bias = bias.to(backend.device)
    model.logits = lambda hidden, rows=None: original(hidden, rows) + (bias if rows is None else 0)
    qwen_backend.run_pick_step = lambda *args, **kwargs: None
    try:
        yield
    finally:
        model.logits, qwen_backend.run_pick_step = original, picking


def requests_for(spec, n: int = 3, seed: int = 0) -> list[Request]:
    """``n`` rows sharing a prefix, with suffixes of different lengths."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(5, 900, size=12)
    return [Request(i, np.concatenate([prefix, rng.integers(5, 900, size=2 + 5 * i)]), spec, prefix_len=12)
            for i in range(n)]


def decode(backend, reqs, jump_forward: bool, max_rows: int | None = None):
    backend.jump_forward, backend.max_decode_rows = jump_forward, max_rows
    backend.reset_decode_stats()
    try:
        return backend.run(reqs), dict(backend.decode_stats)
    finally:
        backend.jump_forward, backend.max_decode_rows = True, None


def assert_same(a, b):
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        assert x.finished == y.finished
        if x.tracked_logits is not None or y.tracked_logits is not None:
            np.testing.assert_allclose(x.tracked_logits, y.tracked_logits, atol=1e-5, rtol=0)


def emitted(outputs) -> int:
    """Tokens chosen or forced, the stop token included."""
    return sum(len(o.token_ids) + o.finished for o in outputs)


# ------------------------------------------------------------------------------------------
# The grammar's forced token


def test_forced_token_is_the_only_allowed_token(backend):
    """Along random constrained decodes of every schema: the forced token read from a bitmask
    row (``token_mask.forced_in``, what ``TokenMask.forced`` gives jump-forward) is the allowed
    set's one member exactly when it has one member, else None; None once terminated."""
    from fastjudge.runtime.grammar import GrammarCache

    grammars = GrammarCache(backend.codec.tokenizer, backend.shape.vocab_size, backend.codec.eos_token_ids,
                            max_threads=1)
    gen = torch.Generator().manual_seed(0)
    forced_seen = 0
    for name in sorted(visexmem_schemas()):
        matcher = grammars.matcher(json_spec(name))
        while not matcher.finished:
            allowed = probe.allowed(matcher).nonzero().flatten().tolist()
            forced = probe.forced(matcher)
            assert forced == (allowed[0] if len(allowed) == 1 else None)
            forced_seen += forced is not None
            matcher.accept(int(probe.masked(matcher, torch.randn(backend.shape.vocab_size, generator=gen)).argmax()))
        assert probe.forced(matcher) is None
    assert forced_seen > 0


# ------------------------------------------------------------------------------------------
# The multi-token step


def test_multi_token_step_equals_one_token_steps(backend):
    """Rows of 3, 1, 0 and 5 new tokens (right-padded in one ``step``; one row continuing at an
    M-RoPE position past its length, one feeding nothing) against each row alone through
    one-token steps: hidden states, K/V, DeltaNet conv and recurrent states, lengths and
    positions. The padded step leaves the row that fed nothing as it was."""
    model, shape = backend.model, backend.shape
    rng = np.random.default_rng(1)
    states = [snapshot_of(backend, rng.integers(5, 900, size=n)) for n in (7, 12, 9, 4)]
    states[1].next_position += 9  # text after an image continues past the length
    counts = [3, 1, 0, 5]
    new = [rng.integers(5, 900, size=k).tolist() for k in counts]
    padded = torch.tensor([t + [0] * (5 - len(t)) for t in new], device=backend.device)
    capacity = 17  # the longest row's 4 + 5 tokens use all but the last few positions
    together = StatePool(shape, len(states), capacity, backend.device, backend.dtype)
    for b, st in enumerate(states):
        together.load(b, st)
    out = run_step(model, together, 0, padded, counts)
    for b, (st, tokens) in enumerate(zip(states, new)):
        alone = StatePool(shape, 1, capacity, backend.device, backend.dtype)
        alone.load(0, st)
        for j, t in enumerate(tokens):
            h = run_step(model, alone, 0, torch.tensor([[t]], device=backend.device), [1])
            torch.testing.assert_close(out[b, j], h[0, 0], atol=1e-5, rtol=1e-5)
        assert int(together.lengths[b]) == int(alone.lengths[0]) == together.held[b] == st.length + len(tokens)
        assert int(together.positions[b]) == int(alone.positions[0]) == st.next_position + len(tokens)
        n = int(alone.lengths[0])
        for kind, mine, ref in zip(shape.layer_types, together.layers, alone.layers):
            if kind == "full_attention":
                for x, y in zip(mine, ref):
                    torch.testing.assert_close(x[b, :, :n], y[0, :, :n], atol=1e-5, rtol=1e-5)
            else:
                for x, y in zip(mine, ref):  # conv state, recurrent state
                    torch.testing.assert_close(x[b], y[0], atol=1e-5, rtol=1e-5)
    idle = states[2]
    for kind, mine, ref in zip(shape.layer_types, together.layers, idle.layers):
        if kind != "full_attention":
            torch.testing.assert_close(mine[0][2], ref[0][0], atol=0, rtol=0)
            torch.testing.assert_close(mine[1][2], ref[1][0].float(), atol=0, rtol=0)
    assert ("linear_attention" in shape.layer_types) == (backend.shape.arch != "qwen3")


def test_slot_moves_and_pool_size(backend):
    """A finished row's slot takes the last live row's state (``move``), which then decodes as
    it would have in its own slot; the pool's bytes are what ``pool_bytes`` says."""
    model, shape = backend.model, backend.shape
    rng = np.random.default_rng(2)
    states = [snapshot_of(backend, rng.integers(5, 900, size=n)) for n in (5, 8)]
    pool = StatePool(shape, 2, 12, backend.device, backend.dtype)
    for b, st in enumerate(states):
        pool.load(b, st)
    token = torch.tensor([[17]], device=backend.device)
    reference = run_step(model, pool, 1, token, [1])[0, 0]
    pool.load(1, states[1])
    pool.move([1], [0])
    moved = run_step(model, pool, 0, token, [1])[0, 0]
    torch.testing.assert_close(moved, reference, atol=1e-6, rtol=1e-6)
    assert pool.nbytes == pool_bytes(shape, 2, 12, torch.empty((), dtype=backend.dtype).element_size())


def test_load_rows_equals_loading_one_by_one(backend):
    """``StatePool.load_rows`` (rows that share a snapshot written together, by a slice or by an
    index) leaves the pool exactly as ``load`` slot by slot: shared snapshots in consecutive and
    scattered slots, an empty row, over a pool that held other states before."""
    shape = backend.shape
    rng = np.random.default_rng(4)
    a, b = (snapshot_of(backend, rng.integers(5, 900, size=n)) for n in (6, 9))
    order = [a, a, b, None, a, b, b]
    pools = [StatePool(shape, 8, 12, backend.device, backend.dtype) for _ in range(2)]
    for pool in pools:
        for slot in range(8):
            pool.load(slot, b if slot % 2 else a)  # stale states to overwrite
    for slot, state in enumerate(order):
        pools[0].load(1 + slot, state)
    pools[1].load_rows(1, order)
    for x, y in zip(pools[0].buffers(), pools[1].buffers()):
        assert torch.equal(x, y)
    assert np.array_equal(pools[0].held, pools[1].held)


def snapshot_of(backend, ids):
    """The state after prompt ``ids``: prefilled into a pool slot of its own, snapshotted."""
    pool = StatePool(backend.shape, 1, len(ids), backend.device, backend.dtype)
    run_step(backend.model, pool, 0, torch.from_numpy(np.asarray(ids))[None].to(backend.device), [len(ids)])
    return pool.snapshot(0, len(ids))


# ------------------------------------------------------------------------------------------
# Jump-forward against token-by-token greedy decoding


@pytest.mark.parametrize("name", sorted(visexmem_schemas()))
def test_jump_forward_equals_token_by_token(backend, name):
    spec = json_spec(name)
    reqs = requests_for(spec, n=2)
    for bias in adversarial_biases(backend).values():
        with biased(backend, bias):
            off, off_stats = decode(backend, reqs, jump_forward=False)
            on, on_stats = decode(backend, reqs, jump_forward=True)
        assert_same(off, on)
        assert off_stats["tokens_forced"] == 0 and on_stats["tokens_forced"] > 0
        for stats in (off_stats, on_stats):
            assert stats["tokens_computed"] + stats["tokens_forced"] == emitted(on)
        assert on_stats["decode_steps"] < off_stats["decode_steps"]


@dataclass(frozen=True)
class TrackedJson(Json):
    """A Json spec that also tracks candidate logits at every step (as Text can): the extend
    must then give the logits at forced positions too."""

    track_ids: tuple[int, ...] = ()


def test_tracked_logits_at_forced_positions(backend):
    base = json_spec("single-response")
    spec = TrackedJson(base.schema, base.max_new_tokens, track_ids=(3, 10, 11, 400))
    reqs = requests_for(spec, n=2)
    with biased(backend, adversarial_biases(backend)["adversarial"]):
        off, _ = decode(backend, reqs, jump_forward=False)
        on, stats = decode(backend, reqs, jump_forward=True)
    assert stats["tokens_forced"] > 0
    assert_same(off, on)
    assert all(o.tracked_logits.shape == (len(o.token_ids), 4) for o in on)


# ------------------------------------------------------------------------------------------
# Early exit and refill


@contextlib.contextmanager
def step_sizes(backend):
    """The number of rows of every decoding step."""
    from fastjudge.backends.qwen import backend as qwen_backend

    sizes = []

    def logged(model, pool, start, tokens, counts, compiled=None, **images):
        sizes.append(tokens.shape[0])
        return run_step(model, pool, start, tokens, counts, compiled, **images)

    qwen_backend.run_step = logged
    try:
        yield sizes
    finally:
        qwen_backend.run_step = run_step


def test_early_exit_and_refill_equal_one_batch(backend):
    """Json rows that finish at different lengths (jump-forward on), and Text rows with tracked
    logits (LAVE's rationale spec) some of which meet EOS early: finished rows leave the batch
    at once, and under a row limit waiting rows join as others leave; the outputs equal one big
    batch's."""
    eos = sorted(backend.codec.eos_token_ids)
    biases = adversarial_biases(backend)
    text_bias = biases["noise"].clone()
    text_bias[eos] += 0.9
    cases = [(json_spec("boxes"), biases["noise"]), (Text(12, track_ids=(3, 10, 11)), text_bias)]
    shrank = False
    for spec, bias in cases:
        reqs = requests_for(spec, n=4, seed=2)
        with biased(backend, bias):
            decode(backend, reqs[:1], True)  # the shared prefix cached: both runs count suffixes and steps
            with step_sizes(backend) as whole_sizes:
                whole, _ = decode(backend, reqs, True)
            with step_sizes(backend) as sizes:
                part, _ = decode(backend, reqs, True, max_rows=2)
        assert_same(whole, part)
        assert max(sizes) <= 2
        # no row is carried along after it finished: each takes exactly the steps it needs,
        # in one batch or joining late
        assert sum(sizes) == sum(whole_sizes)
        assert all(a >= b for a, b in zip(whole_sizes, whole_sizes[1:]))
        shrank |= whole_sizes[-1] < whole_sizes[0] <= 4
    assert shrank


# ------------------------------------------------------------------------------------------
# Against transformers


class GrammarLogits:
    """transformers ``generation/logits_process.py``, ``LogitsProcessor.__call__(input_ids,
    scores)``: called by ``generate`` with the sequence so far and the next-token scores; here
    the grammar accepts the last generated token, then the biased scores are masked."""

    def __init__(self, matcher, bias: torch.Tensor, prompt_len: int):
        self.matcher, self.bias, self.prompt_len = matcher, bias, prompt_len

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] > self.prompt_len:
            self.matcher.accept(int(input_ids[0, -1]))
        return probe.masked(self.matcher, scores[0] + self.bias)[None]


@pytest.mark.parametrize("name", ["parts", "boxes"])
def test_jump_forward_matches_transformers_masked_greedy(qwen_dir, backend, name):
    """transformers ``generation/utils.py``, ``GenerationMixin.generate`` (greedy,
    ``logits_processor``) with the same grammar mask and bias, one prompt at a time."""
    from test_qwen_faithfulness import hf_model
    from transformers import LogitsProcessorList

    hf = hf_model(qwen_dir)
    spec = json_spec(name)
    bias = adversarial_biases(backend)["adversarial"]
    reqs = requests_for(spec, n=1)
    with biased(backend, bias):
        ours, stats = decode(backend, reqs, jump_forward=True)
    assert stats["tokens_forced"] > 0
    grammar = backend._grammars
    for req, out in zip(reqs, ours):
        ids = torch.tensor([req.prompt_ids.tolist()])
        processor = GrammarLogits(grammar.matcher(spec), bias, ids.shape[1])
        gen = hf.generate(ids, max_new_tokens=spec.max_new_tokens, do_sample=False, num_beams=1,
                          logits_processor=LogitsProcessorList([processor]),
                          eos_token_id=sorted(backend.codec.eos_token_ids))[0, ids.shape[1]:].tolist()
        stop = next((i for i, t in enumerate(gen) if t in backend.codec.eos_token_ids), len(gen))
        assert out.token_ids == gen[:stop]
        assert out.finished == (stop < len(gen))


# ------------------------------------------------------------------------------------------
# The option through the loaders


def test_jump_forward_option_reaches_the_backend(qwen_dir):
    assert load_backend(qwen_dir, EngineOptions(device=TEST_DEVICE, dtype="float32")).jump_forward
    assert not load_backend(qwen_dir, EngineOptions(device=TEST_DEVICE, dtype="float32",
                                                    jump_forward=False)).jump_forward
    judge = LaveJudge(qwen_dir, engine=EngineOptions(device=TEST_DEVICE, dtype="float32", jump_forward=False))
    assert judge.backend.jump_forward is False
    with pytest.raises(ValueError):
        TorchQwenBackend(qwen_dir, device=TEST_DEVICE, dtype="float32", max_decode_rows=0)
