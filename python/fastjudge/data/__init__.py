"""Bundled data: LAVE demonstration sets, a sample VQA file (``sample_vqa.jsonl``, 40 items)
and human judgments of its predictions (``sample_human.jsonl``: ``human_score`` 1 correct,
0.5 partly correct or ambiguous, 0 wrong, one judgment per item written for this project to
exercise ``meta-eval`` and ``report --human``; not from an annotation study)."""
