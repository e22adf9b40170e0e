"""Tenant isolation in the prefix cache (vLLM's ``cache_salt``): the salt enters the first
block's hash, so cached blocks, and the ``cached_tokens`` that reveal them, never cross salts.
Without it one user could learn whether another sent a given prompt (issue 25)."""

from pdserve.engine.core.block_manager import BlockManager, prompt_block_hashes
from pdserve.engine.sampling.params import SamplingParams
from tests.factories import make_engine, random_prompts

PROMPT = list(range(10, 10 + 33))  # two full blocks of 16 a hit can cover


def test_block_manager_hits_only_under_the_same_salt():
    bm = BlockManager(16, 16)
    bm.allocate("a", PROMPT, cache_salt="alice")
    bm.mark_final("a", PROMPT, len(PROMPT))
    bm.free("a")
    assert bm.allocate("b", PROMPT, cache_salt="bob").num_cached_tokens == 0
    assert bm.allocate("c", PROMPT).num_cached_tokens == 0  # unsalted is a salt of its own
    assert bm.allocate("d", PROMPT, cache_salt="alice").num_cached_tokens == 32


def test_the_routers_hashes_are_the_workers_for_each_salt():
    """The router's KV index computes the same chain, salt included, or it would route by
    prefixes no worker can reuse."""
    bm = BlockManager(16, 16)
    published = []
    bm.subscribe(lambda h, cached: published.append(h))
    bm.allocate("a", PROMPT, cache_salt="alice")
    bm.mark_final("a", PROMPT, len(PROMPT))
    assert published[:2] == prompt_block_hashes(PROMPT, 16, cache_salt="alice")
    assert prompt_block_hashes(PROMPT, 16, cache_salt="bob") != prompt_block_hashes(PROMPT, 16, cache_salt="alice")
    assert prompt_block_hashes(PROMPT, 16) == prompt_block_hashes(PROMPT, 16, cache_salt="")


def test_the_engine_reports_cached_tokens_only_within_a_salt(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir[0])
    prompt = random_prompts(1, [50], seed=11)[0]

    def cached(rid: str, salt: str) -> int:
        engine.add_request(rid, prompt, SamplingParams(max_tokens=2, cache_salt=salt))
        seen = None
        while engine.has_unfinished():
            for o in engine.step():
                seen = o.num_cached_tokens
        return seen

    assert cached("first", "alice") == 0
    assert cached("other-tenant", "bob") == 0
    assert cached("same-tenant", "alice") == 49  # 3 full blocks and 1 token of the first's tail
