"""pdserve's wire responses -> OpenAI's response and chunk shapes. Pure functions, no I/O.

Requests go the other way in ``pdserve.router.validation`` (typed models of the bodies). A request
with several choices (``n``, batched prompts) ran as one wire request per choice; ``meta``
says how to answer: ``chat``, ``logprobs``, ``top_logprobs``, ``echo``, ``n``, and the
``tokenizer`` (token strings are each token decoded alone, as vLLM reports them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.protos import pdserve_pb2
from pdserve.router.tools import ToolOutput, message

FINISH_NAMES = {pdserve_pb2.FINISH_REASON_STOP: "stop", pdserve_pb2.FINISH_REASON_LENGTH: "length",
                pdserve_pb2.FINISH_REASON_ABORT: "abort"}


@dataclass
class Choice:
    """One choice's wire responses so far, and (``echo``) its prompt's text."""

    index: int
    parts: list = field(default_factory=list)
    prompt_text: str = ""
    sent_chars: int = 0  # text streamed so far (the next chunk's text_offset)
    tools: ToolOutput | None = None  # a chat with tools: the answer's calls (router.tools)


# ---- logprobs --------------------------------------------------------------------------
def _strings(meta: dict, ids) -> list[str]:
    return meta["tokenizer"].hf.batch_decode([[t] for t in ids]) if ids else []


def _alternatives(meta: dict, top, chosen: int | None = None, chosen_lp: float | None = None) -> dict[str, float]:
    """A position's best alternatives as OpenAI's completions dict (token string -> logprob);
    the chosen token joins them when it is not among the best, as vLLM does."""
    ids, values = list(top.token_ids), list(top.logprobs)
    if chosen is not None and chosen not in ids:
        ids.append(chosen)
        values.append(chosen_lp)
    return dict(zip(_strings(meta, ids), values))


def _completion_logprobs(meta: dict, parts: list, first: bool, offset: int) -> dict | None:
    """``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset`` for ``parts``;
    with ``echo`` the first part's prompt leads (its first token has no logprob)."""
    if not meta["logprobs"]:
        return None
    ids, lps, tops = [], [], []
    if first and meta["echo"] and parts and parts[0].prompt_token_ids:
        p = parts[0]
        ids += list(p.prompt_token_ids)
        lps += [None] + list(p.prompt_logprobs)
        tops += [None] + [_alternatives(meta, t, c, v) for t, c, v in
                          zip(p.prompt_top_logprobs, p.prompt_token_ids[1:], p.prompt_logprobs)]
    for r in parts:
        ids += list(r.token_ids)
        lps += list(r.logprobs)
        if meta["top_logprobs"]:
            tops += [_alternatives(meta, t, c, v) for t, c, v in zip(r.top_logprobs, r.token_ids, r.logprobs)]
    strings = _strings(meta, ids)
    offsets = []
    for s in strings:
        offsets.append(offset)
        offset += len(s)
    return {"tokens": strings, "token_logprobs": lps, "top_logprobs": tops if meta["top_logprobs"] else None,
            "text_offset": offsets}


def _chat_logprobs(meta: dict, parts: list) -> dict | None:
    if not meta["logprobs"]:
        return None
    content = []
    for r in parts:
        tops = list(r.top_logprobs) if meta["top_logprobs"] else [None] * len(r.token_ids)
        for token, lp, top in zip(_strings(meta, r.token_ids), r.logprobs, tops):
            alts = [] if top is None else [{"token": s, "logprob": v, "bytes": list(s.encode())}
                                           for s, v in zip(_strings(meta, top.token_ids), top.logprobs)]
            content.append({"token": token, "logprob": lp, "bytes": list(token.encode()), "top_logprobs": alts})
    return {"content": content}


# ---- usage -----------------------------------------------------------------------------
def _finish(resp) -> str | None:
    return FINISH_NAMES.get(resp.finish_reason) if resp is not None and resp.finish_reason else None


def usage_dict(usages: list, n: int = 1) -> dict:
    """Choices' usages (in request order, ``n`` per prompt) -> OpenAI's usage: a prompt
    counts once however many choices it has, every choice's output counts."""
    prompt = sum(u.prompt_tokens for u in usages[::n])
    completion = sum(u.completion_tokens for u in usages)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(u.cached_prompt_tokens for u in usages[::n])}}


def _usage(choices: list[Choice], meta: dict) -> dict | None:
    lasts = [c.parts[-1] for c in choices if c.parts]
    if len(lasts) != len(choices):
        return None
    return usage_dict([r.usage for r in lasts], meta.get("n", 1))


# ---- whole responses -------------------------------------------------------------------
def completion_response(choices: list[Choice], meta: dict) -> dict:
    out = []
    for c in choices:
        prefix = c.prompt_text if meta["echo"] else ""
        out.append({"index": c.index, "text": prefix + "".join(r.text for r in c.parts),
                    "logprobs": _completion_logprobs(meta, c.parts, True, 0),
                    "finish_reason": _finish(c.parts[-1] if c.parts else None)})
    return {"id": meta["id"], "object": "text_completion", "created": meta["created"], "model": meta["model"],
            "choices": out, "usage": _usage(choices, meta)}


def chat_response(choices: list[Choice], meta: dict) -> dict:
    out = []
    for c in choices:
        text, finish = "".join(r.text for r in c.parts), _finish(c.parts[-1] if c.parts else None)
        msg = {"role": "assistant", "content": text}
        if c.tools is not None:
            msg, finish = message(c.tools, text, finish)
        out.append({"index": c.index, "message": msg, "logprobs": _chat_logprobs(meta, c.parts),
                    "finish_reason": finish})
    return {"id": meta["id"], "object": "chat.completion", "created": meta["created"], "model": meta["model"],
            "choices": out, "usage": _usage(choices, meta)}


# ---- stream chunks ---------------------------------------------------------------------
def completion_chunk(meta: dict, choice: Choice | None = None, resp=None, first: bool = False) -> dict:
    """One response of one choice as a chunk; no choice: the usage chunk's frame. A choice's
    first chunk carries its echoed prompt (and its logprobs)."""
    base = {"id": meta["id"], "object": "text_completion", "created": meta["created"], "model": meta["model"]}
    if choice is None:
        return {**base, "choices": []}
    text = (choice.prompt_text if first and meta["echo"] else "") + resp.text
    logprobs = _completion_logprobs(meta, [resp], first, choice.sent_chars)
    choice.sent_chars += len(text)
    return {**base, "choices": [{"index": choice.index, "text": text, "logprobs": logprobs,
                                 "finish_reason": _finish(resp)}]}


def chat_chunk(meta: dict, choice: Choice | None = None, resp=None, role: bool = False) -> dict:
    base = {"id": meta["id"], "object": "chat.completion.chunk", "created": meta["created"], "model": meta["model"]}
    if choice is None:
        return {**base, "choices": []}
    if role:
        return {**base, "choices": [{"index": choice.index, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None}]}
    finish = _finish(resp)
    if choice.tools is None:
        delta = {"content": resp.text} if resp.text or not resp.finish_reason else {}
    else:
        content, calls = choice.tools.feed(resp.text, final=finish is not None)
        delta = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = calls
        finish = choice.tools.finish_reason(finish)
    return {**base, "choices": [{"index": choice.index, "delta": delta, "logprobs": _chat_logprobs(meta, [resp]),
                                 "finish_reason": finish}]}
