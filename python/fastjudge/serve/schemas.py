"""The bodies of the score API, the OpenRLHF reward route and the health route, as pydantic
models: requests are validated with them (after the body limits of :mod:`.bodies`), and the
OpenAPI document (:mod:`.openapi`) is generated from them.

The score request and its results depend on the judge: :func:`score_models` builds them from
the judge's item model and declared result fields (:class:`fastjudge.judges.registry.JudgeSpec`).
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field, StrictStr, create_model, model_validator
from pydantic_core import PydanticCustomError

from ..judges.items import ItemId
from ..judges.registry import JudgeSpec


class Error(BaseModel):
    """Why the request was refused; nothing in it was scored."""

    error: str


# The JSON types of the result field types a judge declares (JudgeSpec.result_types); a field
# of another type is any JSON value.
FIELD_TYPES = {"float": float, "int": int, "str": str, "bool": bool, "list[float]": list[float]}


def score_models(spec: JudgeSpec) -> tuple[type[BaseModel], type[BaseModel], type[BaseModel]]:
    """``(ScoreRequest, Result, ScoreResponse)`` for judge ``spec``. A judge registered without
    an item model takes items as JSON objects, read by its ``parse_item``."""
    item = spec.item_model or dict[str, Any]
    request = create_model("ScoreRequest", __config__=ConfigDict(strict=True),
                           __doc__="Items to score, in the order their results come back.",
                           items=(list[item], ...))
    fields: dict[str, Any] = {
        "index": (int, Field(description="position in the request")),
        "id": (ItemId, None),
        "error": (Optional[str], Field(None, description="why this item got no score; other "
                                                         "items are unaffected")),
    }
    for name in spec.result_fields:
        if name not in fields:
            kind = FIELD_TYPES.get(spec.result_types.get(name), Any)
            fields[name] = (Optional[kind], None)
    result = create_model("Result", __doc__="One item's result (its fields are null when "
                                            "error says why it got none).", **fields)
    response = create_model("ScoreResponse", __doc__="One result per item, in input order.",
                            results=(list[result], ...))
    return request, result, response


class RewardRequest(BaseModel):
    """OpenRLHF's remote reward payload (``prompts`` and ``labels`` beside ``query``), or
    queries that are judge items as JSON object strings."""

    model_config = ConfigDict(strict=True)

    query: list[StrictStr] = Field(description="with prompts: the prompt and the response as "
                                   "the trainer decoded them; without: an item as a JSON object "
                                   "string")
    prompts: Optional[list[StrictStr]] = Field(
        None, description="OpenRLHF: each query's prompt (the query starts with it)")
    labels: Optional[list[Any]] = Field(
        None, description="OpenRLHF: a JSON object string of the judge's fields, or the "
                          "references (a JSON list or one string)")

    @model_validator(mode="after")
    def _one_length(self) -> "RewardRequest":
        lengths = {len(x) for x in (self.query, self.prompts, self.labels) if x is not None}
        if len(lengths) > 1 or (self.labels is not None and self.prompts is None):
            raise PydanticCustomError("lengths", '"query", "prompts" and "labels" must be '
                                      "lists of one length (labels need prompts)")
        return self

    @property
    def is_stock(self) -> bool:
        """OpenRLHF's own payload: it carries the prompts."""
        return self.prompts is not None


class ExtraLogs(BaseModel):
    """Per-query values OpenRLHF logs beside the rewards."""

    error: list[float] = Field(description="1.0 where the item got reward_on_error")
    rating: list[float] = Field(description="the judge's rating (0.0 where there is none)")


class RewardResponse(BaseModel):
    """One reward per query, in query order; an item the judge rejects gets the server's
    reward_on_error and its message in errors."""

    rewards: list[float]
    scores: list[float]
    errors: list[Optional[str]]
    extra_logs: ExtraLogs


class LastSystemFailure(BaseModel):
    at: float = Field(description="Unix time")
    error: str


class Health(BaseModel):
    """The server is up: its judge, queue depth and batch failures."""

    status: str = Field(json_schema_extra={"const": "ok"})
    judge: str
    queue_depth: int
    system_failures: int = Field(description="batches answered 503")
    last_system_failure: Optional[LastSystemFailure]
