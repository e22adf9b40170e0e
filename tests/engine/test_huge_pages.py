"""A CPU model's weights on transparent huge pages (pdserve/engine/huge_pages.py): the loader
moves them there once they are packed, and nothing about them changes but the pages."""

import re

import pytest
import torch

from pdserve.engine import huge_pages
from pdserve.engine.config import EngineConfig
from pdserve.engine.loader import load_model


def _thp_mode() -> str:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return "absent"
    return re.search(r"\[(\w+)\]", text).group(1)


def _huge_bytes_of(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds ``address``."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            inside = int(head.group(1), 16) <= address < int(head.group(2), 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) << 10
    return 0


needs_thp = pytest.mark.skipif(_thp_mode() not in ("always", "madvise"),
                               reason=f"transparent huge pages are {_thp_mode()} on this kernel")


@needs_thp
def test_collapsed_weights_keep_every_bit_and_sit_on_huge_pages():
    weights = [torch.randn(1536, 576).to(torch.bfloat16) for _ in range(40)]  # 1.7 MB each, as a layer's
    before = [w.clone() for w in weights]
    moved = huge_pages.collapse(weights)
    if moved == 0:
        pytest.skip("this kernel refused MADV_COLLAPSE (Linux 6.1+ collapses at once)")
    assert moved >= 32 << 20  # 70 MB of weights: most of their extents
    assert all(torch.equal(w, b) for w, b in zip(weights, before))
    assert _huge_bytes_of(weights[20].data_ptr()) > 0


def test_nothing_to_collapse_is_no_error():
    assert huge_pages.collapse([]) == 0
    assert huge_pages.collapse([torch.empty(0)]) == 0
    assert huge_pages.collapse([torch.ones(8)]) == 0  # far below a huge page: left alone


@needs_thp
def test_the_loader_puts_a_packed_models_weights_on_huge_pages(monkeypatch):
    monkeypatch.setenv(huge_pages.ENV, "1")  # the suite turns it off for its clusters (tests/conftest.py)
    net, _, _ = load_model(EngineConfig().model, torch.bfloat16, torch.device("cpu"), progress=False, huge_pages=True)
    packed = [b for name, b in net.named_buffers() if name.endswith("packed")]
    assert len(packed) > 100  # every layer's projections, and the LM head
    on_huge = [w for w in packed if _huge_bytes_of(w.data_ptr()) > 0]
    assert len(on_huge) >= 0.9 * len(packed)
