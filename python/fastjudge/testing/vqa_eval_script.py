"""The official VQA evaluation script's per-question accuracy, computed the way its loop computes
it (``vqaEval.py``, ``VQAEval.evaluate``): answer dicts, list filtering, no caching. The reference
for ``fastjudge.metrics.vqa`` in the tests and the baseline in ``benchmarks/bench_metrics.py``."""

from __future__ import annotations

from ..metrics.vqa import process_digit_article, process_punctuation


def script_accuracy(prediction, answers):
    """vqaEval.py's per-question loop (master), on answer dicts with unique answer_ids."""
    gts = [{"answer": a, "answer_id": i + 1} for i, a in enumerate(answers)]
    for d in gts:
        d["answer"] = d["answer"].replace("\n", " ").replace("\t", " ").strip()
    res = prediction.replace("\n", " ").replace("\t", " ").strip()
    if len(set(d["answer"] for d in gts)) > 1:
        for d in gts:
            d["answer"] = process_digit_article(process_punctuation(d["answer"]))
        res = process_digit_article(process_punctuation(res))
    accs = []
    for d in gts:
        others = [o for o in gts if o != d]
        matching = [o for o in others if o["answer"] == res]
        accs.append(min(1, float(len(matching)) / 3))
    return float(sum(accs)) / len(accs)
