"""Turning a public request into token ids and engine sampling parameters, with validation."""

from __future__ import annotations

import dataclasses
import json
import unicodedata
import uuid
from dataclasses import dataclass, field

from pdserve.engine.config import ModelConfig
from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.sampling.params import SamplingParams, check_prompt
from pdserve.engine.tokenizer import Tokenizer
from pdserve.protos import pdserve_pb2
from pdserve.router.adapters import AdapterTable, UnknownModel
from pdserve.router.cache_salt import request_salt
from pdserve.router.tool_parsers import ToolParser
from pdserve.router.validation import RequestLimits
from pdserve.wire.convert import sampling_from_proto


@dataclass(frozen=True)
class ModelInfo:
    """What the router knows about the served model (no weights)."""

    name: str  # the name responses report (the first served name)
    config: ModelConfig
    max_model_len: int
    block_size: int  # the workers' KV block size, to estimate a request's blocks
    tokenizer: Tokenizer
    aliases: tuple[str, ...] = ()  # further names requests may use (`--served-model-name a b`)
    tool_parser: ToolParser | None = None  # reads tool calls in the model's text (tool_choice "auto")
    # The LoRA adapters served now, each under its own name (router.adapters); changed at run
    # time by /v1/load_lora_adapter and /v1/unload_lora_adapter.
    adapters: AdapterTable = field(default_factory=AdapterTable, compare=False)

    @property
    def names(self) -> tuple[str, ...]:
        """The base model's names."""
        return (self.name, *self.aliases)

    def served_names(self) -> tuple[str, ...]:
        """Every name a request may give as its model now: the base model's, then each adapter's."""
        return (*self.names, *self.adapters.names())

    def serves(self, name: str) -> bool:
        return name in self.names or name in self.adapters


@dataclass(frozen=True)
class PreparedRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # stop strings included; workers get them stripped
    # The client set no max_tokens: it is the rest of the context (as in vLLM), and the
    # router reserves decode KV for only ``pdserve.wire.convert.DEFAULT_MAX_TOKENS`` of it (past
    # that, the decode engine preempts it before any limited request: pdserve/engine/core/scheduler.py).
    default_max_tokens: bool = False


def prepare(req: pdserve_pb2.GenerateRequest, model: ModelInfo, limits: RequestLimits = RequestLimits(),
            max_tokens_to_context: bool = False, tenant: str = "") -> PreparedRequest:
    """Validate and tokenize; raises ``InvalidRequestError`` naming the field and the limit.

    A request without max_tokens gets ``pdserve.wire.convert.DEFAULT_MAX_TOKENS`` (the gRPC API's
    documented default, and /v1/completions') or, with ``max_tokens_to_context`` (OpenAI
    chat, as vLLM does), the rest of the context after its prompt.

    ``tenant``: the salt of the caller's API key (``pdserve.router.cache_salt``); the request's cache
    salt is the client's within it.

    The size limits come first, so that no request tokenizes or templates more than they allow.
    Runs on a worker thread (the tokenizer's work is off the event loop). The two halves,
    ``validate`` and ``tokenize``, are apart so that a trace can time each.
    """
    return tokenize(validate(req, model, limits, max_tokens_to_context, tenant), model)


@dataclass(frozen=True)
class ValidRequest:
    """A request whose every check before tokenizing passed (``validate``)."""

    req: pdserve_pb2.GenerateRequest
    params: SamplingParams  # max_tokens the most it can be when ``default_max_tokens``
    default_max_tokens: bool


def validate(req: pdserve_pb2.GenerateRequest, model: ModelInfo, limits: RequestLimits = RequestLimits(),
             max_tokens_to_context: bool = False, tenant: str = "") -> ValidRequest:
    """``prepare``'s checks before tokenizing: the model, the size limits, the router-only
    fields, the sampling parameters and the grammar."""
    lora_name = adapter_of(req, model)
    check_limits(req, limits)
    refuse_router_only(req)
    if req.WhichOneof("input") is None:
        raise InvalidRequestError("input", "set one of text, token_ids or chat")
    params = dataclasses.replace(sampling_from_proto(req.sampling), lora_name=lora_name)
    default_max_tokens = max_tokens_to_context and req.sampling.max_tokens == 0
    if default_max_tokens:  # the most it can be, until the prompt's length is known
        params = dataclasses.replace(params, max_tokens=model.max_model_len)
    params.check(model.config.vocab_size)  # cheap: before the tokenizer's work
    if params.structured is not None:  # workers compile it; whether it compiles is known here
        params.structured.validate("structured_output")
    if tenant:
        params = dataclasses.replace(params, cache_salt=request_salt(params.cache_salt, tenant))
    return ValidRequest(req, params, default_max_tokens)


def adapter_of(req: pdserve_pb2.GenerateRequest, model: ModelInfo) -> str:
    """The LoRA adapter the request runs (``SamplingParams.lora_name``; "" for the base model),
    named by its ``model`` (``UnknownModel``, 404, for a name not served) or, by a gRPC client
    that leaves ``model`` empty, by ``sampling.lora_name``, which must then be a served adapter
    and, with ``model`` set too, the same one."""
    lora_name = model.adapters.lora_name(req.model, model.names)
    named = req.sampling.lora_name
    if not named:
        return lora_name
    if named not in model.adapters:
        raise UnknownModel(named, model.adapters.names(), field="sampling.lora_name")
    if req.model and named != lora_name:
        raise InvalidRequestError("sampling.lora_name", f"names adapter {named!r} but model is {req.model!r}; "
                                                        "name the adapter as the model alone")
    return named


def tokenize(valid: ValidRequest, model: ModelInfo) -> PreparedRequest:
    """``prepare``'s second half: the prompt's token ids (chat template applied), then the
    checks that need its length."""
    req, params = valid.req, valid.params
    kind = req.WhichOneof("input")
    if kind == "token_ids":
        ids = list(req.token_ids.ids)
    elif kind == "text":
        ids = model.tokenizer.encode(req.text)
    else:
        ids = chat_token_ids(req.chat, model.tokenizer)
    if valid.default_max_tokens:
        rest = max(model.max_model_len - len(ids), 1)  # a prompt too long is refused just below
        params = dataclasses.replace(params, max_tokens=rest, min_tokens=min(params.min_tokens, rest))
    check_prompt(ids, params, model.config.vocab_size, model.max_model_len)
    return PreparedRequest(req.request_id or f"req-{uuid.uuid4().hex[:16]}", ids, params, valid.default_max_tokens)


def check_limits(req: pdserve_pb2.GenerateRequest, limits: RequestLimits) -> None:
    """Every ``RequestLimits`` size, each refused with its setting's name as the field."""
    s = req.sampling
    check_request_id(req.request_id, limits)
    _at_most("max_stop_token_ids", "stop_token_ids", len(s.stop_token_ids), limits.max_stop_token_ids)
    _at_most("max_stop_strings", "stop", len(s.stop), limits.max_stop_strings)
    for text in s.stop:
        _at_most("max_stop_string_chars", "stop", len(text), limits.max_stop_string_chars)
    if req.WhichOneof("input") == "chat":
        _at_most("max_chat_messages", "messages", len(req.chat.messages), limits.max_chat_messages)
        chars = sum(len(m.content) + len(m.role) + sum(len(c.arguments_json) for c in m.tool_calls)
                    for m in req.chat.messages)
        chars += sum(len(t.description) + len(t.parameters_json) for t in req.chat.tools)
    else:
        chars = len(req.text)
    _at_most("max_prompt_chars", "prompt", chars, limits.max_prompt_chars)


def check_request_id(request_id: str, limits: RequestLimits) -> None:
    """A client's request id, as ``Generate`` and ``Abort`` take it: at most
    ``max_request_id_chars``, and no control characters, because ids go into text logs (the
    router's, the workers'), where a newline would forge a line."""
    _at_most("max_request_id_chars", "request_id", len(request_id), limits.max_request_id_chars)
    if any(unicodedata.category(c) == "Cc" for c in request_id):
        raise InvalidRequestError("request_id", "must not contain control characters (newlines, tabs, ...)")


# Public fields that only the router sets (when it re-sends a migrated request), each with the
# test of whether a client set it. Taken from a client they would lie to the engine about the
# request (resumed_tokens: that the prompt's tail is output already accepted by the grammar),
# and a lie the engine trips over is a fault in a step other requests share.
ROUTER_ONLY_FIELDS = {
    "sampling.structured_output.resumed_tokens": lambda req: req.sampling.structured_output.resumed_tokens != 0,
}


def refuse_router_only(req: pdserve_pb2.GenerateRequest) -> None:
    """INVALID_ARGUMENT naming the first router-only field the client set."""
    for name, is_set in ROUTER_ONLY_FIELDS.items():
        if is_set(req):
            raise InvalidRequestError(name, "is set only by the router (when it re-sends a migrated request); "
                                            "clients leave it 0", 0)


def _at_most(setting: str, field: str, value: int, limit: int) -> None:
    if value > limit:
        raise InvalidRequestError(field, f"{value} is over the router's limit {setting}={limit}", limit)


def chat_token_ids(chat: pdserve_pb2.ChatMessages, tokenizer: Tokenizer, add_generation_prompt: bool = True
                   ) -> list[int]:
    """The chat template applied to wire messages and tools (``/tokenize`` renders the same)."""
    if not chat.messages:
        raise InvalidRequestError("chat.messages", "must contain at least one message", 1)
    messages = [_message(i, m) for i, m in enumerate(chat.messages)]
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                               "parameters": _json(t.parameters_json, "tools") or {}}}
             for t in chat.tools]
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt, tools=tools)
    except ValueError as exc:
        raise InvalidRequestError("chat", str(exc)) from exc
    except Exception as exc:  # a template that raises on these messages (jinja2's TemplateError, ...)
        raise InvalidRequestError("chat", f"the chat template failed on these messages: {exc}") from exc


def _message(i: int, m: pdserve_pb2.ChatMessage) -> dict:
    """A wire message as chat templates take it (tool-call arguments as a mapping, as
    transformers documents them)."""
    if m.role not in ("system", "user", "assistant", "tool"):
        raise InvalidRequestError(f"chat.messages[{i}].role",
                                  f"must be system, user, assistant or tool, got {m.role!r}")
    out: dict = {"role": m.role, "content": m.content}
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        field = f"chat.messages[{i}].tool_calls"
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": _json(c.arguments_json, field) or {}}}
                             for c in m.tool_calls]
    return out


def _json(text: str, field: str):
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise InvalidRequestError(field, f"is not valid JSON ({exc})") from None
