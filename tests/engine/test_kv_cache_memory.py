"""The CPU KV cache's memory: zeroed and contiguous, on transparent huge pages where Linux
offers them (NIXL's kernel-side copy walks far fewer pages), and alive as long as any view
of it is."""

import gc
import re
from pathlib import Path

import pytest
import torch

from pdserve.engine.attention.kv_cache import HUGE_PAGE_BYTES, KVCacheSpec, layer_views

SPEC = KVCacheSpec(num_layers=4, block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.float32)  # 64 KiB/block
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The bracketed choice in THP's ``enabled`` knob ("always", "madvise", "never"), if any."""
    try:
        return re.search(r"\[(\w+)\]", THP.read_text()).group(1)
    except (OSError, AttributeError):
        return None


def huge_kib(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        span = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            inside = int(span.group(1), 16) <= address < int(span.group(2), 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_the_cache_is_zeroed_contiguous_and_its_views_keep_it_alive():
    cache = SPEC.allocate(64, torch.device("cpu"))
    assert cache.shape == (64, 4, 2, 16, 2, 64) and cache.dtype == torch.float32
    assert cache.is_contiguous() and not cache.any()
    k, _ = layer_views(cache, 1)
    del cache
    gc.collect()
    k.fill_(1.0)  # the mapping is still there: writing to it neither faults nor corrupts
    assert k.sum().item() == k.numel()


@pytest.mark.skipif(thp_mode() not in ("always", "madvise"),
                    reason="transparent huge pages are off or absent on this host")
def test_on_linux_the_cache_sits_on_huge_pages():
    cache = SPEC.allocate(256, torch.device("cpu"))  # 16 MiB
    assert cache.data_ptr() % HUGE_PAGE_BYTES == 0
    assert huge_kib(cache.data_ptr()) >= 4 * HUGE_PAGE_BYTES // 1024  # most of it; the kernel may fall short
