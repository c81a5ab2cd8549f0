"""LAVE judge logic: reference handling, demonstrations, prompt layout, rating tokens, invalid
items and the score arithmetic, on the tiny random-weight Flan-T5 checkpoint."""

from __future__ import annotations

import json
from importlib import resources

import numpy as np
import pytest

from fastjudge import LaveJudge, LaveResult, VQAExample
from fastjudge.engine_options import EngineOptions
from fastjudge.judges.lave import (
    BINARY_RULE,
    RATING_CUE,
    TASK_DESCRIPTION,
    filter_references,
    is_binary_question,
    load_demonstrations,
    reference_answers,
)


def bundled(name: str) -> list[dict]:
    """The demonstration files read directly, independently of load_demonstrations."""
    return json.loads(resources.files("fastjudge.data").joinpath(name).read_text(encoding="utf-8"))


GENERAL = bundled("lave_demos_general.json")
BINARY = bundled("lave_demos_binary.json")

COLOR = VQAExample("What color is the kite?", ["red", "red", "red", "orange"], "red", id="color")
BINARY_EX = VQAExample("Is the kite flying?", ["yes", "yes", "no"], "yes", id="binary")


def quoted(answers) -> str:
    return ", ".join("'" + a + "'" for a in answers)


def blocks(prompt: str) -> list[str]:
    """Header, binary rule, one block per demonstration, test example (fields have no blank lines)."""
    return prompt.split("\n\n")


# -- filter_references ---------------------------------------------------------------------------
class TestFilterReferences:
    def test_boundary_exactly_quarter_dropped(self):
        # max count 4 -> threshold 1.0: an answer seen once (exactly 25%) is dropped.
        assert filter_references(["a"] * 4 + ["b"]) == ["a"] * 4

    def test_just_above_quarter_kept(self):
        # max count 7 -> threshold 1.75: count 2 (28.6%) is kept, count 1 dropped.
        assert filter_references(["a"] * 7 + ["b", "b", "c"]) == ["a"] * 7 + ["b", "b"]

    def test_just_below_threshold_dropped_custom_p(self):
        # p=0.5, max 4 -> threshold 2: count 2 dropped (not strictly above), 3 kept.
        assert filter_references(["x"] * 4 + ["y"] * 3 + ["z"] * 2, p=0.5) == ["x"] * 4 + ["y"] * 3

    def test_sorted_with_repetitions(self):
        # the authors show every repetition of a kept answer
        answers = ["zebra", "apple", "zebra", "mango", "apple", "mango"]
        assert filter_references(answers) == ["apple", "apple", "mango", "mango", "zebra", "zebra"]

    def test_p_zero_keeps_all(self):
        answers = ["b"] * 10 + ["a", "c"]
        assert filter_references(answers, p=0) == ["a"] + ["b"] * 10 + ["c"]

    def test_single_answer(self):
        assert filter_references(["only"]) == ["only"]

    def test_judge_without_filter_shows_all(self, t5_backend):
        ex = VQAExample("What fruit is it?", ["pear"] * 9 + ["apple", "pear"], "pear")
        filtered = LaveJudge(t5_backend).build_prompt(ex)
        unfiltered = LaveJudge(t5_backend, filter_refs=False).build_prompt(ex)
        pears = quoted(["pear"] * 10)
        assert filtered.endswith(f"Reference answers: {pears}\nCandidate answer: pear\nOutput:")
        assert unfiltered.endswith(f"Reference answers: 'apple', {pears}\nCandidate answer: pear\nOutput:")

    def test_judge_filter_p(self, t5_backend):
        ex = VQAExample("What fruit is it?", ["pear"] * 3 + ["apple"], "pear")
        # p=0.25: threshold 0.75 keeps apple; p=0.5: threshold 1.5 drops it.
        assert "Reference answers: 'apple', 'pear', 'pear', 'pear'\n" in LaveJudge(t5_backend).build_prompt(ex)
        assert "Reference answers: 'pear', 'pear', 'pear'\n" in LaveJudge(t5_backend, filter_p=0.5).build_prompt(ex)


# -- is_binary_question ---------------------------------------------------------------------------
class TestIsBinaryQuestion:
    @pytest.mark.parametrize("answers", [
        ["Yes"], ["no."], ["NO"], ["YES", "yes", "maybe"], ["no", "No", "no.", "2"],
        ["yes", "no", "no"],
    ])
    def test_binary(self, answers):
        assert is_binary_question(answers) is True

    @pytest.mark.parametrize("answers", [
        ["red"], ["2", "2", "yes"], ["cat", "yes", "cat"], ["yesterday"], ["not"], ["yes please"],
        [" NO "],  # raw strings, as the authors check them: spaces are not stripped
    ])
    def test_not_binary(self, answers):
        assert is_binary_question(answers) is False

    def test_counts_decide_not_first_or_set(self):
        # "yes" is first and present, but "blue" is more common -> not binary.
        assert not is_binary_question(["yes", "blue", "blue"])
        # The distinct set is the same as above, the counts differ -> binary.
        assert is_binary_question(["yes", "yes", "blue"])

    def test_tie_goes_to_first_seen(self):
        assert is_binary_question(["no", "red"])
        assert not is_binary_question(["red", "no"])

    def test_binary_check_on_raw_strings(self, t5_backend):
        # Raw strings all differ, the first seen (" No ") wins the tie and is not yes/no once
        # lowercased without its trailing periods -> general demonstrations, as the authors.
        prompt = LaveJudge(t5_backend).build_prompt(
            VQAExample("Is it daytime?", [" No ", "no", "NO.", "night"], "no"))
        assert "Question: Is it raining?" not in prompt
        assert f"Question: {GENERAL[0]['question']}\n" in prompt


# -- reference_answers ----------------------------------------------------------------------------
class TestReferenceAnswers:
    def test_strings_as_given(self):
        # the authors' code strips no reference answer
        assert reference_answers([" red ", "blue\n"]) == [" red ", "blue\n"]

    def test_vqa_answer_dicts(self):
        refs = [{"answer": "red ", "answer_confidence": "yes", "answer_id": 1}, "blue"]
        assert reference_answers(refs) == ["red ", "blue"]

    def test_repetitions_preserved(self):
        assert reference_answers(["a", {"answer": "a"}, "a"]) == ["a", "a", "a"]

    @pytest.mark.parametrize("refs", [[5], ["ok", None], [{"text": "red"}], [{"answer": 3}], [["red"]]])
    def test_rejects_non_strings(self, refs):
        with pytest.raises(ValueError, match="must be strings"):
            reference_answers(refs)


# -- load_demonstrations --------------------------------------------------------------------------
DEMO_FIELDS = ("question", "references", "prediction", "output", "explanation")


def write_demos(tmp_path, items, name="demos.json"):
    path = tmp_path / name
    path.write_text(json.dumps(items), encoding="utf-8")
    return path


def user_demo(i: int, output: str = "3", caption: str | None = None) -> dict:
    d = {"question": f"What is user question {i}?", "references": [f"ans{i}", f"alt{i}"],
         "prediction": f"pred{i}", "output": output, "explanation": f"Explanation {i}."}
    if caption is not None:
        d["caption"] = caption
    return d


class TestLoadDemonstrations:
    @pytest.mark.parametrize("which,raw", [("general", GENERAL), ("binary", BINARY)])
    def test_builtin_sets(self, which, raw):
        demos = load_demonstrations(None, which)
        assert len(demos) == 8
        assert {d.output for d in demos} == {"1", "2", "3"}
        assert [d.question for d in demos] == [r["question"] for r in raw]
        assert all(d.explanation and d.caption for d in demos)
        assert all(isinstance(d.references, tuple) and d.references for d in demos)

    def test_builtin_binary_sets_are_binary_and_general_are_not(self):
        assert all(is_binary_question(d.references) for d in load_demonstrations(None, "binary"))
        assert not any(is_binary_question(d.references) for d in load_demonstrations(None, "general"))

    def test_user_file(self, tmp_path):
        items = [user_demo(0, "1", caption="A caption."), user_demo(1, "2"), user_demo(2, " 3 ")]
        items[1]["output"] = 2  # authors' files may hold the rating as a number
        demos = load_demonstrations(write_demos(tmp_path, items), "general")
        assert [d.output for d in demos] == ["1", "2", "3"]
        assert demos[0].question == "What is user question 0?"
        assert demos[0].references == ("ans0", "alt0")
        assert demos[0].prediction == "pred0"
        assert demos[0].explanation == "Explanation 0."
        assert demos[0].caption == "A caption."
        assert demos[1].caption is None

    def test_user_file_as_str_path(self, tmp_path):
        demos = load_demonstrations(str(write_demos(tmp_path, [user_demo(0)])), "binary")
        assert len(demos) == 1 and demos[0].question == "What is user question 0?"

    def test_list_of_dicts(self):
        demos = load_demonstrations([user_demo(0), user_demo(1, "1")], "general")
        assert [d.output for d in demos] == ["3", "1"]

    @pytest.mark.parametrize("field", ["question", "references", "prediction", "output"])
    def test_missing_field(self, tmp_path, field):
        items = [user_demo(0), user_demo(1)]
        del items[1][field]
        with pytest.raises(ValueError, match=rf"#1.*missing field '{field}'"):
            load_demonstrations(write_demos(tmp_path, items), "general")

    @pytest.mark.parametrize("output", ["4", "0", "good", "", "3.0", None])
    def test_bad_output(self, tmp_path, output):
        with pytest.raises(ValueError, match="output must be '1', '2' or '3'"):
            load_demonstrations(write_demos(tmp_path, [user_demo(0, output)]), "general")

    @pytest.mark.parametrize("refs", [[], "red"])
    def test_bad_references(self, tmp_path, refs):
        item = user_demo(0)
        item["references"] = refs
        with pytest.raises(ValueError, match="references must be a non-empty list"):
            load_demonstrations(write_demos(tmp_path, [item]), "general")

    @pytest.mark.parametrize("content", [{"question": "q"}, "demos", 3])
    def test_non_list_file(self, tmp_path, content):
        with pytest.raises(ValueError, match="expected a JSON list"):
            load_demonstrations(write_demos(tmp_path, content), "general")

    @pytest.mark.parametrize("items", [[1, 2], ["a demonstration"], [None]])
    def test_non_object_entries(self, tmp_path, items):
        path = write_demos(tmp_path, items)
        try:
            load_demonstrations(path, "general")
        except ValueError as bad:
            assert "#0" in str(bad)
        except Exception as other:  # noqa: BLE001 - the documented contract is ValueError
            raise AssertionError(f"expected ValueError, got {type(other).__name__}: {other}") from other
        else:
            raise AssertionError("no error for non-object demonstrations")

    def test_missing_file(self, tmp_path):
        with pytest.raises(OSError):
            load_demonstrations(tmp_path / "absent.json", "general")

    def test_judge_rejects_bad_demo_file(self, t5_backend, tmp_path):
        items = [user_demo(0, "5")]
        with pytest.raises(ValueError, match="output must be"):
            LaveJudge(t5_backend, demos=write_demos(tmp_path, items))

    def test_user_demos_in_prompt(self, t5_backend, tmp_path):
        general = write_demos(tmp_path, [user_demo(0, "1"), user_demo(1, "2")], "g.json")
        judge = LaveJudge(t5_backend, demos=general)
        prompt = judge.build_prompt(COLOR)
        parts = blocks(prompt)
        assert len(parts) == 2 + 2 + 1
        assert parts[2] == ("Question: What is user question 0?\nReference answers: 'alt0', 'ans0'\n"
                            "Candidate answer: pred0\nOutput: 1")
        assert parts[3].endswith("Candidate answer: pred1\nOutput: 2")
        # Binary questions still get the built-in binary set.
        assert "Question: Is it raining?" in judge.build_prompt(BINARY_EX)
        assert "user question" not in judge.build_prompt(BINARY_EX)

    @pytest.mark.parametrize("n", [0, 1, 3, 8])
    def test_num_shots(self, t5_backend, n):
        judge = LaveJudge(t5_backend, num_shots=n)
        for ex, raw in ((COLOR, GENERAL), (BINARY_EX, BINARY)):
            prompt = judge.build_prompt(ex)
            assert prompt.count("Question:") == n + 1
            shown = [line[len("Question: "):] for line in prompt.splitlines()
                     if line.startswith("Question: ")]
            assert shown == [r["question"] for r in raw[:n]] + [ex.question]

    def test_num_shots_user_file_takes_first(self, t5_backend, tmp_path):
        path = write_demos(tmp_path, [user_demo(i, "123"[i % 3]) for i in range(5)])
        prompt = LaveJudge(t5_backend, num_shots=2, demos=path).build_prompt(COLOR)
        assert prompt.count("Question:") == 3
        assert "user question 0?" in prompt and "user question 1?" in prompt
        assert "user question 2?" not in prompt

    @pytest.mark.parametrize("kwargs", [dict(num_shots=-1), dict(filter_p=1.0), dict(filter_p=-0.1),
                                        dict(max_new_tokens=0), dict(on_unparsable="guess")])
    def test_bad_judge_arguments(self, t5_backend, kwargs):
        with pytest.raises(ValueError):
            LaveJudge(t5_backend, **kwargs)


# -- prompt structure -----------------------------------------------------------------------------
class TestPrompt:
    def test_header_and_rule(self, lave_judge):
        prompt = lave_judge.build_prompt(COLOR)
        assert prompt.startswith("Definition: You are shown a question about an image")
        parts = blocks(prompt)
        assert parts[0] == TASK_DESCRIPTION
        assert "Give the rationale" not in prompt
        assert parts[1] == BINARY_RULE
        assert parts[1].startswith("IMPORTANT: A binary question can only be answered with 'yes' or 'no'")

    def test_score_only_demos(self, lave_judge):
        for ex, raw in ((COLOR, GENERAL), (BINARY_EX, BINARY)):
            parts = blocks(lave_judge.build_prompt(ex))
            assert len(parts) == 2 + len(raw) + 1
            for part, d in zip(parts[2:-1], raw):
                assert part == (f"Question: {d['question']}\n"
                                f"Reference answers: {quoted(sorted(d['references']))}\n"
                                f"Candidate answer: {d['prediction']}\nOutput: {d['output']}")
                assert d["explanation"] not in part

    def test_rationale_demos(self, t5_backend):
        judge = LaveJudge(t5_backend, rationale=True)
        prompt = judge.build_prompt(COLOR)
        parts = blocks(prompt)
        assert parts[0] == TASK_DESCRIPTION + " Give the rationale before rating."
        assert prompt.count("Give the rationale before rating.") == 1
        assert parts[1] == BINARY_RULE
        for part, d in zip(parts[2:-1], GENERAL):
            assert part.endswith(f"Candidate answer: {d['prediction']}\n"
                                 f"Output: {d['explanation']} So rating={d['output']}")
        assert prompt.count("So rating=") == len(GENERAL)

    def test_test_example_last(self, lave_judge):
        # question and prediction as given: the authors' code strips neither
        ex = VQAExample("  What color is the kite?  ", ["red", "red", "red", "orange"], "  red  ")
        prompt = lave_judge.build_prompt(ex)
        assert prompt.endswith("\n\nQuestion:   What color is the kite?  \n"
                               "Reference answers: 'orange', 'red', 'red', 'red'\n"
                               "Candidate answer:   red  \nOutput:")
        assert blocks(prompt)[-1].startswith("Question:   What color is the kite?")

    def test_references_quoted_and_sorted(self, lave_judge):
        ex = VQAExample("What fruit?", ["zebra fruit", "apple", "mango", "apple", {"answer": "kiwi"}], "apple")
        last = blocks(lave_judge.build_prompt(ex))[-1]
        assert "\nReference answers: 'apple', 'apple', 'kiwi', 'mango', 'zebra fruit'\n" in last

    def test_demo_references_sorted(self, lave_judge):
        prompt = lave_judge.build_prompt(COLOR)
        # Bundled order is red, red and white, maroon.
        assert "Reference answers: 'maroon', 'red', 'red and white'\n" in prompt

    def test_binary_question_uses_binary_demos(self, lave_judge):
        prompt = lave_judge.build_prompt(BINARY_EX)
        for d in BINARY:
            assert f"Question: {d['question']}\n" in prompt
        for d in GENERAL:
            assert d["question"] not in prompt

    def test_general_question_uses_general_demos(self, lave_judge):
        prompt = lave_judge.build_prompt(COLOR)
        for d in GENERAL:
            assert f"Question: {d['question']}\n" in prompt
        for d in BINARY:
            assert d["question"] not in prompt

    def test_binary_rule_in_both(self, lave_judge):
        assert BINARY_RULE in lave_judge.build_prompt(COLOR)
        assert BINARY_RULE in lave_judge.build_prompt(BINARY_EX)

    def test_caption(self, t5_backend):
        judge = LaveJudge(t5_backend, use_caption=True)
        ex = VQAExample("What color is the kite?", ["red"], "red", caption="A red kite over a beach.")
        prompt = judge.build_prompt(ex)
        assert prompt.count("Image description:") == len(GENERAL) + 1
        parts = blocks(prompt)
        for part, d in zip(parts[2:-1], GENERAL):
            assert part.startswith(f"Image description: {d['caption']}\nQuestion: {d['question']}\n")
        assert parts[-1] == ("Image description: A red kite over a beach.\nQuestion: What color is the kite?\n"
                             "Reference answers: 'red'\nCandidate answer: red\nOutput:")
        # Without use_caption the caption is not shown.
        assert "Image description" not in LaveJudge(t5_backend).build_prompt(ex)

    def test_caption_missing_is_an_error(self, t5_backend):
        judge = LaveJudge(t5_backend, use_caption=True)
        good = VQAExample("What color is the kite?", ["red"], "red", caption="A red kite.", id="g")
        bad = VQAExample("What color is the kite?", ["red"], "red", id="b")
        blank = VQAExample("What color is the kite?", ["red"], "red", caption="  ", id="blank")
        with pytest.raises(ValueError, match="caption"):
            judge.build_prompt(bad)
        results = judge.score([bad, good, blank])
        assert [r.id for r in results] == ["b", "g", "blank"]
        assert "caption" in results[0].error and results[0].score is None
        assert "caption" in results[2].error and results[2].score is None
        assert results[1].error is None and results[1].rating in (1, 2, 3)

    def test_caption_needs_demo_captions(self, t5_backend, tmp_path):
        path = write_demos(tmp_path, [user_demo(0)])
        with pytest.raises(ValueError, match="caption"):
            LaveJudge(t5_backend, use_caption=True, demos=path)


# -- rating tokens --------------------------------------------------------------------------------
class TestRatingTokens:
    def test_score_only_ids(self, lave_judge, t5_backend):
        ids = lave_judge.rating_token_ids
        assert len(ids) == 3 and len(set(ids)) == 3
        assert [t5_backend.codec.decode([i]) for i in ids] == ["1", "2", "3"]
        assert [t5_backend.codec.response_ids(str(r)) for r in (1, 2, 3)] == [[i] for i in ids]

    def test_rationale_ids_after_cue(self, t5_backend):
        judge = LaveJudge(t5_backend, rationale=True)
        ids = judge.rating_token_ids
        assert len(set(ids)) == 3
        assert [t5_backend.codec.decode([i]).strip() for i in ids] == ["1", "2", "3"]
        cue = t5_backend.codec.response_ids(RATING_CUE)
        for r, i in zip("123", ids):
            assert t5_backend.codec.response_ids(RATING_CUE + r) == cue + [i]


# -- bad items ------------------------------------------------------------------------------------
def bad_and_good_items():
    return [
        VQAExample("What color is the kite?", ["red"], "red", id="ok-0"),
        VQAExample("What color is the kite?", [], "red", id="empty-refs"),
        VQAExample("What color is the kite?", ["  ", ""], "red", id="blank-refs"),
        VQAExample("What color is the kite?", "red", "red", id="string-refs"),
        VQAExample("Is the kite flying?", ["yes", "no"], "yes", id="ok-1"),
        VQAExample("What color is the kite?", ["red"], 5, id="int-prediction"),
        VQAExample(None, ["red"], "red", id="none-question"),
        VQAExample("   ", ["red"], "red", id="blank-question"),
        VQAExample("What color is the kite?", ["red", 7], "red", id="int-reference"),
        VQAExample("How many kites?", [{"answer": "2"}, {"answer": "two"}], "2", id="ok-2"),
    ]


class TestBadItems:
    def test_mixed_list(self, lave_judge):
        items = bad_and_good_items()
        results = lave_judge.score(items)
        assert [r.index for r in results] == list(range(len(items)))
        assert [r.id for r in results] == [ex.id for ex in items]
        expect = {"empty-refs": "references are empty", "blank-refs": "references are empty",
                  "string-refs": "references must be a list", "int-prediction": "prediction must be a string",
                  "none-question": "question", "blank-question": "question",
                  "int-reference": "must be strings"}
        for r in results:
            if r.id.startswith("ok-"):
                assert r.error is None, r
                assert r.rating in (1, 2, 3) and r.score == (r.rating - 1) / 2
                assert r.prompt_tokens > 0
            else:
                assert r.error is not None and expect[r.id] in r.error, r
                assert r.error.startswith("invalid example")
                assert r.score is None and r.soft_score is None and r.rating is None and r.probs is None

    def test_valid_scores_do_not_depend_on_bad_neighbours(self, lave_judge):
        items = bad_and_good_items()
        mixed = {r.id: r for r in lave_judge.score(items)}
        alone = lave_judge.score([ex for ex in items if ex.id.startswith("ok-")])
        for r in alone:
            np.testing.assert_allclose(mixed[r.id].probs, r.probs, atol=1e-6)

    def test_prompt_too_long(self, t5_dir, t5_backend):
        from fastjudge.backends.t5.backend import TorchT5Backend

        short = VQAExample("What color?", ["red"], "red", id="short")
        long = VQAExample("What color?", [f"a very long reference answer number {i}" for i in range(40)],
                          "red", id="long")
        probe = LaveJudge(t5_backend, num_shots=0)
        n_short = len(t5_backend.codec.encode_prompt(probe.build_prompt(short)))
        n_long = len(t5_backend.codec.encode_prompt(probe.build_prompt(long)))
        assert n_long > n_short + 20
        limit = n_short + 10
        backend = TorchT5Backend(t5_dir, device="cpu", dtype="float32", max_input_tokens=limit)
        judge = LaveJudge(backend, num_shots=0)
        results = judge.score([long, short, long])
        assert [r.id for r in results] == ["long", "short", "long"]
        assert results[1].error is None and results[1].rating in (1, 2, 3)
        assert results[1].prompt_tokens == n_short
        for r in (results[0], results[2]):
            assert r.score is None and r.rating is None
            assert f"prompt is {n_long} tokens" in r.error and str(limit) in r.error
            assert "not truncated" in r.error
            assert r.prompt_tokens == n_long

    def test_prompt_too_long_tiny_limit(self, t5_dir):
        from fastjudge.backends.t5.backend import TorchT5Backend

        backend = TorchT5Backend(t5_dir, device="cpu", dtype="float32", max_input_tokens=50)
        judge = LaveJudge(backend)
        results = judge.score([COLOR, VQAExample("What?", [], "x", id="e")])
        assert "above the model limit of 50" in results[0].error
        assert "references are empty" in results[1].error


# -- scores ---------------------------------------------------------------------------------------
SCORED = [
    VQAExample("What color is the kite?", ["red", "red", "orange"], "red", id=0),
    VQAExample("Is the kite flying?", ["yes", "yes", "no"], "no", id=1),
    VQAExample("How many kites are there?", ["2", "two", "2"], "3", id=2),
    VQAExample("What animal is on the beach?", ["dog", "puppy"], "a small brown dog", id=3),
    VQAExample("Is it sunny?", ["yes"], "blue", id=4),
]


class TestScore:
    def test_score_only(self, lave_judge):
        results = lave_judge.score(SCORED)
        assert [r.id for r in results] == [0, 1, 2, 3, 4]
        for r in results:
            assert isinstance(r, LaveResult) and r.error is None
            assert r.rating in (1, 2, 3)
            assert r.score == pytest.approx((r.rating - 1) / 2)
            assert len(r.probs) == 3 and sum(r.probs) == pytest.approx(1.0, abs=1e-9)
            assert all(0.0 <= p <= 1.0 for p in r.probs)
            assert r.soft_score == pytest.approx(sum(p * (i - 1) / 2 for i, p in zip((1, 2, 3), r.probs)))
            assert r.rating == int(np.argmax(r.probs)) + 1
            assert r.rating_source == "choice" and r.rationale is None
            prompt = lave_judge.build_prompt(SCORED[r.index])
            assert r.prompt_tokens == len(lave_judge.backend.codec.encode_prompt(prompt))

    def test_deterministic_and_batch_invariant(self, lave_judge):
        together = lave_judge.score(SCORED)
        for ex, r in zip(SCORED, together):
            (alone,) = lave_judge.score([ex])
            assert alone.rating == r.rating
            np.testing.assert_allclose(alone.probs, r.probs, atol=1e-6)

    def test_small_batches_same_results(self, t5_backend):
        big = LaveJudge(t5_backend).score(SCORED)
        small = LaveJudge(t5_backend, engine=EngineOptions(max_batch_size=1)).score(SCORED)
        for a, b in zip(big, small):
            np.testing.assert_allclose(a.probs, b.probs, atol=1e-6)

    def test_different_inputs_give_different_probs(self, lave_judge):
        probs = [tuple(r.probs) for r in lave_judge.score(SCORED)]
        assert len(set(probs)) == len(SCORED)

    def test_stream_yields_each_index_once(self, lave_judge):
        items = SCORED + bad_and_good_items()
        seen = [r.index for r in lave_judge.stream(items)]
        assert sorted(seen) == list(range(len(items)))

    def test_stream_accepts_generator(self, lave_judge):
        results = list(lave_judge.stream(ex for ex in SCORED))
        assert sorted(r.index for r in results) == list(range(len(SCORED)))

    def test_empty_input(self, lave_judge):
        assert lave_judge.score([]) == []


RATIONALE_KW = dict(rationale=True, max_new_tokens=8, num_shots=2)


@pytest.fixture(scope="module")
def official_results(t5_backend):
    return LaveJudge(t5_backend, on_unparsable="official", **RATIONALE_KW).score(SCORED)


@pytest.fixture(scope="module")
def constrained_results(t5_backend):
    return LaveJudge(t5_backend, on_unparsable="constrain", **RATIONALE_KW).score(SCORED)


class TestRationaleMode:
    def test_official_fallback(self, official_results):
        results = official_results
        assert [r.id for r in results] == [0, 1, 2, 3, 4]
        fallbacks = 0
        for r in results:
            assert r.error is None and isinstance(r.rationale, str)
            last = r.rationale.rstrip()[-1:]
            if last in ("1", "2", "3"):
                assert r.rating == int(last) and r.rating_source == "parsed"
            else:
                fallbacks += 1
                assert r.rating == 2 and r.score == 0.5 and r.soft_score == 0.5
                assert r.rating_source == "official-fallback"
                assert r.probs is None
        assert fallbacks > 0  # random weights: rationales do not end with a rating

    def test_constrain(self, constrained_results):
        results = constrained_results
        assert [r.id for r in results] == [0, 1, 2, 3, 4]
        constrained = 0
        for r in results:
            assert r.error is None and isinstance(r.rationale, str)
            assert r.rating in (1, 2, 3) and r.score == (r.rating - 1) / 2
            if r.rationale.rstrip()[-1:] not in ("1", "2", "3"):
                constrained += 1
                assert r.rating_source == "constrained"
                assert r.probs is not None and sum(r.probs) == pytest.approx(1.0)
                assert r.rating == int(np.argmax(r.probs)) + 1
                assert r.soft_score == pytest.approx(float(np.dot(r.probs, [0, 0.5, 1])))
        assert constrained > 0

    def test_rationales_match_between_policies(self, official_results, constrained_results, t5_backend):
        assert [r.rationale for r in official_results] == [r.rationale for r in constrained_results]
        assert all(r.rationale.strip() for r in official_results)
        assert all(len(t5_backend.codec.response_ids(r.rationale)) <= 8 + 1 for r in official_results)

    def test_rationale_prompt_tokens(self, official_results, t5_backend):
        judge = LaveJudge(t5_backend, **RATIONALE_KW)
        for ex, r in zip(SCORED, official_results):
            assert r.prompt_tokens == len(t5_backend.codec.encode_prompt(judge.build_prompt(ex)))

    def test_stream_each_index_once(self, t5_backend):
        judge = LaveJudge(t5_backend, **RATIONALE_KW)
        items = SCORED[:2] + bad_and_good_items()
        seen = [r.index for r in judge.stream(items)]
        assert sorted(seen) == list(range(len(items)))
