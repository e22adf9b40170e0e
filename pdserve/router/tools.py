"""Tool calling on the chat API, as vLLM serves it: what a request's ``tools`` and
``tool_choice`` make of the prompt, the decoding and the answer.

- ``"none"``: the template sees the tools; the answer is plain content.
- ``"auto"`` (the default with tools): the template sees the tools; the model's text is
  parsed by the served model's tool-call parser (``pdserve.router.tool_parsers``); calls found make
  ``message.tool_calls`` and ``finish_reason: "tool_calls"``.
- ``"required"``: decoding is constrained (``pdserve.engine.sampling.grammar``) to a JSON array of
  ``{"name", "parameters"}`` objects, one of the tools each (one item only with
  ``parallel_tool_calls: false``); ``finish_reason: "tool_calls"``.
- a named function: decoding is constrained to that function's parameters schema; the
  output is the call's arguments, streamed as they come; ``finish_reason: "stop"``, as in
  OpenAI's and vLLM's answers.

``set_chat``, ``set_structured`` and ``tool_plan`` put a parsed body's messages, tools and
constraints on the wire request (``pdserve.router.validation.parse_body`` calls them); ``ToolOutput``
turns one choice's text into OpenAI's content and ``tool_calls`` (whole, or stream deltas).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pdserve.engine.errors import InvalidRequestError
from pdserve.protos import pdserve_pb2
from pdserve.router.http_errors import HttpError
from pdserve.router.openai_bodies import ChatBody, SamplingBody
from pdserve.router.tool_parsers import ToolCall, ToolCallStream, ToolParser
from pdserve.wire.convert import structured_from_proto


@dataclass(frozen=True)
class ToolPlan:
    """A chat request's tools, as the answer needs them."""

    mode: str  # "none" | "auto" | "required" | "named"
    names: tuple[str, ...]  # the tools' function names, in request order
    function: str | None = None  # with "named"
    parallel: bool = True


# ---- the request -----------------------------------------------------------------------
def set_chat(chat: pdserve_pb2.ChatMessages, b: ChatBody) -> None:
    """The messages (with earlier tool calls and tool answers) and the tools, on the wire."""
    for m in b.messages:
        content = m.content if not isinstance(m.content, list) else "".join(p.text for p in m.content)
        msg = chat.messages.add(role=m.role, content=content or "", tool_call_id=m.tool_call_id or "")
        for call in m.tool_calls or ():
            msg.tool_calls.add(id=call.id, name=call.function.name, arguments_json=call.function.arguments)
    for t in b.tools or ():
        f = t.function
        chat.tools.add(name=f.name, description=f.description or "",
                       parameters_json=json.dumps(f.parameters) if f.parameters is not None else "")


def set_structured(p: pdserve_pb2.SamplingParams, b: SamplingBody) -> None:
    """``response_format`` (or vLLM's ``guided_json`` / ``guided_regex``) -> the wire's
    ``structured_output``; whether the spec compiles is checked with the other params."""
    given = [name for name in ("response_format", "guided_json", "guided_regex")
             if getattr(b, name) is not None and not (name == "response_format" and b.response_format.type == "text")]
    if len(given) > 1:
        raise HttpError(400, f"{' and '.join(given)} cannot be combined: set one", param=given[1])
    so = p.structured_output
    if b.guided_regex is not None:
        so.regex = b.guided_regex
    elif b.guided_json is not None:
        so.json_schema = b.guided_json if isinstance(b.guided_json, str) else json.dumps(b.guided_json)
    elif b.response_format is not None and b.response_format.type == "json_object":
        so.json_object = True
    elif b.response_format is not None and b.response_format.type == "json_schema":
        spec = b.response_format.json_schema
        if spec is None or spec.schema_ is None:
            raise HttpError(400, "response_format.json_schema.schema is required with type json_schema",
                            param="response_format.json_schema.schema")
        so.json_schema = json.dumps(spec.schema_)
    if given:
        _check_compiles(p, {"response_format": "response_format.json_schema.schema"}.get(given[0], given[0]))


def _check_compiles(p: pdserve_pb2.SamplingParams, param: str) -> None:
    try:
        structured_from_proto(p.structured_output).validate(param)
    except InvalidRequestError as exc:
        raise HttpError(400, str(exc), param=param) from None


def tool_plan(b: ChatBody, p: pdserve_pb2.SamplingParams) -> ToolPlan | None:
    """The tool mode of a chat request; "required" and a named function constrain ``p`` to
    the call's JSON."""
    tools = [t.model_dump(exclude_none=True) for t in b.tools or ()]
    choice = b.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise HttpError(400, "tool_choice needs tools", param="tool_choice")
        if b.parallel_tool_calls is not None:
            raise HttpError(400, "parallel_tool_calls needs tools", param="parallel_tool_calls")
        return None
    names = tuple(t["function"]["name"] for t in tools)
    if len(set(names)) != len(names):
        raise HttpError(400, "tools: function names must be distinct", param="tools")
    parallel = b.parallel_tool_calls is not False
    if choice is None or isinstance(choice, str):
        plan = ToolPlan(choice or "auto", names, None, parallel)
        schema = required_schema(tools, parallel) if plan.mode == "required" else None
    else:  # {"type": "function", "function": {"name": ...}}
        if choice.function.name not in names:
            raise HttpError(400, f"tool_choice names {choice.function.name!r}, which is not among tools",
                            param="tool_choice")
        plan = ToolPlan("named", names, choice.function.name, parallel)
        schema = named_schema(tools, choice.function.name)
    if schema is not None:
        if p.HasField("structured_output"):
            raise HttpError(400, f"tool_choice {plan.mode!r} constrains the output itself; it cannot be combined "
                            f"with response_format", param="response_format")
        p.structured_output.json_schema = json.dumps(schema)
        _check_compiles(p, "tools")
    return plan


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


# ---- the answer ------------------------------------------------------------------------
class ToolOutput:
    """One choice's answer text -> (content delta, tool-call deltas), for streams (``feed``
    per text delta) and whole answers (one ``feed`` with ``final``)."""

    def __init__(self, plan: ToolPlan, parser: ToolParser | None):
        self.plan = plan
        self._stream = ToolCallStream(parser) if plan.mode == "auto" and parser is not None else None
        self._parts: list[str] = []  # "required": the answer so far, joined once at its end
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
            self._parts.append(delta)
            if not final:
                return "", []
            text = "".join(self._parts)
            calls = _parse_required(text)  # none when max_tokens cut the JSON short:
            return ("", self._new_calls(calls)) if calls else (text, [])  # the text, as content
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
