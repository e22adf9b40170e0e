"""Turning a public request into token ids and engine sampling parameters, with validation."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from engine.config import ModelConfig
from engine.errors import InvalidRequestError
from engine.sampling import SamplingParams, validate_request
from engine.tokenizer import Tokenizer
from protos import pdserve_pb2
from wire.convert import sampling_from_proto

MAX_STOP_STRING_CHARS = 256


@dataclass(frozen=True)
class ModelInfo:
    """What the router knows about the served model (no weights)."""

    name: str
    config: ModelConfig
    max_model_len: int
    block_size: int  # the workers' KV block size, to estimate a request's blocks
    tokenizer: Tokenizer


@dataclass(frozen=True)
class PreparedRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # stop strings included; workers get them stripped


def prepare(req: pdserve_pb2.GenerateRequest, model: ModelInfo) -> PreparedRequest:
    """Validate and tokenize; raises ``InvalidRequestError`` naming the field and the limit."""
    if req.model and req.model != model.name:
        raise InvalidRequestError("model", f"unknown model {req.model!r}; this server serves {model.name!r}")
    kind = req.WhichOneof("input")
    if kind is None:
        raise InvalidRequestError("input", "set one of text, token_ids or chat")
    if kind == "text":
        ids = model.tokenizer.encode(req.text)
    elif kind == "token_ids":
        ids = list(req.token_ids.ids)
    else:
        ids = _chat_ids(req.chat, model.tokenizer)
    params = sampling_from_proto(req.sampling)
    for s in params.stop:
        if len(s) > MAX_STOP_STRING_CHARS:
            raise InvalidRequestError("stop", f"stop strings are limited to {MAX_STOP_STRING_CHARS} characters",
                                      MAX_STOP_STRING_CHARS)
    validate_request(ids, params, model.config.vocab_size, model.max_model_len)
    return PreparedRequest(req.request_id or f"req-{uuid.uuid4().hex[:16]}", ids, params)


def _chat_ids(chat: pdserve_pb2.ChatMessages, tokenizer: Tokenizer) -> list[int]:
    if not chat.messages:
        raise InvalidRequestError("chat.messages", "must contain at least one message", 1)
    for i, m in enumerate(chat.messages):
        if m.role not in ("system", "user", "assistant"):
            raise InvalidRequestError(f"chat.messages[{i}].role",
                                      f"must be system, user or assistant, got {m.role!r}")
    messages = [{"role": m.role, "content": m.content} for m in chat.messages]
    try:
        return tokenizer.apply_chat_template(messages)
    except ValueError as exc:
        raise InvalidRequestError("chat", str(exc)) from exc
