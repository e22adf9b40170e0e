"""Tool calling on the chat API, as vLLM serves it: what a request's ``tools`` and
``tool_choice`` make of the prompt, the decoding and the answer.

- ``"none"``: the template sees the tools; the answer is plain content.
- ``"auto"`` (the default with tools): the template sees the tools; the model's text is
  parsed by the served model's tool-call parser (``router.tool_parsers``); calls found make
  ``message.tool_calls`` and ``finish_reason: "tool_calls"``.
- ``"required"``: decoding is constrained (``engine.grammar``) to a JSON array of
  ``{"name", "parameters"}`` objects, one of the tools each (one item only with
  ``parallel_tool_calls: false``); ``finish_reason: "tool_calls"``.
- a named function: decoding is constrained to that function's parameters schema; the
  output is the call's arguments, streamed as they come; ``finish_reason: "stop"``, as in
  OpenAI's and vLLM's answers.

``ToolOutput`` turns one choice's text into OpenAI's content and ``tool_calls`` (whole, or
stream deltas).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from router.tool_parsers import ToolCall, ToolCallStream, ToolParser


@dataclass(frozen=True)
class ToolPlan:
    """A chat request's tools, as the answer needs them."""

    mode: str  # "none" | "auto" | "required" | "named"
    names: tuple[str, ...]  # the tools' function names, in request order
    function: str | None = None  # with "named"
    parallel: bool = True


def required_schema(tools: list[dict], parallel: bool) -> dict:
    """``tools`` (OpenAI's {"type": "function", "function": {...}}) -> the schema of a
    ``tool_choice: "required"`` answer: a non-empty array of calls."""
    items = [{"type": "object", "properties": {"name": {"enum": [t["function"]["name"]]},
                                               "parameters": _parameters(t["function"])},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema = {"type": "array", "items": {"anyOf": items}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def named_schema(tools: list[dict], name: str) -> dict:
    return _parameters(next(t["function"] for t in tools if t["function"]["name"] == name))


def _parameters(function: dict) -> dict:
    return function.get("parameters") or {"type": "object", "properties": {}}


class ToolOutput:
    """One choice's answer text -> (content delta, tool-call deltas), for streams (``feed``
    per text delta) and whole answers (one ``feed`` with ``final``)."""

    def __init__(self, plan: ToolPlan, parser: ToolParser | None):
        self.plan = plan
        self._stream = ToolCallStream(parser) if plan.mode == "auto" and parser is not None else None
        self._text = ""
        self._calls: list[ToolCall] = []
        self._named_id: str | None = None

    @property
    def called(self) -> bool:
        return bool(self._calls) or self._named_id is not None

    def feed(self, delta: str, final: bool) -> tuple[str, list[dict]]:
        """The content to send and ``delta.tool_calls`` entries (OpenAI's stream shape)."""
        mode = self.plan.mode
        if mode == "named":
            return "", self._named(delta)
        if mode == "required":
            self._text += delta
            return ("", self._new_calls(_parse_required(self._text))) if final else ("", [])
        if self._stream is None:
            return delta, []
        content, calls = self._stream.feed(delta, final)
        if calls and not self.plan.parallel:
            calls = calls[:max(0, 1 - len(self._calls))]  # only the first call, as vLLM keeps it
        return content, self._new_calls(calls)

    def _named(self, delta: str) -> list[dict]:
        if self._named_id is None:
            call = ToolCall(self.plan.function, "")
            self._named_id = call.id
            first = {"index": 0, "id": call.id, "type": "function",
                     "function": {"name": call.name, "arguments": delta}}
            return [first]
        return [{"index": 0, "function": {"arguments": delta}}] if delta else []

    def _new_calls(self, calls: list[ToolCall]) -> list[dict]:
        out = []
        for call in calls:
            out.append({"index": len(self._calls), **call.to_openai()})
            self._calls.append(call)
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        """Calls from "auto" or "required" finish with "tool_calls" (vLLM's rule); a named
        function keeps the engine's reason."""
        if reason == "stop" and self._calls and self.plan.mode in ("auto", "required"):
            return "tool_calls"
        return reason


def _parse_required(text: str) -> list[ToolCall]:
    """A constrained "required" answer -> its calls (none if cut short by max_tokens)."""
    try:
        items = json.loads(text)
    except ValueError:
        return []
    return [ToolCall(i["name"], json.dumps(i["parameters"], ensure_ascii=False)) for i in items]


def message(output: ToolOutput, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
    """A whole answer -> OpenAI's ``message`` and the choice's finish reason."""
    content, deltas = output.feed(text, final=True)
    msg: dict = {"role": "assistant", "content": content or None}
    if deltas:
        msg["tool_calls"] = [{k: v for k, v in d.items() if k != "index"} for d in deltas]
    elif msg["content"] is None:
        msg["content"] = ""
    return msg, output.finish_reason(finish_reason)
