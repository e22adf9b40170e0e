"""Tool calling end to end inside one process, on the tiny random Llama whose chat template
has tools (``tests.factories.TOOLS_CHAT_TEMPLATE``, Hermes style): the OpenAI body goes
through the router's parsing and preparation (the template renders the tools), the engine
decodes under the tool choice's constraint, and the answer is OpenAI's. Random weights
know nothing of tools, so any valid call shows the constraint at work."""

import json

import jsonschema
import pytest

from pdserve.engine.loader import read_model_config
from pdserve.router.frontend import ModelInfo, prepare
from pdserve.router.openai_format import Choice, chat_response
from pdserve.router.tool_parsers import choose
from pdserve.router.tools import ToolOutput
from pdserve.router.validation import parse_body
from pdserve.protos import pdserve_pb2
from tests.factories import make_engine

UNIT = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "days": {"enum": [1, 2, 3]}},
        "required": ["unit", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_forecast", "description": "weather", "parameters": UNIT}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"],
             "additionalProperties": False}}}]
MESSAGES = [{"role": "user", "content": "Weather in Oslo for two days?"}]


@pytest.fixture(scope="module")
def model(tool_llama):
    directory, tok = tool_llama
    cfg = read_model_config(directory)
    return ModelInfo("tiny", cfg, 512, 16, tok, tool_parser=choose("auto", tok.hf.chat_template))


@pytest.fixture(scope="module")
def engine(tool_llama):
    return make_engine(tool_llama[0], tokenizer=tool_llama[1])


def answer(body: dict, model, engine) -> dict:
    """The non-streamed chat answer the HTTP front would give, the engine standing in for
    the workers."""
    reqs, opts = parse_body({"messages": MESSAGES, "tools": TOOLS, "max_tokens": 64, **body}, True, "tiny")
    prepared = prepare(reqs[0], model)
    out = engine.generate([prepared.prompt_token_ids], prepared.params)[0]
    part = pdserve_pb2.GenerateResponse(token_ids=out.token_ids, text=out.text,
                                        finish_reason={"stop": 1, "length": 2}[out.finish_reason],
                                        usage=pdserve_pb2.Usage(prompt_tokens=1, completion_tokens=len(out.token_ids)))
    choice = Choice(0, [part], tools=ToolOutput(opts.tools, model.tool_parser))
    meta = {"id": "x", "created": 0, "model": "tiny", "logprobs": False}
    return chat_response([choice], meta)["choices"][0]


def test_the_template_shows_the_tools_to_the_model(model):
    reqs, _ = parse_body({"messages": MESSAGES, "tools": TOOLS}, True, "tiny")
    text = model.tokenizer.hf.decode(prepare(reqs[0], model).prompt_token_ids)
    assert "<tools>" in text and '"name": "get_forecast"' in text and json.dumps(UNIT) in text


def test_required_tool_choice_answers_valid_calls(model, engine):
    choice = answer({"tool_choice": "required"}, model, engine)
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    for call in choice["message"]["tool_calls"]:
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call["function"]["name"])
        jsonschema.validate(json.loads(call["function"]["arguments"]), schema)
        assert call["id"].startswith("call_") and call["type"] == "function"


def test_named_tool_choice_answers_that_function(model, engine):
    choice = answer({"tool_choice": {"type": "function", "function": {"name": "get_forecast"}}}, model, engine)
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_forecast" and choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(call["function"]["arguments"]), UNIT)


def test_auto_with_random_weights_answers_plain_content(model, engine):
    """The parser finds no call in random text: the answer is content, finish "length"."""
    choice = answer({"max_tokens": 6}, model, engine)
    assert "tool_calls" not in choice["message"] and choice["finish_reason"] == "length"
    assert choice["message"]["content"]


def test_a_tool_turn_renders_in_the_template(model):
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_forecast", "arguments": '{"unit": "celsius", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    reqs, _ = parse_body({"messages": history, "tools": TOOLS}, True, "tiny")
    text = model.tokenizer.hf.decode(prepare(reqs[0], model).prompt_token_ids)
    assert '{"name": "get_forecast", "arguments": {"unit": "celsius", "days": 2}}' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text


def test_tokenize_renders_tools_as_the_chat_does(model):
    from pdserve.router.tokenize_api import tokenize_request

    reqs, _ = parse_body({"messages": MESSAGES, "tools": TOOLS}, True, "tiny")
    ids = tokenize_request({"messages": MESSAGES, "tools": TOOLS}, ("tiny",), 10_000)(model.tokenizer)
    assert ids == prepare(reqs[0], model).prompt_token_ids
