"""The OpenAI-compatible routes in the server's OpenAPI document (:mod:`.openapi`): their
paths and schemas, as :mod:`.openai_routes` and :mod:`.openai_protocol` answer them."""

from __future__ import annotations


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(name: str) -> dict:
    return {"application/json": {"schema": _ref(name)}}


NULLABLE_STRING = {"type": ["string", "null"]}

OPENAI_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": NULLABLE_STRING, "code": NULLABLE_STRING}}}}

_CONTENT = {"oneOf": [
    {"type": "string"}, {"type": "null", "description": "assistant turns only"},
    {"type": "array", "items": {"oneOf": [
        {"type": "object", "required": ["type", "text"], "properties": {
            "type": {"const": "text"}, "text": {"type": "string"}}},
        {"type": "object", "required": ["type", "image_url"], "properties": {
            "type": {"const": "image_url"},
            "image_url": {"type": "object", "required": ["url"], "properties": {
                "url": {"type": "string", "description": "data:image/...;base64,...; an "
                        "http(s) URL only under the server's --image-url-prefix list"},
                "detail": {"type": "string", "description": "ignored"}}}}}]},
     "description": "text parts (joined with newlines) and images (vision-language models); "
                    "other part types answer 400"}]}

_USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
          "properties": {k: {"type": "integer"} for k in
                         ("prompt_tokens", "completion_tokens", "total_tokens")}}

_FINISH = {"enum": ["stop", "length"]}
_HEAD = {"id": {"type": "string"}, "created": {"type": "integer"}, "model": {"type": "string"}}

OPENAI_SCHEMAS = {
    "OpenAIError": OPENAI_ERROR,
    "ModelList": {"type": "object", "required": ["object", "data"], "properties": {
        "object": {"const": "list"},
        "data": {"type": "array", "maxItems": 1, "items": {
            "type": "object", "required": ["id", "object", "created", "owned_by"],
            "properties": {"id": {"type": "string"}, "object": {"const": "model"},
                           "created": {"type": "integer"}, "owned_by": {"type": "string"}}}}}},
    "ChatCompletionRequest": {"type": "object", "required": ["messages"], "properties": {
        "model": {"type": "string", "description": "any name: the server's one model answers"},
        "messages": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["role"], "properties": {
                "role": {"enum": ["system", "developer", "user", "assistant"]},
                "content": _CONTENT}}},
        "max_tokens": {"type": "integer", "minimum": 1},
        "max_completion_tokens": {"type": "integer", "minimum": 1,
                                  "description": "as max_tokens; either is capped by the "
                                                 "server's limit and the context left"},
        "temperature": {"type": ["number", "null"],
                        "description": "ignored: decoding is greedy"},
        "top_p": {"type": ["number", "null"], "description": "ignored: decoding is greedy"},
        "seed": {"type": ["number", "null"], "description": "ignored: decoding is greedy"},
        "n": {"const": 1},
        "stream": {"type": "boolean"},
        "stream_options": {"type": "object",
                           "properties": {"include_usage": {"type": "boolean"}}},
        "stop": {"oneOf": [{"type": "string"}, {"type": "array", "maxItems": 4,
                                                 "items": {"type": "string"}}]},
        "response_format": {"oneOf": [
            {"type": "object", "required": ["type"],
             "properties": {"type": {"enum": ["text", "json_object"]}}},
            {"type": "object", "required": ["type", "json_schema"], "properties": {
                "type": {"const": "json_schema"},
                "json_schema": {"type": "object", "required": ["schema"],
                                "properties": {"name": {"type": "string"},
                                               "schema": {"type": "object"}}}}}]}}},
    "ChatCompletion": {"type": "object",
                       "required": ["id", "object", "created", "model", "choices", "usage"],
                       "properties": {**_HEAD, "object": {"const": "chat.completion"},
                                      "usage": _USAGE,
                                      "choices": {"type": "array", "items": {
                                          "type": "object",
                                          "required": ["index", "message", "finish_reason"],
                                          "properties": {
                                              "index": {"type": "integer"},
                                              "message": {"type": "object",
                                                          "required": ["role", "content"],
                                                          "properties": {
                                                              "role": {"const": "assistant"},
                                                              "content": {"type": "string"}}},
                                              "finish_reason": _FINISH}}}}},
    "ChatCompletionChunk": {
        "type": "object", "required": ["id", "object", "created", "model", "choices"],
        "description": "one server-sent event 'data: {chunk}'; the stream ends with "
                       "'data: [DONE]'",
        "properties": {**_HEAD, "object": {"const": "chat.completion.chunk"}, "usage": _USAGE,
                       "choices": {"type": "array", "items": {
                           "type": "object", "required": ["index", "delta", "finish_reason"],
                           "properties": {"index": {"type": "integer"},
                                          "delta": {"type": "object", "properties": {
                                              "role": {"const": "assistant"},
                                              "content": {"type": "string"}}},
                                          "finish_reason": {"oneOf": [_FINISH,
                                                                      {"type": "null"}]}}}}}},
}

REFUSALS = {
    "400": "malformed JSON or an invalid request (the field is named in param); a prompt too "
           "long for the model (code context_length_exceeded); an image that does not decode or "
           "is above the pixel budget (code invalid_image), or images for a text-only model "
           "(code image_not_supported)",
    "401": "missing or wrong API key (only when the server has one)",
    "404": "the judge's model is not a decoder-only chat model (code model_not_found)",
    "408": "the body did not arrive in time after the request head",
    "413": "body above the server's size limit",
    "422": "a string that is not valid Unicode (a lone surrogate)",
    "429": "the queue is full; retry later",
    "500": "an internal error (logged by the server)",
    "503": "a system failure after the server's retries (code service_unavailable; retry "
           "after the Retry-After seconds), or the server is shutting down (retry on another "
           "instance)",
    "504": "not finished within the server's timeout",
}


def _refusals(*statuses: str) -> dict:
    """401 comes from the server's key guard, with its ``{"error": message}`` body."""
    return {s: {"description": REFUSALS[s],
                "content": _json("Error" if s == "401" else "OpenAIError")} for s in statuses}


def openai_paths(key: tuple) -> dict:
    """The two routes; ``key``: ``("401",)`` when the server has an API key."""
    return {
        "/v1/models": {"get": {
            "summary": "OpenAI-compatible: the served model (none for a judge that has no "
                       "chat model)",
            "responses": {"200": {"description": "the model list", "content": _json("ModelList")},
                          **_refusals(*key, "500")}}},
        "/v1/chat/completions": {"post": {
            "summary": "OpenAI-compatible chat completion on the judge's model (greedy)",
            "requestBody": {"required": True, "content": _json("ChatCompletionRequest")},
            "responses": {"200": {"description": "the completion, or with stream: true "
                                                 "server-sent events", "content": {
                **_json("ChatCompletion"),
                "text/event-stream": {"schema": _ref("ChatCompletionChunk")}}},
                **_refusals("400", *key, "404", "408", "413", "422", "429", "500", "503", "504")}}},
    }
