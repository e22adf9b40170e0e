"""Speculative decoding in the engine (pdserve/engine/spec/): greedy tokens are transformers'
token for token with guesses verified in the same forward, guesses do get accepted where the
text repeats, the stop rules cut inside the kept guesses, and no block leaks or is shared
holding a rejected guess."""

import pytest

from pdserve.engine.config import SpeculativeConfig
from pdserve.engine.sampling.params import SamplingParams
from tests.factories import hf_greedy, make_engine, random_prompts

NGRAM = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)


@pytest.fixture(scope="module")
def spec_engine(tiny_llama_dir):
    directory, _ = tiny_llama_dir
    return make_engine(directory, speculative=NGRAM, policy="mixed", max_num_batched_tokens=64)


def repetitive_prompts() -> list[list[int]]:
    """Random prompts of several lengths, some repeating a phrase (the lookup finds those)."""
    short, phrase, long_one = random_prompts(3, [3, 12, 70], seed=7)
    return [short, phrase * 5, long_one, phrase[:5] * 8 + long_one[:9]]


def test_greedy_matches_transformers_batched(spec_engine, tiny_llama_dir):
    _, hf = tiny_llama_dir
    prompts = repetitive_prompts()
    before = spec_engine.spec_stats.num_accepted_tokens
    outs = spec_engine.generate(prompts, SamplingParams(max_tokens=30, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 30), f"prompt of {len(prompt)} tokens"
    stats = spec_engine.spec_stats
    assert stats.num_accepted_tokens > before  # it did speculate, and guesses were kept
    assert sum(stats.accepted_per_pos) == stats.num_accepted_tokens
    spec_engine.blocks.check_invariants()
    assert spec_engine.num_free_blocks == spec_engine.blocks.num_blocks  # no block leaked


def test_off_engine_has_no_stats(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir[0], num_blocks=32)
    assert engine.spec_stats is None and engine.spec is None
