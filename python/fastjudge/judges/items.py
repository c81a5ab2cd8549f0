"""Items in and results out for the built-in judges: one JSON item of an HTTP request, or one
row of a file job, as the judge's example; and a result as the fields of an output row.

LAVE items: ``question``, ``references`` (strings or ``{"answer": ...}`` objects),
``prediction``, optional ``caption`` and ``id``.

Image-text items (VisExMEM, holistic): ``image`` (a path; file jobs resolve relative paths
against the image root) or ``image_b64`` (base64 of the encoded image), ``text`` (or
``caption``), optional ``boxes`` ``[[x0, y0, x1, y1], ...]`` in pixels, optional ``claims`` (the
text's claims to check instead of decomposing it: strings, or objects with ``text`` and
optionally ``part_id``, ``type``, ``parent_part_id``, ``head_part_id``, ``target_part_id``; the
judge bounds their count and length) and ``id``.

Nothing here imports torch: the example classes are imported when an item is converted.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
from typing import Any


class ItemError(ValueError):
    """An input item that is not a valid example for the judge (the server answers 422)."""


# -- LAVE ------------------------------------------------------------------------------------
def parse_lave_item(d: Any, where: str):
    """One item of an HTTP request, checked strictly; :class:`ItemError` names ``where``."""
    from .lave import VQAExample

    if not isinstance(d, dict):
        raise ItemError(f"{where}: expected a JSON object, got {type(d).__name__}")
    missing = [k for k in ("question", "references", "prediction") if k not in d]
    if missing:
        raise ItemError(f"{where}: missing field(s) {', '.join(missing)}")
    if not isinstance(d["question"], str):
        raise ItemError(f"{where}: question must be a string")
    if not isinstance(d["prediction"], str):
        raise ItemError(f"{where}: prediction must be a string")
    refs = d["references"]
    if not isinstance(refs, list) or not all(
            isinstance(r, str) or (isinstance(r, dict) and isinstance(r.get("answer"), str))
            for r in refs):
        raise ItemError(f"{where}: references must be a list of strings "
                        "(or of {\"answer\": str} objects)")
    caption = d.get("caption")
    if caption is not None and not isinstance(caption, str):
        raise ItemError(f"{where}: caption must be a string or null")
    ident = d.get("id")
    if ident is not None and not isinstance(ident, (str, int, float, bool)):
        raise ItemError(f"{where}: id must be a string or a number")
    return VQAExample(d["question"], refs, d["prediction"], caption, ident)


def lave_from_row(item: dict, ident: Any):
    """One row of a file job: fields as given; the judge validates them (a per-item error)."""
    from .lave import VQAExample

    return VQAExample(question=item.get("question"), references=item.get("references"),
                      prediction=item.get("prediction"), caption=item.get("caption"), id=ident)


# -- image-text ------------------------------------------------------------------------------
def image_text_from_row(row: Any, ident: Any = None, where: str = "item"):
    """One item as an example; :class:`ItemError` names what is wrong. Whether the image opens
    and the boxes fit is checked by the judge (a per-item error there)."""
    if not isinstance(row, dict):
        raise ItemError(f"{where}: expected a JSON object, got {type(row).__name__}")
    text = row.get("text", row.get("caption"))
    if not isinstance(text, str):
        raise ItemError(f"{where}: text (or caption) must be a string")
    if "image_b64" in row:
        try:
            image = base64.b64decode(row["image_b64"], validate=True)
        except (binascii.Error, TypeError, ValueError):
            raise ItemError(f"{where}: image_b64 is not valid base64") from None
    elif isinstance(row.get("image"), str):
        image = row["image"]
    else:
        raise ItemError(f"{where}: needs image (a path) or image_b64")
    boxes = row.get("boxes")
    if boxes is not None and not isinstance(boxes, list):
        raise ItemError(f"{where}: boxes must be a list of [x0, y0, x1, y1]")
    claims = row.get("claims")
    if claims is not None and not (isinstance(claims, list) and claims and all(
            isinstance(c, str) or (isinstance(c, dict) and isinstance(c.get("text"), str)) for c in claims)):
        raise ItemError(f"{where}: claims must be a non-empty list of strings (or of objects with a "
                        "text)")
    from .visexmem import ImageTextExample

    return ImageTextExample(image=image, text=text, boxes=boxes,
                            id=ident if ident is not None else row.get("id"), claims=claims)


def parse_image_text_item(d: Any, where: str):
    """One item of an HTTP request. The server reads no files on a client's behalf: images come
    as ``image_b64``; a path is refused."""
    if isinstance(d, dict) and "image_b64" not in d and "image" in d:
        raise ItemError(f"{where}: the server does not read image paths; send the encoded image "
                        "as image_b64 (base64)")
    return image_text_from_row(d, None, where)


def image_text_result(result, fields: tuple[str, ...]) -> dict:
    """JSON-ready output fields of an image-text result (claims as plain objects)."""
    out = {}
    for k in fields:
        v = getattr(result, k, None)
        out[k] = [dataclasses.asdict(c) for c in v] if k == "claims" else v
    return out
