"""The OpenAI request bodies read into wire requests, and the size limits every request meets.

Two steps, each done once per request:

1. Shape (HTTP only): ``parse_body`` turns raw bytes into a ``GenerateRequest``. Bytes that
   are not UTF-8 or not JSON, a wrong type, ``NaN``/``Infinity``, or a number the wire type
   cannot hold (``max_tokens`` >= 2**32, ``seed`` >= 2**64, ...) become an ``HttpError`` 400
   naming the parameter. Types are strict: ``"false"`` is not a boolean, ``1.0`` not an
   integer. Semantic ranges (temperature in [0, 100], ...) are not checked here.
2. Meaning (HTTP and gRPC): ``pdserve.router.frontend.prepare`` applies ``RequestLimits`` before any
   tokenization, then checks every value for what it does: the ranges and sizes every engine
   also checks on entry (``pdserve.engine.sampling.params``), and that a structured spec compiles.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from pdserve.protos import pdserve_pb2
from pdserve.router.adapters import unknown_model
from pdserve.router.http_errors import HttpError
from pdserve.router.openai_bodies import UINT32_MAX, UINT64_MAX, ChatBody, CompletionBody, SamplingBody, param_name
from pdserve.router.tools import ToolPlan, set_chat, set_structured, tool_plan

BODY_BYTES_PER_CHAR = 7  # 6 for a character written as a JSON \u escape, 1 more of room for the rest of a body


@dataclass(frozen=True)
class RequestLimits:
    """Sizes a request may have; each breach is a 400 / INVALID_ARGUMENT naming its setting.

    They bound the work a request can cause before it is refused: reading and parsing the
    body, tokenizing, the chat template, and the per-token scans of stop ids and strings.
    """

    # An HTTP body or a gRPC GenerateRequest message. Parsing JSON holds the router's GIL, so
    # this bounds how long one body can stall its event loop (/health included): 1 MiB of
    # token ids parses in ~20-35 ms, 4 MiB in ~75-140 ms. It stays at least BODY_BYTES_PER_CHAR
    # times max_prompt_chars (pdserve/cluster/serve_config.py refuses less), so that the longest
    # allowed prompt fits even as JSON \u escapes, as Python's json.dumps writes non-ASCII.
    max_body_bytes: int = 1 << 20
    max_prompt_chars: int = 131_072  # text prompt, or all chat contents together (~4x SmolLM2's context)
    max_stop_token_ids: int = 64  # scanned for every generated token
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_chat_messages: int = 512
    max_request_id_chars: int = 256
    max_choices: int = 16  # completions: prompts x n in one request (each runs as its own request)


@dataclass(frozen=True)
class Options:
    """What the HTTP front needs besides the wire requests: how to answer."""

    stream: bool
    include_usage: bool
    logprobs: bool
    top_logprobs: int = 0  # alternatives per token in the answer
    echo: bool = False  # completions: the prompt (and its logprobs) before the output
    n: int = 1  # choices per prompt; requests are prompt-major (prompt i's j-th is i * n + j)
    tools: ToolPlan | None = None  # chat with tools: how the answer reports calls (router.tools)
    session_id: str | None = None  # the client's session hint, for every request of the body (router.session_hint)
    timeout_s: float | None = None  # the body's ``timeout``: every request's deadline, in seconds


# Fields that would change the answer and that pdserve does not implement: a client that
# sets one must not quietly get something else. Each maps to the values that mean "off".
_UNSUPPORTED = {
    "functions": (None, []), "function_call": (None, "none"), "suffix": (None, ""),
    "guided_choice": (None,), "guided_grammar": (None,),
    "structured_outputs": (None,), "prompt_logprobs": (None,), "prompt_embeds": (None,),
}


def _refuse_unsupported(body: dict) -> None:
    for name, off in _UNSUPPORTED.items():
        if name in body and body[name] not in off:
            raise HttpError(400, f"{name} is not supported by this server", param=name)


# ---- bytes -> request ------------------------------------------------------------------
def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def decode_json(raw: bytes) -> Any:
    """Bytes -> a JSON value; 400 for bytes that are not UTF-8, not JSON, or nest too deep."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise HttpError(400, f"body is not valid UTF-8 (byte {exc.start})", param="body") from exc
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except (json.JSONDecodeError, ValueError) as exc:  # ValueError: NaN / Infinity
        raise HttpError(400, f"body is not valid JSON: {exc}", param="body") from exc
    except RecursionError as exc:
        raise HttpError(400, "body nests too deeply", param="body") from exc
    _check_strings(value)
    return value


def _check_strings(value: Any) -> None:
    """JSON may escape a lone surrogate (``"\\ud800"``): valid JSON, but no UTF-8 string, so
    protobuf and the tokenizer would fail on it. Refused here, keys included."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise HttpError(400, f"body has a string that is not valid Unicode (a lone surrogate "
                                f"at character {exc.start})", param="body") from None


# Body fields whose spec becomes a grammar: converting one may take up to ~1 s
# (pdserve.engine.sampling.grammar.MAX_SCHEMA_DEPTH), so such a body is parsed off the event loop.
GRAMMAR_FIELDS = ("response_format", "guided_json", "guided_regex", "tools")


def converts_grammar(body: Any) -> bool:
    """Whether ``parse_body`` of this decoded body may convert a grammar (a schema, a regex,
    or the call schema of ``tool_choice``): the HTTP front then runs it on the tokenizer
    threads, as it does a large body."""
    return isinstance(body, dict) and any(body.get(name) is not None for name in GRAMMAR_FIELDS)


def parse_body(body: Any, chat: bool, model_names: str | tuple[str, ...], limits: RequestLimits = RequestLimits()
               ) -> tuple[list[pdserve_pb2.GenerateRequest], Options]:
    """A decoded JSON body -> one wire request per choice (prompts x ``n``, prompt-major)
    and the answer options; ``HttpError`` naming the parameter for anything refused."""
    if not isinstance(body, dict):
        raise HttpError(400, "body must be a JSON object", param="body")
    _refuse_unsupported(body)
    try:
        parsed = (ChatBody if chat else CompletionBody).model_validate(body)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        param = param_name(err["loc"])
        raise HttpError(400, f"{param}: {err['msg']}", param=param) from None
    names = (model_names,) if isinstance(model_names, str) else model_names
    if parsed.model is not None and parsed.model not in names:  # vLLM's words
        raise HttpError(404, unknown_model(parsed.model, names), "NotFoundError", "model")
    if parsed.stream_options is not None and not parsed.stream:
        raise HttpError(400, "stream_options needs stream: true", param="stream_options")
    if parsed.stream_options is not None and parsed.stream_options.continuous_usage_stats:
        raise HttpError(400, "stream_options.continuous_usage_stats is not supported by this server",
                        param="stream_options.continuous_usage_stats")
    if parsed.best_of is not None and parsed.best_of != parsed.n:
        raise HttpError(400, f"best_of ({parsed.best_of}) other than n ({parsed.n}) is not supported", param="best_of")
    template = pdserve_pb2.GenerateRequest(model=parsed.model or "")  # an adapter's name runs it (router.adapters)
    _set_sampling(template.sampling, parsed, chat)
    set_structured(template.sampling, parsed)
    plan = None
    if chat:
        set_chat(template.chat, parsed)
        plan = tool_plan(parsed, template.sampling)
        prompts = [None]
    else:
        prompts = _prompts(parsed.prompt)
    total = len(prompts) * parsed.n
    if total > limits.max_choices:
        raise HttpError(400, f"{len(prompts)} prompts x n={parsed.n} is {total} choices, over the router's limit "
                        f"max_choices={limits.max_choices}", param="n" if len(prompts) == 1 else "prompt")
    requests = []
    for prompt in prompts:
        for j in range(parsed.n):
            req = pdserve_pb2.GenerateRequest()
            req.CopyFrom(template)
            if prompt is not None:
                _set_prompt(req, prompt)
            if parsed.seed is not None and j:  # n seeded choices: each its own reproducible draw
                req.sampling.seed = (parsed.seed + j) % (UINT64_MAX + 1)
            requests.append(req)
    include_usage = parsed.stream_options is not None and parsed.stream_options.include_usage
    top = (parsed.top_logprobs or 0) if chat else (parsed.logprobs or 0)
    echo = not chat and parsed.echo
    return requests, Options(parsed.stream, include_usage, template.sampling.logprobs, top, echo, parsed.n, plan,
                             parsed.session_id, parsed.timeout)


def _prompts(prompt) -> list:
    """The completions ``prompt`` as a list of prompts (a string, or a list of token ids)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return list(prompt)
    return [prompt]


def _set_prompt(req: pdserve_pb2.GenerateRequest, prompt) -> None:
    if isinstance(prompt, str):
        req.text = prompt
    elif prompt:
        req.token_ids.ids.extend(prompt)
    else:
        raise HttpError(400, "prompt must not be empty", param="prompt")


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    out = {}
    for key, value in (bias or {}).items():
        try:
            tid = int(key)
        except ValueError:
            tid = -1
        if not 0 <= tid <= UINT32_MAX:
            raise HttpError(400, f"logit_bias: key {key!r} is not a token id", param="logit_bias")
        out[tid] = value
    return out


def _set_sampling(p: pdserve_pb2.SamplingParams, b: SamplingBody, chat: bool) -> None:
    """Every value here fits its wire type (the models bound them), so no setter raises.
    Floats go to float32: a value too large becomes inf, refused by ``SamplingParams.check``.
    Without max_tokens a chat request gets the rest of the context (``pdserve.router.frontend``), a
    completion 16 tokens (``pdserve.wire.convert.DEFAULT_MAX_TOKENS``), as OpenAI and vLLM give."""
    max_tokens = b.max_completion_tokens if chat and b.max_completion_tokens is not None else b.max_tokens
    if max_tokens is not None:
        p.max_tokens = max_tokens
    p.temperature = b.temperature
    if b.top_p is not None:
        p.top_p = b.top_p
    if b.repetition_penalty is not None:
        p.repetition_penalty = b.repetition_penalty
    p.top_k = b.top_k
    p.min_p = b.min_p
    p.min_tokens = b.min_tokens
    p.presence_penalty = b.presence_penalty
    p.frequency_penalty = b.frequency_penalty
    for tid, bias in _logit_bias(b.logit_bias).items():
        p.logit_bias[tid] = bias
    if b.seed is not None:
        p.seed = b.seed
    p.stop.extend([b.stop] if isinstance(b.stop, str) else b.stop or [])
    p.stop_token_ids.extend(b.stop_token_ids or [])
    p.ignore_eos = b.ignore_eos
    if b.cache_salt is not None:
        p.cache_salt = b.cache_salt
    if chat:
        p.logprobs = b.logprobs
        if b.top_logprobs and not b.logprobs:
            raise HttpError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        p.top_logprobs = b.top_logprobs or 0
    else:
        p.logprobs = b.logprobs is not None
        p.top_logprobs = b.logprobs or 0
        if b.echo and b.logprobs is not None:
            p.prompt_logprobs = b.logprobs
