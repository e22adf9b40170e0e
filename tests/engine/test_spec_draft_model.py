"""Speculative decoding with a draft model in the engine (issue 57), float32: the greedy tokens
are transformers' generate of the target token for token, whether the draft agrees with the
target (the target as its own draft: nearly every guess kept) or hardly at all (a 1-layer
random model of the same vocabulary: nearly every guess rejected, each rejection rolling the
draft's KV back); every block of the target and of the draft is free at the end."""

import pytest

from pdserve.engine.config import MIXED, SpeculativeConfig
from pdserve.engine.sampling.params import SamplingParams
from tests.factories import hf_greedy, make_engine, random_prompts

MAX_TOKENS = 16


@pytest.mark.parametrize("draft", ["target", "one_layer"])
def test_greedy_tokens_equal_transformers_with_a_draft_model(tiny_llama_dir, tiny_draft_dir, draft):
    directory, hf = tiny_llama_dir
    spec = SpeculativeConfig(method="draft_model", model=str(directory if draft == "target" else tiny_draft_dir),
                             num_speculative_tokens=3)
    engine = make_engine(directory, num_blocks=64, policy=MIXED, speculative=spec)
    prompts = random_prompts(3, [3, 17, 40], seed=13)
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, MAX_TOKENS), f"a {len(prompt)}-token prompt, draft {draft}"
    stats = engine.spec_stats
    assert stats.num_drafts > 0
    if draft == "target":  # the same weights guess the target's argmax: nearly all kept
        assert stats.acceptance_rate > 0.9, stats
    else:  # the guesses of an unrelated model: rejections, the draft's KV rolled back each time
        assert stats.num_accepted_tokens < stats.num_draft_tokens, stats
    proposer = engine.spec.proposer
    assert proposer.num_tracked == 0 and proposer.blocks.num_free_blocks == proposer.blocks.num_blocks
    proposer.blocks.check_invariants()
    assert engine.num_free_blocks == engine.blocks.num_blocks
    engine.blocks.check_invariants()


def test_sampled_requests_verify_the_drafts_distributions(tiny_llama_dir):
    """Sampled guesses reach rejection sampling with their rows (the draft's softmax at the
    request's temperature): a seeded request's tokens are its own whatever its batch, and every
    block is free at the end."""
    directory, _ = tiny_llama_dir
    spec = SpeculativeConfig(method="draft_model", model=str(directory), num_speculative_tokens=3)
    engine = make_engine(directory, num_blocks=64, policy=MIXED, speculative=spec)
    prompt = random_prompts(1, [12], seed=4)[0]
    seeded = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.8, seed=5)
    together = engine.generate([prompt, prompt, random_prompts(1, [30], seed=9)[0]],
                               [seeded, seeded, SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0)])
    [alone] = engine.generate([prompt], seeded)
    assert together[0].token_ids == together[1].token_ids == alone.token_ids
    assert len(alone.token_ids) == MAX_TOKENS
    assert engine.spec_stats.num_accepted_tokens > 0
    assert engine.spec.proposer.blocks.num_free_blocks == engine.spec.proposer.blocks.num_blocks
