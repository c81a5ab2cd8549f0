"""VisExMEM's JSON target formats (the paper's Table 5 parts, evidence selection, explanations
and grounding boxes, and the single response of the "Dec." control), as schemas for
``runtime.grammar.Json`` constrained decoding."""

from __future__ import annotations

from typing import Sequence

from ...runtime.grammar import object_schema, text_schema

#: Part ids of the parts schema ("P1", "P2", ...).
PART_ID_PATTERN = r"^P[0-9]{1,3}$"

#: Part types of the parts schema.
PART_TYPES = ("object", "attribute", "count", "relation", "action", "spatial", "negation", "text")

#: Qwen grounding coordinates are integers on a 0..1000 grid.
BOX_COORD_MAX = 1000

#: Scores of the control modes are integers 0..SCORE_MAX.
SCORE_MAX = 100


def _part_properties(max_text_chars: int, types: Sequence[str]) -> dict:
    """The fields of one part (Table 5), in output order."""
    part_id = {"type": "string", "pattern": PART_ID_PATTERN}
    link = {"anyOf": [part_id, {"type": "null"}]}
    return {
        "part_id": part_id,
        "text": text_schema(max_text_chars),
        "type": {"type": "string", "enum": list(types)},
        "parent_part_id": link,
        "head_part_id": link,
        "target_part_id": link,
    }


def parts_schema(max_parts: int = 12, max_text_chars: int = 120,
                 types: Sequence[str] = PART_TYPES) -> dict:
    """``{"parts": [{part_id, text, type, parent_part_id, head_part_id, target_part_id}]}``:
    the decomposition of a text into parts; ids are ``P<digits>``, the links a part id or null."""
    part = object_schema(_part_properties(max_text_chars, types))
    return object_schema({"parts": {"type": "array", "items": part, "maxItems": int(max_parts)}})


def _evidence_ids(ids: Sequence[str]) -> dict:
    """An array of ids drawn from ``ids``, at most ``len(ids)`` of them. Uniqueness is not
    enforced by the grammar: dedupe after parsing."""
    ids = list(dict.fromkeys(str(i) for i in ids))
    if ids:
        return {"type": "array", "items": {"type": "string", "enum": ids}, "maxItems": len(ids)}
    return {"type": "array", "maxItems": 0}


def evidence_schema(ids: Sequence[str]) -> dict:
    """``{"selected_evidence_ids": [...]}`` with ids drawn from ``ids``."""
    return object_schema({"selected_evidence_ids": _evidence_ids(ids)})


def explanation_schema(max_chars: int = 300) -> dict:
    """``{"explanation": "..."}``."""
    return object_schema({"explanation": text_schema(max_chars)})


def boxes_schema(max_boxes: int = 8) -> dict:
    """``{"boxes": [{"bbox_2d": [x0, y0, x1, y1]}]}`` with integer coordinates on Qwen's
    0..1000 grounding grid."""
    coord = {"type": "integer", "minimum": 0, "maximum": BOX_COORD_MAX}
    box = object_schema({"bbox_2d": {"type": "array", "items": coord, "minItems": 4, "maxItems": 4}})
    return object_schema({"boxes": {"type": "array", "items": box, "maxItems": int(max_boxes)}})


def score_schema() -> dict:
    """An integer alignment score, 0..:data:`SCORE_MAX`."""
    return {"type": "integer", "minimum": 0, "maximum": SCORE_MAX}


def _assessment(evidence_ids: Sequence[str], max_explanation_chars: int, explain: bool) -> dict:
    """What the single response says about one claim: its evidence, its score and (``explain``)
    a short explanation, in this order."""
    fields = {"selected_evidence_ids": _evidence_ids(evidence_ids), "support": score_schema()}
    if explain:
        fields["explanation"] = text_schema(max_explanation_chars)
    return fields


def _overall(claims: dict, max_explanation_chars: int, explain: bool) -> dict:
    top = {"claims": claims}
    if explain:
        top["explanation"] = text_schema(max_explanation_chars)
    top["score"] = score_schema()
    return object_schema(top)


def single_response_schema(evidence_ids: Sequence[str], max_parts: int = 12, max_text_chars: int = 120,
                           max_explanation_chars: int = 300, explain: bool = True,
                           types: Sequence[str] = PART_TYPES) -> dict:
    """The single response of the "Dec." control, decomposing the caption itself:
    ``{"claims": [{<part fields>, "selected_evidence_ids", "support", "explanation"}],
    "explanation", "score"}`` -- at least one claim; support and score are integers
    0..:data:`SCORE_MAX`; without ``explain`` no explanation fields."""
    claim = object_schema({**_part_properties(max_text_chars, types),
                           **_assessment(evidence_ids, max_explanation_chars, explain)})
    claims = {"type": "array", "items": claim, "minItems": 1, "maxItems": int(max_parts)}
    return _overall(claims, max_explanation_chars, explain)


def given_claims_response_schema(claim_keys: Sequence[str], evidence_ids: Sequence[str],
                                 max_explanation_chars: int = 300, explain: bool = True) -> dict:
    """The single response of the "Dec." control for claims given with the example (listed in
    the prompt under ``claim_keys``): ``{"claims": {<key>: {"selected_evidence_ids", "support",
    "explanation"}, ...}, "explanation", "score"}`` -- exactly one entry per key, in order."""
    entry = object_schema(_assessment(evidence_ids, max_explanation_chars, explain))
    return _overall(object_schema({k: entry for k in claim_keys}), max_explanation_chars, explain)
