"""A CPU model's weights moved onto transparent huge pages (2 MiB) once they are packed.

Why: a decode step streams every weight once (269 MB for the default model in bfloat16),
and a prefill step as many times as it has row tiles. On 4 KiB pages that is a page walk
every 64 cache lines, more than the second-level TLB covers many times over. Measured on
this project's machine (an AMD EPYC, Zen 4, BENCHMARKS.md): the whole model's linears, one
thread, ran 9-14% faster on huge pages at every row count from 1 to 512, and a large read
went from 27.6 to 34.0 GB/s.

Only an engine that decodes asks (``load_model(huge_pages=True)``: a decode or colocated
worker's, whose scheduler runs mixed steps, and a draft model's). A prefill worker's does not:
its steps reuse each weight across row tiles, so the TLB costs it little (a 512-token prefill
1.02x the rate on huge pages), and with the decode core's helper borrowed for it a 256-token
prefill took 186 ms on huge pages against 164 ms on 4 KiB ones (`benchmarks/borrow_prefill.py`,
the cause not found).

How: the weights are ordinary torch tensors, already written, in the allocator's anonymous
private mappings, which this system backs with huge pages only where asked (THP ``madvise``
mode). For each mapping that holds a weight, the span from its first weight to its last is
collapsed into huge pages now (``MADV_COLLAPSE``, Linux 6.1+): the kernel copies each 2 MiB
extent into a huge page. The mapping is not marked for huge pages (``MADV_HUGEPAGE``): later
allocations there keep 4 KiB pages. Contents do not change, so no result does. Other
allocations inside a span come along, and the memory used grows by the pages of the span no
one had touched yet (none measurable for the default model: 609 MB resident either way).
Where the advice is refused (an older kernel, THP off, not Linux) nothing happens beyond a debug
line. The KV cache asks for huge pages itself, before its first touch
(``pdserve.engine.attention.kv_cache.host_zeros``).

What it costs: the kernel copies every extent, about 3.5 ms a huge page on this project's VMs
(1.9 s for the default model's 540 MB of float32 weights, up to 7 s with two workers starting
on two cores), paid by every decode worker's start. ``PDSERVE_HUGE_PAGES=0`` skips it: the test
suite sets it (tests/conftest.py), since contents never change and no served test measures speed;
tests/engine/test_huge_pages.py turns it back on to check the move itself.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
from typing import Iterable

import torch

log = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
MADV_COLLAPSE = 25  # Linux's <asm-generic/mman-common.h>
MIN_SPAN_BYTES = 4 * HUGE_PAGE_BYTES  # smaller spans are not worth a system call


ENV = "PDSERVE_HUGE_PAGES"  # "0": the loader leaves weights where they are


def wanted() -> bool:
    """Whether the loader moves a decoding model's weights onto huge pages (``ENV`` not "0")."""
    return os.environ.get(ENV, "1") != "0"


def collapse(tensors: Iterable[torch.Tensor]) -> int:
    """Back the memory of ``tensors`` (CPU ones; others are skipped) with huge pages, as the
    module docstring says. Returns the bytes collapsed (0 where nothing could be)."""
    if not sys.platform.startswith("linux"):
        return 0
    ranges = sorted({(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
                     for t in tensors if t.device.type == "cpu" and t.untyped_storage().nbytes() > 0})
    if not ranges:
        return 0
    spans: dict[tuple[int, int], list[int]] = {}  # mapping -> [first byte, last byte] of weights in it
    mappings = _anonymous_mappings()
    for start, nbytes in ranges:
        mapping = next(((a, b) for a, b in mappings if a <= start < b), None)
        if mapping is not None:
            span = spans.setdefault(mapping, [start, start + nbytes])
            span[0], span[1] = min(span[0], start), max(span[1], min(start + nbytes, mapping[1]))
    libc = _libc()
    done = 0
    for (a, b), (lo, hi) in spans.items():  # whole extents, inside the mapping, covering the weights
        lo = max(lo // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES, -(-a // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES)
        hi = min(-(-hi // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES, b // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES)
        if hi - lo < MIN_SPAN_BYTES:
            continue
        if libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_COLLAPSE) != 0:
            log.debug("huge pages refused for %d MiB of weights (errno %d)", (hi - lo) >> 20, ctypes.get_errno())
            continue
        done += hi - lo
    return done


def _anonymous_mappings() -> list[tuple[int, int]]:
    """This process's private anonymous writable mappings (the allocator's), as (start, end)."""
    out = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 5 and fields[1].startswith("rw") and fields[1][3] == "p" and fields[4] == "0" and \
                    (len(fields) == 5 or fields[5] == "[heap]"):
                a, b = (int(v, 16) for v in fields[0].split("-"))
                out.append((a, b))
    return out


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc
