"""Sampling and structured output on the check's device (part 3 of scripts/gpu_check.sh):
what failed on the first CUDA request (issue 26) runs, and behaves as it does on the CPU.

What a seed promises differs by device. On the CPU pdserve's kernels are batch-invariant, so a
seeded request draws the same tokens whatever shares its batch. On CUDA it promises only
repeatability: the same batch, run the same way, draws the same tokens. cuBLAS picks its
kernels (and their reduction orders) by the batch's shape, so a sequence's bfloat16 logits,
and with them a draw near a boundary, may move with its company. The same goes for the path
a prompt takes: a prompt whose prefix is cached runs attention over that prefix instead of a
whole prefill, so the module's engine keeps no prefix cache, and every run of a batch takes
the same path. Never run on a GPU where it was written."""

import dataclasses
import json

import pytest

from pdserve.engine.sampling.grammar import GrammarKind, StructuredOutput
from pdserve.engine.sampling.params import SamplingParams
from pdserve.engine.tokenizer import Tokenizer
from tests.factories import make_engine

pytestmark = pytest.mark.cuda

PROMPTS = [[3 + (5 * i + n) % 256 for i in range(n)] for n in (4, 33, 70)]
SCHEMA = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "ok": {"type": "boolean"}},
          "required": ["unit", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine(smol_dir, device):
    """No prefix cache: a batch run twice takes the same path both times (see the docstring)."""
    return make_engine(smol_dir, tokenizer=Tokenizer(smol_dir), dtype="bfloat16", device=device.type,
                       num_blocks=512, enable_prefix_cache=False)


def _run(engine, params, prompts=PROMPTS):
    return [o.token_ids for o in engine.generate(prompts, params)]


def test_seeded_draws_repeat_for_the_same_batch(engine, device):
    """Repeatable for the same batch on every device; independent of the batch only on the CPU
    (its batch-invariant kernels), which is checked there and not on CUDA."""
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    batch = _run(engine, params)
    assert _run(engine, params) == batch
    alone = _run(engine, params, PROMPTS[1:2])
    assert _run(engine, params, PROMPTS[1:2]) == alone
    if device.type == "cpu":
        assert alone == batch[1:2]


def test_unseeded_draws_run_and_differ(engine):
    params = SamplingParams(max_tokens=16, temperature=1.5, ignore_eos=True)
    first, second = _run(engine, params), _run(engine, params)
    assert all(len(t) == 16 for t in first) and first != second


@pytest.mark.parametrize("filters", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)])
def test_filters_that_keep_only_the_most_likely_draw_it(engine, filters):
    """Each drawn token is a most likely one: its logprob is the best at its step. Not always
    greedy's token: a bfloat16 LM head on CUDA gives bfloat16-valued logits, whose maxima tie
    exactly now and then (the first H100 run drew the other of two at min_p=1.0, which keeps
    every token as likely as the best), where greedy takes the lower id."""
    params = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True, logprobs=True, top_logprobs=1,
                            **filters)
    for out in engine.generate(PROMPTS, params):
        assert len(out.token_ids) == 12
        for i, (chosen, top) in enumerate(zip(out.logprobs, out.top_logprobs)):
            assert chosen == top[0][1], (filters, i, chosen, top)


def test_top_k_p_and_min_p_together_run(engine):
    params = SamplingParams(max_tokens=12, temperature=1.0, top_k=20, top_p=0.9, min_p=0.05, seed=3, ignore_eos=True)
    assert all(len(t) == 12 for t in _run(engine, params))


def test_penalties_and_bias_steer_the_draw(engine):
    """A large logit bias makes its token every draw; a frequency penalty on a token that
    repeats turns the draw away from it; min_tokens holds off EOS."""
    biased = _run(engine, SamplingParams(max_tokens=6, temperature=1.0, logit_bias=((65, 100.0),), ignore_eos=True))
    assert biased == [[65] * 6] * len(PROMPTS)
    nudged = SamplingParams(max_tokens=16, logit_bias=((65, 12.0),), ignore_eos=True)
    repeated = _run(engine, nudged)
    penalised = _run(engine, dataclasses.replace(nudged, frequency_penalty=2.0))
    for plain, pen in zip(repeated, penalised):
        assert plain.count(65) > pen.count(65) > 0
    banned = _run(engine, SamplingParams(max_tokens=8, min_tokens=8, logit_bias=((2, 100.0),)))
    assert all(2 not in t for t in banned)


def test_logprobs_come_back_for_every_token(engine):
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=9, logprobs=True, top_logprobs=4, ignore_eos=True)
    for out in engine.generate(PROMPTS, params):
        assert len(out.logprobs) == len(out.top_logprobs) == 8
        for chosen, token, top in zip(out.logprobs, out.token_ids, out.top_logprobs):
            assert chosen <= 0 and len(top) == 4
            assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
            assert chosen <= top[0][1] + 1e-6


def test_a_json_schema_request_gives_valid_json(engine):
    so = StructuredOutput(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA))
    params = SamplingParams(max_tokens=64, temperature=1.0, seed=5, structured=so)
    for out in engine.generate(PROMPTS, params):
        text = engine.tokenizer.decode(out.token_ids)
        value = json.loads(text)
        assert value["unit"] in ("celsius", "fahrenheit") and isinstance(value["ok"], bool)
        assert out.finish_reason == "stop"
