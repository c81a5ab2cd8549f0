"""The grammar path on both xgrammar lines fastjudge supports: 0.1.32 (pinned by TensorRT-LLM
1.3.x) and 0.2.9+. Runs with whichever is installed; the 0.1.32 matcher surface is also imitated
on a newer install, so both branches of ``JsonMatcher.completed`` run everywhere.

Upstream contract: xgrammar ``python/xgrammar/matcher.py`` at tag v0.1.32, ``GrammarMatcher``
(no ``is_completed``; ``find_jump_forward_string`` returns the nanobind ``str`` of the forced
bytes, so bytes ending inside a character raise ``UnicodeDecodeError``), and at 0.2.9
``GrammarMatcher.is_completed`` / ``find_jump_forward_string`` (whole characters only)."""

from __future__ import annotations

import json

import pytest
import torch

xgr = pytest.importorskip("xgrammar")

from fastjudge.checkpoints import train_bpe_tokenizer  # noqa: E402
from fastjudge.demo import tokenizer_corpus  # noqa: E402
from fastjudge.runtime.grammar import GrammarCache, Json, object_schema, text_schema  # noqa: E402

# GrammarMatcher's public names in xgrammar v0.1.32 (python/xgrammar/matcher.py)
V0132_MATCHER = {"accept_token", "accept_string", "fill_next_token_bitmask", "find_jump_forward_string",
                 "rollback", "is_terminated", "reset", "max_rollback_tokens", "stop_token_ids"}


class Matcher0132:
    """A real matcher seen through xgrammar 0.1.32's GrammarMatcher surface only."""

    def __init__(self, matcher):
        self._real = matcher

    def __getattr__(self, name):
        if name not in V0132_MATCHER:
            raise AttributeError(name)
        return getattr(self._real, name)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return train_bpe_tokenizer(tmp_path_factory.mktemp("bpe"), tokenizer_corpus())


@pytest.fixture(scope="module")
def cache(tok):
    return GrammarCache(tok, len(tok) + 8, {tok.eos_token_id}, max_threads=2)


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("surface", ["installed", "0.1.32"])
def test_completed_means_whole_json(cache, surface):
    """``completed`` is True exactly when the text so far parses, on every step of random decoding
    (object schemas: complete JSON cannot be extended), with either matcher surface."""
    schema = object_schema({"a": text_schema(6), "b": {"enum": ["x", "yz"]}})
    spec = Json.from_schema(schema)
    vocab = list(cache.tokenizer_info.decoded_vocab)
    gen = torch.Generator().manual_seed(3)
    for _ in range(4):
        m = cache.matcher(spec)
        if surface == "0.1.32":
            m._matcher = Matcher0132(m._matcher)
            assert not hasattr(m._matcher, "is_completed")
        raw = b""
        seen_complete = False
        while True:
            token = int(m.mask(torch.randn(cache.vocab_size, generator=gen)).argmax())
            m.accept(token)
            if m.finished:
                break
            raw += vocab[token]
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:  # mid-character: not whole JSON
                assert not m.completed
                continue
            assert m.completed == _parses(text), text
            seen_complete |= m.completed
        assert seen_complete and m.completed


@pytest.mark.parametrize("schema, forced", [
    ({"enum": ["é", "è"]}, '"'),  # the shared lead byte C3 is forced but is no whole character
    ({"enum": ["aé", "aè"]}, '"a'),
    (object_schema({"k": {"enum": ["xyz"]}}), '{"k": "xyz"}'),
])
def test_jump_forward_whole_characters(cache, schema, forced):
    m = cache.matcher(Json.from_schema(schema, 8))
    assert m.jump_forward() == forced
    assert m.num_tokens == 0 and m.allowed().any()  # the state is unchanged


def test_jump_forward_after_the_end(cache, tok):
    m = cache.matcher(Json.from_schema({"enum": ["x"]}, 8))
    for t in tok.encode('"x"', add_special_tokens=False):
        m.accept(t)
    assert m.jump_forward() == ""
    m.accept(tok.eos_token_id)
    assert m.finished and m.jump_forward() == ""


def test_bytes_never_in_utf8_are_masked(cache):
    """Inside a string xgrammar 0.1.32 allows the lead bytes C0, C1 and F5..F7 and any
    continuation after F4; the matcher masks them on either version."""
    vocab = list(cache.tokenizer_info.decoded_vocab)
    single = {raw[0]: i for i, raw in enumerate(vocab) if len(raw) == 1}
    m = cache.matcher(Json.from_schema(object_schema({"a": text_schema(8)})))
    for t in (single[b] for b in b'{"a": "'):
        m.accept(t)
    allowed = m.allowed()
    never = {0xC0, 0xC1, *range(0xF5, 0x100)}
    assert not any(allowed[i] for i, raw in enumerate(vocab) if never & set(raw))
    assert allowed[single[0xC3]] and allowed[single[0xF4]]  # valid leads stay allowed
    m.accept(single[0xF4])
    after = m.allowed()
    assert [b for b in range(0x80, 0xC0) if after[single[b]]] == list(range(0x80, 0x90))
