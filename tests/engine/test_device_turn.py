"""Workers that share a device start one at a time (pdserve/engine/device_turn.py): the second
measures the device as the first left it. Two engines start at once here on a stand-in device
whose free memory is what neither holds; the lock directory is the test's own."""

import logging
import threading
from types import SimpleNamespace

import pytest
import torch

from pdserve.engine import device_turn
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.errors import KVMemoryError
from pdserve.engine.llm_engine import LLMEngine

MIB = 1 << 20


class SharedDevice:
    """One device of ``total`` bytes for two workers: once a worker's profile step is read, it
    holds its whole share, and that much is no longer free for the other. A reading of the free
    memory waits (up to a second) for the other worker's: started together, with nothing to make
    one wait for the other, both read the device empty."""

    def __init__(self, total: int):
        self.total, self.held = total, {}
        self.together = threading.Barrier(2, timeout=1.0)

    def probe(self, share: float) -> "Probe":
        return Probe(self, share)


class Probe:
    name = "stand-in device"

    def __init__(self, device: SharedDevice, share: float):
        self.device, self.share = device, share

    def total_bytes(self) -> int:
        return self.device.total

    def free_bytes(self) -> int:
        try:
            self.device.together.wait()
        except threading.BrokenBarrierError:  # the other worker was not reading at the same time
            pass
        return self.device.total - sum(self.device.held.values())

    def start_peak(self) -> None:
        pass

    def used_bytes(self) -> int:
        self.device.held[id(self)] = int(self.share * self.device.total)  # its weights, step and KV to come
        return 4 * MIB


def start_two(model_dir, share: float, device: SharedDevice) -> list:
    """Two engines at ``share`` of ``device``, started at once: each one's engine or error."""
    results = [None, None]

    def start(i: int) -> None:
        config = EngineConfig(model=str(model_dir), dtype="float32", cache=CacheConfig(gpu_memory_utilization=share),
                              scheduler=SchedulerConfig(max_num_batched_tokens=64))
        try:
            results[i] = LLMEngine.from_config(config, progress=False, detokenize=False, memory=device.probe(share))
        except KVMemoryError as exc:
            results[i] = exc

    threads = [threading.Thread(target=start, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


@pytest.fixture
def lock_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(device_turn, "LOCK_DIR", tmp_path)
    return tmp_path


def test_two_workers_started_together_at_045_both_start(tiny_llama_dir, lock_dir, caplog):
    with caplog.at_level(logging.INFO, logger="pdserve.engine.device_turn"):
        engines = start_two(tiny_llama_dir[0], 0.45, SharedDevice(64 * MIB))
    assert all(isinstance(e, LLMEngine) for e in engines), engines
    assert engines[0].blocks.num_blocks == engines[1].blocks.num_blocks  # each measured its own use
    assert any(r.getMessage().startswith("waiting for another worker's start on host-ram") for r in caplog.records)
    assert (lock_dir / "host-ram.lock").exists()


def test_two_workers_started_together_whose_shares_overlap_leave_one_refused(tiny_llama_dir, lock_dir):
    """0.6 twice is more than the device: the second to start finds only what the first left."""
    results = start_two(tiny_llama_dir[0], 0.6, SharedDevice(64 * MIB))
    refused = [r for r in results if isinstance(r, KVMemoryError)]
    assert len(refused) == 1 and sum(isinstance(r, LLMEngine) for r in results) == 1, results
    assert "0.6 of stand-in device's 64.0 MiB asks for 38.4 MiB, but only 25.6 MiB is free at start" in str(refused[0])


def test_each_cuda_device_is_named_by_its_uuid_and_taken_in_order(monkeypatch):
    """A tensor-parallel worker takes every rank's device (rank 0's, then rank r on device r),
    sorted, so that two workers never wait on each other; a CPU worker of an exact size takes none."""
    uuids = {0: "bbbb", 1: "aaaa", 2: "cccc"}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=uuids[i]))
    keys = device_turn.turn_keys
    assert keys(torch.device("cuda", 2), 1, measured=False) == ("cuda-cccc",)
    assert keys(torch.device("cuda"), 2, measured=True) == ("cuda-aaaa", "cuda-bbbb")
    assert keys(torch.device("cuda", 2), 2, measured=True) == ("cuda-aaaa", "cuda-cccc")
    assert keys(torch.device("cpu"), 2, measured=True) == ("host-ram",)
    assert keys(torch.device("cpu"), 1, measured=False) == ()
