"""Continuous batching, preemption, chunked prefill and block accounting on the tiny model."""

import pytest
import torch

from pdserve.engine.sampling.params import SamplingParams
from tests.factories import make_engine, random_prompts
from tests.helpers.engine_runs import LENGTHS, run_staggered


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bfloat16: pdserve's batch-invariant kernels
def test_concurrent_requests_with_preemption_equal_their_solo_runs(tiny_llama_dir, dtype, kernel_path):
    """On every kernel path this processor runs: a request's tokens never depend on its batch."""
    directory, _ = tiny_llama_dir
    prompts = random_prompts(len(LENGTHS), LENGTHS, seed=5)
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    solo_engine = make_engine(directory, num_blocks=64, dtype=dtype)
    solo = [solo_engine.generate([p], params)[0].token_ids for p in prompts]
    # 40 blocks of 16 cannot hold 9 sequences growing to ~250 tokens: forces preemption.
    engine = make_engine(directory, num_blocks=40, dtype=dtype)
    together = run_staggered(engine, prompts, params)
    assert engine.scheduler.num_preemptions > 0
    assert together == solo
    assert engine.num_free_blocks == 40


def test_seeded_sampling_is_reproducible_regardless_of_batch(tiny_llama_dir):
    directory, _ = tiny_llama_dir
    prompts = random_prompts(5, [3, 30, 60, 11, 90], seed=6)
    sampled = SamplingParams(max_tokens=20, temperature=0.9, top_k=50, top_p=0.9, seed=1234, ignore_eos=True)
    greedy = SamplingParams(max_tokens=20, ignore_eos=True)
    alone = make_engine(directory).generate([prompts[0]], sampled)[0].token_ids
    mixed = run_staggered(make_engine(directory, num_blocks=24), prompts, [sampled] + [greedy] * 4, join_every=2)
    assert mixed[0] == alone
    other_seed = make_engine(directory).generate([prompts[0]], SamplingParams(
        max_tokens=20, temperature=0.9, top_k=50, top_p=0.9, seed=99, ignore_eos=True))[0].token_ids
    assert other_seed != alone


def test_chunked_prefill_gives_the_same_kv_and_next_token(tiny_llama_dir):
    directory, _ = tiny_llama_dir
    prompt = random_prompts(1, [150], seed=7)[0]
    params = SamplingParams(max_tokens=10, ignore_eos=True)  # prefill-only: stops after 1, holds KV
    whole = make_engine(directory, max_num_batched_tokens=4096, enable_prefix_cache=False)
    chunked = make_engine(directory, max_num_batched_tokens=32)
    results = []
    for engine in (whole, chunked):
        engine.add_request("r", prompt, params, hold_kv=True)
        steps, token = 0, None
        while engine.has_unfinished():
            for o in engine.step():
                token = o.new_token_ids[0]
            steps += 1
        blocks = engine.held_block_ids("r")
        results.append((token, steps, engine.kv_cache[blocks].flatten(0, 1)[:150]))  # (tokens, L, 2, h, d)
    (t1, s1, kv1), (t2, s2, kv2) = results
    assert s1 == 1 and s2 == 5  # 150 tokens in chunks of 32
    assert t1 == t2
    torch.testing.assert_close(kv1, kv2, rtol=1e-5, atol=1e-5)


def test_every_block_is_free_after_finish_and_abort(tiny_llama_dir):
    directory, _ = tiny_llama_dir
    engine = make_engine(directory, num_blocks=48, max_num_batched_tokens=64)
    prompts = random_prompts(6, [5, 50, 100, 20, 70, 33], seed=8)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=30, ignore_eos=True))
    engine.step()  # request 1 is mid-chunk, others wait
    assert engine.abort("1")
    for _ in range(4):
        engine.step()
    assert engine.abort("0")  # decoding
    assert engine.abort("5")  # still waiting, or just prefilled
    while engine.has_unfinished():
        engine.step()
    assert engine.num_free_blocks == 48
    assert not engine.abort("0")  # already gone


def test_prefix_cache_hit_skips_computation_and_keeps_output(tiny_llama_dir):
    directory, _ = tiny_llama_dir
    engine = make_engine(directory)
    shared = random_prompts(1, [64], seed=9)[0]
    a, b = shared + [5, 6, 7], shared + [8, 9]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    first = engine.generate([a], params)[0].token_ids
    before = engine.runner.num_forward_tokens
    engine.add_request("b", b, params)
    out = []
    while engine.has_unfinished():
        for o in engine.step():
            out += o.new_token_ids
            cached = o.num_cached_tokens
    assert cached == 64
    assert engine.runner.num_forward_tokens - before == 2 + 9  # uncached prompt tail + decode steps
    assert out == make_engine(directory, enable_prefix_cache=False).generate([b], params)[0].token_ids
    assert first == make_engine(directory, enable_prefix_cache=False).generate([a], params)[0].token_ids


@pytest.mark.parametrize("field,params,prompt", [
    ("max_tokens", SamplingParams(max_tokens=0), [5]),
    ("temperature", SamplingParams(temperature=-1.0), [5]),
    ("top_p", SamplingParams(top_p=0.0), [5]),
    ("top_k", SamplingParams(top_k=-3), [5]),
    ("min_p", SamplingParams(min_p=1.5), [5]),
    ("repetition_penalty", SamplingParams(repetition_penalty=0.0), [5]),
    ("stop_token_ids", SamplingParams(stop_token_ids=(10**6,)), [5]),
    ("prompt", SamplingParams(), []),
    ("prompt_token_ids", SamplingParams(), [10**6]),
    ("max_tokens", SamplingParams(max_tokens=2048), [5] * 10),
    ("prompt", SamplingParams(max_tokens=1), [5] * 2048),
])
def test_bad_requests_name_the_field_and_limit(tiny_llama_dir, field, params, prompt):
    from pdserve.engine.errors import InvalidRequestError

    directory, _ = tiny_llama_dir
    engine = make_engine(directory, num_blocks=256)
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("x", prompt, params)
    assert err.value.field == field
    assert field in str(err.value)
    assert engine.num_free_blocks == 256 and not engine.has_unfinished()


def test_prompt_larger_than_the_whole_cache_is_rejected_not_queued_forever(tiny_llama_dir):
    from pdserve.engine.errors import InvalidRequestError

    directory, _ = tiny_llama_dir
    engine = make_engine(directory, num_blocks=4)  # 64 token slots
    with pytest.raises(InvalidRequestError, match="blocks"):
        engine.add_request("x", [5] * 100, SamplingParams(max_tokens=1))
