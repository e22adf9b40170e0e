"""The KV cache's size: exactly as set, or what ``gpu_memory_utilization`` leaves of the device
after the weights and a profiled step (pdserve/engine/memory.py). Devices here are stand-ins of
given numbers or a fake /proc: no test allocates gigabytes."""

import logging

import pytest
import torch

from pdserve.engine.config import DEFAULT_KV_CACHE_BYTES, CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.errors import KVMemoryError
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.memory import FixedMemory, HostMemory, check_free_at_start, kv_budget_for_share
from pdserve.engine.profile_step import profile_sequences

GIB = 1 << 30


def test_two_workers_at_045_share_one_device_and_a_third_is_refused_naming_the_numbers():
    """Each worker asks for its share of the device's total, checked against what is free when
    it starts, and its KV gets that share less its own use (not the other worker's)."""
    total, used = 80 * GIB, 6 * GIB  # an 80 GiB device; each worker's weights and largest step
    free = total
    budgets = []
    for _ in range(2):
        check_free_at_start(0.45, total, free, "cuda:0")
        budgets.append(kv_budget_for_share(0.45, total, used, "cuda:0"))
        free -= used + budgets[-1]  # what this worker now holds
    assert budgets == [int(0.45 * total) - used] * 2
    assert free == total - 2 * int(0.45 * total)  # 10% of the device is left
    with pytest.raises(KVMemoryError) as exc:
        check_free_at_start(0.45, total, free, "cuda:0")
    assert exc.value.setting == "gpu_memory_utilization"
    assert str(exc.value) == ("gpu_memory_utilization: 0.45 of cuda:0's 80.00 GiB asks for 36.00 GiB, but only "
                              "8.00 GiB is free at start (other processes hold the rest); lower "
                              "--gpu-memory-utilization or free the device")


def test_a_share_the_weights_and_step_already_fill_is_refused():
    with pytest.raises(KVMemoryError, match=r"^gpu_memory_utilization: 0.1 of host RAM's 24.00 GiB is 2.40 GiB, "
                                            r"and this worker already uses 3.00 GiB .* nothing is left"):
        kv_budget_for_share(0.1, 24 * GIB, 3 * GIB, "host RAM")
    assert kv_budget_for_share(1.0, 24 * GIB, 3 * GIB, "host RAM") == 21 * GIB


def test_the_profile_step_splits_the_token_budget_at_the_context_length():
    assert profile_sequences(2048, 8192) == [2048]
    assert profile_sequences(2048, 512) == [512] * 4
    assert profile_sequences(100, 64) == [64, 36]


def test_host_ram_is_read_from_proc(tmp_path):
    (tmp_path / "self").mkdir()
    (tmp_path / "meminfo").write_text("MemTotal:       24576000 kB\nMemFree:  100 kB\nMemAvailable:   12288000 kB\n")
    (tmp_path / "self" / "status").write_text("Name:\tpython\nVmHWM:\t  300000 kB\nVmRSS:\t  200000 kB\n")
    ram = HostMemory(tmp_path)
    assert (ram.total_bytes(), ram.free_bytes(), ram.used_bytes()) == (24576000 * 1024, 12288000 * 1024,
                                                                        300000 * 1024)
    ram.start_peak()  # the fake has nowhere to reset the peak: the peak stays, a larger use
    assert ram.used_bytes() == 300000 * 1024
    (tmp_path / "meminfo").write_text("MemTotal: 1 kB\n")
    with pytest.raises(KVMemoryError, match="gpu_memory_utilization: .*meminfo has no MemAvailable; size the KV "
                                            "cache exactly with --kv-cache-memory"):
        ram.free_bytes()
    real = HostMemory()  # this host: sane, whatever it is
    assert real.total_bytes() >= real.free_bytes() > 0 and real.used_bytes() > 0


def test_an_exact_size_wins_and_none_is_the_default():
    assert CacheConfig().exact_budget_bytes() == DEFAULT_KV_CACHE_BYTES
    assert CacheConfig(gpu_memory_utilization=0.5).exact_budget_bytes() is None
    assert CacheConfig(memory_budget_bytes=5 << 20, gpu_memory_utilization=0.5).exact_budget_bytes() == 5 << 20
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\], got 1.5"):
        CacheConfig(gpu_memory_utilization=1.5)


def _engine(model_dir, share: float, memory) -> LLMEngine:
    config = EngineConfig(model=str(model_dir), dtype="float32", cache=CacheConfig(gpu_memory_utilization=share),
                          scheduler=SchedulerConfig(max_num_batched_tokens=64))
    return LLMEngine.from_config(config, progress=False, detokenize=False, memory=memory)


def test_the_cache_of_a_started_engine_follows_its_share(tiny_llama_dir, caplog):
    """A real engine start on a 64 MiB stand-in device: at 0.4 its cache holds what 0.4 x 64 MiB
    leaves after its use, at 0.2 what 0.2 leaves; the profile step ran once each; the log line
    says how many tokens that is."""
    directory, _ = tiny_llama_dir
    used = 4 << 20
    engines = {}
    with caplog.at_level(logging.INFO, logger="pdserve.engine.llm_engine"):
        for share in (0.2, 0.4):
            device = FixedMemory(total=64 << 20, free=64 << 20, used=used)
            engines[share] = _engine(directory, share, device)
            assert device.profiles == 1
    for share, engine in engines.items():
        scratch = 4 * engine.cache_spec.block_bytes  # the profile step's 64 tokens wrote there, counted in "used"
        budget = int(share * (64 << 20)) - (used - scratch)
        assert engine.blocks.num_blocks == budget // engine.cache_spec.block_bytes == engine.cache_size.num_blocks
        assert engine.kv_cache.shape[0] == engine.blocks.num_blocks
    assert engines[0.4].blocks.num_blocks > 2 * engines[0.2].blocks.num_blocks
    n = engines[0.4].blocks.num_blocks
    assert any(r.getMessage().startswith(f"KV cache: {n} blocks x 16 tokens = {16 * n} tokens (") and
               "gpu_memory_utilization 0.4 of stand-in device's 64.0 MiB" in r.getMessage() for r in caplog.records)


def test_a_start_on_a_device_too_full_for_the_share_loads_nothing(tiny_llama_dir):
    device = FixedMemory(total=64 << 20, free=16 << 20, used=0)
    with pytest.raises(KVMemoryError, match="0.4 of stand-in device's 64.0 MiB asks for 25.6 MiB, but only 16.0 MiB"):
        _engine(tiny_llama_dir[0], 0.4, device)
    assert device.profiles == 0  # refused before the weights load and the profile step


def test_ranks_on_devices_of_their_own_take_the_least_any_rank_leaves(monkeypatch):
    """CUDA, a GPU per rank (stand-in numbers): F is each rank's share of its own device; the
    block count is the least any rank's share leaves after its own use, the same on every rank."""
    from pdserve.engine.distributed.memory_share import RankUse, agree_blocks, shares_memory

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert not shares_memory(torch.device("cuda"), 2) and shares_memory(torch.device("cuda"), 4)
    assert shares_memory(torch.device("cpu"), 2)
    block = 2 << 20  # an 8B model's block on one of 2 ranks
    uses = [RankUse(used=10 * GIB, total=80 * GIB), RankUse(used=11 * GIB, total=80 * GIB)]  # rank 1 holds more
    blocks, source = agree_blocks(uses, 0.45, False, block, "cuda:0")
    assert blocks == (int(0.45 * 80 * GIB) - 11 * GIB) // block
    assert source == ("gpu_memory_utilization 0.45 of each rank's cuda:0, the least left on rank 1: 80.00 GiB, "
                      "11.00 GiB used by its weights and the profile step")
    with pytest.raises(KVMemoryError, match=r"^gpu_memory_utilization: 0.1 of rank 0's cuda:0's 80.00 GiB is "
                                            r"8.00 GiB, and this worker already uses 10.00 GiB"):
        agree_blocks(uses, 0.1, False, block, "cuda:0")


def test_ranks_sharing_one_memory_split_what_their_share_leaves_after_all_their_uses():
    """A CPU host (or ranks sharing a GPU): F is the worker's share of the one memory, for every
    rank's use together; each rank's cache holds an N-th of what is left."""
    from pdserve.engine.distributed.memory_share import RankUse, agree_blocks

    uses = [RankUse(used=3 * GIB, total=24 * GIB), RankUse(used=1 * GIB, total=24 * GIB)]
    blocks, source = agree_blocks(uses, 0.5, True, 1 << 20, "host RAM")
    assert blocks == (12 * GIB - 4 * GIB) // 2 // (1 << 20) == 4096
    assert source == ("gpu_memory_utilization 0.5 of host RAM's 24.00 GiB for 2 ranks together, 4.00 GiB used by "
                      "their weights and the profile step")
    with pytest.raises(KVMemoryError, match="holds no 1048576-byte KV block"):
        agree_blocks([RankUse(GIB, 2 * GIB), RankUse(GIB - 1000, 2 * GIB)], 1.0, True, 1 << 20, "host RAM")


def test_a_tensor_parallel_worker_on_cpu_measures_its_share_on_every_rank(tiny_llama_dir, caplog):
    """TP 2 over gloo on this host: every rank loads its share and runs the profile step, the
    KV is what 0.x of host RAM leaves after both ranks' peaks, split between them (rank 0's use
    a stand-in here, its follower's the real peak of its process), mapped by both; its tokens
    are transformers'."""
    from tests.factories import hf_greedy, random_prompts
    from pdserve.engine.sampling.params import SamplingParams

    total = HostMemory().total_bytes()
    rank0_used = 64 << 20
    share = (rank0_used + (512 << 20)) / total  # room for the follower's process (276 MiB here) and some cache
    config = EngineConfig(model=str(tiny_llama_dir[0]), dtype="float32", tensor_parallel_size=2,
                          cache=CacheConfig(gpu_memory_utilization=share),
                          scheduler=SchedulerConfig(max_num_batched_tokens=64))
    with caplog.at_level(logging.INFO, logger="pdserve.engine.llm_engine"):
        engine = LLMEngine.from_config(config, progress=False, detokenize=False,
                                       memory=FixedMemory(total=total, free=total, used=rank0_used))
    try:
        n, block = engine.cache_size.num_blocks, engine.cache_spec.block_bytes
        assert engine.blocks.num_blocks == n and [c.shape[0] for c in engine.rank_caches] == [n, n]
        follower_used = int(share * total) - rank0_used - 2 * n * block  # what the split leaves unexplained
        assert 32 << 20 < follower_used < 512 << 20  # a process with torch and its share of the model: real
        assert "for 2 ranks together" in engine.cache_size.source
        assert any(r.getMessage().startswith(f"KV cache: {n} blocks x 16 tokens") for r in caplog.records)
        prompts = random_prompts(2, [5, 30], vocab=tiny_llama_dir[1].config.vocab_size, seed=7)
        outs = engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        assert [o.token_ids for o in outs] == [hf_greedy(tiny_llama_dir[1], p, 6) for p in prompts]
    finally:
        engine.close()


def test_the_profile_step_measures_a_real_peak_on_this_host(tiny_llama_dir):
    """On host RAM the use is this process's peak resident set over the profile step (its
    weights, libraries and activations): a stand-in total 64 MiB above what this process holds
    now leaves the cache at most about that, however much this process holds."""
    from pathlib import Path

    from pdserve.engine.memory import _kib_field

    class SmallHost(HostMemory):
        def __init__(self):
            super().__init__()
            self.total = _kib_field(Path("/proc/self/status"), "VmRSS") + (64 << 20)

        def total_bytes(self):
            return self.total

        def free_bytes(self):
            return self.total

    engine = _engine(tiny_llama_dir[0], 1.0, SmallHost())
    kv = engine.blocks.num_blocks * engine.cache_spec.block_bytes
    assert 0 < kv <= 72 << 20  # the slack: pages this process may give back between the two readings
