"""VisExMEM: reference-free image-text evaluation by decomposed, evidence-grounded verification
(the pipeline is described in ``judge.py``).

* ``judge``: the stages over a batch of examples, and the result types;
* ``prompts``: the prompt texts and how image slots sit in them;
* ``schemas``: the JSON target formats for constrained decoding;
* ``claims``: part-graph repair and the global score's aggregates.
"""

from .claims import AGGREGATES, LINK_FIELDS, aggregate, validate_parts
from .judge import EVIDENCE_LAYOUTS, STAGES, ClaimResult, ImageTextExample, VisExJudge, VisExResult
from .prompts import (DECISION_PREFIX, DECOMPOSE_TASK, EXPLAIN_CLAIM_TASK, EXPLAIN_OVERALL_TASK, INTRO,
                      PROPOSE_TASK, SELECT_TASK, VERIFY_TASK)
from .schemas import PART_TYPES

__all__ = ["VisExJudge", "VisExResult", "ClaimResult", "ImageTextExample", "aggregate", "validate_parts",
           "AGGREGATES", "LINK_FIELDS", "EVIDENCE_LAYOUTS", "STAGES", "PART_TYPES", "INTRO", "DECOMPOSE_TASK",
           "PROPOSE_TASK", "SELECT_TASK", "VERIFY_TASK", "EXPLAIN_CLAIM_TASK", "EXPLAIN_OVERALL_TASK",
           "DECISION_PREFIX"]
