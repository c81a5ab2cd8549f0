"""The server's API as an OpenAPI 3.1 document, served at ``GET /openapi.json``.

Written by hand for the routes :func:`fastjudge.serve.create_app` serves; the item schema
comes from the judge's item parser (LAVE or image-text items) and the result schema from the
judge's declared result fields and types (:class:`fastjudge.judges.registry.JudgeSpec`).
"""

from __future__ import annotations

from ..judges import items
from ..judges.registry import JudgeSpec
from .openai_schemas import OPENAI_SCHEMAS, openai_paths

ERROR = {"type": "object", "required": ["error"],
         "properties": {"error": {"type": "string"}}}

ITEM_ID = {"type": ["string", "number", "boolean", "null"],
           "description": "echoed in the item's result"}

LAVE_ITEM = {
    "type": "object", "required": ["question", "references", "prediction"],
    "properties": {
        "question": {"type": "string"},
        "references": {"type": "array", "items": {"oneOf": [
            {"type": "string"},
            {"type": "object", "required": ["answer"],
             "properties": {"answer": {"type": "string"}}}]}},
        "prediction": {"type": "string"},
        "caption": {"type": ["string", "null"]},
        "id": ITEM_ID,
    },
}

IMAGE_TEXT_ITEM = {
    "type": "object", "required": ["image_b64"],
    "anyOf": [{"required": ["text"]}, {"required": ["caption"]}],
    "properties": {
        "image_b64": {"type": "string", "contentEncoding": "base64",
                      "description": "the encoded image (PNG, JPEG, ...); the server reads no "
                                     "image paths"},
        "text": {"type": "string"},
        "caption": {"type": "string", "description": "used when there is no text"},
        "boxes": {"type": ["array", "null"], "items": {
            "type": "array", "items": {"type": "number"}, "minItems": 4, "maxItems": 4},
            "description": "candidate evidence boxes [x0, y0, x1, y1] in pixels"},
        "claims": {"type": ["array", "null"], "minItems": 1, "items": {"oneOf": [
            {"type": "string"},
            {"type": "object", "required": ["text"], "properties": {"text": {"type": "string"}}}]},
            "description": "the text's claims to check instead of decomposing it"},
        "id": ITEM_ID,
    },
}

ITEM_SCHEMAS = {items.parse_lave_item: LAVE_ITEM, items.parse_image_text_item: IMAGE_TEXT_ITEM}

FIELD_TYPES = {
    "float": {"type": ["number", "null"]},
    "int": {"type": ["integer", "null"]},
    "str": {"type": ["string", "null"]},
    "bool": {"type": ["boolean", "null"]},
    "list[float]": {"type": ["array", "null"], "items": {"type": "number"}},
}

# Statuses a route may answer besides 200, with their meaning.
REFUSALS = {
    "400": "malformed JSON, JSON nested deeper than 400 levels, invalid Content-Length",
    "401": "missing or wrong API key (only when the server has one)",
    "408": "the body did not arrive in time after the request head",
    "413": "body above the server's size limit",
    "422": "wrong shapes or types, or a string that is not valid Unicode (a lone surrogate)",
    "429": "more items than the queue can take; retry later",
    "500": "an internal error (logged by the server)",
    "503": "a system failure (out of memory that splitting did not cure, a CUDA error, a "
           "backend failure no item explains) after the server's retries; nothing was scored: "
           "retry after the Retry-After seconds",
    "504": "not finished within the server's timeout",
}


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict) -> dict:
    return {"application/json": {"schema": schema}}


def _refusals(*statuses: str) -> dict:
    return {s: {"description": REFUSALS[s], "content": _json(_ref("Error"))} for s in statuses}


def _result_schema(spec: JudgeSpec) -> dict:
    properties = {"index": {"type": "integer", "description": "position in the request"},
                  "id": ITEM_ID,
                  "error": {"type": ["string", "null"],
                            "description": "why this item got no score; other items are "
                                           "unaffected"}}
    for name in spec.result_fields:
        if name not in properties:
            properties[name] = FIELD_TYPES.get(spec.result_types.get(name), {})
    return {"type": "object", "required": ["index", "error"], "properties": properties}


def openapi_document(spec: JudgeSpec, version: str, authenticated: bool) -> dict:
    """The document for a server of judge ``spec``; ``authenticated``: the routes but
    ``/health`` need a bearer key."""
    key = ("401",) if authenticated else ()
    scoring = ("400", *key, "408", "413", "422", "429", "500", "503", "504")
    guarded = (*key, "500")
    paths = {
        "/v1/score": {"post": {
            "summary": "score items (results in input order, or NDJSON as they finish)",
            "parameters": [{"name": "stream", "in": "query", "required": False,
                            "schema": {"type": "string", "enum": ["1", "true", "yes"]},
                            "description": "answer NDJSON: one result per line as each "
                                           "finishes; a line {\"error\": ...} ends a stream "
                                           "that ran past the timeout"}],
            "requestBody": {"required": True, "content": _json(_ref("ScoreRequest"))},
            "responses": {"200": {"description": "one result per item", "content": {
                **_json(_ref("ScoreResponse")),
                "application/x-ndjson": {"schema": _ref("Result")}}},
                **_refusals(*scoring)}}},
        "/get_reward": {"post": {
            "summary": "OpenRLHF remote reward model: one reward per query",
            "requestBody": {"required": True, "content": _json(_ref("RewardRequest"))},
            "responses": {"200": {"description": "rewards in query order",
                                  "content": _json(_ref("RewardResponse"))},
                          **_refusals(*scoring)}}},
        "/health": {"get": {
            "summary": "liveness and queue depth (needs no key)", "security": [],
            "responses": {"200": {"description": "the server is up",
                                  "content": _json(_ref("Health"))},
                          **_refusals("500")}}},
        "/metrics": {"get": {
            "summary": "Prometheus metrics",
            "responses": {"200": {"description": "Prometheus text format",
                                  "content": {"text/plain": {"schema": {"type": "string"}}}},
                          **_refusals(*guarded)}}},
        "/openapi.json": {"get": {
            "summary": "this document",
            "responses": {"200": {"description": "OpenAPI 3.1",
                                  "content": _json({"type": "object"})},
                          **_refusals(*guarded)}}},
        **openai_paths(key),
    }
    item = ITEM_SCHEMAS.get(spec.parse_item, {"type": "object"})
    schemas = {
        "Error": ERROR,
        "Item": item,
        "Result": _result_schema(spec),
        "ScoreRequest": {"type": "object", "required": ["items"],
                         "properties": {"items": {"type": "array", "items": _ref("Item")}}},
        "ScoreResponse": {"type": "object", "required": ["results"],
                          "properties": {"results": {"type": "array",
                                                     "items": _ref("Result")}}},
        "RewardRequest": {"type": "object", "required": ["query"], "properties": {
            "query": {"type": "array", "items": {
                "type": "string", "description": "with prompts: the prompt and the response as "
                "the trainer decoded them; without: an item as a JSON object string"}},
            "prompts": {"type": "array", "items": {"type": "string"},
                        "description": "OpenRLHF: each query's prompt (the query starts with it)"},
            "labels": {"type": "array", "description": "OpenRLHF: a JSON object string of the "
                       "judge's fields, or the references (a JSON list or one string)"}}},
        "RewardResponse": {"type": "object",
                           "required": ["rewards", "scores", "errors", "extra_logs"],
                           "properties": {
                               "rewards": {"type": "array", "items": {"type": "number"}},
                               "scores": {"type": "array", "items": {"type": "number"}},
                               "errors": {"type": "array",
                                          "items": {"type": ["string", "null"]}},
                               "extra_logs": {"type": "object", "properties": {
                                   "error": {"type": "array", "items": {"type": "number"}},
                                   "rating": {"type": "array", "items": {"type": "number"}}}}}},
        "Health": {"type": "object",
                   "required": ["status", "judge", "queue_depth", "system_failures",
                                "last_system_failure"],
                   "properties": {"status": {"const": "ok"}, "judge": {"type": "string"},
                                  "queue_depth": {"type": "integer"},
                                  "system_failures": {"type": "integer",
                                                      "description": "batches answered 503"},
                                  "last_system_failure": {
                                      "type": ["object", "null"], "required": ["at", "error"],
                                      "properties": {"at": {"type": "number",
                                                            "description": "Unix time"},
                                                     "error": {"type": "string"}}}}},
        **OPENAI_SCHEMAS,
    }
    document = {
        "openapi": "3.1.0",
        "info": {"title": f"fastjudge reward server ({spec.name})", "version": version},
        "paths": paths,
        "components": {"schemas": schemas},
    }
    if authenticated:
        document["components"]["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer",
                       "description": "the server's API key (--api-key or FASTJUDGE_API_KEY)"}}
        document["security"] = [{"bearer": []}]
    return document
