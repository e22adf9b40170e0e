"""OpenAI's request and response shapes <-> pdserve's wire types. Pure functions, no I/O."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from protos import pdserve_pb2

FINISH_NAMES = {pdserve_pb2.FINISH_REASON_STOP: "stop", pdserve_pb2.FINISH_REASON_LENGTH: "length",
                pdserve_pb2.FINISH_REASON_ABORT: "abort"}


class HttpError(Exception):
    """A request the HTTP front refuses before it reaches the router's validation."""

    def __init__(self, status: int, message: str, kind: str = "BadRequestError", param: str | None = None):
        self.status, self.kind, self.param = status, kind, param
        super().__init__(message)


@dataclass(frozen=True)
class Options:
    stream: bool
    include_usage: bool
    logprobs: bool


def _number(body: dict, key: str, kind: type, default: Any = None) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise HttpError(400, f"{key} must be a {kind.__name__}, got {value!r}", param=key)
    return value


def to_generate_request(body: Any, chat: bool, model) -> tuple[pdserve_pb2.GenerateRequest, Options]:
    """Translate an OpenAI body; raises HttpError naming the field it cannot take."""
    if not isinstance(body, dict):
        raise HttpError(400, "body must be a JSON object")
    if "model" in body and body["model"] != model.name:
        raise HttpError(404, f"model {body['model']!r} does not exist; this server serves {model.name!r}",
                        "NotFoundError", "model")
    if _number(body, "n", int, 1) != 1:
        raise HttpError(400, "n: only 1 completion per request is supported", param="n")
    req = pdserve_pb2.GenerateRequest()
    if chat:
        _chat_input(req, body.get("messages"))
    else:
        _completion_input(req, body.get("prompt"))
    req.sampling.CopyFrom(_sampling(body, chat))
    stream = bool(body.get("stream", False))
    stream_options = body.get("stream_options") or {}
    if stream_options and not stream:
        raise HttpError(400, "stream_options needs stream: true", param="stream_options")
    return req, Options(stream, bool(stream_options.get("include_usage")), req.sampling.logprobs)


def _chat_input(req: pdserve_pb2.GenerateRequest, messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise HttpError(400, "messages must be a non-empty list", param="messages")
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):  # content parts: text only
            if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                raise HttpError(400, "only text content parts are supported", param=f"messages[{i}].content")
            content = "".join(p.get("text", "") for p in content)
        if not isinstance(content, str):
            raise HttpError(400, "each message needs a string content", param=f"messages[{i}].content")
        req.chat.messages.add(role=str(m.get("role", "")), content=content)


def _completion_input(req: pdserve_pb2.GenerateRequest, prompt: Any) -> None:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        req.text = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(t < 0 for t in prompt):
            raise HttpError(400, "token ids must be non-negative", param="prompt")
        req.token_ids.ids.extend(prompt)
    else:
        raise HttpError(400, "prompt must be a string or a list of token ids (one prompt per request)",
                        param="prompt")


def _sampling(body: dict, chat: bool) -> pdserve_pb2.SamplingParams:
    p = pdserve_pb2.SamplingParams()
    max_tokens = _number(body, "max_completion_tokens", int) if chat else None
    max_tokens = max_tokens if max_tokens is not None else _number(body, "max_tokens", int)
    if max_tokens is not None:
        if max_tokens < 1:
            raise HttpError(400, f"max_tokens must be >= 1, got {max_tokens}", param="max_tokens")
        p.max_tokens = max_tokens
    p.temperature = _number(body, "temperature", float, 1.0)
    for key in ("top_p", "repetition_penalty"):
        value = _number(body, key, float)
        if value is not None:
            setattr(p, key, value)
    p.top_k = _number(body, "top_k", int, 0)
    p.min_p = _number(body, "min_p", float, 0.0)
    seed = _number(body, "seed", int)
    if seed is not None:
        if seed < 0:
            raise HttpError(400, f"seed must be >= 0, got {seed}", param="seed")
        p.seed = seed
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)):
        raise HttpError(400, "stop must be a string or a list of strings", param="stop")
    p.stop.extend(stop or [])
    p.stop_token_ids.extend(body.get("stop_token_ids") or [])
    p.ignore_eos = bool(body.get("ignore_eos", False))
    logprobs = body.get("logprobs")
    if chat:
        if _number(body, "top_logprobs", int, 0):
            raise HttpError(400, "top_logprobs > 0 is not supported; logprobs of the chosen tokens are",
                            param="top_logprobs")
        p.logprobs = bool(logprobs)
    elif logprobs is not None:
        if not isinstance(logprobs, int) or isinstance(logprobs, bool) or logprobs > 0:
            raise HttpError(400, "logprobs: only 0 (the chosen tokens' logprobs) is supported", param="logprobs")
        p.logprobs = True
    return p


# ---- responses -------------------------------------------------------------------------
def _logprobs(meta: dict, responses: list) -> dict | None:
    if not meta["logprobs"]:
        return None
    ids = [t for r in responses for t in r.token_ids]
    values = [x for r in responses for x in r.logprobs]
    tokens = meta["tokenizer"].hf.convert_ids_to_tokens(ids)
    if meta["chat"]:
        return {"content": [{"token": t, "logprob": v, "bytes": list(t.encode()), "top_logprobs": []}
                            for t, v in zip(tokens, values)]}
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": None, "text_offset": []}


def _finish(resp) -> str | None:
    return FINISH_NAMES.get(resp.finish_reason) if resp is not None else None


def usage_dict(usage) -> dict[str, int]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


def completion_response(parts: list, meta: dict) -> dict:
    last = parts[-1] if parts else None
    return {"id": meta["id"], "object": "text_completion", "created": meta["created"], "model": meta["model"],
            "choices": [{"index": 0, "text": "".join(r.text for r in parts), "logprobs": _logprobs(meta, parts),
                         "finish_reason": _finish(last)}],
            "usage": usage_dict(last.usage) if last is not None else None}


def chat_response(parts: list, meta: dict) -> dict:
    last = parts[-1] if parts else None
    return {"id": meta["id"], "object": "chat.completion", "created": meta["created"], "model": meta["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(r.text for r in parts)},
                         "logprobs": _logprobs(meta, parts), "finish_reason": _finish(last)}],
            "usage": usage_dict(last.usage) if last is not None else None}


def completion_chunk(meta: dict, resp=None, usage_only: bool = False, role: bool = False) -> dict:
    base = {"id": meta["id"], "object": "text_completion", "created": meta["created"], "model": meta["model"]}
    if usage_only:
        return {**base, "choices": []}
    return {**base, "choices": [{"index": 0, "text": resp.text, "logprobs": _logprobs(meta, [resp]),
                                 "finish_reason": _finish(resp) if resp.finish_reason else None}]}


def chat_chunk(meta: dict, resp=None, usage_only: bool = False, role: bool = False) -> dict:
    base = {"id": meta["id"], "object": "chat.completion.chunk", "created": meta["created"], "model": meta["model"]}
    if usage_only:
        return {**base, "choices": []}
    if role:
        return {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None}]}
    delta = {"content": resp.text} if resp.text or not resp.finish_reason else {}
    return {**base, "choices": [{"index": 0, "delta": delta, "logprobs": _logprobs(meta, [resp]),
                                 "finish_reason": _finish(resp) if resp.finish_reason else None}]}
