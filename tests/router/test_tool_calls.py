"""Tool calls: the parsers on fixed text (whole and streamed in every split), the answer
shapes of each tool_choice mode, and the request side (schemas, refusals)."""

import json

import pytest

from pdserve.router.tool_parsers import HermesParser, Llama3JsonParser, ToolCallStream, choose
from pdserve.router.tools import ToolOutput, ToolPlan, message
from pdserve.router.validation import HttpError, parse_body
from tests.factories import TOOLS_CHAT_TEMPLATE

HERMES = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>')
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
USER = [{"role": "user", "content": "x"}]


def calls_of(parsed):
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


def test_hermes_parses_every_call_and_keeps_the_text_before_them():
    parsed = HermesParser().parse(HERMES, final=True)
    assert parsed.content == "Let me check."
    assert calls_of(parsed) == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]


@pytest.mark.parametrize("text", ["no calls here", '<tool_call>{"name": "f", "arguments": {oops}</tool_call>',
                                  '<tool_call>{"arguments": {}}</tool_call>'])
def test_hermes_text_that_is_not_a_call_stays_content(text):
    parsed = HermesParser().parse(text, final=True)
    assert parsed.content == text and parsed.calls == ()


def test_hermes_unclosed_last_call_counts_only_at_the_end():
    text = '<tool_call>{"name": "f", "arguments": {"a": 1}}'
    assert HermesParser().parse(text, final=False).calls == ()
    assert calls_of(HermesParser().parse(text, final=True)) == [("f", {"a": 1})]


def test_llama3_json_calls_with_and_without_the_python_tag():
    p = Llama3JsonParser()
    assert calls_of(p.parse('{"name": "f", "parameters": {"x": 2}}', True)) == [("f", {"x": 2})]
    two = p.parse('<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"y": "z"}}', True)
    assert calls_of(two) == [("f", {}), ("g", {"y": "z"})]
    assert p.parse("The answer is 4.", True).calls == ()


def test_parser_is_chosen_by_the_chat_template():
    assert choose("auto", TOOLS_CHAT_TEMPLATE).name == "hermes"
    assert choose("auto", "{{ '<|python_tag|>' }}").name == "llama3_json"
    assert choose("auto", "{{ messages }}") is None and choose(None, TOOLS_CHAT_TEMPLATE) is None
    assert choose("llama3_json", None).name == "llama3_json"
    with pytest.raises(ValueError, match="tool_call_parser"):
        choose("mistral", None)


@pytest.mark.parametrize("step", [1, 2, 3, 5, 7, 11, 1000])
def test_streamed_text_in_any_split_gives_the_same_content_and_calls(step):
    stream = ToolCallStream(HermesParser())
    content, calls = "", []
    pieces = [HERMES[i:i + step] for i in range(0, len(HERMES), step)]
    for i, piece in enumerate(pieces):
        c, new = stream.feed(piece, final=i == len(pieces) - 1)
        assert "<" not in c  # no part of a marker is ever streamed as content
        content += c
        calls += new
    assert content == "Let me check." and [c.name for c in calls] == ["get_weather", "get_time"]


def test_streamed_text_without_calls_is_all_content():
    stream = ToolCallStream(HermesParser())
    out = [stream.feed(p, final=False)[0] for p in ("a <tool", "s are fun")] + [stream.feed("", final=True)[0]]
    assert "".join(out) == "a <tools are fun" and out[0] == "a "


def test_auto_answer_has_tool_calls_and_finish_reason_tool_calls():
    out = ToolOutput(ToolPlan("auto", ("get_weather", "get_time")), HermesParser())
    msg, finish = message(out, HERMES, "stop")
    assert finish == "tool_calls" and msg["content"] == "Let me check."
    assert [(c["type"], c["function"]["name"]) for c in msg["tool_calls"]] == [("function", "get_weather"),
                                                                                ("function", "get_time")]
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    one = ToolOutput(ToolPlan("auto", ("get_weather", "get_time"), parallel=False), HermesParser())
    assert len(message(one, HERMES, "stop")[0]["tool_calls"]) == 1
    plain = ToolOutput(ToolPlan("auto", ("f",)), HermesParser())
    assert message(plain, "Hello", "stop") == ({"role": "assistant", "content": "Hello"}, "stop")


def test_required_and_named_answers():
    req = ToolOutput(ToolPlan("required", ("get_weather",)), None)
    msg, finish = message(req, '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]', "stop")
    assert finish == "tool_calls" and msg["content"] is None
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
    cut = message(ToolOutput(ToolPlan("required", ("f",)), None), '[{"name": "f", "par', "length")
    assert cut == ({"role": "assistant", "content": '[{"name": "f", "par'}, "length")
    named = ToolOutput(ToolPlan("named", ("get_weather",), "get_weather"), None)
    first = named.feed('{"city": ', final=False)[1]
    assert first[0]["function"] == {"name": "get_weather", "arguments": '{"city": '} and "id" in first[0]
    assert named.feed('"Rome"}', final=True)[1] == [{"index": 0, "function": {"arguments": '"Rome"}'}}]
    assert named.finish_reason("stop") == "stop"  # OpenAI and vLLM answer a named function so


def test_tool_choice_constrains_the_request_to_the_call_json():
    reqs, opts = parse_body({"messages": USER, "tools": [WEATHER, TIME], "tool_choice": "required",
                             "parallel_tool_calls": False}, True, "m")
    schema = json.loads(reqs[0].sampling.structured_output.json_schema)
    assert schema["maxItems"] == 1 and [i["properties"]["name"]["enum"] for i in schema["items"]["anyOf"]] == [
        ["get_weather"], ["get_time"]]
    assert [t.name for t in reqs[0].chat.tools] == ["get_weather", "get_time"] and opts.tools.mode == "required"
    reqs, opts = parse_body({"messages": USER, "tools": [WEATHER], "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}}, True, "m")
    assert json.loads(reqs[0].sampling.structured_output.json_schema) == WEATHER["function"]["parameters"]
    reqs, opts = parse_body({"messages": USER, "tools": [WEATHER]}, True, "m")
    assert opts.tools.mode == "auto" and not reqs[0].sampling.HasField("structured_output")


@pytest.mark.parametrize("body,param", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"parallel_tool_calls": True}, "parallel_tool_calls"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"guided_regex": "a(", "max_tokens": 2}, "guided_regex"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
])
def test_refusals_name_the_field(body, param):
    with pytest.raises(HttpError) as err:
        parse_body({"messages": USER, **body}, True, "m")
    assert (err.value.status, err.value.param) == (400, param)
