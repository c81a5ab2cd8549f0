"""Reference-based metrics and meta-evaluation (numpy only; matplotlib optional for plots).

* :mod:`.vqa` -- VQA Accuracy and exact match exactly as the official VQA evaluation script.
* :mod:`.stats` -- Spearman / Kendall tau-b, vectorized bootstrap CIs.
* :mod:`.significance` -- the LAVE paper's significance test between two metrics' correlations.
* :mod:`.human_ratings` -- LAVE's human score, Krippendorff's alpha.
* :mod:`.image_text_meta_eval` -- image-text benchmark meta-evaluation: pairwise accuracy (tie
  calibration), Winoground scores, Spearman per benchmark, Cohen's kappa, T2IScoreScore's rank
  and sep.
* :mod:`.error_graphs` -- T2IScoreScore's rank and sep over error graphs.
* :mod:`.meta_eval` -- ``fastjudge meta-eval``: metrics vs human judgments from JSONL files.
"""

from .error_graphs import ts2_rank, ts2_sep
from .human_ratings import human_score, krippendorff_alpha
from .image_text_meta_eval import (
    cohen_kappa,
    pairwise_accuracy,
    spearman_by_benchmark,
    tie_calibrated_pairwise_accuracy,
    winoground_scores,
)
from .significance import CorrelationComparison, compare_correlations
from .stats import BootstrapCI, bootstrap_ci, bootstrap_replicates, kendall, spearman
from .vqa import exact_match, normalize_answer, vqa_accuracy, vqa_accuracy_many, vqa_overall_accuracy

__all__ = ["vqa_accuracy", "vqa_accuracy_many", "vqa_overall_accuracy", "exact_match", "normalize_answer", "spearman",
           "kendall", "bootstrap_ci", "bootstrap_replicates", "BootstrapCI",
           "compare_correlations", "CorrelationComparison", "krippendorff_alpha", "human_score",
           "pairwise_accuracy", "tie_calibrated_pairwise_accuracy", "winoground_scores",
           "spearman_by_benchmark", "cohen_kappa", "ts2_rank", "ts2_sep"]
