"""VisExMEM: reference-free image-text evaluation by decomposed, evidence-grounded verification
(the pipeline is described in ``judge.py``).

* ``judge``: the stages over a batch of examples;
* ``records``: the example and result types;
* ``controls``: the paper's "Dec." and "Hol." controls, as the judge's other modes;
* ``prompts``: the prompt texts and how image slots sit in them;
* ``schemas``: the JSON target formats for constrained decoding;
* ``claims``: given claims, part-graph repair and the global score's aggregates.
"""

from .claims import AGGREGATES, LINK_FIELDS, aggregate, given_parts, validate_parts
from .controls import MODES, IntegerReading
from .judge import EVIDENCE_LAYOUTS, STAGES, VisExJudge
from .prompts import (
    DECISION_PREFIX,
    DECOMPOSE_TASK,
    EXPLAIN_CLAIM_TASK,
    EXPLAIN_OVERALL_TASK,
    HOLISTIC_INTRO,
    HOLISTIC_SCORE_TASK,
    INTRO,
    PROPOSE_TASK,
    SELECT_TASK,
    VERIFY_TASK,
)
from .records import ClaimResult, ImageTextExample, VisExResult
from .schemas import PART_TYPES, SCORE_MAX

__all__ = ["VisExJudge", "VisExResult", "ClaimResult", "ImageTextExample", "aggregate", "validate_parts",
           "given_parts", "IntegerReading", "AGGREGATES", "LINK_FIELDS", "EVIDENCE_LAYOUTS", "STAGES", "MODES",
           "PART_TYPES", "SCORE_MAX", "INTRO", "DECOMPOSE_TASK", "PROPOSE_TASK", "SELECT_TASK", "VERIFY_TASK",
           "EXPLAIN_CLAIM_TASK", "EXPLAIN_OVERALL_TASK", "DECISION_PREFIX", "HOLISTIC_INTRO",
           "HOLISTIC_SCORE_TASK"]
