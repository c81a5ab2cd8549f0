"""The holistic judge's VQAScore mode against the world, on a tiny random-weight Qwen3.5
vision-language checkpoint.

The reference is t2v_metrics' VQAScore for Qwen3-VL / Qwen3.5
(``t2v_metrics/models/vqascore_models/qwen3vl_model.py``, ``Qwen3VLModel.forward`` and
``_build_inputs``): the user turn is [image, question] through the chat template with thinking
off; ``generate`` runs one greedy step with ``output_scores=True``; the score is the softmax over
the full vocabulary of that step's scores, read at the first token of ``tokenizer.encode("Yes")``.
Here transformers' ``Qwen3_5ForConditionalGeneration.generate`` does exactly that on the ids and
pixel values fastjudge built, in float32."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import TEST_DEVICE

from fastjudge import HolisticJudge, ImageTextExample
from fastjudge.checkpoints import build_random_qwen_vl
from fastjudge.demo import tokenizer_corpus
from fastjudge.engine_options import EngineOptions
from fastjudge.runtime.requests import Choice
from fastjudge.runtime.scheduler import run_requests

REL_TOL = 1e-4
CAPTIONS = ["A red bus.", "Two  dogs play on the grass ", 'A sign that says "stop".']


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return build_random_qwen_vl(tmp_path_factory.mktemp("holistic_vl"), tokenizer_corpus(), seed=5)


@pytest.fixture(scope="module")
def judge(vl_dir):
    return HolisticJudge(vl_dir, engine=EngineOptions(device=TEST_DEVICE, dtype="float32"))


@pytest.fixture(scope="module")
def reference(vl_dir, judge):
    from fastjudge.reference.holistic import VQAScoreReference

    return VQAScoreReference(vl_dir, judge, dtype="float32")


def image(seed: int, h: int, w: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def examples() -> list[ImageTextExample]:
    sizes = [(72, 96), (64, 64), (56, 112)]
    return [ImageTextExample(image(k, *hw), text, id=k) for k, (hw, text) in enumerate(zip(sizes, CAPTIONS))]


def vqascore_generate(reference, request) -> tuple[float, float]:
    """P("Yes"), P("No") as t2v_metrics reads them (``fastjudge.reference.holistic``: one greedy
    ``generate`` step, softmax over the whole vocabulary of its scores, at each word's first
    token), on the ids and pixel values fastjudge built."""
    ids = torch.tensor([list(request.prompt_ids)])
    pixel_values = torch.cat([torch.as_tensor(im.pixel_values) for im in request.images])
    grid = torch.tensor([im.grid_thw for im in request.images])
    yes, no = reference.probs(ids, pixel_values, grid)
    return yes, no


def test_vqascore_prompt_is_the_metric_user_turn(judge):
    """[image, question] in one user turn, the image first with nothing between it and the
    question (the Qwen chat templates write an image item as vision start, image pad, vision
    end), the text unchanged, then the assistant turn with thinking off."""
    tok = judge.codec.tokenizer
    ex = examples()[1]
    request = judge._request(0, ex)
    question = f'Does this figure show "{ex.text}"? Please answer Yes or No.'
    text = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>" + question
            + "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    ids = tok(text, add_special_tokens=False).input_ids
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    (im,) = request.images
    count = int(np.prod(im.grid_thw)) // 4  # merged 2 x 2 patches
    at = ids.index(pad)
    assert list(request.prompt_ids) == ids[:at] + [pad] * count + ids[at + 1:]
    # shared by an image's captions: everything up to and including the image's vision end
    assert request.prefix_len == at + count + 1 and request.prefix_images == 1
    assert request.spec == Choice(judge.yes_no_ids, full_vocab=True)
    assert judge.yes_no_ids == tuple(tok.encode(w, add_special_tokens=False)[0] for w in ("Yes", "No"))


def test_vqascore_matches_transformers_generate(judge, reference):
    """All pairs scored together (batched, right-padded) against ``generate`` on each pair
    alone, within 1e-4 relative in float32; ``probs`` carry P("No") the same way."""
    exs = examples()
    results = judge.score(exs)
    worst = 0.0
    for ex, r in zip(exs, results):
        assert r.error is None, r.error
        yes, no = vqascore_generate(reference, judge._request(0, ex))
        for ours, theirs in ((r.score, yes), (r.probs[1], no)):
            worst = max(worst, abs(ours - theirs) / theirs)
        assert r.decision == ("yes" if r.probs[0] >= r.probs[1] else "no")
        assert 0 < r.probs[0] + r.probs[1] < 1  # full-vocabulary probabilities
    assert worst < REL_TOL, worst


def test_normalizations_and_templates(judge):
    """``normalize="yes-no"`` is the full-vocabulary pair renormalised; ``template="fastjudge"``
    keeps fastjudge's own prompt and reads either way."""
    exs = examples()
    vocab = judge.score(exs)
    pair = HolisticJudge(judge.backend, normalize="yes-no").score(exs)
    for v, p in zip(vocab, pair):
        assert sum(p.probs) == pytest.approx(1)
        assert p.score == pytest.approx(v.probs[0] / (v.probs[0] + v.probs[1]), rel=1e-6)
        assert p.decision == v.decision
    own = HolisticJudge(judge.backend, template="fastjudge")
    assert own.normalize == "yes-no"
    own_vocab = HolisticJudge(judge.backend, template="fastjudge", normalize="vocab")
    for a, b in zip(own.score(exs), own_vocab.score(exs)):
        assert a.score == pytest.approx(b.probs[0] / (b.probs[0] + b.probs[1]), rel=1e-6)
    request = own._request(0, exs[0])
    assert request.prefix_len > 0 and request.spec == Choice(own.yes_no_ids)
    with pytest.raises(ValueError, match="template"):
        HolisticJudge(judge.backend, template="clip")
    with pytest.raises(ValueError, match="normalize"):
        HolisticJudge(judge.backend, normalize="softmax")


def test_full_vocab_choice_beside_plain_choice(judge):
    """One batch may mix full-vocabulary and candidate-only Choice requests: the first get
    ``logprobs`` over the vocabulary, the second none, and both the same logits and probs as
    when run apart."""
    request = judge._request(0, examples()[0])
    plain = replace(request, index=1, spec=Choice(judge.yes_no_ids))
    together = {o.index: o for b in run_requests(judge.backend, [request, plain], 1 << 16) for o in b}
    apart = judge.backend.run([plain])[0]
    assert together[1].logprobs is None
    np.testing.assert_allclose(together[1].probs, apart.probs, rtol=1e-6)
    np.testing.assert_allclose(together[0].logits, together[1].logits, rtol=1e-6)
    full = together[0].logprobs
    assert full.shape == (2,) and np.all(full < np.log(together[0].probs))


def test_image_content_key_and_pixels(tmp_path):
    """The content key follows the pixels (and the shape), not how the image is given; the
    pixel tensor is a copy the caller's array cannot change afterwards."""
    from PIL import Image as PILImage

    from fastjudge.io.images import image_tensor, load_image, read_image

    a = image(3, 20, 30)
    PILImage.fromarray(a).save(tmp_path / "a.png")
    keys = {read_image(src)[1] for src in (a, np.asfortranarray(a), PILImage.fromarray(a),
                                            (tmp_path / "a.png").read_bytes(), tmp_path / "a.png")}
    assert len(keys) == 1
    changed = a.copy()
    changed[7, 11, 2] ^= 1
    assert read_image(changed)[1] not in keys
    assert read_image(a.reshape(30, 20, 3))[1] not in keys  # same bytes, another shape
    loaded = load_image(a)
    assert loaded.key in keys and torch.equal(loaded.pixels, torch.from_numpy(a).permute(2, 0, 1))
    pixels = image_tensor(a)
    assert pixels.is_contiguous() and pixels.shape == (3, 20, 30)
    a[0, 0] = a[0, 0] + 1
    assert not torch.equal(pixels, torch.from_numpy(a).permute(2, 0, 1))  # a copy, taken then


def test_image_pixels_built_once_per_content(judge, monkeypatch):
    """An image's captions share one encoding; its pixel tensor is built once. The same array
    changed between examples is another image (the key is the content)."""
    from fastjudge.judges import holistic

    real, built = holistic.image_tensor, []
    monkeypatch.setattr(holistic, "image_tensor", lambda array: built.append(1) or real(array))
    a = image(4, 56, 84)
    memo = {}
    first = [judge._request(i, ImageTextExample(a, text), memo) for i, text in enumerate(CAPTIONS)]
    assert len(built) == 1 and len({id(r.images[0]) for r in first}) == 1
    a[0, 0, 0] ^= 255
    again = judge._request(3, ImageTextExample(a, CAPTIONS[0]), memo)
    assert len(built) == 2 and again.images[0].key != first[0].images[0].key
    before, after = (torch.as_tensor(r.images[0].pixel_values) for r in (first[0], again))
    assert not torch.equal(before, after)


def test_t5_backend_refuses_full_vocab(t5_backend):
    from fastjudge.runtime.requests import Request

    request = Request(0, t5_backend.codec.encode_prompt("Question: a? Output:"), Choice((3, 4), full_vocab=True))
    with pytest.raises(NotImplementedError, match="decoder-only"):
        t5_backend.run([request])


def test_command_line_options():
    from fastjudge.cli import build_parser
    from fastjudge.judges import registry

    argv = ["rescore", "--judge", "holistic", "--model", "m", "--input", "i", "--output", "o",
            "--template", "fastjudge", "--normalize", "vocab"]
    values = registry.option_values(build_parser().parse_args(argv), registry.HOLISTIC_OPTIONS)
    assert values["template"] == "fastjudge" and values["normalize"] == "vocab"


def test_recent_images_read_each_source_once(tmp_path, monkeypatch):
    """``RecentImages``: an image's captions next to each other read (decode and hash) its
    source once; an equal but distinct array, bytes, and a source pushed out of the recent ones
    are read again; every read gives ``read_image``'s array and key."""
    from PIL import Image

    from fastjudge.io import images

    reads = []
    real = images.read_image

    def counted(image, root=None, max_pixels=images.MAX_IMAGE_PIXELS):
        reads.append(image if isinstance(image, str) else type(image).__name__)
        return real(image, root, max_pixels)

    monkeypatch.setattr(images, "read_image", counted)
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (20, 30, 3), dtype=np.uint8)
    Image.fromarray(a).save(tmp_path / "a.png")
    recent = images.RecentImages(root=tmp_path, size=2)

    key_a = real(a)[1]
    for _ in range(3):
        array, key = recent.read(a)
        assert array is a and key == key_a
    assert recent.read("a.png")[1] == key_a and recent.read("a.png")[1] == key_a
    assert recent.read(a.copy())[1] == key_a  # another object: read again, same content key
    assert reads == ["ndarray", "a.png", "ndarray"]
    png = (tmp_path / "a.png").read_bytes()
    recent.read(png), recent.read(png)
    assert reads[-2:] == ["bytes", "bytes"]
    recent.read(a)  # pushed out by the two sources after it (size 2): read again
    assert reads[-1] == "ndarray"
