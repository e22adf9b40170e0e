"""``--gpu-memory-utilization`` on a real CUDA device (pdserve/engine/memory.py): an engine at a
share keeps the process's memory within it, and a second process at the same share started at
the same time starts too, with about the same cache (each measures its own use, in turn). CUDA only: on the CPU
dry-run a share of host RAM would be gigabytes (tests/engine/test_kv_sizing.py checks the CPU
path on stand-ins). Never run on a GPU where it was written."""

import json
import subprocess
import sys

import pytest
import torch

from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.cuda

SHARE = 0.3
SLACK = 512 << 20  # CUDA graphs' pool, captured after the cache and outside the profile

CHILD = """
import json, sys
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.llm_engine import LLMEngine
e = LLMEngine.from_config(EngineConfig(model=sys.argv[1], dtype="bfloat16", device="cuda",
                                       cache=CacheConfig(gpu_memory_utilization=float(sys.argv[2]))),
                          progress=False, detokenize=False)
print(json.dumps({"blocks": e.blocks.num_blocks}))
"""


def test_two_processes_at_a_share_each_start_within_it(smol_dir, device):
    if device.type != "cuda":
        pytest.skip("a share of host RAM is gigabytes: the CPU path is checked on stand-ins")
    total = torch.cuda.mem_get_info(device)[1]
    # Both start at once: each takes the device's turn (pdserve/engine/device_turn.py) to measure.
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(smol_dir), str(SHARE)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    engine = LLMEngine.from_config(EngineConfig(model=str(smol_dir), dtype="bfloat16", device="cuda",
                                                cache=CacheConfig(gpu_memory_utilization=SHARE)),
                                   progress=False, detokenize=False)
    kv = engine.kv_cache.numel() * engine.kv_cache.element_size()
    assert kv > (SHARE * total) / 2  # a 135M model and one step leave most of the share to the cache
    assert torch.cuda.memory_reserved(device) <= SHARE * total + SLACK
    stdout, stderr = child.communicate(timeout=300)
    assert child.returncode == 0, stderr[-2000:]
    other = json.loads(stdout.strip().splitlines()[-1])["blocks"]
    assert abs(other - engine.blocks.num_blocks) <= 0.05 * engine.blocks.num_blocks
    print(f"\nKV at {SHARE} of {total / 2**30:.1f} GiB: {engine.cache_size.line()}; the second process: {other} blocks")
