"""JSON-schema-constrained decoding: a real byte-level BPE tokenizer with Qwen's chat tokens,
random (and adversarially biased) logits through the matcher; every output must parse, be valid
under its schema and stop within the schema's token bound."""

from __future__ import annotations

import json
import re
from typing import Callable

import pytest
import torch

pytest.importorskip("xgrammar")

from grammar_probe import allowed, masked  # noqa: E402

from fastjudge.checkpoints import train_bpe_tokenizer  # noqa: E402
from fastjudge.demo import tokenizer_corpus  # noqa: E402
from fastjudge.judges.visexmem.schemas import (  # noqa: E402
    PART_TYPES,
    boxes_schema,
    evidence_schema,
    explanation_schema,
    parts_schema,
)
from fastjudge.runtime.grammar import (  # noqa: E402
    GrammarCache,
    GrammarError,
    Json,
    JsonMatcher,
    canonical_schema,
)
from fastjudge.runtime.json_bounds import _pattern_max_chars, json_token_bound  # noqa: E402

PAD = 24  # model vocabulary rows past the tokenizer (lm_head padding)
EVIDENCE_IDS = ["E1", "E2", "E10", "E11", "caption", "box_3", "ocr:1"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return train_bpe_tokenizer(tmp_path_factory.mktemp("bpe"), tokenizer_corpus())


@pytest.fixture(scope="module")
def vocab(tok):
    return len(tok) + PAD


@pytest.fixture(scope="module")
def cache(tok, vocab):
    return GrammarCache(tok, vocab, {tok.eos_token_id}, max_threads=2)


_TOKEN_BYTES = {}


def token_bytes(cache) -> list[bytes]:
    """Each token's bytes (xgrammar rebuilds the list on every access: keep one)."""
    if id(cache) not in _TOKEN_BYTES:
        _TOKEN_BYTES[id(cache)] = (cache, list(cache.tokenizer_info.decoded_vocab))
    return _TOKEN_BYTES[id(cache)][1]


def special_ids(tok):
    return sorted(i for i, t in tok.added_tokens_decoder.items() if t.special)


# ------------------------------------------------------------------------------------------
# A validator for the keywords the schemas use (independent of the grammar machinery)


def validate(value, schema, path="$"):
    def fail(why):
        raise AssertionError(f"{path}: {why}: {value!r}")

    if "anyOf" in schema:
        errors = []
        for sub in schema["anyOf"]:
            try:
                return validate(value, sub, path)
            except AssertionError as e:
                errors.append(str(e))
        fail(f"no anyOf branch matches ({errors})")
    if "enum" in schema and value not in schema["enum"]:
        fail("not in enum")
    kind = schema.get("type")
    if kind == "object":
        if not isinstance(value, dict):
            fail("not an object")
        props = schema.get("properties", {})
        missing = set(schema.get("required", [])) - set(value)
        if missing:
            fail(f"missing {sorted(missing)}")
        if schema.get("additionalProperties") is False and set(value) - set(props):
            fail(f"extra {sorted(set(value) - set(props))}")
        for k, v in value.items():
            validate(v, props.get(k, {}), f"{path}.{k}")
    elif kind == "array":
        if not isinstance(value, list):
            fail("not an array")
        if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)):
            fail(f"length {len(value)}")
        for i, v in enumerate(value):
            validate(v, schema.get("items", {}), f"{path}[{i}]")
    elif kind == "string":
        if not isinstance(value, str):
            fail("not a string")
        if "pattern" in schema and re.search(schema["pattern"], value) is None:
            fail(f"does not match {schema['pattern']!r}")
        if not schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value)):
            fail("length")
    elif kind == "integer":
        if not isinstance(value, int) or isinstance(value, bool):
            fail("not an integer")
        if not schema.get("minimum", value) <= value <= schema.get("maximum", value):
            fail("out of range")
    elif kind == "null":
        if value is not None:
            fail("not null")


def check(value, schema):
    validate(value, schema)
    try:
        import jsonschema
    except ImportError:
        return
    jsonschema.validate(value, schema)


# ------------------------------------------------------------------------------------------
# Decoding with random logits


def schemas():
    return {
        "parts": parts_schema(),
        "evidence": evidence_schema(EVIDENCE_IDS),
        "explanation": explanation_schema(),
        "boxes": boxes_schema(),
    }


def decode_json(step_fn: Callable[[int | None], torch.Tensor], matcher: JsonMatcher,
                max_new_tokens: int) -> tuple[list[int], bool]:
    """Greedy constrained decoding of one row: ``step_fn(last_token)`` returns the next
    full-vocabulary logits (``last_token`` is None on the first call). Returns the tokens without
    the stop token, and whether a stop token ended the text (False: the budget ran out)."""
    tokens: list[int] = []
    last = None
    while len(tokens) < max_new_tokens:
        token = int(masked(matcher, step_fn(last)).argmax())
        matcher.accept(token)
        if matcher.finished:
            return tokens, True
        tokens.append(token)
        last = token
    return tokens, False


def random_decode(tok, cache, schema, seed, bias=None, scale=1.0):
    spec = Json.from_schema(schema)
    matcher = cache.matcher(spec)
    gen = torch.Generator().manual_seed(seed)

    def step(_last):
        z = torch.randn(cache.vocab_size, generator=gen) * scale
        return z if bias is None else z + bias

    tokens, finished = decode_json(step, matcher, spec.max_new_tokens)
    assert finished and matcher.finished, f"ran out of {spec.max_new_tokens} tokens"
    assert len(tokens) + 1 <= json_token_bound(schema)
    specials = set(special_ids(tok))
    assert all(0 <= t < len(tok) and t not in specials for t in tokens)
    vocab_bytes = token_bytes(cache)
    raw = b"".join(vocab_bytes[t] for t in tokens)
    text = raw.decode("utf-8")  # strict: valid UTF-8, so the tokenizer decodes it as matched
    assert tok.decode(tokens) == text
    value = json.loads(text)  # strict: no raw control characters
    check(value, schema)
    assert text == json.dumps(value, ensure_ascii=False)  # fixed separators, no free whitespace
    return tokens, value


@pytest.mark.parametrize("name", ["parts", "evidence", "explanation", "boxes"])
def test_random_logits_give_valid_json(tok, cache, name):
    schema = schemas()[name]
    lengths = []
    for seed in range(24):
        tokens, value = random_decode(tok, cache, schema, seed)
        lengths.append(len(tokens))
        if name == "evidence":
            assert set(value["selected_evidence_ids"]) <= set(EVIDENCE_IDS)
    assert max(lengths) < json_token_bound(schema)


def byte_tokens(cache, pred) -> list[int]:
    """Ids of the tokens whose first byte satisfies ``pred`` (byte-level BPE)."""
    return [i for i, raw in enumerate(token_bytes(cache)) if raw and pred(raw[0])]


# Quote, digits, space, backslash, closers, comma, control bytes, and UTF-8 lead bytes that
# invite overlong forms, surrogates and code points past U+10FFFF.
BIASED_BYTES = [b'"', b"0", b"9", b" ", b"\\", b"]", b"}", b",", b"\x00", b"\t", b"\n", b"P",
                b"\xe0", b"\xed", b"\xf0", b"\xf4", b"\xc0", b"\xff"]


@pytest.mark.parametrize("byte", BIASED_BYTES, ids=[repr(b)[2:-1] for b in BIASED_BYTES])
def test_biased_logits_give_valid_json(tok, cache, vocab, byte):
    bias = torch.zeros(vocab)
    bias[byte_tokens(cache, lambda b: b == byte[0])] = 8.0
    if byte[0] >= 0xC0:  # and after the lead byte, the continuation bytes that break UTF-8
        bias[byte_tokens(cache, lambda b: 0x80 <= b <= 0xBF)] = 4.0
    for name, schema in schemas().items():
        for seed in range(3):
            _, value = random_decode(tok, cache, schema, seed, bias=bias)
            if name == "evidence":
                assert set(value["selected_evidence_ids"]) <= set(EVIDENCE_IDS)


def test_padding_and_special_tokens_never_chosen(tok, cache, vocab):
    """Huge logits on the lm_head padding rows and on the chat tokens: still never emitted."""
    banned = list(range(len(tok), vocab)) + [i for i in special_ids(tok) if i != tok.eos_token_id]
    assert len(banned) > PAD
    bias = torch.zeros(vocab)
    bias[banned] = 1e4
    for name, schema in schemas().items():
        for seed in range(3):
            random_decode(tok, cache, schema, seed, bias=bias)
    matcher = cache.matcher(Json.from_schema(explanation_schema()))
    for piece in ['{"explanation": "', "a"]:
        assert not allowed(matcher)[banned].any()
        for t in tok.encode(piece, add_special_tokens=False):
            matcher.accept(t)


def closer_penalty(tok, vocab, chars='"]}'):
    """Penalise every token that could close a string, array or object: decoding then runs to
    the schema's limits (longest strings, most items): the worst case a model can produce."""
    penalty = torch.zeros(vocab)
    for i in range(len(tok)):
        if any(c in tok.decode([i]) for c in chars):
            penalty[i] = -1e3
    return penalty


def test_runaway_logits_stop_at_schema_bounds(tok, cache, vocab):
    penalty = closer_penalty(tok, vocab)
    schema = parts_schema(max_parts=5, max_text_chars=40)
    for seed in range(4):
        tokens, value = random_decode(tok, cache, schema, seed, bias=penalty)
        assert len(value["parts"]) == 5
        assert all(len(p["text"]) == 40 for p in value["parts"])
    _, value = random_decode(tok, cache, explanation_schema(77), 0, bias=penalty)
    assert len(value["explanation"]) == 77
    penalty = closer_penalty(tok, vocab, "]}")  # ids are quoted: only arrays may not close
    _, value = random_decode(tok, cache, evidence_schema(EVIDENCE_IDS), 0, bias=penalty)
    assert len(value["selected_evidence_ids"]) == len(EVIDENCE_IDS)
    _, value = random_decode(tok, cache, boxes_schema(3), 0, bias=penalty)
    assert len(value["boxes"]) == 3 and all(len(b["bbox_2d"]) == 4 for b in value["boxes"])


def test_full_size_schemas_terminate_under_runaway_logits(tok, cache, vocab):
    penalty = closer_penalty(tok, vocab)
    for name, schema in schemas().items():
        tokens, _ = random_decode(tok, cache, schema, 0, bias=penalty)
        assert len(tokens) < json_token_bound(schema)


# ------------------------------------------------------------------------------------------
# Matcher contract


def test_equal_schemas_share_one_compiled_grammar(tok, vocab):
    cache = GrammarCache(tok, vocab, [tok.eos_token_id], max_threads=1)
    a = {"type": "object", "additionalProperties": False, "required": ["x"],
         "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}}}
    b = {"properties": {"x": {"maximum": 9, "minimum": 0, "type": "integer"}}, "required": ["x"],
         "type": "object", "additionalProperties": False}
    spec_a, spec_b = Json.from_schema(a, 8), Json.from_schema(json.dumps(b), 8)
    assert spec_a == spec_b and hash(spec_a) == hash(spec_b)
    assert cache.compiled(spec_a) is cache.compiled(spec_b)
    cache.matcher(spec_a), cache.matcher(b)
    assert (len(cache), cache.misses, cache.hits) == (1, 1, 3)
    # Property order is the output order: a different spec.
    c = {**a, "properties": {"y": {"type": "null"}, "x": a["properties"]["x"]}, "required": ["y", "x"]}
    d = {**a, "properties": {"x": a["properties"]["x"], "y": {"type": "null"}}, "required": ["y", "x"]}
    assert Json.from_schema(c, 8) != Json.from_schema(d, 8)
    assert list(json.loads(canonical_schema(c))["properties"]) == ["y", "x"]


def test_compiled_grammars_are_bounded(tok, vocab, monkeypatch):
    """Schemas from clients (the chat route) cannot grow the cache without bound: the least
    recently used grammar goes first."""
    import fastjudge.runtime.grammar as grammar_module

    monkeypatch.setattr(grammar_module, "MAX_COMPILED_GRAMMARS", 2)
    cache = GrammarCache(tok, vocab, [tok.eos_token_id], max_threads=1)
    schemas = [{"type": "integer", "minimum": 0, "maximum": n} for n in (1, 2, 3)]
    cache.compiled(schemas[0]), cache.compiled(schemas[1])
    cache.compiled(schemas[0])  # now the most recent: schemas[1] goes when a third arrives
    cache.compiled(schemas[2])
    assert len(cache) == 2 and cache.misses == 3
    cache.compiled(schemas[0])
    assert cache.hits == 2
    cache.compiled(schemas[1])
    assert cache.misses == 4


def test_rejected_tokens_raise(tok, cache, vocab):
    matcher = cache.matcher(Json.from_schema(explanation_schema(5)))
    with pytest.raises(GrammarError):
        matcher.accept(tok.convert_tokens_to_ids("x"))  # must open with "{"
    with pytest.raises(GrammarError):
        matcher.accept(tok.eos_token_id)  # not complete yet
    with pytest.raises(GrammarError):
        matcher.accept(vocab - 1)  # padding row
    with pytest.raises(GrammarError):
        matcher.accept(vocab)  # outside the vocabulary
    for t in tok.encode('{"explanation": "abc"}', add_special_tokens=False):
        assert tok.eos_token_id not in allowed(matcher).nonzero().flatten().tolist()
        matcher.accept(t)
    assert not matcher.finished
    assert allowed(matcher).nonzero().flatten().tolist() == [tok.eos_token_id]  # the JSON is whole
    matcher.accept(tok.eos_token_id)
    assert matcher.finished
    with pytest.raises(GrammarError):
        matcher.accept(tok.convert_tokens_to_ids("x"))
    with pytest.raises(GrammarError):
        matcher.fill_row(torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32), 0)


def test_text_longer_than_the_bound_is_rejected(tok, cache):
    matcher = cache.matcher(Json.from_schema(explanation_schema(5)))
    for t in tok.encode('{"explanation": "abcde', add_special_tokens=False):
        matcher.accept(t)
    assert allowed(matcher)[tok.convert_tokens_to_ids('"')]
    with pytest.raises(GrammarError):
        matcher.accept(tok.convert_tokens_to_ids("f"))


def test_several_stop_tokens(tok, vocab):
    stops = [tok.eos_token_id, tok.pad_token_id]  # <|im_end|>, <|endoftext|>
    cache = GrammarCache(tok, vocab, stops, max_threads=1)
    spec = Json.from_schema(evidence_schema(["E1"]))
    matcher = cache.matcher(spec)
    for t in tok.encode('{"selected_evidence_ids": []}', add_special_tokens=False):
        matcher.accept(t)
    assert allowed(matcher).nonzero().flatten().tolist() == sorted(stops)
    bias = torch.zeros(vocab)
    bias[tok.pad_token_id] = 1e4
    z = masked(matcher, torch.randn(vocab) + bias)
    assert int(z.argmax()) == tok.pad_token_id
    matcher.accept(tok.pad_token_id)
    assert matcher.finished
    # Without it as a stop token, <|endoftext|> is a special token and never allowed.
    matcher = GrammarCache(tok, vocab, [tok.eos_token_id]).matcher(spec)
    assert not allowed(matcher)[tok.pad_token_id]


def test_mask_shapes_and_input_untouched(tok, cache, vocab):
    matcher = cache.matcher(Json.from_schema(boxes_schema()))
    logits = torch.randn(vocab, dtype=torch.bfloat16)
    before = logits.clone()
    flat, row = masked(matcher, logits), masked(matcher, logits[None])
    assert torch.equal(logits, before)
    assert flat.shape == (vocab,) and row.shape == (1, vocab) and flat.dtype == torch.float32
    assert torch.equal(flat, row[0])
    ok = allowed(matcher)
    assert torch.isinf(flat[~ok]).all() and torch.isfinite(flat[ok]).all()
    assert ok.nonzero().flatten().tolist() == [tok.convert_tokens_to_ids("{")]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_mask_on_cuda_matches_cpu(tok, cache, vocab):
    spec = Json.from_schema(parts_schema(3, 20))
    on_cpu, on_gpu = cache.matcher(spec), cache.matcher(spec)
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        z = torch.randn(vocab, generator=gen)
        a, b = masked(on_cpu, z), masked(on_gpu, z.cuda())
        assert b.device.type == "cuda" and torch.equal(a, b.cpu())
        token = int(a.argmax())
        on_cpu.accept(token), on_gpu.accept(token)
        if on_cpu.finished:
            break
    assert on_cpu.finished and on_gpu.finished


# ------------------------------------------------------------------------------------------
# Schemas and bounds


def test_schema_shapes():
    parts = parts_schema(max_parts=4, max_text_chars=10)
    part = parts["properties"]["parts"]["items"]
    assert list(part["properties"]) == ["part_id", "text", "type", "parent_part_id", "head_part_id",
                                        "target_part_id"]
    assert set(PART_TYPES) <= set(part["properties"]["type"]["enum"])
    for schema in (parts, part, evidence_schema(["a"]), explanation_schema(), boxes_schema()):
        assert schema["additionalProperties"] is False
        assert schema["required"] == list(schema["properties"])
    check({"parts": [{"part_id": "P1", "text": "a dog", "type": "object", "parent_part_id": None,
                      "head_part_id": None, "target_part_id": "P2"}]}, parts)
    with pytest.raises(AssertionError):
        check({"parts": [{"part_id": "Q1", "text": "a dog", "type": "object", "parent_part_id": None,
                          "head_part_id": None, "target_part_id": None}]}, parts)
    with pytest.raises(AssertionError):
        check({"boxes": [{"bbox_2d": [0, 0, 1001, 5]}]}, boxes_schema())
    assert evidence_schema(["a", "b", "a"])["properties"]["selected_evidence_ids"]["maxItems"] == 2


def test_empty_evidence_list(tok, cache):
    schema = evidence_schema([])
    for seed in range(3):
        _, value = random_decode(tok, cache, schema, seed)
        assert value == {"selected_evidence_ids": []}


def test_token_bounds():
    assert _pattern_max_chars(r"^P[0-9]{1,3}$") == 4
    assert _pattern_max_chars(r'^[^"\\\x00-\x1f]{1,120}$') == 120
    assert _pattern_max_chars(r"^ab?c{2}\d$") == 5
    for unbounded in (r"^P[0-9]+$", r"^a*$", r"^(a|b)$", r"^a{2,}$"):
        with pytest.raises(ValueError):
            _pattern_max_chars(unbounded)
    for schema in ({"type": "string"}, {"type": "array", "items": {"type": "null"}},
                   {"type": "integer", "minimum": 0}, {"type": "number"}):
        with pytest.raises(ValueError):
            json_token_bound(schema)
    spec = Json.from_schema(boxes_schema(2))
    # {"boxes": [{"bbox_2d": [1000, 1000, 1000, 1000]}, {...}]} + the stop token
    longest = json.dumps({"boxes": [{"bbox_2d": [1000] * 4}] * 2})
    assert spec.max_new_tokens == len(longest) == json_token_bound(boxes_schema(2)) - 1
    assert Json.from_schema(boxes_schema(2), 50).max_new_tokens == 50
    with pytest.raises(ValueError):
        Json.from_schema(boxes_schema(2), 0)


def test_budget_exhaustion_reports_unfinished(tok, cache):
    spec = Json.from_schema(explanation_schema())
    matcher = cache.matcher(spec)
    gen = torch.Generator().manual_seed(0)
    tokens, finished = decode_json(lambda _: torch.randn(cache.vocab_size, generator=gen), matcher, 3)
    assert len(tokens) == 3 and not finished and not matcher.finished


def test_matcher_type(cache):
    assert isinstance(cache.matcher(Json.from_schema(explanation_schema())), JsonMatcher)
