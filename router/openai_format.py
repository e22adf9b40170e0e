"""pdserve's wire responses -> OpenAI's response and chunk shapes. Pure functions, no I/O.

Requests go the other way in ``router.validation`` (typed models of the bodies)."""

from __future__ import annotations

from protos import pdserve_pb2

FINISH_NAMES = {pdserve_pb2.FINISH_REASON_STOP: "stop", pdserve_pb2.FINISH_REASON_LENGTH: "length",
                pdserve_pb2.FINISH_REASON_ABORT: "abort"}


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
