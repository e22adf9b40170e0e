"""A decoding request's KV moved to another engine mid-stream (``LLMEngine.hold_running``, what an
elastic worker changing role does with the streams it hands over): the first engine holds the
KV of the prompt and every output token but the newest; the second takes it as a prompt's KV
(``add_prefilled``) with the newest token as its first, under the router's parameters for a
moved attempt (``pdserve.router.attempts.moved_params``), and decodes on. The output is the one
engine's alone, token for token, a grammar keeps its place, and the requests left behind in the
first engine's batch are untouched.

Float32 and the tiny random Llama with the default model's tokenizer (grammars need it)."""

import json

import pytest

from pdserve.engine.sampling.grammar import GrammarKind, StructuredOutput
from pdserve.engine.sampling.params import SamplingParams
from pdserve.router.attempts import moved_params
from tests.factories import make_engine

SCHEMA = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "ok": {"type": "boolean"}},
          "required": ["unit", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engines(tool_llama):
    """The engine a stream leaves and the one it moves to: a decode worker's, no tokenizer
    until a grammar needs one."""
    return make_engine(tool_llama[0]), make_engine(tool_llama[0])


@pytest.fixture(scope="module")
def prompts(tool_llama):
    return [tool_llama[1].encode(text) for text in ("The weather today", "Give me JSON:", "hello there, how")]


def outputs_until(engine, wanted: dict[str, int], got: dict[str, list[int]]) -> None:
    """Step ``engine`` until each request in ``wanted`` has that many output tokens (or ended)."""
    while any(len(got[r]) < n for r, n in wanted.items()) and engine.has_unfinished():
        for o in engine.step():
            got[o.request_id] += o.new_token_ids


def move(source, target, request_id: str, prompt: list[int], sent: list[int], params: SamplingParams) -> list[int]:
    """Hold ``request_id``'s KV on ``source``, take it up on ``target`` as the router's moved
    attempt would, free the source's copy; return the rest of the output from ``target``."""
    free_before = target.num_free_blocks
    block_ids, num_tokens = source.hold_running(request_id)
    assert num_tokens == len(prompt) + len(sent) - 1  # the newest token is sampled, not computed
    local = target.add_prefilled(request_id, prompt + sent[:-1], sent[-1], moved_params(params, len(sent)))
    assert len(local) == len(block_ids) == -(-num_tokens // source.blocks.block_size)
    target.kv_cache[local] = source.kv_cache[block_ids]
    assert source.free_held(request_id)
    target.kv_ready(request_id)
    rest = []
    while target.has_unfinished():
        rest += [t for o in target.step() for t in o.new_token_ids]
    assert target.num_free_blocks == free_before  # it finished there, every block back
    return rest


@pytest.mark.parametrize("sent", [1, 2, 9])
def test_a_moved_stream_goes_on_with_the_tokens_of_one_engine(engines, prompts, sent):
    """Moved after its first token (what a prefill answer carries), after two, and deep into
    its output (past a block boundary of 16): the same greedy tokens, as many as asked."""
    source, target = engines
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    whole = source.generate(prompts[:1], params)[0].token_ids
    source.add_request("r", prompts[0], params)
    got = {"r": []}
    outputs_until(source, {"r": sent}, got)
    assert got["r"] == whole[:sent]
    assert got["r"] + move(source, target, "r", prompts[0], got["r"], params) == whole
    assert not source.has_unfinished() and source.num_held == 0


def test_the_batch_left_behind_is_untouched(engines, prompts):
    """Three streams decode together; one moves. The two left finish with their own tokens,
    and the moved one with its own."""
    source, target = engines
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    whole = {f"r{i}": out.token_ids for i, out in enumerate(source.generate(prompts, params))}
    got = {}
    for i, prompt in enumerate(prompts):
        source.add_request(f"r{i}", prompt, params)
        got[f"r{i}"] = []
    outputs_until(source, {"r1": 5}, got)
    sent = list(got["r1"])
    moved = sent + move(source, target, "r1", prompts[1], sent, params)
    while source.has_unfinished():
        for o in source.step():
            got[o.request_id] += o.new_token_ids
    assert moved == whole["r1"]
    assert got["r0"] == whole["r0"] and got["r2"] == whole["r2"]
    assert got["r1"] == sent  # nothing more came out of the source after the move


def test_a_grammar_keeps_its_place_across_a_move(tool_llama, engines, prompts):
    source, target = engines
    params = SamplingParams(max_tokens=48, structured=StructuredOutput(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA)))
    whole = source.generate(prompts[1:2], params)[0].token_ids
    source.add_request("g", prompts[1], params)
    got = {"g": []}
    outputs_until(source, {"g": 4}, got)
    assert got["g"] + move(source, target, "g", prompts[1], got["g"], params) == whole
    assert json.loads(tool_llama[1].hf.decode(whole, skip_special_tokens=True))["unit"] in ("celsius", "fahrenheit")


def test_only_a_decoding_stream_with_its_kv_computed_can_be_held(engines, prompts):
    """A queued prompt, a prompt whose KV is still to arrive, and an unknown id are left as
    they are (None); a held stream takes no more steps and its blocks come back when freed."""
    source, _ = engines
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    free = source.num_free_blocks
    source.add_request("queued", prompts[0], params)
    assert source.hold_running("queued") is None and source.hold_running("nobody") is None
    source.add_prefilled("arriving", prompts[1], 5, params)
    assert source.hold_running("arriving") is None
    source.abort("arriving")
    got = {"queued": []}
    outputs_until(source, {"queued": 2}, got)
    assert source.hold_running("queued") is not None and source.num_held == 1
    assert not source.has_runnable() and source.step() == []  # held: no step runs it
    assert source.free_held("queued") and source.num_free_blocks == free
