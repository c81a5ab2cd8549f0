"""LAVE with the authors' code (``LaveJudge(model, official_repo=PATH)``).

The authors' repository (github.com/mair-lab/lave) holds ``lave.py`` (``LaveBase``, the prompt
builder: ``__init__(num_shots, rationalize, filter_refs, use_caption, demos_file,
binary_demos_file, debug)`` and ``build_prompt(prediction, references, question, caption)``),
``lave_ft5.py`` (``LaveFT5.batch_compute``: one padded batch through ``generate`` with
``max_new_tokens=100``; ``LaveFT5.postprocess``: the token just before the first EOS, decoded on
its own, rating 2 unless it is exactly "1", "2" or "3") and ``data/lave_demos.json``,
``data/lave_demos_binary.json``. The project may not contain their text, so the tests build a
stand-in checkout: the same file layout, class interface and data handling, in words of our own.
It proves the loading path; the scoring is checked against a transcription of the authors'
scoring loop (``fastjudge.reference.lave.AuthorsLave``) run with transformers on the tiny
Flan-T5 checkpoint.
"""

from __future__ import annotations

import importlib.util
import json
import shutil

import numpy as np
import pytest
from conftest import TEST_DEVICE, read_rows, write_lines

from fastjudge import LaveJudge, VQAExample
from fastjudge.checkpoints import scale_output_rows
from fastjudge.cli import main
from fastjudge.demo import sample_rows
from fastjudge.engine_options import EngineOptions
from fastjudge.judges.lave_official import official_rating, rating_probs, split_prompt

# -- the stand-in checkout ------------------------------------------------------------------------
STAND_IN_BUILDER = '''"""Stand-in for the LAVE authors' prompt builder, written for fastjudge's tests: their module
layout, class, constructor and build_prompt behaviour, other words."""

import json
from collections import Counter


class LaveBase:
    def __init__(self, num_shots=8, rationalize=True, filter_refs=True, use_caption=False,
                 demos_file="data/lave_demos.json", binary_demos_file="data/lave_demos_binary.json",
                 debug=False):
        self.num_shots = num_shots
        self.rationalize = rationalize
        self.filter_refs = filter_refs
        self.use_caption = use_caption
        self.debug = debug
        with open(demos_file) as f:
            self.demos = json.load(f)
        with open(binary_demos_file) as f:
            self.binary_demos = json.load(f)

    def instructions(self):
        seen = "a picture summary, a question" if self.use_caption else "a question"
        text = (f"Grade a candidate reply. You see {seen}, answers from experts and the reply. "
                "Grades: 1 wrong, 2 partly right, 3 right.")
        if self.rationalize:
            text += " Reason first, then grade."
        return text + "\\n\\nRule: a yes/no question takes only 'yes' or 'no'; anything else gets 1."

    def block(self, question, refs, prediction, output, caption=None):
        lines = ["Picture summary: '" + caption + "'"] if self.use_caption else []
        quoted = ", ".join("'" + r + "'" for r in sorted(refs))
        lines += ["Question: '" + question + "'", "Expert answers: " + quoted,
                  "Reply: '" + prediction + "'", "Output: " + output]
        return "\\n".join(lines)

    @staticmethod
    def keep_common(refs):
        counts = Counter(refs)
        top = max(counts.values())
        return [r for r in refs if counts[r] / top > 0.25]

    @staticmethod
    def is_binary_question(question, references):
        first = Counter(references).most_common(1)[0][0]
        return first.lower().rstrip(".") in ("yes", "no")

    def build_prompt(self, prediction, references, question, caption=None):
        binary = self.is_binary_question(question, references)
        shots = (self.binary_demos if binary else self.demos)[: self.num_shots]
        parts = [self.instructions()]
        for d in shots:
            out = d["explanation"] + " So rating=" + str(d["output"]) if self.rationalize \\
                else str(d["output"])
            parts.append(self.block(d["question"], d["references"], d["prediction"], out,
                                    d.get("caption")))
        refs = self.keep_common(references) if self.filter_refs else list(references)
        parts.append(self.block(question, refs, prediction, "",
                                caption.strip() if self.use_caption else None))
        return "\\n\\n".join(parts).strip()
'''


def stand_in_demos(binary: bool) -> list[dict]:
    """Ten demonstrations (more than the default eight shots), our own."""
    demos = []
    for i in range(10):
        if binary:
            refs = ["yes"] * (3 + i % 4) + ["no"] * (i % 3)
            prediction = ("yes", "no", "maybe")[i % 3]
        else:
            refs = [f"shade {i}", f"shade {i}", f"tone {i}"]
            prediction = f"shade {i}" if i % 2 else f"hue {i}"
        rating = ("3", "1", "2")[i % 3] if binary else ("1", "3", "2")[i % 3]
        demos.append({"question": f"{'Is' if binary else 'What'} sample thing {i} shown?",
                      "references": refs, "prediction": prediction,
                      "explanation": f"The reply {'matches' if rating == '3' else 'misses'} the experts.",
                      "output": rating, "caption": f"Sample picture {i} with a thing."})
    return demos


def write_checkout(root, builder: str = STAND_IN_BUILDER):
    (root / "data").mkdir(parents=True, exist_ok=True)
    (root / "lave.py").write_text(builder, encoding="utf-8")
    (root / "data" / "lave_demos.json").write_text(json.dumps(stand_in_demos(False)))
    (root / "data" / "lave_demos_binary.json").write_text(json.dumps(stand_in_demos(True)))
    return root


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    return write_checkout(tmp_path_factory.mktemp("lave-checkout"))


def stand_in_builder(checkout, **options):
    """The stand-in's LaveBase loaded here on its own, as the authors' users run it."""
    spec = importlib.util.spec_from_file_location("stand_in_lave", checkout / "lave.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.LaveBase(demos_file=str(checkout / "data" / "lave_demos.json"),
                           binary_demos_file=str(checkout / "data" / "lave_demos_binary.json"),
                           **options)


def answers(example: VQAExample) -> list[str]:
    """The reference answers as the authors' builder takes them: strings."""
    return [r["answer"] if isinstance(r, dict) else r for r in example.references]


def sample_examples(n=None) -> list[VQAExample]:
    return [VQAExample(r["question"], r["references"], r["prediction"], r.get("caption"), r["id"])
            for r in sample_rows()[:n]]


# Inputs whose handling differs between tools that strip and the authors' code, which does not.
RAW_INPUTS = [
    VQAExample("  Is it daytime?", [" No ", "no", "NO.", "night"], " no ", id="spaces"),
    VQAExample("What fruit?", ["pear", "pear", "pear", "pear", "apple"], "pear", id="filtered"),
    VQAExample("What fruit?", ["kiwi", "pear", "kiwi", "apple", "pear", "kiwi"], "kiwi", id="repeats"),
    VQAExample("Is it on?", ["Yes.", "yes.", "no"], "yes", id="binary-period"),
    VQAExample("Which one?", [{"answer": "left "}, {"answer": "left "}, {"answer": ""}], "left",
               id="answer-objects"),
]


# -- loading the checkout -------------------------------------------------------------------------
class TestPrompts:
    @pytest.mark.parametrize("options", [
        {},
        {"rationale": False},
        {"num_shots": 2, "filter_refs": False},
        {"num_shots": 0},
        {"use_caption": True, "num_shots": 3},
    ])
    def test_prompts_are_the_checkouts(self, t5_backend, checkout, options):
        judge = LaveJudge(t5_backend, official_repo=checkout, **options)
        builder = stand_in_builder(checkout, num_shots=options.get("num_shots", 8),
                                   rationalize=options.get("rationale", True),
                                   filter_refs=options.get("filter_refs", True),
                                   use_caption=options.get("use_caption", False))
        for ex in RAW_INPUTS + sample_examples(12):
            caption = (ex.caption or "  A caption with spaces. ") if judge.use_caption else None
            expected = builder.build_prompt(ex.prediction, answers(ex), ex.question, caption)
            ex = VQAExample(ex.question, ex.references, ex.prediction, caption)
            assert judge.build_prompt(ex) == expected

    def test_authors_defaults(self, t5_backend, checkout):
        judge = LaveJudge(t5_backend, official_repo=checkout)
        assert judge.rationale is True and judge.num_shots == 8 and judge.filter_refs is True
        prompt = judge.build_prompt(RAW_INPUTS[1])
        assert prompt.startswith("Grade a candidate reply.")  # the checkout's words
        assert "Reason first, then grade." in prompt
        assert prompt.count("Question: '") == 8 + 1
        assert "Expert answers: 'pear', 'pear', 'pear', 'pear'\n" in prompt  # apple filtered out
        assert prompt.endswith("Reply: 'pear'\nOutput:")

    def test_the_checkouts_code_runs(self, t5_backend, tmp_path):
        edited = write_checkout(tmp_path / "edited",
                                STAND_IN_BUILDER.replace("Grade a candidate reply.", "Rate it."))
        assert LaveJudge(t5_backend, official_repo=edited).build_prompt(RAW_INPUTS[0]).startswith(
            "Rate it.")

    def test_other_demonstration_files(self, t5_backend, checkout, tmp_path):
        mine = tmp_path / "mine.json"
        mine.write_text(json.dumps([{"question": "Own demo?", "references": ["a"], "prediction": "a",
                                     "explanation": "Same.", "output": 3}]))
        judge = LaveJudge(t5_backend, official_repo=checkout, demos=mine)
        assert "Question: 'Own demo?'" in judge.build_prompt(RAW_INPUTS[1])
        assert "Question: 'Own demo?'" not in judge.build_prompt(RAW_INPUTS[3])  # binary: theirs

    def test_split_keeps_the_prompt(self, t5_backend, checkout):
        judge = LaveJudge(t5_backend, official_repo=checkout)
        prefix, rest = split_prompt(judge.build_prompt(RAW_INPUTS[2]))
        assert rest.startswith("Question: 'What fruit?'") and prefix.endswith("\n\n")
        assert split_prompt("no blank line") == ("", "no blank line")

    @pytest.mark.parametrize("change, message", [
        (lambda root: (root / "lave.py").unlink(), "lave.py is missing"),
        (lambda root: (root / "data" / "lave_demos_binary.json").unlink(), "lave_demos_binary.json"),
        (lambda root: (root / "lave.py").write_text("X = 1\n"), "defines no class LaveBase"),
    ])
    def test_not_a_checkout(self, t5_backend, tmp_path, change, message):
        root = write_checkout(tmp_path / "broken")
        change(root)
        with pytest.raises(ValueError, match=message):
            LaveJudge(t5_backend, official_repo=root)

    @pytest.mark.parametrize("options", [{"filter_p": 0.5}, {"demos": [{"question": "q"}]}])
    def test_options_the_authors_code_cannot_follow(self, t5_backend, checkout, options):
        with pytest.raises(ValueError, match="official_repo"):
            LaveJudge(t5_backend, official_repo=checkout, **options)

    def test_invalid_items_are_errors(self, t5_backend, checkout):
        judge = LaveJudge(t5_backend, official_repo=checkout, max_new_tokens=2)
        results = judge.score([VQAExample("What?", [], "x", id="empty"), RAW_INPUTS[1]])
        assert "references are empty" in results[0].error and results[0].score is None
        assert results[1].error is None and results[1].rating in (1, 2, 3)


# -- the parse rule -------------------------------------------------------------------------------
class TestParseRule:
    """``LaveFT5.postprocess``: the token before the first EOS (without EOS: the last token),
    decoded alone; exactly "1", "2" or "3" or else rating 2 (None here)."""

    def test_rule(self, t5_backend):
        codec = t5_backend.codec
        word_initial, glued = rating_families(codec)
        words = codec.response_ids("the kite is red")
        decode = codec.decode
        assert [official_rating(words + [t], decode) for t in word_initial] == [1, 2, 3]
        assert [official_rating(words + [t], decode) for t in glued] == [1, 2, 3]
        assert official_rating(words, decode) is None  # ends on a word
        assert official_rating([], decode) is None  # EOS first: the decoder start token
        assert official_rating([word_initial[2], *words], decode) is None  # a rating earlier

    def test_probs_read_the_family_of_the_produced_token(self):
        families = ((10, 11, 12), (20, 21, 22))
        steps = np.array([[0.0] * 6, [1.0, 2.0, 3.0, 0.0, 5.0, 0.0]])
        by_glued = rating_probs(families, steps, [7, 21])
        np.testing.assert_allclose(by_glued, np.exp([0, 5, 0]) / np.exp([0, 5, 0]).sum())
        by_word = rating_probs(families, steps, [7, 12])
        np.testing.assert_allclose(by_word, np.exp([1, 2, 3]) / np.exp([1, 2, 3]).sum())
        assert rating_probs(families, steps, [7, 8]) is None  # no rating token produced
        assert rating_probs(families, steps, []) is None
        assert rating_probs(families, None, [7, 21]) is None


# -- scores against the authors' scoring loop -----------------------------------------------------
@pytest.fixture(scope="module")
def varied_dir(t5_dir, t5_backend, tmp_path_factory):
    """The tiny Flan-T5 checkpoint with its EOS and rating rows of the LM head scaled up, so
    greedy generations end at varied lengths, many on a rating token, some not at all."""
    target = tmp_path_factory.mktemp("flan-t5-varied") / "model"
    shutil.copytree(t5_dir, target)
    ratings = [t for family in rating_families(t5_backend.codec) for t in family]
    scale_output_rows(target, {**{t: RATING_SCALE for t in ratings},
                               t5_backend.shape.eos_token_id: EOS_SCALE})
    return target


def rating_families(codec) -> list[tuple[int, ...]]:
    """The rating tokens as the model writes them: word-initial ("Output: 3") and glued to the
    rating cue ("So rating=3")."""
    return [codec.answer_ids(["1", "2", "3"]).ids,
            codec.answer_ids(["1", "2", "3"], after=" So rating=").ids]


RATING_SCALE = 2.5
EOS_SCALE = 2.5


@pytest.fixture(scope="module")
def authors_runs(varied_dir, checkout):
    """The authors' scoring of the fixture items in both modes (``fastjudge.reference.lave.
    AuthorsLave``, the transcription of their ``LaveFT5.batch_compute``: every item in one
    pad-longest batch through ``generate`` with ``max_new_tokens=100``; the token just before
    the first EOS, decoded on its own; rating 2 unless that is exactly "1", "2" or "3"), in
    float32 on the CPU: {rationale: (their builder's prompts, results, generated lengths)}."""
    from fastjudge.reference.lave import AuthorsLave

    items = scored_examples()
    runs = {}
    for rationale in (True, False):
        builder = stand_in_builder(checkout, rationalize=rationale)
        prompts = [builder.build_prompt(ex.prediction, answers(ex), ex.question) for ex in items]
        judge = LaveJudge(varied_dir, official_repo=checkout, rationale=rationale,
                          engine=EngineOptions(device="cpu", dtype="float32"))
        authors = AuthorsLave(varied_dir, judge, dtype="float32", batch_size=len(items))
        runs[rationale] = (prompts, authors.score(items), authors.generated_lengths)
    return runs


def scored_examples() -> list[VQAExample]:
    return sample_examples(9) + RAW_INPUTS[:3]


@pytest.mark.parametrize("rationale", [True, False], ids=["rationale", "score-only"])
@pytest.mark.parametrize("batching", [{}, {"max_batch_size": 1},
                                      {"max_batch_size": 3, "max_batch_tokens": 1500}])
def test_scores_equal_the_authors(varied_dir, checkout, authors_runs, rationale, batching):
    prompts, theirs, lengths = authors_runs[rationale]
    judge = LaveJudge(varied_dir, official_repo=checkout, rationale=rationale,
                      engine=EngineOptions(device=TEST_DEVICE, dtype="float32", **batching))
    items = scored_examples()
    results = judge.score(items)
    assert [judge.build_prompt(ex) for ex in items] == prompts
    assert [r.score for r in results] == [t.score for t in theirs]
    # the fixture covers the rule's cases: rows end at varied lengths, on a rating or not,
    # and rationales run to the limit
    assert len(set(lengths)) > (3 if rationale else 1), sorted(lengths)
    assert not rationale or 100 in lengths, sorted(lengths)
    assert {r.rating_source for r in results} == {"parsed", "official-fallback"}
    for r, t in zip(results, theirs):
        assert r.error is None and t.error is None
        assert (r.rating, r.rating_source, r.rationale) == (t.rating, t.rating_source, t.rationale)
        assert rationale or r.rationale is None
        if r.rating_source == "parsed":  # the rating tokens' distribution at the step that wrote it
            np.testing.assert_allclose(r.probs, t.probs, rtol=1e-4, atol=1e-6)
            assert r.soft_score == pytest.approx(float(np.dot(r.probs, [0, 0.5, 1])))
        else:
            assert r.rating == 2 and r.score == 0.5
            assert r.probs is None and r.soft_score is None


def test_command_line(varied_dir, checkout, tmp_path):
    items = scored_examples()[:6]
    inp = write_lines(tmp_path / "in.jsonl", [json.dumps({
        "id": ex.id, "question": ex.question, "references": ex.references,
        "prediction": ex.prediction}) for ex in items])
    out = tmp_path / "out.jsonl"
    assert main(["lave", "--model", str(varied_dir), "--input", str(inp), "--output", str(out),
                 "--dtype", "float32", "--device", "cpu", "--no-progress",
                 "--official-repo", str(checkout), "--no-rationale"]) == 0
    rows = {r["id"]: r for r in read_rows(out)}
    judge = LaveJudge(varied_dir, official_repo=checkout, rationale=False,
                      engine=EngineOptions(device="cpu", dtype="float32"))
    for r in judge.score(items):
        assert rows[r.id]["score"] == r.score and rows[r.id]["rating_source"] == r.rating_source
        assert rows[r.id]["rationale"] is None
