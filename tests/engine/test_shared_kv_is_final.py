"""No request's output depends on what happened to another: an aborted prompt, a prompt still
being computed, a pull that failed, a preempted sequence. The oracle for each is the same
prompt under a fresh ``cache_salt``, which can share nothing with what came before.

The cache starts full of stale KV (random values, as a cache that has served other requests
holds), so a block reused before it was computed gives a different greedy output, not a
lucky zero. On the first design (blocks hashed at allocation) every test here fails.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from pdserve.engine.sampling.params import SamplingParams
from tests.factories import make_engine, random_prompts
from tests.helpers.engine_runs import drain, run

CHUNK = 32  # prefill token budget: a 100-token prompt takes 4 steps
PROMPT = random_prompts(1, [100], seed=41)[0]
_fresh = itertools.count()


def greedy(max_tokens: int = 8, salt: str = "") -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, cache_salt=salt)


def stale_engine(model_dir, chunk: int = CHUNK):
    engine = make_engine(model_dir, num_blocks=64, max_num_batched_tokens=chunk)
    engine.kv_cache.copy_(torch.randn(engine.kv_cache.shape, generator=torch.Generator().manual_seed(0)))
    return engine


@pytest.fixture
def engine(tiny_llama_dir):
    return stale_engine(tiny_llama_dir[0])


def reference(engine, prompt: list[int], max_tokens: int = 8) -> list[int]:
    return run(engine, f"fresh-{next(_fresh)}", prompt, greedy(max_tokens, salt=f"fresh-{next(_fresh)}"))[0]


def test_a_prompt_aborted_between_chunks_leaves_nothing_wrong_behind(engine):
    engine.add_request("dropped", PROMPT, greedy())
    engine.step()  # the first 32-token chunk
    assert engine.prompt_progress("dropped") == CHUNK
    engine.abort("dropped")  # the client closed its connection
    tokens, cached = run(engine, "again", PROMPT, greedy())
    assert cached == CHUNK  # what the dropped prompt did compute is reused, and only that
    assert tokens == reference(engine, PROMPT)


def test_a_prompt_aborted_inside_a_block_leaves_a_tail_of_what_it_computed_only(tiny_llama_dir):
    """A first chunk of 40 tokens: 2 full blocks and 8 tokens of the third. The aborted prompt's
    tail (pdserve/engine/core/block_tails.py) holds those 8, and not the rest of the block."""
    engine = stale_engine(tiny_llama_dir[0], chunk=40)
    engine.add_request("dropped", PROMPT, greedy())
    engine.step()
    assert engine.prompt_progress("dropped") == 40
    engine.abort("dropped")
    tokens, cached = run(engine, "again", PROMPT, greedy())
    assert cached == 40
    assert tokens == reference(engine, PROMPT)


def test_a_pull_still_in_flight_is_not_shared(engine):
    """A decode worker's blocks for a pull that has not landed yet hold no KV of the prompt:
    a local prefill of the same prompt meanwhile (a migrated or locally prefilled request)
    computes it all, and the pull, once it lands, still decodes its own way."""
    engine.add_prefilled("pulled", PROMPT, first_token=7, params=greedy())
    tokens, cached = run(engine, "local", PROMPT, greedy())
    assert cached == 0 and tokens == reference(engine, PROMPT)
    engine.abort("pulled")


def test_a_failed_pull_leaves_nothing_a_local_prefill_could_find(engine):
    """A decode worker's blocks for a pull that never landed (the source died, the checksum
    failed) are freed unfound: a later local prefill of the same prompt computes it all."""
    engine.add_prefilled("pulled", PROMPT, first_token=7, params=greedy())
    engine.abort("pulled")  # the transfer failed: the router re-prefills elsewhere
    tokens, cached = run(engine, "local", PROMPT, greedy())
    assert cached == 0 and tokens == reference(engine, PROMPT)


def test_a_verified_pull_is_shared_once_it_lands(engine):
    """The blocks of a pull become findable at ``kv_ready`` (after verification), holding the
    KV the source computed: here the source is this engine's own prefill of the prompt."""
    engine.add_request("source", PROMPT, greedy(), hold_kv=True)
    drain(engine)
    source = engine.held_block_ids("source")
    blocks = engine.add_prefilled("pulled", PROMPT, first_token=7, params=greedy(1))
    engine.kv_cache[blocks] = engine.kv_cache[source]  # the transfer
    engine.free_held("source")
    engine.kv_ready("pulled")
    drain(engine)
    tokens, cached = run(engine, "local", PROMPT, greedy())
    # Every full block, and the pulled prompt's tail short of the last token (always computed).
    assert cached == len(PROMPT) - 1 and tokens == reference(engine, PROMPT)


def test_a_preempted_sequence_aborted_mid_recompute_leaves_nothing_wrong(tiny_llama_dir):
    """Two long decodes in a cache too small for both: one is preempted, comes back to be
    recomputed chunk by chunk, and is aborted before its recompute ends. A request with its
    whole token list must decode as it would from scratch. The preempted one asks for prompt
    logprobs, so its recompute takes fresh blocks (no prefix hits): its own freed blocks, each
    now at another position of its table."""
    engine = make_engine(tiny_llama_dir[0], num_blocks=14, max_num_batched_tokens=CHUNK, policy="mixed")
    engine.kv_cache.copy_(torch.randn(engine.kv_cache.shape, generator=torch.Generator().manual_seed(1)))
    prompts = random_prompts(2, [90], seed=42)
    engine.add_request("long-0", prompts[0], greedy(max_tokens=40))
    engine.add_request("long-1", prompts[1], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                                            prompt_logprobs=0))
    while engine.scheduler.num_preemptions == 0:
        engine.step()
    victim = engine.scheduler.waiting[0]
    assert victim.seq_id == "long-1"  # the youngest of two equal limits
    while engine.prompt_progress(victim.seq_id) is None or engine.prompt_progress(victim.seq_id) >= victim.num_tokens:
        engine.step()  # until its recompute has blocks and is not done
    history = list(victim.token_ids)
    engine.abort(victim.seq_id)
    drain(engine)
    tokens, _ = run(engine, "resend", history, greedy())
    assert tokens == reference(engine, history)
