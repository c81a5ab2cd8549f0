"""VQA Accuracy and exact match against the rules of the official vqaEval.py (VQA API, master).

Expected values are worked out by hand from the script's rules (see
fastjudge/metrics/vqa.py); an oracle that follows the script's loop literally (answer dicts
with answer_id, leave-one-out by dict inequality, float sum in annotator order) checks the
accuracy arithmetic on random items, and a transcription of ``VQAEval.evaluate``'s bookkeeping
(``setEvalQA``, ``setAccuracy``: PythonEvaluationTools/vqaEvaluation/vqaEval.py) with Python
2.7's ``round`` checks the per-question and overall rounding."""

from __future__ import annotations

import math
import random
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastjudge.metrics import exact_match, normalize_answer, vqa_accuracy, vqa_accuracy_many
from fastjudge.metrics.vqa import (
    official_round,
    process_digit_article,
    process_punctuation,
    vqa_overall_accuracy,
    vqa_scores,
)
from fastjudge.testing.vqa_eval_script import script_accuracy


# --- normalization ------------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("yes.", "yes"),                 # period not followed by a digit: deleted
    ("2.5", "2.5"),                  # period followed by a digit: kept
    ("5.", "5"),                     # "(?!<=\d)" is a look-ahead typo: period after a digit goes
    ("1.5.", "1.5"),
    ("a.b.c", "abc"),
    ("3,000", "3000"),               # comma between digits: every punctuation char deleted
    ("1,2.", "12"),
    ("a,1,2", "a12"),
    ("red, white", "red white"),     # ", " in the text: comma deleted
    ("red,white", "red white"),      # no space next to it: comma becomes a space
    ("t-shirt", "t shirt"),          # '-' is punctuation in the current script
    ("x - y", "x y"),
    ("(cat)", "cat"),
    ("hello!world", "hello world"),
    ("what?!", "what"),              # no space around: both become spaces, then split/join
    ("3:00", "3:00"),                # ':' is not in the list
    ("don't", "don't"),              # "'" is not in the list
    ("dont", "don't"),               # contractions map
    ("somebody'd", "somebodyd"),     # the map's reversed entry
    ("Im", "im"),                    # capitalized keys never match a lowercased word
    ("Two Dogs", "2 dogs"),          # number words
    ("none", "0"),
    ("zero", "0"),
    ("ten", "10"),
    ("eleven", "eleven"),
    ("The Dog", "dog"),              # articles
    ("an apple", "apple"),
    ("a", ""),
    ("A  big\tdog\n", "big dog"),   # whitespace collapsed by split/join
    ("x/y", "x y"),
    ("x / y", "x y"),
    ("\"quoted\"", "quoted"),
    ("[x]{y}", "x y"),
    ("x_y", "x y"),
    ("c++", "c"),                    # '+' twice -> "c  " -> "c"
    ("", ""),
])
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


def test_period_strip_count_quirk():
    """The script passes re.UNICODE (= 32) as sub()'s count: only 32 periods are deleted."""
    assert process_punctuation("." * 40 + "x") == "." * 8 + "x"
    assert process_punctuation("." * 32 + "x") == "x"


def test_comma_strip_checks_original_text():
    # the digit-comma test and the space tests look at the original text, not the partly
    # processed one: "a; ,b" has "; " and " ," so both are deleted
    assert process_punctuation("a; ,b") == "a b"
    # "a;b 1,2": digit comma present -> ';' deleted too (not replaced by a space)
    assert process_punctuation("a;b 1,2") == "ab 12"


def test_digits_are_ascii_only():
    """Python 2 semantics of the script: \\d matches only ASCII digits, so a comma between
    Arabic-Indic digits becomes a space instead of being deleted."""
    assert process_punctuation("\u0661,\u0662") == "\u0661 \u0662"
    assert process_punctuation("1,2") == "12"


def test_process_digit_article_order():
    # number words map before the article test; contractions after
    assert process_digit_article("The ONE thats") == "1 that's"


# --- VQA accuracy -------------------------------------------------------------------------------
def test_distinct_answer_quirk():
    """Ten identical references: nothing is normalized, not even the prediction."""
    refs = ["yes"] * 10
    assert vqa_accuracy("Yes", refs) == 0.0
    assert vqa_accuracy("yes.", refs) == 0.0
    assert vqa_accuracy(" yes\n", refs) == 1.0   # whitespace cleanup always happens
    assert vqa_accuracy("yes", refs) == 1.0
    assert vqa_accuracy("Yes", refs, normalize="always") == 1.0
    assert vqa_accuracy("yes.", refs, normalize="always") == 1.0
    # two distinct strings (case differs): everything is normalized
    assert vqa_accuracy("YES.", ["yes"] * 9 + ["Yes"]) == 1.0
    # number words: "two" x3 is one distinct answer, so "2" does not match ...
    assert vqa_accuracy("2", ["two"] * 3) == 0.0
    # ... but with a second distinct answer both become "2"
    assert vqa_accuracy("2", ["two", "2", "2"]) == pytest.approx(2 / 3)
    assert vqa_accuracy("two", ["two"] * 3) == pytest.approx(2 / 3)  # n = 3: each sees 2 others


def test_normalize_none():
    assert vqa_accuracy("Yes", ["yes", "Yes", "yes", "yes"], normalize="none") == pytest.approx(0.25)
    # 4 refs, 1 match: the matching annotator sees 0 others, the 3 others see 1 -> 3 * (1/3) / 4


@pytest.mark.parametrize("k, expected", [(0, 0.0), (1, 0.3), (2, 0.6), (3, 0.9), (4, 1.0),
                                         (7, 1.0), (10, 1.0)])
def test_ten_references(k, expected):
    refs = ["cat"] * k + ["dog", "mouse"] * 5
    refs = refs[:10]
    assert vqa_accuracy("cat", refs) == pytest.approx(expected)


def test_float_sum_in_annotator_order():
    """k = 2 of 10: the script sums 1/3 and 2/3 in annotator order; the result's last bit
    depends on where the matches are, and is reproduced."""
    def script_sum(matches):
        k = sum(matches)
        total = 0
        for m in matches:
            total += min(1, float(k - m) / 3)
        return float(total) / len(matches)

    for positions in [(0, 1), (8, 9), (0, 9), (3, 6), (1, 4, 7), (0, 1, 2), (7, 8, 9)]:
        refs = ["x"] * 10
        for p in positions:
            refs[p] = "cat"
        refs[5 if 5 not in positions else 4] = "y"  # two distinct -> normalized, still "cat"/"x"/"y"
        got = vqa_accuracy("cat", refs)
        assert got == script_sum([r == "cat" for r in refs])  # bit-identical
    values = {vqa_accuracy("cat", ["cat" if i in pos else "x" for i in range(10)])
              for pos in [(0, 1), (8, 9), (2, 7)]}
    assert len(values) > 1  # the order really matters at the last bit


def test_fewer_than_ten_references():
    # n = 5, k = 2: matching annotators see 1 other (1/3), the other 3 see 2 (2/3)
    assert vqa_accuracy("red", ["red", "red", "blue", "green", "pink"]) == pytest.approx(
        (2 / 3 + 3 * 2 / 3) / 5)
    # n = 2, one match: (0 + 1/3) / 2
    assert vqa_accuracy("red", ["red", "blue"]) == pytest.approx(1 / 6)
    # n = 2, both match: each sees 1 other: 1/3
    assert vqa_accuracy("red", ["red", "red"]) == pytest.approx(1 / 3)


def test_single_reference_modes():
    assert vqa_accuracy("red", ["red"]) == pytest.approx(1 / 3)            # default "vqa"
    assert vqa_accuracy("blue", ["red"]) == 0.0
    assert vqa_accuracy("red", ["red"], single_reference="official") == 0.0  # vqaEval.py
    assert vqa_accuracy("red", ["red"], single_reference="exact") == 1.0
    assert vqa_accuracy("Red", ["red"], single_reference="exact") == 0.0   # one distinct answer
    assert vqa_accuracy("Red", ["red"], normalize="always", single_reference="exact") == 1.0


def test_vqa_style_references_and_errors():
    refs = [{"answer": "yes", "answer_id": i} for i in range(1, 4)] + [{"answer": "no"}]
    assert vqa_accuracy("yes", refs) == pytest.approx(3 * (2 / 3) / 4 + (1 / 4))
    with pytest.raises(ValueError, match="empty"):
        vqa_accuracy("yes", [])
    with pytest.raises(ValueError, match="strings"):
        vqa_accuracy("yes", ["yes", 3])
    with pytest.raises(ValueError, match="strings"):
        vqa_accuracy("yes", [{"text": "yes"}])
    with pytest.raises(ValueError, match="list"):
        vqa_accuracy("yes", "yes")
    with pytest.raises(ValueError, match="prediction"):
        vqa_accuracy(None, ["yes"])
    with pytest.raises(ValueError, match="normalize"):
        vqa_accuracy("yes", ["yes"], normalize="sometimes")
    with pytest.raises(ValueError, match="single_reference"):
        vqa_accuracy("yes", ["yes"], single_reference="maybe")


def test_exact_match():
    assert exact_match("Yes.", ["yes"] * 10) == 1.0  # normalized by default
    assert exact_match("Yes.", ["yes"] * 10, normalize="official") == 0.0
    assert exact_match("two", ["2", "3"]) == 1.0
    assert exact_match("a cat", ["the cat"]) == 1.0
    assert exact_match("cats", ["cat"]) == 0.0
    assert exact_match("cat", ["dog", {"answer": " Cat "}]) == 1.0
    assert exact_match("Cat", ["cat"], normalize="none") == 0.0
    assert vqa_scores("Yes.", ["yes"] * 10) == (0.0, 1.0)




VOCAB = ["yes", "Yes", "yes.", "no", "2", "two", "Two ", "the dog", "dog", "a dog!", "t-shirt",
         "t shirt", "don't", "dont", "3,000", "3000", "1.5", "5.", "5", "red, white", "red white",
         "none", "0", "(cat)", "cat", "\tcat\n", "x - y", "x y", "", " "]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(VOCAB), min_size=2, max_size=12), st.sampled_from(VOCAB))
def test_matches_script_loop(answers, prediction):
    assert vqa_accuracy(prediction, answers) == script_accuracy(prediction, answers)


def test_many_matches_single():
    rng = random.Random(0)
    items = []
    for _ in range(2000):
        n = rng.choice([1, 2, 3, 5, 10, 10])
        base = rng.sample(VOCAB, rng.choice([1, 2, 3]))
        items.append((rng.choice(base + VOCAB[:5]), [rng.choice(base) for _ in range(n)]))
    for mode in ("official", "always", "none"):
        many = vqa_accuracy_many([p for p, _ in items], [r for _, r in items], normalize=mode)
        assert many == [vqa_accuracy(p, r, normalize=mode) for p, r in items]
    assert [vqa_scores(p, r)[0] for p, r in items] == vqa_accuracy_many(
        [p for p, _ in items], [r for _, r in items])
    assert [script_accuracy(p, r) for p, r in items if len(r) > 1] == [
        vqa_accuracy(p, r) for p, r in items if len(r) > 1]


# --- the script's rounding ----------------------------------------------------------------------
def py27_round(x: float, ndigits: int = 2) -> float:
    """Python 2.7's ``round(x, ndigits)`` for x >= 0 (``float_round`` / ``_Py_double_round`` in
    its floatobject.c): the exact binary value of x to the nearest multiple of 10**-ndigits,
    an exact half away from zero, then back to the nearest double."""
    scaled = Fraction(x) * 10 ** ndigits
    return float(Fraction(math.floor(scaled + Fraction(1, 2)), 10 ** ndigits))


def script_report(predictions, answer_lists):
    """vqaEval.py (master) ``VQAEval.evaluate``'s bookkeeping: ``accQA`` gets each question's
    unrounded mean, ``setEvalQA`` stores ``round(100*acc, self.n)`` with n = 2, and
    ``setAccuracy`` sets overall = ``round(100*float(sum(accQA))/len(accQA), self.n)``."""
    acc_qa, eval_qa = [], []
    for prediction, answers in zip(predictions, answer_lists):
        acc = script_accuracy(prediction, answers)
        acc_qa.append(acc)
        eval_qa.append(py27_round(100 * acc, 2))
    total = 0
    for acc in acc_qa:  # Python 2's sum(): left to right
        total += acc
    return eval_qa, py27_round(100 * float(total) / len(acc_qa), 2)


def test_python27_round():
    """Exact ties go away from zero as in Python 2.7 (Python 3 sends them to even); values
    whose binary form lies below the tie (2.675) round down in both."""
    for x, expected in [(0.125, 0.13), (0.375, 0.38), (12.125, 12.13), (2.675, 2.67), (66.666, 66.67),
                        (33.33333333333333, 33.33), (0.0, 0.0), (100.0, 100.0)]:
        assert official_round(x) == py27_round(x) == expected, x
    assert round(0.125, 2) == 0.12  # what Python 3 would have reported


def test_official_rounding_matches_the_script():
    rng = random.Random(1)
    items = []
    for _ in range(3000):
        base = rng.sample(VOCAB, rng.choice([1, 2, 3]))
        n = rng.choice([2, 3, 5, 10, 10, 10])
        items.append((rng.choice(base + VOCAB[:5]), [rng.choice(base) for _ in range(n)]))
    predictions, answers = [p for p, _ in items], [r for _, r in items]
    eval_qa, overall = script_report(predictions, answers)
    assert vqa_accuracy_many(predictions, answers, official_rounding=True) == eval_qa
    assert vqa_overall_accuracy(vqa_accuracy_many(predictions, answers)) == overall
    for k in range(1, 40):  # and on every prefix, where the last digit moves
        assert vqa_overall_accuracy(vqa_accuracy_many(predictions[:k], answers[:k])) == \
            script_report(predictions[:k], answers[:k])[1]


def test_overall_rounds_once_from_unrounded_values():
    # 2/3, 2/3, 0: per question 66.67, 66.67, 0.0; overall 44.44 (not 44.45 from the rounded)
    accs = [2 / 3, 2 / 3, 0.0]
    assert [official_round(100 * a) for a in accs] == [66.67, 66.67, 0.0]
    assert vqa_overall_accuracy(accs) == 44.44
    # 97 of 800 right: 100 * 97 / 800 is exactly 12.125, a tie: 12.13 as the script reports
    assert vqa_overall_accuracy([1.0] * 97 + [0.0] * 703) == 12.13
    with pytest.raises(ValueError, match="no accuracies"):
        vqa_overall_accuracy([])


def test_vqa_acc_summary_reports_the_script_overall(tmp_path, capsys):
    import json

    from fastjudge.cli import main

    rows = [{"id": i, "question": "?", "prediction": p, "references": r}
            for i, (p, r) in enumerate([("cat", ["cat", "cat", "dog"]), ("dog", ["cat"] * 9 + ["dog"]),
                                        ("red", ["red", "blue"])])]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows) + "not json\n")
    # exit 3: a row is an item error
    assert main(["vqa-acc", "--input", str(src), "--output", str(out), "--no-progress"]) == 3
    accs = [r["vqa_accuracy"] for r in map(json.loads, out.read_text().splitlines()) if r["error"] is None]
    line = [x for x in capsys.readouterr().err.splitlines() if "overall accuracy" in x]
    assert line == [f"fastjudge vqa-acc overall accuracy (vqaEval.py rounding): "
                    f"{vqa_overall_accuracy(accs):.2f} over the 3 items scored in this run"]
