"""``/tokenize`` and ``/detokenize`` bodies (vLLM's shapes), validated like the generation
bodies: typed models, a 400 naming the parameter for anything else.

``/tokenize`` takes ``prompt`` (text; ``add_special_tokens``, default true, adds BOS as a
completion does) or ``messages`` and ``tools`` (the chat template, with
``add_generation_prompt``, default true, as a chat completion applies it). ``/detokenize`` takes ``tokens``.
"""

from __future__ import annotations

from typing import Annotated, Any, Callable

from pydantic import Field, ValidationError

from pdserve.engine.tokenizer import Tokenizer
from pdserve.protos import pdserve_pb2
from pdserve.router.adapters import unknown_model
from pdserve.router.frontend import chat_token_ids
from pdserve.router.tools import set_chat
from pdserve.router.http_errors import HttpError
from pdserve.router.openai_bodies import ChatMessage, StrictModel, TokenId, Tool, param_name


class TokenizeBody(StrictModel):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    tools: list[Tool] | None = None  # rendered by the chat template, as a chat completion's
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True


class DetokenizeBody(StrictModel):
    model: str | None = None
    tokens: list[TokenId]


def _validate(cls, body: Any, model_names: tuple[str, ...]):
    if not isinstance(body, dict):
        raise HttpError(400, "body must be a JSON object", param="body")
    try:
        parsed = cls.model_validate(body)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        param = param_name(err["loc"])
        raise HttpError(400, f"{param}: {err['msg']}", param=param) from None
    if parsed.model is not None and parsed.model not in model_names:
        raise HttpError(404, unknown_model(parsed.model, tuple(model_names)), "NotFoundError", "model")  # vLLM's
    return parsed


def tokenize_request(body: Any, model_names: tuple[str, ...], max_chars: int) -> Callable[[Tokenizer], list[int]]:
    """The body -> the tokenizer call to make (on the router's tokenizer thread)."""
    b = _validate(TokenizeBody, body, model_names)
    if (b.prompt is None) == (b.messages is None):
        raise HttpError(400, "set exactly one of prompt and messages", param="prompt")
    if b.prompt is not None:
        text = b.prompt
        if len(text) > max_chars:
            raise HttpError(400, f"{len(text)} characters is over the router's limit max_prompt_chars={max_chars}",
                            param="prompt")
        special = b.add_special_tokens is not False
        return lambda tok: tok.hf.encode(text, add_special_tokens=special)
    chat = pdserve_pb2.ChatMessages()
    set_chat(chat, b)
    chars = sum(len(m.content) + sum(len(c.arguments_json) for c in m.tool_calls) for m in chat.messages)
    if chars + sum(len(t.parameters_json) + len(t.description) for t in chat.tools) > max_chars:
        raise HttpError(400, f"messages are over the router's limit max_prompt_chars={max_chars}", param="messages")

    def template(tok: Tokenizer) -> list[int]:
        return chat_token_ids(chat, tok, b.add_generation_prompt)  # InvalidRequestError names the field

    return template


def detokenize_request(body: Any, model_names: tuple[str, ...], vocab_size: int, max_tokens: int) -> list[int]:
    """The ids to decode: at most ``max_tokens`` (the model's context: no sequence is longer),
    counted before the list is validated item by item."""
    tokens = body.get("tokens") if isinstance(body, dict) else None
    if isinstance(tokens, list) and len(tokens) > max_tokens:
        raise HttpError(400, f"{len(tokens)} tokens is over the limit max_model_len={max_tokens}", param="tokens")
    ids = _validate(DetokenizeBody, body, model_names).tokens
    bad = [t for t in ids if t >= vocab_size]
    if bad:
        raise HttpError(400, f"token id {bad[0]} is outside [0, {vocab_size})", param="tokens")
    return ids
