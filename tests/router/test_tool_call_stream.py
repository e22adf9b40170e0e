"""Streamed tool calls (pdserve.router.tool_parsers.ToolCallStream) read incrementally: in any
split, the same content and calls as re-parsing the whole text at every delta (the reading
before it was incremental, kept here as the oracle), and the work per delta bounded however
long the answer (counted as the characters the parser and the JSON reader are handed, never
timed)."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.router import tool_parsers
from pdserve.router.tool_parsers import HermesParser, Llama3JsonParser, ToolCallStream


class Reparsing:
    """The oracle: the whole text parsed again at every delta (``held_back`` of llama3_json as
    it was: it held leading whitespace too, which only delays that content)."""

    def __init__(self, parser):
        self.parser, self.text, self.sent_content, self.sent_calls = parser, "", 0, 0

    def held_back(self, text: str) -> int:
        if isinstance(self.parser, Llama3JsonParser):
            body = text.lstrip()
            return len(text) if not body or self.parser.TAG.startswith(body) else 0
        return self.parser.held_back(text)

    def feed(self, delta: str, final: bool):
        self.text += delta
        begin = self.parser.start(self.text)
        if begin is None:
            safe, calls = len(self.text) - (0 if final else self.held_back(self.text)), ()
        else:
            parsed = self.parser.parse(self.text, final)
            safe, calls = (len(self.text), ()) if final and not parsed.calls else (begin, parsed.calls)
        content = self.text[self.sent_content:safe] if safe > self.sent_content else ""
        self.sent_content = max(self.sent_content, safe)
        new = list(calls[self.sent_calls:])
        self.sent_calls = max(self.sent_calls, len(calls))
        return content, new


def run(stream, pieces: list[str]) -> list[tuple[str, list[tuple[str, str]]]]:
    """Each delta's (content, [(name, arguments)]), the last one final."""
    out = []
    for i, piece in enumerate(pieces):
        content, calls = stream.feed(piece, final=i == len(pieces) - 1)
        out.append((content, [(c.name, c.arguments) for c in calls]))
    return out


CALL = '{"name": "f", "arguments": {"a": 1}}'
HERMES_BITS = ["Hi ", "<tool_call>", "</tool_call>", CALL, '{"name": "g", "arguments": "{\\"b\\": [2]}"}',
               '{"name": 3}', "{oops", "\n", "<tool", "</tool_c", "call>", "_call>", "<", "x"]
LLAMA_BITS = ["  ", "\n", "{", '"name": "f", "parameters": {}}', "; ", '{"name": "g", "parameters": {"y": 1}}',
              "<|python_tag|>", "<|py", "thon_tag|>", "The answer", "}", "<"]


def pieces_of(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:])] or [""]


@pytest.mark.parametrize("parser,bits", [(HermesParser, HERMES_BITS), (Llama3JsonParser, LLAMA_BITS)])
def test_any_split_reads_as_reparsing_the_whole_text_at_every_delta(parser, bits):
    @settings(max_examples=300, deadline=None)
    @given(st.lists(st.sampled_from(bits), max_size=14), st.lists(st.integers(0, 400), max_size=12))
    def check(parts, cuts):
        pieces = pieces_of("".join(parts), cuts)
        ours, oracle = run(ToolCallStream(parser()), pieces), run(Reparsing(parser()), pieces)
        if parser is HermesParser:
            assert ours == oracle  # delta by delta
        else:  # leading whitespace may now come sooner: the same content and calls, in order
            assert "".join(c for c, _ in ours) == "".join(c for c, _ in oracle)
            assert [k for _, ks in ours for k in ks] == [k for _, ks in oracle for k in ks]

    check()


class Counting:
    """Counts the characters handed to a parser's methods and to the JSON reader."""

    def __init__(self, parser, monkeypatch):
        self.parser, self.chars = parser, 0
        real_loads = json.loads

        def loads(text, *args, **kwargs):
            self.chars += len(text)
            return real_loads(text, *args, **kwargs)

        monkeypatch.setattr(tool_parsers, "json", type("CountingJson", (), {"loads": staticmethod(loads),
                                                                            "dumps": staticmethod(json.dumps)}))

    def __getattr__(self, name):
        attr = getattr(self.parser, name)
        if name not in ("start", "held_back", "parse"):
            return attr

        def counted(text, *args, **kwargs):
            self.chars += len(text)
            return attr(text, *args, **kwargs)

        return counted


@pytest.mark.parametrize("parser,text", [
    (HermesParser, "Checking. " + f"<tool_call>{CALL}</tool_call>\n" * 300),
    (HermesParser, "<tool_call>" + '{"name": "f", "arguments": {"a": "' + "x" * 12000 + '"}}</tool_call>'),
    (Llama3JsonParser, "  " + "; ".join([CALL.replace("arguments", "parameters")] * 300)),
    (Llama3JsonParser, " " * 3000 + "plain content " * 300),
])
def test_work_per_delta_stays_bounded_as_the_answer_grows(monkeypatch, parser, text):
    counting = Counting(parser(), monkeypatch)
    stream = ToolCallStream(counting)
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    calls = [c for _, cs in run(stream, pieces) for c in cs]
    assert counting.chars <= 6 * len(text), (counting.chars, len(text))
    assert len(calls) == text.count('"name"') if "content" not in text else not calls
