"""Prefix route against whole prompts (``backends.qwen.routing``): which requests run their shared
prefix once, and that either way a request's result is transformers' on its whole prompt."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import TEST_DEVICE

from fastjudge.backends.qwen.backend import TorchQwenBackend
from fastjudge.backends.qwen.routing import route, share_common_prefixes
from fastjudge.checkpoints import build_random_qwen
from fastjudge.demo import tokenizer_corpus
from fastjudge.runtime.prefix_cache import PrefixCache
from fastjudge.runtime.requests import Choice, Request, Text
from fastjudge.runtime.scheduler import run_requests

CANDS = (10, 11, 12)


@pytest.fixture(scope="module")
def qwen35_dir(tmp_path_factory):
    return build_random_qwen(tmp_path_factory.mktemp("qwen3_5_route"), tokenizer_corpus(), seed=5)


@pytest.fixture()
def backend(qwen35_dir):
    return TorchQwenBackend(qwen35_dir, device=TEST_DEVICE, dtype="float32")


def prompts(rng, prefixes: list[int], suffix_len: int = 9) -> list[Request]:
    """``prefixes[i]``: the prefix length of request ``i``'s own prefix (one prefix per request)."""
    out = []
    for i, p in enumerate(prefixes):
        ids = rng.integers(5, 900, size=p + suffix_len)
        out.append(Request(i, ids, Choice(CANDS), prefix_len=p))
    return out


def by_index(backend, requests):
    batches = list(run_requests(backend, requests, 1 << 16))
    return {o.index: o for b in batches for o in b}, len(batches)


@torch.inference_mode()
def hf_probs(model_dir, requests):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    for r in requests:
        logits = hf(input_ids=torch.tensor([r.prompt_ids.tolist()])).logits[0, -1, list(CANDS)].double()
        out.append(torch.softmax(logits, -1).numpy())
    return out


def test_unshared_prefixes_run_whole_in_one_batch(backend, qwen35_dir):
    """Prefixes nobody else shares: one batched pass of whole prompts (no prefix cached), each
    row equal to transformers' forward on its prompt (``Qwen3_5ForCausalLM.forward``) and to the
    same request through the prefix route."""
    reqs = prompts(np.random.default_rng(0), [40, 57, 33, 71])
    outs, batches = by_index(backend, reqs)
    assert batches == 1 and len(backend.prefix_cache) == 0
    via_prefix = {o.index: o for o in backend.run(reqs[:1])}  # run() takes requests as given
    assert len(backend.prefix_cache) == 1
    np.testing.assert_allclose(outs[0].probs, via_prefix[0].probs, rtol=1e-5)
    for r, ref in zip(reqs, hf_probs(qwen35_dir, reqs)):
        np.testing.assert_allclose(outs[r.index].probs, ref, rtol=1e-4, atol=1e-6)


def test_shared_prefix_runs_once(backend):
    """Three requests of one 60-token prefix: the prefix route (one cached state), one batch."""
    rng = np.random.default_rng(1)
    prefix = rng.integers(5, 900, size=60)
    reqs = [Request(i, np.concatenate([prefix, rng.integers(5, 900, size=5 + i)]), Choice(CANDS), prefix_len=60)
            for i in range(3)]
    outs, batches = by_index(backend, reqs)
    assert batches == 1 and len(backend.prefix_cache) == 1
    alone = backend.run([Request(0, reqs[2].prompt_ids, Choice(CANDS))])[0]
    np.testing.assert_allclose(outs[2].probs, alone.probs, rtol=1e-5)


def test_rows_of_different_prefixes_share_a_batch(backend, qwen35_dir):
    """Two prefixes of different lengths, three requests each, with different suffix lengths:
    both prefixes cached, all six rows in one suffix batch (each from its own snapshot), each
    equal to transformers' forward on its whole prompt."""
    rng = np.random.default_rng(6)
    reqs = []
    for p in (50, 83):
        prefix = rng.integers(5, 900, size=p)
        for i in range(3):
            ids = np.concatenate([prefix, rng.integers(5, 900, size=2 + 5 * i)])
            reqs.append(Request(len(reqs), ids, Choice(CANDS), prefix_len=p))
    outs, batches = by_index(backend, reqs)
    assert batches == 1 and len(backend.prefix_cache) == 2
    for r, ref in zip(reqs, hf_probs(qwen35_dir, reqs)):
        np.testing.assert_allclose(outs[r.index].probs, ref, rtol=1e-4, atol=1e-6)


def test_kept_prefix_is_cached_for_one_request(backend):
    """A request marked ``keep_prefix`` (its prefix comes back in a later call: LAVE's
    demonstrations) takes the prefix route alone; the next call is served from the cache."""
    rng = np.random.default_rng(2)
    prefix = rng.integers(5, 900, size=48)
    calls = [[Request(0, np.concatenate([prefix, rng.integers(5, 900, size=7)]), Choice(CANDS), prefix_len=48,
                      keep_prefix=True)] for _ in range(2)]
    by_index(backend, calls[0])
    assert len(backend.prefix_cache) == 1
    hits = backend.prefix_cache.index.hits
    by_index(backend, calls[1])
    assert backend.prefix_cache.index.hits == hits + 1


def test_greedy_text_with_unshared_prefixes(backend, qwen35_dir):
    """Generation rows whose prefixes nobody shares run whole: the tokens of transformers'
    greedy ``generate`` (``GenerationMixin.generate``, ``do_sample=False``)."""
    from transformers import AutoModelForCausalLM

    rng = np.random.default_rng(3)
    reqs = [Request(i, rng.integers(5, 900, size=30 + 11 * i), Text(6), prefix_len=20 + i) for i in range(3)]
    outs, _ = by_index(backend, reqs)
    assert len(backend.prefix_cache) == 0
    hf = AutoModelForCausalLM.from_pretrained(str(qwen35_dir), dtype=torch.float32).eval()
    eos = sorted(backend.codec.eos_token_ids)
    for r in reqs:
        gen = hf.generate(torch.tensor([r.prompt_ids.tolist()]), max_new_tokens=6, do_sample=False, num_beams=1,
                          eos_token_id=eos)[0, len(r.prompt_ids):].tolist()
        stop = next((i for i, t in enumerate(gen) if t in eos), len(gen))
        assert outs[r.index].token_ids == gen[:stop]


def key_of(r: Request) -> bytes:
    return r.prompt_ids[: r.prefix_len].astype(np.int64).tobytes()


@pytest.mark.parametrize("sharing, prefix_len, pass_tokens, whole", [
    (1, 500, 64, True),    # nobody shares it: nothing to save
    (2, 63, 64, True),     # (n - 1) * P = 63 < 64: a second pass costs more than it saves
    (2, 64, 64, False),    # 64 saved tokens pay for the pass
    (5, 20, 64, False),
    (3, 40, 2048, True),   # a device whose pass costs thousands of tokens of work
])
def test_cost_rule(sharing, prefix_len, pass_tokens, whole):
    """``(n - 1) * P < pass_tokens`` for a prefix neither cached nor seen: whole."""
    prefix = np.arange(prefix_len)
    reqs = [Request(i, np.concatenate([prefix, [1000 + i]]), Choice(CANDS), prefix_len=prefix_len)
            for i in range(sharing)]
    routed = route(reqs, key_of, PrefixCache(1 << 20), pass_tokens)
    assert [r.prefix_len for r in routed] == [0 if whole else prefix_len] * sharing
    assert [r.index for r in routed] == [r.index for r in reqs]


def test_cached_or_kept_prefixes_take_the_prefix_route():
    prefix = np.arange(30)
    reqs = [Request(0, np.concatenate([prefix, [7]]), Choice(CANDS), prefix_len=30),
            Request(1, np.arange(12), Choice(CANDS))]  # no prefix at all: untouched
    cache = PrefixCache(1 << 20)
    assert [r.prefix_len for r in route(reqs, key_of, cache, 64)] == [0, 0]  # nobody shares it: whole

    class State:
        nbytes = 100

    cache.insert(prefix, State())
    assert [r.prefix_len for r in route(reqs, key_of, cache, 64)] == [30, 0]  # cached
    kept = [Request(0, np.concatenate([prefix, [7]]), Choice(CANDS), prefix_len=30),
            Request(2, np.concatenate([prefix, [8]]), Choice(CANDS), prefix_len=30, keep_prefix=True)]
    assert [r.prefix_len for r in route(kept, key_of, PrefixCache(1 << 20), 64)] == [30, 30]  # one asks to keep it


def test_common_beginnings_run_once(backend, qwen35_dir):
    """Requests that begin alike without saying so (VisExMEM's verification prompts: one intro,
    then each caption's own prefix that nobody else shares): the common beginning runs once as a
    prefix (cached), every row continues from it, each equal to transformers' forward on its
    whole prompt and to the same request run whole."""
    rng = np.random.default_rng(7)
    intro = rng.integers(5, 900, size=70)
    reqs = []
    for i in range(5):
        own = rng.integers(5, 900, size=20 + 3 * i)  # a caption of its own, declared as prefix
        ids = np.concatenate([intro, own, rng.integers(5, 900, size=6)])
        reqs.append(Request(i, ids, Choice(CANDS), prefix_len=70 + len(own)))
    routed = backend.route(reqs)
    assert [r.prefix_len for r in routed] == [70] * 5
    outs, batches = by_index(backend, reqs)
    assert batches == 1 and len(backend.prefix_cache) == 1
    alone = backend.run([Request(0, reqs[3].prompt_ids, Choice(CANDS))])[0]
    np.testing.assert_allclose(outs[3].probs, alone.probs, rtol=1e-5)
    for r, ref in zip(reqs, hf_probs(qwen35_dir, reqs)):
        np.testing.assert_allclose(outs[r.index].probs, ref, rtol=1e-4, atol=1e-6)


def begin_alike(groups: list[tuple[int, int]], seed: int = 0) -> list[Request]:
    """For each (count, length): ``count`` requests beginning with the same ``length`` tokens,
    then 5 of their own; families differ from their first token."""
    rng = np.random.default_rng(seed)
    reqs = []
    for family, (count, length) in enumerate(groups):
        start = np.concatenate([[1000 + family], rng.integers(5, 900, size=length - 1)])
        reqs += [Request(len(reqs) + i, np.concatenate([start, rng.integers(5, 900, size=5)]), Choice(CANDS))
                 for i in range(count)]
    return reqs


def everything(r: Request) -> int:
    return len(r.prompt_ids)


@pytest.mark.parametrize("groups, pass_tokens, shared", [
    ([(4, 50), (3, 30), (1, 80)], 64, [50] * 4 + [0] * 3 + [0]),  # 3 x 50 pays for a pass, 2 x 30 does not
    ([(3, 32)], 64, [32] * 3),                                      # 2 x 32 = 64: it pays, just
    ([(2, 40)], 2048, [0, 0]),                                      # a device whose pass costs more
])
def test_common_beginnings_are_shared_where_it_pays(groups, pass_tokens, shared):
    reqs = begin_alike(groups)
    got = share_common_prefixes(reqs, everything, pass_tokens)
    assert [r.prefix_len for r in got] == shared
    assert [r.index for r in got] == [r.index for r in reqs]
    assert all(np.array_equal(a.prompt_ids, b.prompt_ids) for a, b in zip(got, reqs))


def test_nested_beginnings_share_where_they_save_most():
    """Six requests begin with 20 common tokens, two threes of them with 100: the threes share
    their 100 (2 x (2 x 100 - 64) saved, against 5 x 20 - 64); eight that begin with 100 common
    tokens, in pairs with 110, share the 100 (7 x 100 - 64 against 4 x (110 - 64))."""
    rng = np.random.default_rng(4)

    def nested(common: int, groups: int, each: int, inner: int) -> list[Request]:
        """``groups`` groups of ``each`` requests: all begin with the same ``common`` tokens, a
        group's with the same ``inner`` tokens in all."""
        start, reqs = rng.integers(5, 900, size=common), []
        for group in range(groups):
            head = np.concatenate([start, [1000 + group], rng.integers(5, 900, size=inner - common - 1)])
            reqs += [Request(len(reqs), np.concatenate([head, rng.integers(5, 900, size=4)]), Choice(CANDS))
                     for _ in range(each)]
        return reqs

    assert [r.prefix_len for r in share_common_prefixes(nested(20, 2, 3, 100), everything, 64)] == [100] * 6
    assert [r.prefix_len for r in share_common_prefixes(nested(100, 4, 2, 110), everything, 64)] == [100] * 8


def test_what_may_not_be_a_common_prefix():
    """A declared prefix is left as it is (and its request out of the groups); a prefix leaves at
    least one token of the prompt; none reaches a request's first image."""
    start = np.arange(5, 105)
    reqs = [Request(0, start.copy(), Choice(CANDS)),  # the whole common beginning: 99 may be shared
            Request(1, np.concatenate([start, [7, 8]]), Choice(CANDS)),
            Request(2, np.concatenate([start, [9]]), Choice(CANDS)),
            Request(3, np.concatenate([start, [9, 9]]), Choice(CANDS), prefix_len=101)]
    assert [r.prefix_len for r in share_common_prefixes(reqs, everything, 64)] == [99, 99, 99, 101]
    before_image = {0: 100, 1: 60, 2: 100, 3: 100}
    got = share_common_prefixes(reqs, lambda r: before_image[r.index], 64)
    assert [r.prefix_len for r in got] == [60, 60, 60, 101]


def test_text_before_the_first_image():
    """``TorchQwenBackend._text_before_images``: the tokens before the first image token; all of
    a prompt without images."""
    from fastjudge.runtime.requests import Image

    class Stub:
        image_token_id = 77

    ids = np.array([3, 4, 5, 77, 77, 6, 77, 8])
    image = Image(pixel_values=None, grid_thw=(1, 2, 2), key=b"a")
    assert TorchQwenBackend._text_before_images(Stub(), Request(0, ids, Choice(CANDS), images=(image, image))) == 3
    assert TorchQwenBackend._text_before_images(Stub(), Request(0, ids, Choice(CANDS))) == 8


def test_mlps_run_on_real_tokens_only(backend, monkeypatch):
    """Rows of very different suffix lengths in one pass (most of the padded batch is padding):
    the MLPs run on the real tokens alone (``model.packed_tokens``), with the results of the
    padded run (float32, 1e-6)."""
    from fastjudge.backends.qwen import model

    real = torch.tensor([[True] * 5 + [False] * 3, [True] * 8])
    assert model.packed_tokens(real).tolist() == [0, 1, 2, 3, 4, 8, 9, 10, 11, 12, 13, 14, 15]
    assert model.packed_tokens(torch.ones(2, 8, dtype=torch.bool)) is None  # nothing to leave out
    rng = np.random.default_rng(8)
    prefix = rng.integers(5, 900, size=40)
    reqs = [Request(i, np.concatenate([prefix, rng.integers(5, 900, size=n)]), Choice(CANDS), prefix_len=40)
            for i, n in enumerate((3, 30, 7, 2))]
    calls = []
    monkeypatch.setattr(model, "packed_tokens", lambda r, f=model.packed_tokens: calls.append(f(r)) or calls[-1])
    packed, _ = by_index(backend, reqs)
    assert any(c is not None for c in calls)
    monkeypatch.setattr(model, "PACK_MIN_PADDING", 1.1)  # never pack
    backend.prefix_cache = PrefixCache(1 << 26)
    padded, _ = by_index(backend, reqs)
    for r in reqs:
        np.testing.assert_allclose(packed[r.index].probs, padded[r.index].probs, rtol=1e-6)
