"""The OpenAI-compatible routes' bodies as pydantic models: the chat request is validated with
:class:`ChatCompletionRequest` (what it may hold, and why, is in :mod:`.openai_protocol`), the
answers are built from :class:`ChatCompletion`, :class:`ChatCompletionChunk` and
:class:`ModelList`, and the OpenAPI document (:mod:`.openapi`) is generated from all of them.

What a model cannot say alone stays in :mod:`.openai_protocol`: which image URLs this server
takes (its ``--image-url-prefix`` list) and how a data URL decodes.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from ..io.validation import tagged_union

MAX_STOP_STRINGS = 4
# option -> its neutral value; any other value would change a greedy answer
NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1}
GREEDY = "ignored: decoding is greedy"
ROLES = ("system", "developer", "user", "assistant")  # developer is read as system


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str] = Field(description="the request field at fault")
    code: Optional[str]


class OpenAIError(BaseModel):
    """An OpenAI error object."""

    error: OpenAIErrorDetail


# -- the request -------------------------------------------------------------------------------
class TextPart(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["text"]
    text: StrictStr


class ImageUrl(BaseModel):
    model_config = ConfigDict(strict=True)

    url: StrictStr = Field(description="data:image/...;base64,...; an http(s) URL only under the "
                                       "server's --image-url-prefix list")
    detail: Optional[StrictStr] = Field(None, description="ignored")


class ImageUrlPart(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["image_url"]
    image_url: tagged_union(
        {"object": ImageUrl, "url": StrictStr},
        lambda v: "object" if isinstance(v, dict) else "url" if isinstance(v, str) else None,
        'expected {"url": "data:..."}')


def _part_kind(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else None
    return kind if kind in ("text", "image_url") else None


ContentPart = tagged_union(
    {"text": TextPart, "image_url": ImageUrlPart}, _part_kind,
    'expected {"type": "text", "text": "..."} or {"type": "image_url", "image_url": {"url": '
    '"data:..."}}; other content (audio, files, video, input_image) is not supported')


def _content_kind(value: Any) -> str | None:
    if value is None:
        return "none"
    return "text" if isinstance(value, str) else "parts" if isinstance(value, list) else None


Content = tagged_union(
    {"text": StrictStr, "parts": list[ContentPart], "none": None}, _content_kind,
    "content must be a string or a list of content parts")


class Message(BaseModel):
    """One turn. ``developer`` is read as ``system``; text parts are joined with newlines;
    images need a vision-language model. Tool turns and tool calls are not served."""

    model_config = ConfigDict(strict=True)

    role: Literal[ROLES]
    content: Content = Field(None, description="null in assistant turns only")
    tool_calls: Optional[Any] = Field(None, description="not supported: absent or empty")
    function_call: Optional[Any] = Field(None, description="not supported: absent or empty")

    @field_validator("role", mode="before")
    @classmethod
    def _known_role(cls, role: Any) -> Any:
        if role not in ROLES:
            raise PydanticCustomError("role", "role {role} is not supported; use system, "
                                      "developer, user or assistant (tools are not served)",
                                      {"role": repr(role)[:40]})
        return role

    @model_validator(mode="after")
    def _served(self) -> "Message":
        if self.tool_calls or self.function_call:
            raise PydanticCustomError("tool_calls", "tool calls are not supported")
        if self.content is None and self.role != "assistant":
            raise PydanticCustomError("content", "content must be a string or a list of "
                                      "content parts (null only in assistant turns)")
        return self


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: Optional[StrictBool] = None


class TextFormat(BaseModel):
    type: Literal["text"]


class JsonObjectFormat(BaseModel):
    type: Literal["json_object"]


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(strict=True, populate_by_name=True)

    name: Optional[StrictStr] = None
    json_schema: dict[str, Any] = Field(alias="schema", description="the output is JSON valid "
                                                                     "under this schema")
    strict: Optional[StrictBool] = None


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


def _format_kind(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else None
    return kind if kind in ("text", "json_object", "json_schema") else None


ResponseFormat = tagged_union(
    {"text": TextFormat, "json_object": JsonObjectFormat, "json_schema": JsonSchemaFormat},
    _format_kind, 'expected {"type": "text"}, {"type": "json_object"} or {"type": '
    '"json_schema", "json_schema": {"schema": {...}}}')

PositiveInt = Annotated[StrictInt, Field(ge=1)]
StopString = Annotated[StrictStr, Field(min_length=1)]
Stop = tagged_union(
    {"one": StopString,
     "list": Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]},
    lambda v: "one" if isinstance(v, str) else "list" if isinstance(v, list) else None,
    f"expected a non-empty string or a list of at most {MAX_STOP_STRINGS}")


def _refused(name: str) -> Any:
    return Field(None, description=f"not supported: {name} must be absent or empty")


class ChatCompletionRequest(BaseModel):
    """A chat completion on the server's model, decoded greedily. Fields not listed are
    ignored (harnesses pass their own extra arguments through)."""

    model_config = ConfigDict(strict=True)

    model: Optional[StrictStr] = Field(None, description="any name: the server's one model "
                                                         "answers")
    messages: list[Message] = Field(min_length=1)
    max_tokens: Optional[PositiveInt] = None
    max_completion_tokens: Optional[PositiveInt] = Field(
        None, description="as max_tokens (and wins over it); either is capped by the server's "
                          "limit and the context left")
    temperature: Optional[StrictFloat] = Field(None, description=GREEDY)
    top_p: Optional[StrictFloat] = Field(None, description=GREEDY)
    top_k: Optional[StrictFloat] = Field(None, description=GREEDY)
    min_p: Optional[StrictFloat] = Field(None, description=GREEDY)
    seed: Optional[StrictFloat] = Field(None, description=GREEDY)
    presence_penalty: Optional[StrictFloat] = Field(None, description="0 only")
    frequency_penalty: Optional[StrictFloat] = Field(None, description="0 only")
    repetition_penalty: Optional[StrictFloat] = Field(None, description="1 only")
    logit_bias: Optional[dict[str, Any]] = _refused("logit_bias")
    logprobs: Optional[StrictBool] = _refused("logprobs")
    top_logprobs: Optional[StrictInt] = _refused("top_logprobs")
    tools: Optional[Any] = _refused("tools")
    functions: Optional[Any] = _refused("functions")
    n: Optional[StrictInt] = Field(None, description="1 only: greedy decoding gives one answer")
    stream: Optional[StrictBool] = None
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Stop] = None
    response_format: Optional[ResponseFormat] = None

    @field_validator(*NEUTRAL)
    @classmethod
    def _neutral(cls, value, info):
        neutral = NEUTRAL[info.field_name]
        if value is not None and value != neutral:
            raise PydanticCustomError("unsupported", "not supported (greedy decoding only); omit "
                                      "it or send {neutral}", {"neutral": neutral})
        return value

    @field_validator("logit_bias", "logprobs", "top_logprobs", "tools", "functions")
    @classmethod
    def _absent(cls, value):
        if value:
            raise PydanticCustomError("unsupported", "not supported")
        return value

    @field_validator("n")
    @classmethod
    def _one(cls, value):
        if value is not None and value != 1:
            raise PydanticCustomError("unsupported", "must be 1: greedy decoding gives one answer")
        return value


# -- the answers -------------------------------------------------------------------------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: Literal["stop", "length"]


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage


class Delta(BaseModel):
    """What a chunk adds; a field it does not add is absent (as in OpenAI's chunks)."""

    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None

    @model_serializer(mode="wrap")
    def _present(self, serialize):
        return {k: v for k, v in serialize(self).items() if v is not None}


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: None = None
    finish_reason: Optional[Literal["stop", "length"]] = None


class ChatCompletionChunk(BaseModel):
    """One server-sent event ``data: {chunk}``; the stream ends with ``data: [DONE]``."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Optional[Usage] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "fastjudge"


class ModelList(BaseModel):
    """The served model (none for a judge that has no chat model)."""

    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(max_length=1)
