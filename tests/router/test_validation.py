"""Every wrong type, range or encoding from the issue's list is a 400 naming the parameter,
and each size limit is refused before tokenizing, naming its setting."""

import json
from types import SimpleNamespace

import pytest

from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.sampling.params import SamplingParams
from pdserve.protos import pdserve_pb2
from pdserve.router.frontend import ModelInfo, prepare
from pdserve.router.validation import HttpError, RequestLimits, decode_json, parse_body

MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("raw", [b"\xff\xfe\xfd", b'{"prompt": "a\xff"}', b"{", b"", b'{"prompt": NaN}',
                                 b'{"prompt": "x", "temperature": Infinity}', b"[" * 100_000,
                                 b'{"prompt": "a\\ud800"}', b'{"\\udfff": 1}'])
def test_bytes_that_are_not_utf8_json_are_400(raw):
    with pytest.raises(HttpError) as err:
        decode_json(raw)
    assert (err.value.status, err.value.param) == (400, "body")


@pytest.mark.parametrize("body,chat,param", [
    ({"prompt": "x", "max_tokens": 2**32}, False, "max_tokens"),
    ({"prompt": "x", "top_k": 2**31}, False, "top_k"),
    ({"prompt": "x", "top_k": -(2**31) - 1}, False, "top_k"),
    ({"prompt": "x", "seed": 2**64}, False, "seed"),
    ({"prompt": "x", "seed": -1}, False, "seed"),
    ({"prompt": [1, 2**32]}, False, "prompt"),
    ({"prompt": [[1, -1]]}, False, "prompt"),
    ({"prompt": "x", "stream": True, "stream_options": [1]}, False, "stream_options"),
    ({"prompt": "x", "stream": "false"}, False, "stream"),
    ({"prompt": "x", "stream": 0}, False, "stream"),
    ({"prompt": "x", "temperature": float("nan")}, False, "temperature"),
    ({"prompt": "x", "top_p": float("-inf")}, False, "top_p"),
    ({"prompt": "x", "max_tokens": 1.0}, False, "max_tokens"),
    ({"prompt": "x", "max_tokens": True}, False, "max_tokens"),
    ({"prompt": "x", "stop_token_ids": [1, "2"]}, False, "stop_token_ids[1]"),
    ({"prompt": "x", "stop_token_ids": 5}, False, "stop_token_ids"),
    ({"prompt": "x", "ignore_eos": "yes"}, False, "ignore_eos"),
    ({"prompt": {"a": 1}}, False, "prompt"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, True, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [7]}]}, True, "messages[0].content"),
    ({"messages": [{"role": 1, "content": "x"}]}, True, "messages[0].role"),
    ({"messages": "hi"}, True, "messages"),
    ({"messages": MSG, "max_completion_tokens": 2**32}, True, "max_completion_tokens"),
    ({"messages": MSG, "logprobs": "true"}, True, "logprobs"),
])
def test_wrong_types_and_unrepresentable_numbers_are_400_naming_the_parameter(body, chat, param):
    with pytest.raises(HttpError) as err:
        parse_body(json.loads(json.dumps(body)), chat, "m")
    assert (err.value.status, err.value.param) == (400, param), str(err.value)


def test_false_is_false_and_largest_representable_values_pass_shape_checks():
    [req], opts = parse_body({"prompt": [0, 2**32 - 1], "stream": False, "seed": 2**64 - 1, "top_k": 2**31 - 1,
                              "max_tokens": 2**32 - 1}, False, "m")
    assert not opts.stream and req.sampling.seed == 2**64 - 1 and req.sampling.max_tokens == 2**32 - 1


class Tok:
    calls = 0

    def encode(self, text):
        Tok.calls += 1
        return [1] * len(text)

    def apply_chat_template(self, messages):
        Tok.calls += 1
        return [1] * 4


MODEL = ModelInfo("m", SimpleNamespace(vocab_size=100), max_model_len=64, block_size=16, tokenizer=Tok())


def grpc_request(**sampling) -> pdserve_pb2.GenerateRequest:
    return pdserve_pb2.GenerateRequest(text="hello", sampling=pdserve_pb2.SamplingParams(**sampling))


@pytest.mark.parametrize("req,field,setting", [
    (grpc_request(stop_token_ids=list(range(3))), "stop_token_ids", "max_stop_token_ids=2"),
    (grpc_request(stop=["a", "b", "c"]), "stop", "max_stop_strings=2"),
    (grpc_request(stop=["abcd"]), "stop", "max_stop_string_chars=3"),
    (pdserve_pb2.GenerateRequest(text="x" * 11), "prompt", "max_prompt_chars=10"),
    (pdserve_pb2.GenerateRequest(request_id="r" * 9), "request_id", "max_request_id_chars=8"),
])
def test_size_limits_refuse_before_tokenizing_naming_the_setting(req, field, setting):
    limits = RequestLimits(max_stop_token_ids=2, max_stop_strings=2, max_stop_string_chars=3, max_prompt_chars=10,
                           max_chat_messages=2, max_request_id_chars=8)
    before = Tok.calls
    with pytest.raises(InvalidRequestError) as err:
        prepare(req, MODEL, limits)
    assert err.value.field == field and setting in str(err.value)
    assert Tok.calls == before


def test_chat_message_count_and_characters_are_limited():
    req = pdserve_pb2.GenerateRequest()
    for _ in range(3):
        req.chat.messages.add(role="user", content="abcd")
    with pytest.raises(InvalidRequestError) as err:
        prepare(req, MODEL, RequestLimits(max_chat_messages=2))
    assert "max_chat_messages=2" in str(err.value)
    with pytest.raises(InvalidRequestError) as err:
        prepare(req, MODEL, RequestLimits(max_prompt_chars=20))
    assert "max_prompt_chars=20" in str(err.value)


@pytest.mark.parametrize("sampling,field", [
    ({"temperature": float("nan")}, "temperature"), ({"temperature": float("inf")}, "temperature"),
    ({"repetition_penalty": 1e-40}, "repetition_penalty"), ({"repetition_penalty": float("nan")}, "repetition_penalty"),
    ({"top_p": float("nan")}, "top_p"), ({"min_p": float("inf")}, "min_p"), ({"top_k": -5}, "top_k"),
    ({"stop_token_ids": [100]}, "stop_token_ids"), ({"max_tokens": 2**32 - 1}, "max_tokens"),
])
def test_sampling_values_are_checked_before_tokenizing(sampling, field):
    before = Tok.calls
    with pytest.raises(InvalidRequestError) as err:
        prepare(grpc_request(**sampling), MODEL)
    assert err.value.field == field
    if field != "max_tokens":  # needs the prompt's length
        assert Tok.calls == before


def test_a_tiny_temperature_is_greedy_and_cannot_overflow_the_logits():
    import torch

    from pdserve.engine.sampling.sampler import Sampler, SamplerRow

    params = SamplingParams(temperature=1e-40)
    assert params.greedy
    logits = torch.tensor([[30.0, 1.0, -5.0], [1.0, 2.0, 3.0]])
    rows = [SamplerRow("a", params, [0]), SamplerRow("b", SamplingParams(temperature=1.0, seed=1), [0])]
    tokens = Sampler(torch.device("cpu"))(logits, rows).token_ids
    assert tokens[0] == 0


def test_token_ids_beyond_the_vocabulary_are_invalid():
    with pytest.raises(InvalidRequestError) as err:
        prepare(pdserve_pb2.GenerateRequest(token_ids=pdserve_pb2.TokenIds(ids=[1, 100])), MODEL)
    assert err.value.field == "prompt_token_ids"


def test_max_tokens_unset_is_the_rest_of_the_context_on_the_openai_front_and_16_on_grpc():
    req = pdserve_pb2.GenerateRequest(text="hello", sampling=pdserve_pb2.SamplingParams(min_tokens=40))
    p = prepare(req, MODEL, max_tokens_to_context=True)
    assert p.params.max_tokens == 64 - 5 and p.default_max_tokens and p.params.min_tokens == 40
    p = prepare(grpc_request(max_tokens=7), MODEL, max_tokens_to_context=True)
    assert p.params.max_tokens == 7 and not p.default_max_tokens
    assert prepare(grpc_request(), MODEL).params.max_tokens == 16


@pytest.mark.parametrize("sampling,field", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3.0}, "frequency_penalty"),
    ({"logit_bias": {100: 1.0}}, "logit_bias"), ({"logit_bias": {5: 101.0}}, "logit_bias"),
    ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"), ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"), ({"prompt_logprobs": 21}, "prompt_logprobs"),
])
def test_new_sampling_fields_out_of_range_name_the_field(sampling, field):
    with pytest.raises(InvalidRequestError) as err:
        prepare(grpc_request(**sampling), MODEL)
    assert err.value.field == field
