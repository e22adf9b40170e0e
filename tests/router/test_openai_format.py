"""OpenAI request bodies -> pdserve requests: accepted shapes and refusals naming the field."""

from types import SimpleNamespace

import pytest

from pdserve.protos import pdserve_pb2
from pdserve.router.openai_format import Choice, completion_response
from pdserve.router.validation import HttpError, parse_body


def to_generate_request(body, chat, model):
    reqs, opts = parse_body(body, chat, model.name)
    assert len(reqs) == 1
    return reqs[0], opts


MODEL = SimpleNamespace(name="smollm2")


def test_completion_text_and_sampling_fields():
    req, opts = to_generate_request({"model": "smollm2", "prompt": "hi", "max_tokens": 7, "temperature": 0,
                                     "top_p": 0.9, "seed": 3, "stop": "x", "stream": True,
                                     "stream_options": {"include_usage": True}}, False, MODEL)
    s = req.sampling
    assert req.text == "hi" and s.max_tokens == 7 and s.temperature == 0 and s.top_p == pytest.approx(0.9)
    assert s.seed == 3 and list(s.stop) == ["x"] and opts.stream and opts.include_usage


def test_token_id_prompt_and_openai_default_temperature():
    req, _ = to_generate_request({"prompt": [5, 6, 7]}, False, MODEL)
    assert list(req.token_ids.ids) == [5, 6, 7] and req.sampling.temperature == 1.0


def test_chat_messages_and_text_parts():
    req, _ = to_generate_request({"messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        "max_completion_tokens": 4, "logprobs": True}, True, MODEL)
    assert [(m.role, m.content) for m in req.chat.messages] == [("system", "be brief"), ("user", "ab")]
    assert req.sampling.max_tokens == 4 and req.sampling.logprobs


@pytest.mark.parametrize("body,chat,status,param", [
    ({"prompt": "x", "model": "gpt-4"}, False, 404, "model"),
    ({"prompt": "x", "n": 17}, False, 400, "n"),
    ({"prompt": ["a", "b"], "n": 9}, False, 400, "prompt"),
    ({"prompt": "x", "n": 2, "best_of": 3}, False, 400, "best_of"),
    ({"prompt": "x", "suffix": "y"}, False, 400, "suffix"),
    ({"prompt": "x", "logit_bias": {"a": 1}}, False, 400, "logit_bias"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, True, 400,
     "tools[0].function"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}, True, 400, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]}, True, 400, "functions"),
    ({"prompt": "x", "guided_grammar": "root ::= x"}, False, 400, "guided_grammar"),
    ({"prompt": "x", "max_tokens": 0}, False, 400, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, False, 400, "temperature"),
    ({"prompt": "x", "stop": [1]}, False, 400, "stop"),
    ({"prompt": "x", "logprobs": 21}, False, 400, "logprobs"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, False, 400, "stream_options"),
    ({"messages": []}, True, 400, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, True, 400, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, True, 400, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, True, 400,
     "top_logprobs"),
])
def test_refusals_name_the_field(body, chat, status, param):
    with pytest.raises(HttpError) as err:
        to_generate_request(body, chat, MODEL)
    assert (err.value.status, err.value.param) == (status, param)


def test_completion_response_joins_text_and_reports_usage():
    parts = [pdserve_pb2.GenerateResponse(token_ids=[1], text="Hel"),
             pdserve_pb2.GenerateResponse(token_ids=[2], text="lo", finish_reason=pdserve_pb2.FINISH_REASON_LENGTH,
                                          usage=pdserve_pb2.Usage(prompt_tokens=3, completion_tokens=2))]
    meta = {"id": "cmpl-1", "created": 0, "model": "m", "chat": False, "logprobs": False, "echo": False}
    out = completion_response([Choice(0, parts)], meta)
    assert out["choices"][0]["text"] == "Hello" and out["choices"][0]["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                            "prompt_tokens_details": {"cached_tokens": 0}}


def test_new_fields_reach_the_wire_request():
    reqs, opts = parse_body({"prompt": "x", "max_tokens": 3, "presence_penalty": 0.5, "frequency_penalty": -1,
                             "logit_bias": {"7": 2.5, "9": -100}, "min_tokens": 2, "logprobs": 3, "echo": True,
                             "repetition_penalty": 1.1, "best_of": 1, "user": "u", "response_format": None},
                            False, MODEL.name)
    s = reqs[0].sampling
    assert s.presence_penalty == 0.5 and s.frequency_penalty == -1 and dict(s.logit_bias) == {7: 2.5, 9: -100}
    assert s.min_tokens == 2 and s.logprobs and s.top_logprobs == 3 and s.prompt_logprobs == 3
    assert opts.echo and opts.top_logprobs == 3


def test_n_and_batched_prompts_make_one_request_per_choice_prompt_major():
    reqs, opts = parse_body({"prompt": [[5, 6], [7]], "n": 3, "seed": 10, "temperature": 1.0}, False, MODEL.name)
    assert [list(r.token_ids.ids) for r in reqs] == [[5, 6]] * 3 + [[7]] * 3 and opts.n == 3
    assert [r.sampling.seed for r in reqs] == [10, 11, 12] * 2  # seeded choices differ, reproducibly
    reqs, _ = parse_body({"prompt": ["a", "b"]}, False, MODEL.name)
    assert [r.text for r in reqs] == ["a", "b"] and not reqs[0].sampling.HasField("seed")


def test_max_tokens_left_unset_for_the_router_to_default():
    reqs, _ = parse_body({"messages": [{"role": "user", "content": "x"}]}, True, MODEL.name)
    assert reqs[0].sampling.max_tokens == 0  # router.frontend.prepare: the rest of the context
