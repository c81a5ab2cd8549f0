"""The prompt codec (``fastjudge.codec``) on real tokenizers trained here: image slots expanded in
id space give the ids of the fully expanded text (what the Qwen processor feeds the model), the
shared prefix is exact, answer ids follow one rule for every judge, and every backend satisfies
the ``Backend`` protocol."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastjudge.backends.protocol import Backend, check_backend
from fastjudge.checkpoints import QWEN_VISION_TOKENS, train_bpe_tokenizer
from fastjudge.codec import ChatCodec, ImageTokens, TextCodec
from fastjudge.demo import tokenizer_corpus
from fastjudge.judges.lave import RATING_CUE
from fastjudge.judges.visexmem import DECISION_PREFIX
from fastjudge.runtime.requests import Image


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    tok = train_bpe_tokenizer(tmp_path_factory.mktemp("codec-bpe"), tokenizer_corpus())
    tok.add_tokens(QWEN_VISION_TOKENS, special_tokens=True)
    return tok


@pytest.fixture(scope="module")
def codec(chat_tokenizer):
    ids = {t: chat_tokenizer.convert_tokens_to_ids(t) for t in QWEN_VISION_TOKENS}
    image_tokens = ImageTokens(ids["<|image_pad|>"], ids["<|vision_start|>"], ids["<|vision_end|>"], 2)
    return ChatCodec(chat_tokenizer, [chat_tokenizer.convert_tokens_to_ids("<|im_end|>")], image_tokens)


def image(grid, key: bytes) -> Image:
    return Image(torch.zeros(int(np.prod(grid)), 4), grid, key)


def expanded_text(grid) -> str:
    """An image as the Qwen processor writes it: one image token per merged patch."""
    n = int(np.prod(grid)) // 4
    return "<|vision_start|>" + "<|image_pad|>" * n + "<|vision_end|>"


def test_image_slots_match_the_expanded_text(codec, chat_tokenizer):
    """The codec never writes n image tokens as text; its ids must equal tokenizing the text the
    processor would have written (special tokens are atomic, so the two agree)."""
    a, b = image((1, 4, 6), b"a"), image((1, 2, 2), b"b")
    prefix = ("Look at this:\n\n", a, "\nCaption: a red bus.\n\n")
    rest = ("Claim: the bus is red. Region E1 ", b, " Answer yes or no.")
    enc = codec.encode(prefix, rest)
    text = "".join(expanded_text(p.grid_thw) if isinstance(p, Image) else p for p in prefix + rest)
    reference = chat_tokenizer(codec.format_prompt(text), add_special_tokens=False).input_ids
    assert enc.ids.tolist() == reference
    assert enc.images == (a, b) and enc.prefix_images == 1
    # the shared prefix is this prompt's own leading tokens, and ends after the caption
    head = chat_tokenizer(codec.format_prompt(text), add_special_tokens=False).input_ids[: enc.prefix_len]
    assert chat_tokenizer.decode(head).endswith("Caption: a red bus.\n\n")
    request = enc.request(7, spec=None)
    assert (request.prefix_len, request.prefix_images, request.images) == (enc.prefix_len, 1, (a, b))


def test_image_tokens_in_the_text_are_refused(codec):
    """A caption holding the image token's text would shift every image run: an item error."""
    with pytest.raises(ValueError, match="image tokens"):
        codec.encode(("Intro ", image((1, 2, 2), b"x")), "caption <|image_pad|> here")


def test_text_only_codec_refuses_images(chat_tokenizer):
    plain = ChatCodec(chat_tokenizer, [0])
    with pytest.raises(ValueError, match="no vision tower"):
        plain.encode(("a", image((1, 2, 2), b"x")))
    assert plain.encode("a", "b").ids.tolist() == plain.encode_prompt("ab").tolist()


def test_answer_ids_one_rule(codec):
    """Ratings after the rationale cue: forced cue tokens then one token each; yes/no after
    VisExMEM's decision prefix: the shared tokens are forced, each word read at its next token."""
    ratings = codec.answer_ids(["1", "2", "3"], after=RATING_CUE, single_token=True)
    assert ratings.forced == tuple(codec.response_ids(RATING_CUE))
    assert [codec.decode([i]) for i in ratings.ids] == ["1", "2", "3"]
    decision = codec.answer_ids(["yes", "no"], after=DECISION_PREFIX)
    yes, no = (codec.response_ids(DECISION_PREFIX + w) for w in ("yes", "no"))
    n = len(decision.forced)
    assert yes[:n] == no[:n] == list(decision.forced) and (yes[n], no[n]) == decision.ids
    with pytest.raises(ValueError, match="single token"):
        codec.answer_ids(["yes please", "no"], single_token=True)
    with pytest.raises(ValueError, match="apart"):
        codec.answer_ids(["same", "same"])


def test_text_codec_has_no_shared_prefix(t5_backend):
    codec = t5_backend.codec
    assert isinstance(codec, TextCodec)
    enc = codec.encode("Definition: rate it.\n\n", "Question: what? Output:")
    assert enc.prefix_len == 0 and enc.ids[-1] == t5_backend.shape.eos_token_id
    with pytest.raises(ValueError, match="no images"):
        codec.encode(("x", image((1, 2, 2), b"x")))


def test_backends_satisfy_the_protocol(t5_backend):
    """Every backend judges may be handed; the trtllm backend is checked in test_builders (it
    needs a build directory)."""
    assert isinstance(t5_backend, Backend)
    check_backend(t5_backend)
    with pytest.raises(TypeError, match="codec"):
        check_backend(object())
