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
from typing import Annotated, Any, Optional, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    model_validator,
)
from pydantic_core import PydanticCustomError

from ..io.validation import describe, tagged_union


class ItemError(ValueError):
    """An input item that is not a valid example for the judge (the server answers 422)."""


# -- request models --------------------------------------------------------------------------
# The shapes an HTTP request's items take, as pydantic models: the server validates with them and
# its OpenAPI document is generated from them. File rows are read by the *_from_row functions.
ItemId = Annotated[Union[StrictStr, StrictInt, StrictFloat, StrictBool, None],
                   Field(description="echoed in the item's result")]


def _string_or_object(value: Any) -> str | None:
    return "string" if isinstance(value, str) else "object" if isinstance(value, dict) else None


def string_or(model: type, message: str) -> Any:
    """A string or a ``model`` object, refused with ``message`` when it is neither."""
    return tagged_union({"string": StrictStr, "object": model}, _string_or_object, message)


class ReferenceAnswer(BaseModel):
    """A reference answer as VQA annotations hold it."""

    answer: StrictStr


class LaveItem(BaseModel):
    """One LAVE item: the question, the human reference answers (repetitions included: they
    drive the outlier filter), the candidate answer, and optionally an image caption."""

    model_config = ConfigDict(strict=True)

    question: StrictStr
    references: list[string_or(ReferenceAnswer, 'a reference is a string or {"answer": string}')]
    prediction: StrictStr
    caption: Optional[StrictStr] = None
    id: ItemId = None

    def example(self):
        from .lave import VQAExample

        refs = [r if isinstance(r, str) else {"answer": r.answer} for r in self.references]
        return VQAExample(self.question, refs, self.prediction, self.caption, self.id)


class GivenClaim(BaseModel):
    """A claim given with the item: ``text``, and optionally ``part_id``, ``type`` and the link
    fields (``parent_part_id``, ``head_part_id``, ``target_part_id``), which the judge checks."""

    model_config = ConfigDict(extra="allow", strict=True)

    text: StrictStr


def _base64(text: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise PydanticCustomError("base64", "not valid base64") from None


Box = Annotated[list[StrictFloat], Field(min_length=4, max_length=4)]


class ImageTextItem(BaseModel):
    """One image-text item (VisExMEM, holistic). The server reads no files on a client's
    behalf: the image comes encoded as ``image_b64``; ``text`` (or ``caption``) is checked
    against it."""

    model_config = ConfigDict(strict=True, json_schema_extra={
        "anyOf": [{"required": ["text"]}, {"required": ["caption"]}]})

    image_b64: Annotated[StrictStr, AfterValidator(_base64), Field(
        json_schema_extra={"contentEncoding": "base64"},
        description="the encoded image (PNG, JPEG, ...)")]
    text: Optional[StrictStr] = None
    caption: Optional[StrictStr] = Field(None, description="used when there is no text")
    boxes: Optional[list[Box]] = Field(
        None, description="candidate evidence boxes [x0, y0, x1, y1] in pixels")
    claims: Optional[Annotated[list[string_or(
        GivenClaim, 'a claim is a string or an object with a "text"')], Field(min_length=1)]] = \
        Field(None, description="the text's claims to check instead of decomposing it")
    id: ItemId = None

    @model_validator(mode="before")
    @classmethod
    def _no_paths(cls, data: Any) -> Any:
        if isinstance(data, dict) and "image_b64" not in data and "image" in data:
            raise PydanticCustomError("image_path", "the server does not read image paths; send "
                                      "the encoded image as image_b64 (base64)")
        return data

    @model_validator(mode="after")
    def _has_text(self) -> "ImageTextItem":
        if self.text is None and self.caption is None:
            raise PydanticCustomError("text_missing", "text (or caption) is required")
        return self

    def example(self):
        from .visexmem import ImageTextExample

        claims = None if self.claims is None else [
            c if isinstance(c, str) else c.model_dump() for c in self.claims]
        return ImageTextExample(image=self.image_b64, text=self.text if self.text is not None
                                else self.caption, boxes=self.boxes, id=self.id, claims=claims)


def parse_item(model: type, d: Any, where: str):
    """The example of one HTTP item, validated by ``model``; :class:`ItemError` names where
    each problem is."""
    try:
        return model.model_validate(d).example()
    except ValidationError as bad:
        raise ItemError(describe(bad, d, where)) from None


def parse_lave_item(d: Any, where: str):
    """One LAVE item of an HTTP request (:class:`LaveItem`)."""
    return parse_item(LaveItem, d, where)


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
    """One image-text item of an HTTP request (:class:`ImageTextItem`)."""
    return parse_item(ImageTextItem, d, where)


def image_text_result(result, fields: tuple[str, ...]) -> dict:
    """JSON-ready output fields of an image-text result (claims as plain objects)."""
    out = {}
    for k in fields:
        v = getattr(result, k, None)
        out[k] = [dataclasses.asdict(c) for c in v] if k == "claims" else v
    return out
