"""Speculative decoding in the engine (pdserve/engine/spec/): greedy tokens are transformers'
token for token with guesses verified in the same forward, guesses do get accepted where the
text repeats, the stop rules cut inside the kept guesses, and no block leaks or is shared
holding a rejected guess."""

import pytest

from pdserve.engine.config import SpeculativeConfig
from pdserve.engine.sampling.params import SamplingParams
from tests.factories import default_reference, hf_greedy, make_engine, random_prompts

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


def test_preemption_with_guesses_in_flight_keeps_tokens_and_blocks_right(tiny_llama_dir):
    """Too few blocks for the batch: sequences are preempted and recomputed while others
    speculate; the block manager's invariants hold after every step, the tokens are still
    transformers', and every block is free at the end."""
    directory, hf = tiny_llama_dir
    engine = make_engine(directory, num_blocks=9, speculative=NGRAM, policy="mixed", max_num_batched_tokens=64)
    prompts = repetitive_prompts()[1:3]  # 60 and 70 tokens: 5 blocks each with their answers, 9 in all
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    tokens = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for o in engine.step():
            tokens[o.request_id] += o.new_token_ids
        engine.blocks.check_invariants()
    assert engine.scheduler.num_preemptions > 0 and engine.spec_stats.num_drafts > 0
    for i, prompt in enumerate(prompts):
        assert tokens[f"r{i}"] == hf_greedy(hf, prompt, 20)
    assert engine.num_free_blocks == engine.blocks.num_blocks


def test_a_seeded_sampled_request_draws_the_tokens_it_draws_without_speculation(spec_engine, tiny_llama_dir):
    """A seeded request draws one uniform per token it emits, speculating or not
    (``spec/rejection.py``'s coupling): its tokens are those of an engine without speculation,
    alone or in any batch, and guesses were kept on the way."""
    prompt = random_prompts(1, [6], seed=8)[0]  # its seeded answer repeats itself: guesses are kept
    seeded = SamplingParams(max_tokens=20, temperature=0.3, top_k=40, seed=5, ignore_eos=True)
    before = spec_engine.spec_stats.num_accepted_tokens
    [alone] = spec_engine.generate([prompt], seeded)
    assert spec_engine.spec_stats.num_accepted_tokens > before
    other = SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)
    _, batched = spec_engine.generate([repetitive_prompts()[2], prompt], [other, seeded])
    [plain] = make_engine(tiny_llama_dir[0], num_blocks=32).generate([prompt], seeded)
    assert alone.token_ids == batched.token_ids == plain.token_ids and len(plain.token_ids) == 20


def test_off_engine_has_no_stats(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir[0], num_blocks=32)
    assert engine.spec_stats is None and engine.spec is None


CODE = """def area(width, height):
    return width * height


def perimeter(width, height):
    return 2 * (width + height)
"""


@pytest.mark.slow
def test_default_model_keeps_guesses_on_a_repetitive_prompt_and_matches_transformers():
    """SmolLM2 in float32 asked to repeat code with one change: the lookup's guesses are kept
    (acceptance above zero: it cannot pass by never speculating) and the tokens are transformers' greedy ones."""
    from pdserve.engine.loader import materialize
    from pdserve.engine.tokenizer import Tokenizer

    reference, _ = default_reference()
    directory = materialize("default", progress=False)
    engine = make_engine(directory, num_blocks=128, speculative=NGRAM)
    prompt = Tokenizer(directory).apply_chat_template(
        [{"role": "user", "content": "Repeat this code, renaming width to w:\n\n" + CODE}])
    [out] = engine.generate([prompt], SamplingParams(max_tokens=48, ignore_eos=True))
    assert out.token_ids == hf_greedy(reference, prompt, 48)
    assert engine.spec_stats.num_accepted_tokens > 0 and engine.spec_stats.mean_accepted_length > 1.0
