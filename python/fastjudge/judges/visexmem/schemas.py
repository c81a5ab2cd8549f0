"""VisExMEM's JSON target formats (the paper's Table 5 parts, evidence selection, explanations
and grounding boxes), as schemas for ``runtime.grammar.Json`` constrained decoding."""

from __future__ import annotations

from typing import Sequence

from ...runtime.grammar import object_schema, text_schema

#: Part ids of the parts schema ("P1", "P2", ...).
PART_ID_PATTERN = r"^P[0-9]{1,3}$"

#: Part types of the parts schema.
PART_TYPES = ("object", "attribute", "count", "relation", "action", "spatial", "negation", "text")

#: Qwen grounding coordinates are integers on a 0..1000 grid.
BOX_COORD_MAX = 1000


def parts_schema(max_parts: int = 12, max_text_chars: int = 120,
                 types: Sequence[str] = PART_TYPES) -> dict:
    """``{"parts": [{part_id, text, type, parent_part_id, head_part_id, target_part_id}]}``:
    the decomposition of a text into parts; ids are ``P<digits>``, the links a part id or null."""
    part_id = {"type": "string", "pattern": PART_ID_PATTERN}
    link = {"anyOf": [part_id, {"type": "null"}]}
    part = object_schema({
        "part_id": part_id,
        "text": text_schema(max_text_chars),
        "type": {"type": "string", "enum": list(types)},
        "parent_part_id": link,
        "head_part_id": link,
        "target_part_id": link,
    })
    return object_schema({"parts": {"type": "array", "items": part, "maxItems": int(max_parts)}})


def evidence_schema(ids: Sequence[str]) -> dict:
    """``{"selected_evidence_ids": [...]}`` with ids drawn from ``ids``, at most ``len(ids)`` of
    them. Uniqueness is not enforced by the grammar: dedupe after parsing."""
    ids = list(dict.fromkeys(str(i) for i in ids))
    if ids:
        items = {"type": "array", "items": {"type": "string", "enum": ids}, "maxItems": len(ids)}
    else:
        items = {"type": "array", "maxItems": 0}
    return object_schema({"selected_evidence_ids": items})


def explanation_schema(max_chars: int = 300) -> dict:
    """``{"explanation": "..."}``."""
    return object_schema({"explanation": text_schema(max_chars)})


def boxes_schema(max_boxes: int = 8) -> dict:
    """``{"boxes": [{"bbox_2d": [x0, y0, x1, y1]}]}`` with integer coordinates on Qwen's
    0..1000 grounding grid."""
    coord = {"type": "integer", "minimum": 0, "maximum": BOX_COORD_MAX}
    box = object_schema({"bbox_2d": {"type": "array", "items": coord, "minItems": 4, "maxItems": 4}})
    return object_schema({"boxes": {"type": "array", "items": box, "maxItems": int(max_boxes)}})
