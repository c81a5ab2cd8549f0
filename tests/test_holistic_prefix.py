"""The holistic judge's shared image prefix: the prompt up to the end of the image runs once per
image, and each caption's question continues from that state, several images side by side in
one batch. Scores must equal those of the same prompts run whole, without a shared prefix, and
transformers' ``Qwen3_5ForConditionalGeneration.generate`` as t2v_metrics reads it
(``t2v_metrics/models/vqascore_models/qwen3vl_model.py``, ``Qwen3VLModel.forward``: one greedy
step, softmax over the full vocabulary at the first token of "Yes")."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from conftest import TEST_DEVICE

from fastjudge import HolisticJudge, ImageTextExample
from fastjudge.checkpoints import build_random_qwen_vl
from fastjudge.demo import tokenizer_corpus
from fastjudge.engine_options import EngineOptions
from fastjudge.runtime.prefix_cache import PrefixCache
from fastjudge.runtime.scheduler import run_requests

CAPTIONS = ["A red bus.", "Two dogs play on the grass.", 'A sign that says "stop".', "A tree."]
# three images of one size (their captions can share a batch) and one of another size
SIZES = [(56, 84), (56, 84), (56, 84), (84, 56)]


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return build_random_qwen_vl(tmp_path_factory.mktemp("holistic_prefix_vl"), tokenizer_corpus(), seed=7)


@pytest.fixture(scope="module")
def judge(vl_dir):
    return HolisticJudge(vl_dir, engine=EngineOptions(device=TEST_DEVICE, dtype="float32"))


def examples() -> list[ImageTextExample]:
    """Each image with 2 to 4 captions, the images' pairs interleaved."""
    rng = np.random.default_rng(3)
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in SIZES]
    out = []
    for j in range(4):
        for k, im in enumerate(images):
            if j < 2 + k % 3:
                out.append(ImageTextExample(im, CAPTIONS[(j + k) % 4], id=(k, j)))
    return out


def fresh(backend) -> None:
    backend.prefix_cache = PrefixCache(1 << 28)


def unshared(judge, exs):
    """Each prompt run whole from its first token (no shared prefix), P("Yes") and P("No")."""
    requests = [replace(judge._request(i, ex), prefix_len=0, prefix_images=0) for i, ex in enumerate(exs)]
    outs = {o.index: o for b in run_requests(judge.backend, requests, 1 << 16) for o in b}
    return np.exp(np.array([outs[i].logprobs for i in range(len(exs))]))


def test_prefix_is_the_image_turn_opening(judge):
    """The shared prefix ends with the image's vision-end token; the ids are the whole prompt's."""
    tok = judge.codec.tokenizer
    request = judge._request(0, examples()[0])
    ids = list(request.prompt_ids)
    end = tok.convert_tokens_to_ids("<|vision_end|>")
    assert request.prefix_len == ids.index(end) + 1 and request.prefix_images == 1
    assert judge.codec.encode("", (request.images[0],) + ('Does this figure show "A red bus."? '
                                                        "Please answer Yes or No.",)).ids.tolist() == ids


@pytest.mark.parametrize("template", ["vqascore", "fastjudge"])
def test_shared_prefix_equals_whole_prompts(judge, template):
    """Several captions per image, several images per batch (and one image of another size in
    its own group): the same P("Yes") / P("No") as every prompt run whole."""
    j = HolisticJudge(judge.backend, template=template, normalize="vocab")
    exs = examples()
    fresh(j.backend)
    results = j.score(exs)
    assert all(r.error is None for r in results)
    shared = np.array([r.probs for r in results])
    np.testing.assert_allclose(shared, unshared(j, exs), rtol=2e-5)


def test_one_prefix_per_image_and_mixed_batches(judge):
    """The planner puts different images' captions in one batch (any grids), and the model runs
    each image's prefix exactly once: tokens computed are one prefix per image plus every
    caption's suffix. A second run reuses the cached states: suffixes only. (The test images'
    prefixes are 12 tokens, too short to pay for their own pass on the CPU: the prefix route is
    forced, ``pass_tokens = 0``; ``backends.qwen.routing``.)"""
    exs = examples()
    requests = [judge._request(i, ex) for i, ex in enumerate(exs)]
    backend = judge.backend
    fresh(backend)
    backend.pass_tokens, pass_tokens = 0, backend.pass_tokens
    prefixes = {r.images[0].key: r.prefix_len for r in requests}
    suffixes = sum(r.num_tokens - r.prefix_len for r in requests)
    before, batches = backend.tokens_computed, []
    run = backend.run
    backend.run = lambda batch: batches.append({r.images[0].key for r in batch}) or run(batch)
    try:
        judge.score(exs)
        assert max(len(keys) for keys in batches) == len(SIZES)  # every image's captions together
        assert backend.tokens_computed - before == sum(prefixes.values()) + suffixes
        before = backend.tokens_computed
        judge.score(exs)
        assert backend.tokens_computed - before == suffixes
    finally:
        del backend.run
        backend.pass_tokens = pass_tokens


def test_batched_prefix_rows_equal_one_by_one(judge):
    """Prefix states computed together for several images equal each image's computed alone
    (the batch size of one): the scores of a batch whose states were all computed together
    against batches of one row each."""
    exs = [ex for ex in examples() if ex.image.shape[:2] == SIZES[0]]
    requests = [judge._request(i, ex) for i, ex in enumerate(exs)]
    fresh(judge.backend)
    together = {o.index: o for o in judge.backend.run(requests)}
    fresh(judge.backend)
    alone = {r.index: judge.backend.run([r])[0] for r in requests}
    for i in together:
        np.testing.assert_allclose(together[i].logprobs, alone[i].logprobs, rtol=2e-5)


def test_shared_prefix_matches_transformers_generate(judge, vl_dir):
    """Two captions of one image and one of another image of the same size, scored in one
    batch from shared prefix states, against ``generate`` on each whole prompt alone
    (float32, 1e-4 relative)."""
    from test_holistic import REL_TOL, vqascore_generate

    from fastjudge.reference.holistic import VQAScoreReference

    reference = VQAScoreReference(vl_dir, judge, dtype="float32")
    exs = [ex for ex in examples() if ex.image.shape[:2] == SIZES[0] and ex.id[0] < 2][:3]
    assert len({ex.id[0] for ex in exs}) == 2
    requests = [judge._request(i, ex) for i, ex in enumerate(exs)]
    fresh(judge.backend)
    outs = {o.index: o for o in judge.backend.run(requests)}
    worst = 0.0
    for i, request in enumerate(requests):
        theirs = vqascore_generate(reference, request)
        ours = np.exp(outs[i].logprobs)
        worst = max(worst, *(abs(a - b) / b for a, b in zip(ours, theirs)))
    assert worst < REL_TOL, worst
