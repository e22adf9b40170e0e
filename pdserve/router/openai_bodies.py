"""The OpenAI request bodies as typed pydantic models (strict types, no NaN or Infinity,
wire-sized integers), for ``pdserve.router.validation.parse_body`` and the tool plan of
``pdserve.router.tools`` to read; ``/tokenize`` and ``/detokenize`` build on them too."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from pdserve.engine.sampling.params import MAX_TOP_LOGPROBS
from pdserve.router.session_hint import MAX_SESSION_ID_CHARS

UINT32_MAX = 2**32 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
UINT64_MAX = 2**64 - 1
MAX_TIMEOUT_S = 86_400.0  # a day: the body's ``timeout`` past it is surely a unit mistake (ms)

UInt32 = Annotated[int, Field(ge=0, le=UINT32_MAX)]
TokenId = Annotated[int, Field(ge=0, le=UINT32_MAX)]
TopN = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]


class StrictModel(BaseModel):
    # extra="ignore": fields pdserve has no use for (user, ...) are accepted and ignored, as
    # vLLM does; those that would change the answer and are not supported are refused by
    # name in ``pdserve.router.validation``.
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore", frozen=True)


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class FunctionCallIn(StrictModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(StrictModel):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(StrictModel):
    role: str
    content: Union[str, list[TextPart], None] = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers


class FunctionDef(StrictModel):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: FunctionName


class JsonSchemaSpec(StrictModel):
    name: str
    description: str | None = None
    schema_: Union[dict[str, Any], bool, None] = Field(default=None, alias="schema")
    strict: bool | None = None  # constrained decoding is always strict


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class SamplingBody(StrictModel):
    model: str | None = None
    n: Annotated[int, Field(ge=1, le=UINT32_MAX)] = 1
    best_of: Annotated[int, Field(ge=1, le=UINT32_MAX)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1, le=UINT32_MAX)] | None = None
    min_tokens: UInt32 = 0
    temperature: float = 1.0
    top_p: float | None = None
    top_k: Annotated[int, Field(ge=INT32_MIN, le=INT32_MAX)] = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None  # token id (as a string, JSON keys are) -> bias
    seed: Annotated[int, Field(ge=0, le=UINT64_MAX)] | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    response_format: ResponseFormat | None = None
    guided_json: Union[dict[str, Any], str, None] = None  # vLLM's extensions
    guided_regex: str | None = None
    cache_salt: str | None = None  # vLLM's: prefix-cache blocks are shared only within a salt
    # SGLang's and Dynamo's session hint: only which decode worker served the session last
    # (router.session_hint); the tokens alone find a conversation's KV.
    session_id: Annotated[str, Field(min_length=1, max_length=MAX_SESSION_ID_CHARS)] | None = None
    # The request's deadline in seconds (an extension, as the OpenAI clients' own ``timeout``):
    # past it the request ends with a timeout error and its work on the workers is aborted.
    # The router's request_timeout_s caps it; X-Request-Timeout says the same as a header.
    timeout: Annotated[float, Field(gt=0, le=MAX_TIMEOUT_S)] | None = None


class CompletionBody(SamplingBody):
    prompt: Union[str, list[TokenId], list[str], list[list[TokenId]]]
    logprobs: TopN | None = None  # the chosen tokens' logprobs and this many alternatives
    echo: bool = False


class ChatBody(SamplingBody):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=UINT32_MAX)] | None = None
    logprobs: bool = False
    top_logprobs: TopN | None = None
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool | None = None


def param_name(loc: tuple) -> str:
    """A pydantic error location as the client's parameter name (``messages[0].role``)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("str", "int", "list[str]", "list[int]", "list[list[int]]") or "[" in str(part):
            continue  # pydantic names the union member it tried; the client's field is enough
        else:
            out += f".{part}" if out else str(part)
    return out or "body"
