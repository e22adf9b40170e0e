"""Tool calls in a model's own text (``tool_choice: "auto"``): one parser per output format,
chosen by model family, as vLLM's ``--tool-call-parser`` does. Pure functions, no I/O.

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call.
  The format of Qwen's chat models since Qwen2 and of NousResearch Hermes 2 Pro / Hermes 3
  (their chat templates hold ``<tool_call>``).
- ``llama3_json``: the whole answer is ``{"name": ..., "parameters": {...}}`` (calls joined by
  ``;``), after an optional ``<|python_tag|>``: Llama 3.1, 3.2 and 3.3 Instruct's JSON tool calls.

``"auto"`` picks the parser whose markers the chat template contains (``choose``). Text that
starts a call but does not parse stays content, as vLLM leaves it.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Protocol


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = field(default_factory=_call_id)

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class Parsed:
    content: str  # the text that is not a call
    calls: tuple[ToolCall, ...] = ()


class ToolParser(Protocol):
    name: str
    anchored: bool  # calls only begin the answer (after whitespace), never after content

    def start(self, text: str) -> int | None:
        """Index where the calls begin in ``text``, or None while none has begun."""

    def held_back(self, text: str) -> int:
        """Characters at the end of ``text`` that may be the start of a call's marker: a
        stream holds them until the next text decides."""

    def parse(self, text: str, final: bool) -> Parsed:
        """The calls complete in ``text`` (``final``: the whole answer; an unclosed last call
        counts if it parses) and the content before them."""

    def reader(self) -> CallReader | None:
        """Reads calls as they complete in a stream (``ToolCallStream``); None: a format
        whose calls are complete only at the end."""


class CallReader(Protocol):
    def feed(self, delta: str) -> list[ToolCall]:
        """The calls complete so far, once the calls' text has grown by ``delta``."""


def _call_from(obj, args_keys: tuple[str, ...]) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # some models send the arguments as JSON text already
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _suffix_prefix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class HermesParser:
    name = "hermes"
    anchored = False
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)

    def start(self, text: str) -> int | None:
        i = text.find(self.OPEN)
        return None if i < 0 else i

    def held_back(self, text: str) -> int:
        return _suffix_prefix(text, self.OPEN)

    def parse(self, text: str, final: bool) -> Parsed:
        begin = self.start(text)
        if begin is None:
            return Parsed(text)
        calls = []
        for m in self._BLOCK.finditer(text, begin):
            closed = m.group(0).endswith(self.CLOSE)
            if not closed and not final:
                break  # still being written
            call = self.call(m.group(1))
            if call is None:
                return Parsed(text) if final else Parsed(text[:begin], tuple(calls))
            calls.append(call)
        return Parsed(text[:begin], tuple(calls))

    def reader(self) -> _ClosedBlocks:
        return _ClosedBlocks()

    @staticmethod
    def call(block: str) -> ToolCall | None:
        """One block's text (between the markers) as a call; None if it is not one."""
        try:
            return _call_from(json.loads(block), ("arguments", "parameters"))
        except ValueError:
            return None


class Llama3JsonParser:
    name = "llama3_json"
    anchored = True
    TAG = "<|python_tag|>"

    def start(self, text: str) -> int | None:
        body = text.lstrip()
        return len(text) - len(body) if body.startswith(("{", self.TAG)) else None

    def held_back(self, text: str) -> int:
        body = text.lstrip()  # whitespace before it is content whether calls follow or not
        return len(body) if self.TAG.startswith(body) else 0

    def reader(self) -> None:
        return None  # one JSON document: complete only at the end

    def parse(self, text: str, final: bool) -> Parsed:
        begin = self.start(text)
        if begin is None or not final:  # one JSON document: complete only at the end
            return Parsed(text if begin is None else text[:begin])
        body = text[begin:].removeprefix(self.TAG)
        calls = []
        for part in body.split(";"):
            try:
                call = _call_from(json.loads(part), ("parameters", "arguments"))
            except ValueError:
                call = None
            if call is None:
                return Parsed(text)
            calls.append(call)
        return Parsed(text[:begin], tuple(calls))


PARSERS: dict[str, type] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}
DEFAULT_PARSER = "auto"  # ``--tool-call-parser``'s default
CHOICES = ("auto", "none", *PARSERS)


def choose(name: str | None, chat_template: str | None) -> ToolParser | None:
    """``name`` from ``PARSERS``; ``"auto"``: the one whose markers the template holds (None
    if no template matches); ``"none"`` or None: no parser (``tool_choice: "auto"`` is then
    refused). Raises ValueError for an unknown name."""
    if name in (None, "none"):
        return None
    if name != "auto":
        if name not in PARSERS:
            raise ValueError(f"tool_call_parser: {name!r} is not one of {', '.join(CHOICES)}")
        return PARSERS[name]()
    template = chat_template or ""
    if HermesParser.OPEN in template:
        return HermesParser()
    if Llama3JsonParser.TAG in template or "Environment: ipython" in template:
        return Llama3JsonParser()
    return None


class ToolCallStream:
    """A streamed answer's text -> content deltas and tool calls as they complete: content
    flows until a call's marker may have begun, then the rest is held and parsed.

    Each delta costs time in proportion to its own length, however long the answer (the
    whole text was parsed again per delta before): before the calls, only the text that may
    begin a marker is held and looked at again; after, hermes blocks are read as they close,
    each once (``_ClosedBlocks``), and the whole rest is parsed once, at the end, by the
    parser's own ``parse``, so the final answer is exactly what ``parse`` makes of the text."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self._held = ""  # before the calls: text not sent yet, which may begin them
        self._passing = False  # an anchored parser's answer began with content: it has no calls
        self._rest: list[str] | None = None  # the text from the calls' start on (None: not begun)
        self._reader = parser.reader()
        self._sent_calls = 0

    def feed(self, delta: str, final: bool) -> tuple[str, list[ToolCall]]:
        content = ""
        if self._rest is None:
            content, delta = self._before_calls(delta, final)
            if self._rest is None:
                return content, []
        self._rest.append(delta)
        if final:
            parsed = self.parser.parse("".join(self._rest), final=True)
            if not parsed.calls:  # what began as calls is none: all of it is content
                return content + "".join(self._rest), []
            calls: tuple[ToolCall, ...] | list[ToolCall] = parsed.calls
        else:
            calls = self._reader.feed(delta) if self._reader is not None else ()
        new = list(calls[self._sent_calls:])
        self._sent_calls = max(self._sent_calls, len(calls))
        return content, new

    def _before_calls(self, delta: str, final: bool) -> tuple[str, str]:
        """(content to send, the text of ``delta`` from the calls' start on, if they began)."""
        if self._passing:
            return delta, ""
        window = self._held + delta
        begin = self.parser.start(window)
        if begin is not None:
            self._held, self._rest = "", []
            return window[:begin], window[begin:]
        hold = 0 if final else self.parser.held_back(window)
        content, self._held = window[:len(window) - hold], window[len(window) - hold:]
        self._passing = self.parser.anchored and content.strip() != ""
        return content, ""


class _ClosedBlocks:
    """Hermes calls as their blocks close, in a text fed in pieces: each character is looked
    at a bounded number of times (a marker split across pieces is found from the last
    ``len(marker) - 1`` characters kept), and each block is joined and parsed once. The first
    block that is not a call ends the reading, as ``HermesParser.parse`` stops there."""

    def __init__(self):
        self.calls: list[ToolCall] = []
        self._inside = False  # within a block (looking for its end), else between blocks
        self._block: list[str] = []  # the open block's text so far
        self._carry = ""  # the last characters looked at, which may begin a marker
        self._failed = False

    def feed(self, delta: str) -> list[ToolCall]:
        text, pos = self._carry + delta, 0
        while not self._failed:
            marker = HermesParser.CLOSE if self._inside else HermesParser.OPEN
            found = text.find(marker, pos)
            if found < 0:
                keep = max(pos, len(text) - len(marker) + 1)
                if self._inside:
                    self._block.append(text[pos:keep])
                self._carry = text[keep:]
                break
            if self._inside:
                self._block.append(text[pos:found])
                call = HermesParser.call("".join(self._block))
                self._block = []
                if call is None:
                    self._failed = True
                else:
                    self.calls.append(call)
            self._inside = not self._inside
            pos = found + len(marker)
        return self.calls
