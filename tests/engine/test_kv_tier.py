"""The KV tier below the prefix cache (pdserve/engine/kv_tier/, docs/kv_tier.md): evicted prefix
blocks go to a directory and come back, verified, when a prompt revisits them.

On the tiny random Llama in float32: tokens with the tier equal tokens without it and
transformers' own; a revisited prefix whose blocks were evicted comes back from the tier; a
corrupted block file is caught, removed and its prompt computed; two engines sharing a
directory load each other's blocks; the directory stays within its bound, least recently used
out first. The block life with a tier is property-tested in test_block_life.py."""

from __future__ import annotations

import dataclasses
import os
import threading
import time

import numpy as np
import pytest
import torch

from pdserve.engine.config import KVTierConfig
from pdserve.engine.core.block_hashes import full_block_hashes
from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.kv_tier.engine_tier import build_kv_tier, namespace_of
from pdserve.engine.kv_tier.store import HEADER, BlockStore, ReadResult
from pdserve.engine.kv_tier.tier import KVTier
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.loader import load_model
from pdserve.engine.sampling.params import SamplingParams
from tests.factories import engine_config, hf_greedy, make_hf_model, random_prompts
from tests.helpers.engine_runs import run

BS = 16
NUM_BLOCKS = 8  # one prompt of 5 blocks and its answer fill it: the next prompt evicts the last
MAX_TOKENS = 8
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


def tier_engine(model_dir, directory, offload_bytes: int = 64 << 20, **kwargs) -> LLMEngine:
    kv_tier = KVTierConfig(offload_bytes, str(directory)) if directory is not None else None
    config = dataclasses.replace(engine_config(model_dir, num_blocks=NUM_BLOCKS, block_size=BS, **kwargs),
                                 kv_tier=kv_tier)
    model, model_cfg, model_dir = load_model(config.model, config.torch_dtype(), config.torch_device(), progress=False)
    return LLMEngine(model, model_cfg, config, model_dir=str(model_dir))


@pytest.fixture(scope="module")
def prompts():
    """Three prompts of 5 blocks and 3 tokens: 5 full blocks a revisit can take back."""
    return random_prompts(3, [5 * BS + 3], seed=11)


def visit(engine: LLMEngine, prompts, order) -> list[tuple[list[int], int]]:
    return [run(engine, f"r{i}", prompts[p], PARAMS) for i, p in enumerate(order)]


def namespace_dir(root) -> str:
    (name,) = [n for n in os.listdir(root)]
    return os.path.join(root, name)


def test_revisits_come_back_from_the_tier_with_the_same_tokens(tiny_llama_dir, prompts, tmp_path):
    directory, hf = tiny_llama_dir
    order = [0, 1, 2, 0, 1]  # each visit evicts what is left of the one two before: revisits are tier hits
    plain = visit(tier_engine(directory, None), prompts, order)
    engine = tier_engine(directory, tmp_path)
    tiered = visit(engine, prompts, order)
    for p, (ours, _), (theirs, _) in zip(order, tiered, plain):
        assert ours == theirs == hf_greedy(hf, prompts[p], MAX_TOKENS)
    assert [cached for _, cached in plain] == [0] * len(order)  # without the tier, all computed again
    assert [cached for _, cached in tiered] == [0, 0, 0, 5 * BS, 5 * BS]
    stats = engine.kv_tier.stats()
    assert engine.blocks.prefix_hits == engine.blocks.tier_hits == stats.hit_tokens == 10 * BS
    assert stats.blocks_loaded == 10 and stats.blocks_offloaded >= 10 and stats.corrupt_blocks == 0
    engine.blocks.check_invariants()
    engine.close()
    assert stats.bytes_used > 0 and stats.tier_id.endswith(os.path.realpath(namespace_dir(tmp_path)))


def test_a_corrupted_block_is_detected_removed_and_its_prompt_computed(tiny_llama_dir, prompts, tmp_path):
    directory, hf = tiny_llama_dir
    engine = tier_engine(directory, tmp_path)
    removed = []
    engine.kv_tier.subscribe(lambda h, stored: None if stored else removed.append(h))
    visit(engine, prompts, [0, 1, 2])
    engine.kv_tier.flush()  # the blocks of prompt 0 are in their files, none pending in memory
    second = full_block_hashes(prompts[0], BS, num_blocks=2)[1]
    path = os.path.join(namespace_dir(tmp_path), second.hex() + ".kvb")
    with open(path, "r+b") as f:  # one bit of the payload's last byte
        f.seek(-1, os.SEEK_END)
        last = f.read(1)[0]
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last ^ 1]))
    tokens, cached = run(engine, "again", prompts[0], PARAMS)
    assert tokens == hf_greedy(hf, prompts[0], MAX_TOKENS)
    assert cached == BS  # the first block came back; the chain stopped at the corrupt one
    assert engine.kv_tier.stats().corrupt_blocks == 1 and removed == [second]
    assert not os.path.exists(path)
    engine.blocks.check_invariants()
    engine.close()


def test_two_engines_sharing_a_directory_load_each_others_blocks(tiny_llama_dir, prompts, tmp_path):
    directory, hf = tiny_llama_dir
    first = tier_engine(directory, tmp_path)
    visit(first, prompts, [0, 1, 2])  # prompt 0's blocks all offloaded by the first engine
    first.close()
    second = tier_engine(directory, tmp_path)
    assert second.kv_tier.tier_id == first.kv_tier.tier_id
    tokens, cached = run(second, "elsewhere", prompts[0], PARAMS)
    assert tokens == hf_greedy(hf, prompts[0], MAX_TOKENS) and cached == 5 * BS
    assert second.kv_tier.stats().blocks_loaded == 5 and second.kv_tier.stats().blocks_offloaded == 0
    second.close()


def test_the_namespace_parts_models_dtypes_and_layouts(tiny_llama_dir):
    _, hf = tiny_llama_dir
    other = make_hf_model("llama", seed=5)  # the same config.json, other weights (a fine-tune)
    cfg = hf.config
    base = namespace_of(cfg, hf, torch.float32, BS, (BS, 2, 2, 2, 16))
    assert base == namespace_of(cfg, hf, torch.float32, BS, (BS, 2, 2, 2, 16))
    assert base != namespace_of(cfg, other, torch.float32, BS, (BS, 2, 2, 2, 16))
    assert base != namespace_of(cfg, hf, torch.bfloat16, BS, (BS, 2, 2, 2, 16))
    assert base != namespace_of(cfg, hf, torch.float32, 8, (8, 2, 2, 2, 16))


def test_the_tier_is_refused_where_it_cannot_work_yet(tiny_llama_dir, tmp_path):
    directory, _ = tiny_llama_dir
    with pytest.raises(ValueError, match="kv_offload_bytes.*prefix cache"):
        tier_engine(directory, tmp_path, enable_prefix_cache=False)
    with pytest.raises(ValueError, match="kv_offload_bytes must hold at least one block"):
        tier_engine(directory, tmp_path, offload_bytes=1000)
    config = dataclasses.replace(engine_config(directory), tensor_parallel_size=2,
                                 kv_tier=KVTierConfig(1 << 20, str(tmp_path)))
    with pytest.raises(ValueError, match="kv_offload_bytes.*tensor_parallel_size 1, got 2"):
        build_kv_tier(config, None, None, torch.zeros(4, 8), BlockManager(4, 16))


# ---- the store and the tier, without a model ---------------------------------------------
def blocks_over(cache: torch.Tensor, directory, capacity: int) -> tuple[BlockManager, KVTier]:
    tier = KVTier(cache, str(directory), capacity)
    bm = BlockManager(cache.shape[0], 2)
    bm.attach_tier(tier)
    return bm, tier


def test_the_directory_stays_within_its_bound_least_recently_used_out_first(tmp_path):
    payload = 1000
    one = HEADER.size + 16 + 8 * 2 + payload
    stores = [BlockStore(str(tmp_path), 4 * one, payload) for _ in range(2)]  # two processes' views
    hashes = [bytes([i]) * 16 for i in range(12)]
    data = np.arange(payload, dtype=np.uint8)
    out = np.empty(payload, dtype=np.uint8)
    for i, h in enumerate(hashes[:4]):
        assert stores[i % 2].write(h, (i, i), data)[0]
    for i in range(4):
        os.utime(stores[0].path(hashes[i]), ns=(10 + i, 10 + i))  # 0 is the oldest file ...
    assert stores[1].read(hashes[0], (0, 0), out) is ReadResult.HIT  # ... but was just used
    evicted = []
    for i, h in enumerate(hashes[4:], start=4):
        evicted += stores[i % 2].write(h, (i, i), data)[1]
        files = [n for n in os.listdir(tmp_path) if n.endswith(".kvb")]
        on_disk = sum(os.path.getsize(os.path.join(tmp_path, n)) for n in files)
        assert on_disk == stores[0].bytes_used() == stores[1].bytes_used() <= 4 * one
    assert evicted[:3] == [hashes[1], hashes[2], hashes[3]]  # 0 was touched by its load: out last
    assert stores[0].read(hashes[1], (1, 1), out) is ReadResult.MISS


def test_a_block_removed_while_looked_up_is_a_miss_and_other_tokens_are_refused(tmp_path):
    cache = torch.arange(4 * 8, dtype=torch.float32).reshape(4, 8)
    bm, tier = blocks_over(cache, tmp_path, 1 << 20)
    bm.allocate("a", [1, 2, 3, 4, 5])
    bm.mark_final("a", [1, 2, 3, 4, 5], 5)
    bm.free("a")
    first, second = full_block_hashes([1, 2, 3, 4], 2)
    for i in range(4):  # every block handed out again: the two full ones go down to the tier
        bm.allocate(f"x{i}", [9])
    tier.flush()
    assert tier.contains(first) and tier.contains(second)
    os.unlink(tier.store.path(second))  # another process evicts it after our lookup
    for i in range(4):
        bm.free(f"x{i}")
    alloc = bm.allocate("b", [1, 2, 3, 4, 5])
    assert alloc.num_cached_tokens == 2 and bm.tier_hits == 2
    assert tier.stats().corrupt_blocks == 0 and tier.contains(first)
    bm.check_invariants()
    tier.close()


def test_pending_blocks_are_served_from_memory_and_bounded(tmp_path):
    cache = torch.randn(6, 64)
    saved = cache.clone()
    tier = KVTier(cache, str(tmp_path), 1 << 20, max_pending_bytes=2 * 64 * 4, offload_wait_s=60)  # two host slots
    hashes = full_block_hashes(list(range(12)), 2)
    for b, h in enumerate(hashes):
        tier.offload(b, h, (2 * b, 2 * b + 1))  # waits for the writer when both slots are taken
    cache.zero_()
    for b, h in enumerate(hashes):  # pending or written, each comes back as it was
        assert tier.load(b, h, (2 * b, 2 * b + 1))
    assert torch.equal(cache, saved)
    tier.flush()
    assert sorted(n for n in os.listdir(tmp_path) if n.endswith(".kvb")) == sorted(h.hex() + ".kvb" for h in hashes)
    # A file under a block's hash with other tokens than asked is not that block's KV.
    assert not tier.load(0, hashes[0], (7, 7)) and tier.stats().corrupt_blocks == 1
    assert not tier.contains(hashes[0])
    tier.close()


@pytest.mark.parametrize("damage", ["payload", "tokens", "truncated", "header"])
def test_a_damaged_file_reads_corrupt_and_is_deleted(tmp_path, damage):
    payload = 64
    store = BlockStore(str(tmp_path), 1 << 20, payload)
    h = bytes(range(16))
    store.write(h, (5, 6), np.arange(payload, dtype=np.uint8))
    path, out = store.path(h), np.empty(payload, dtype=np.uint8)
    raw = bytearray(open(path, "rb").read())
    full = len(raw)
    where = {"payload": len(raw) - 3, "tokens": HEADER.size + 16 + 2, "header": 5}.get(damage)
    if where is None:
        raw = raw[:-1]
    else:
        raw[where] ^= 0x10
    open(path, "wb").write(bytes(raw))
    assert store.read(h, (5, 6), out) is ReadResult.CORRUPT
    assert not os.path.exists(path) and store.bytes_used() == full - len(raw)  # less the size it had
    assert store.read(h, (5, 6), out) is ReadResult.MISS


def test_an_offload_waits_for_a_stuck_writer_only_briefly_then_drops_the_block(tmp_path):
    cache = torch.randn(3, 64)
    tier = KVTier(cache, str(tmp_path), 1 << 20, max_pending_bytes=64 * 4)  # one host slot
    release, write = threading.Event(), tier.store.write
    tier.store.write = lambda *args: (release.wait(), write(*args))[1]  # a disk that hangs
    a, b = full_block_hashes(list(range(4)), 2)
    tier.offload(0, a, (0, 1))
    started = time.monotonic()
    tier.offload(1, b, (2, 3))  # the one buffer holds a's copy, the writer is stuck on it
    assert time.monotonic() - started < 2 and tier.blocks_dropped == 1 and not tier.contains(b)
    assert tier.load(2, a, (0, 1)) and torch.equal(cache[2], cache[0])  # a is served from memory
    release.set()
    tier.close()
    assert os.path.exists(tier.store.path(a)) and not os.path.exists(tier.store.path(b))


def test_writers_and_readers_of_one_directory_at_once_keep_its_bound_and_never_read_corrupt(tmp_path):
    """Two writers (each its own store and lock descriptor, as two processes have) and a reader
    on one directory at once: every read is a verified hit or a miss, and the shared count is
    the files' size, within the bound."""
    payload, tokens = 4096, (1, 2)
    one = HEADER.size + 16 + 8 * len(tokens) + payload
    hashes = [i.to_bytes(16, "little") for i in range(64)]
    results, errors = [], []

    def writer(k: int) -> None:
        store = BlockStore(str(tmp_path), 5 * one, payload)
        try:
            for h in hashes[k::2]:
                store.write(h, tokens, np.full(payload, h[0], dtype=np.uint8))
        except Exception as exc:  # reported below: a thread's exception would be lost
            errors.append(exc)

    def reader() -> None:
        store, out = BlockStore(str(tmp_path), 5 * one, payload), np.empty(payload, dtype=np.uint8)
        for _ in range(3):
            for h in hashes:
                result = store.read(h, tokens, out)
                results.append(result)
                if result is ReadResult.HIT and not (out == h[0]).all():
                    errors.append(AssertionError(f"block {h[0]} read another's bytes"))

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(2)] + [threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and ReadResult.CORRUPT not in results
    on_disk = sum(os.path.getsize(os.path.join(tmp_path, n)) for n in os.listdir(tmp_path) if n.endswith(".kvb"))
    assert on_disk == BlockStore(str(tmp_path), 5 * one, payload).bytes_used() <= 5 * one


def test_the_stored_hashes_come_from_the_file_names_newest_first_past_the_limit(tmp_path):
    """What a worker announces at start (``stored_hashes``): every block file's hash, read from
    its name without opening it (a damaged file is listed, and still refused at its load);
    nothing else in the directory; past the limit, the most recently used."""
    payload, tokens = 64, (1, 2)
    store = BlockStore(str(tmp_path), 1 << 20, payload)
    hashes = [bytes([i]) * 16 for i in range(5)]
    for h in hashes:
        store.write(h, tokens, np.zeros(payload, dtype=np.uint8))
    with open(store.path(hashes[0]), "r+b") as f:
        f.write(b"junk")  # damaged: still named as a block
    for i, h in enumerate(hashes):
        os.utime(store.path(h), ns=(100 + i, 100 + i))  # hashes[4] the most recently used
    for name in (".tmp-1-2-" + "ab" * 16, "notes.kvb", "ABCD.kvb", "abc.kvb", "ab" * 16):
        (tmp_path / name).write_bytes(b"x")
    assert sorted(store.stored_hashes(100)) == sorted(hashes)
    assert store.stored_hashes(2) == [hashes[4], hashes[3]]
    assert store.read(hashes[0], tokens, np.empty(payload, dtype=np.uint8)) is ReadResult.CORRUPT
    with pytest.raises(ValueError, match="limit must be at least 1, got 0"):
        store.stored_hashes(0)
    cache = torch.zeros(2, payload // 4)
    tier = KVTier(cache, str(tmp_path), 1 << 20)  # and the tier adds a block not written yet
    release, write = threading.Event(), tier.store.write
    tier.store.write = lambda *args: (release.wait(), write(*args))[1]  # a disk that hangs
    fresh = bytes([9]) * 16
    tier.offload(0, fresh, tokens)
    assert sorted(tier.stored_hashes()) == sorted([fresh, *hashes[1:]])
    release.set()
    tier.close()
