"""Held KV (a prefill worker's lease) under cache pressure: its blocks are referenced, so the
prefix cache never evicts or reuses them, whatever else runs; their bytes stay as computed."""

from pdserve.engine.sampling.params import SamplingParams
from tests.factories import make_engine, random_prompts


def test_held_blocks_keep_their_bytes_while_other_prompts_churn_the_cache(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir[0], num_blocks=12)
    held_prompt = random_prompts(1, [60], seed=41)[0]  # 4 blocks, held as for a decode worker
    engine.add_request("held", held_prompt, SamplingParams(max_tokens=4), hold_kv=True)
    while not engine.step():
        pass
    block_ids = engine.held_block_ids("held")
    kept = engine.kv_cache[block_ids].clone()
    seen: set[int] = set()
    for i, prompt in enumerate(random_prompts(6, [70, 100, 40], seed=42)):  # 8 free blocks, prompts of 3 to 7
        engine.add_request(f"other-{i}", prompt, SamplingParams(max_tokens=3))
        while engine.scheduler.num_unfinished:  # the other one (held KV is not in any queue)
            engine.step()
            if engine.blocks.has(f"other-{i}"):
                seen.update(engine.blocks.block_table(f"other-{i}"))
    assert len(seen) == 8 and not seen & set(block_ids)  # every free block was used, no held one
    assert engine.held_block_ids("held") == block_ids
    assert (engine.kv_cache[block_ids] == kept).all()
    assert engine.free_held("held") and engine.blocks.num_free_blocks == 12
