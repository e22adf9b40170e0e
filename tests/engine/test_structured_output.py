"""Constrained decoding in the engine (xgrammar masks; the tiny random Llama with a real
49,152-token vocabulary): the output follows the grammar even from random weights, ends with
EOS when the grammar is complete, other rows of the batch are bit-identical, and the grammar's
place survives the prefill/decode hand-off and a migration's re-prefill."""

import json

import jsonschema
import pytest

from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.sampling.grammar import GrammarKind, StructuredOutput, resumed
from pdserve.engine.sampling.params import SamplingParams
from tests.factories import make_engine

# Every value is bounded (enum, boolean, short string), so random weights finish it well
# within MAX_TOKENS: the test checks the grammar, not the model's taste.
SCHEMA = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "ok": {"type": "boolean"},
                                           "city": {"type": "string", "maxLength": 6}},
          "required": ["unit", "ok", "city"], "additionalProperties": False}
JSON_SCHEMA = StructuredOutput(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA))
MAX_TOKENS = 48
EOS = 2


@pytest.fixture(scope="module")
def engine(tool_llama):
    return make_engine(tool_llama[0], tokenizer=tool_llama[1])


@pytest.fixture(scope="module")
def prompts(tool_llama):
    tok = tool_llama[1]
    return [tok.encode(text) for text in ("The weather today", "Give me JSON:", "hello")]


def test_json_schema_output_validates_and_ends_with_eos(engine, prompts):
    """Sampled (greedy rows are in the tests below): every draw stays inside the grammar."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=3, structured=JSON_SCHEMA)
    for out in engine.generate(prompts, params):
        jsonschema.validate(json.loads(out.text), SCHEMA)
        assert out.finish_reason == "stop" and out.token_ids[-1] == EOS


def test_unconstrained_output_is_not_json(engine, prompts):
    """The check above could not pass by chance: the same prompts, free, are not JSON."""
    for out in engine.generate(prompts, SamplingParams(max_tokens=8)):
        with pytest.raises(ValueError):
            json.loads(out.text)


def test_regex_and_json_object(engine, prompts):
    regex = StructuredOutput(GrammarKind.REGEX, r"(yes|no), [0-9]{3}")
    obj = StructuredOutput(GrammarKind.JSON_OBJECT)
    outs = engine.generate(prompts[:1] * 2, [SamplingParams(max_tokens=MAX_TOKENS, structured=regex),
                                             SamplingParams(max_tokens=200, structured=obj)])
    assert outs[0].finish_reason == "stop"
    assert outs[0].text.split(", ")[0] in ("yes", "no") and len(outs[0].text.split(", ")[1]) == 3
    if outs[1].finish_reason == "stop":  # an open-ended object may run past max_tokens
        assert isinstance(json.loads(outs[1].text), dict)
    else:
        assert outs[1].text.lstrip().startswith("{")


def test_unconstrained_rows_are_bit_identical_beside_constrained_ones(engine, prompts):
    free = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=True, temperature=0.8, seed=5)
    alone = engine.generate(prompts, free)
    mixed = engine.generate(prompts + prompts, [free] * 3 + [SamplingParams(max_tokens=20, structured=JSON_SCHEMA,
                                                                            logprobs=True)] * 3)
    for a, b in zip(alone, mixed[:3]):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


def test_prefill_decode_handoff_keeps_the_grammar_place(tool_llama, engine, prompts):
    """A prefill-only request samples the first token and holds the KV; a second engine (the
    decode side) gets prompt + first token, the copied KV, and finishes: the same output as
    one engine alone."""
    params = SamplingParams(max_tokens=MAX_TOKENS, structured=JSON_SCHEMA)
    whole = engine.generate(prompts[:1], params)[0].token_ids
    decode = make_engine(tool_llama[0])  # as a worker's: no tokenizer until a grammar needs one
    engine.add_request("r", prompts[0], params, hold_kv=True)
    first = engine.step()[0].new_token_ids[0]
    blocks = decode.add_prefilled("r", prompts[0], first, params)
    decode.kv_cache[blocks] = engine.kv_cache[engine.held_block_ids("r")]
    engine.free_held("r")
    decode.kv_ready("r")
    rest = []
    while decode.has_unfinished():
        rest += [t for o in decode.step() for t in o.new_token_ids]
    assert [first] + rest == whole


def test_migrated_request_resumes_the_grammar_from_its_resent_output(engine, prompts):
    params = SamplingParams(max_tokens=MAX_TOKENS, structured=JSON_SCHEMA)
    whole = engine.generate(prompts[1:2], params)[0].token_ids
    sent = 5
    again = SamplingParams(max_tokens=MAX_TOKENS - sent, structured=resumed(JSON_SCHEMA, sent))
    assert engine.generate([prompts[1] + whole[:sent]], again)[0].token_ids == whole[sent:]


@pytest.mark.parametrize("so", [StructuredOutput(GrammarKind.JSON_SCHEMA, '{"type": "nonsense"}'),
                                StructuredOutput(GrammarKind.JSON_SCHEMA, "{not json"),
                                StructuredOutput(GrammarKind.REGEX, "a(b")])
def test_bad_specs_end_their_request_naming_the_field(engine, prompts, so):
    """Compiled off the engine thread (``pdserve.engine.sampling.grammar_jobs``), a spec that does not
    compile ends its request before it joins a batch: its one output carries the error."""
    engine.add_request("bad", prompts[0], SamplingParams(structured=so))
    (out,) = engine.step()
    assert out.finish_reason == "error" and out.new_token_ids == []
    assert isinstance(out.error, InvalidRequestError) and out.error.field == "structured_output"
    assert not engine.has_unfinished()


def test_min_tokens_is_refused_with_a_grammar(engine, prompts):
    """Once the grammar is complete only EOS may follow, and min_tokens would ban it."""
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("bad", prompts[0], SamplingParams(min_tokens=2, structured=JSON_SCHEMA))
    assert err.value.field == "min_tokens"


def test_specs_too_large_or_too_deep_are_refused_before_compiling():
    """xgrammar's time grows steeply with nesting: such specs never reach it."""
    deep: dict = {"type": "integer"}
    for _ in range(70):  # 140 JSON levels
        deep = {"type": "object", "properties": {"a": deep}}
    for so, limit in ((StructuredOutput(GrammarKind.JSON_SCHEMA, json.dumps(deep)), 128),
                      (StructuredOutput(GrammarKind.REGEX, "a" * 70_000), 65_536)):
        with pytest.raises(InvalidRequestError) as err:
            so.validate()
        assert err.value.field == "structured_output" and err.value.limit == limit
