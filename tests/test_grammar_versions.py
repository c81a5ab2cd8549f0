"""The grammar path on both xgrammar lines fastjudge supports: 0.1.32 (pinned by TensorRT-LLM
1.3.x) and 0.2.9+. Runs with whichever is installed; the 0.1.32 matcher surface is also imitated
on a newer install, so a decode through the engine's path uses nothing 0.1.32 lacks.

Upstream contract: xgrammar ``python/xgrammar/matcher.py`` at tag v0.1.32, ``GrammarMatcher``'s
public names (no ``is_completed``), and its UTF-8 leniency inside strings (see
``runtime/grammar.py``)."""

from __future__ import annotations

import json

import pytest
import torch

xgr = pytest.importorskip("xgrammar")

import grammar_probe as probe  # noqa: E402

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
def test_decode_through_either_surface(cache, surface):
    """Random constrained decodes through ``fill_row`` and ``accept`` (the engine's calls) on
    either matcher surface end in JSON that parses, the stop token allowed exactly when the text
    so far is whole JSON (object schemas: complete JSON cannot be extended)."""
    schema = object_schema({"a": text_schema(6), "b": {"enum": ["x", "yz"]}})
    spec = Json.from_schema(schema)
    vocab = list(cache.tokenizer_info.decoded_vocab)
    eos = min(cache.stop_token_ids)
    gen = torch.Generator().manual_seed(3)
    for _ in range(4):
        m = cache.matcher(spec)
        if surface == "0.1.32":
            m._matcher = Matcher0132(m._matcher)
            assert not hasattr(m._matcher, "is_completed")
        raw = b""
        while True:
            stop_allowed = bool(probe.allowed(m)[eos])
            try:
                whole = _parses(raw.decode("utf-8"))
            except UnicodeDecodeError:  # mid-character: not whole JSON
                whole = False
            assert stop_allowed == whole, raw
            token = int(probe.masked(m, torch.randn(cache.vocab_size, generator=gen)).argmax())
            m.accept(token)
            if m.finished:
                break
            raw += vocab[token]
        assert _parses(raw.decode("utf-8"))


def test_bytes_never_in_utf8_are_masked(cache):
    """Inside a string xgrammar 0.1.32 allows the lead bytes C0, C1 and F5..F7 and any
    continuation after F4; the matcher masks them on either version."""
    vocab = list(cache.tokenizer_info.decoded_vocab)
    single = {raw[0]: i for i, raw in enumerate(vocab) if len(raw) == 1}
    m = cache.matcher(Json.from_schema(object_schema({"a": text_schema(8)})))
    for t in (single[b] for b in b'{"a": "'):
        m.accept(t)
    allowed = probe.allowed(m)
    never = {0xC0, 0xC1, *range(0xF5, 0x100)}
    assert not any(allowed[i] for i, raw in enumerate(vocab) if never & set(raw))
    assert allowed[single[0xC3]] and allowed[single[0xF4]]  # valid leads stay allowed
    m.accept(single[0xF4])
    after = probe.allowed(m)
    assert [b for b in range(0x80, 0xC0) if after[single[b]]] == list(range(0x80, 0x90))
