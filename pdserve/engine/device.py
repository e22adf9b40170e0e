"""What the engine's host side must know about its device beyond the kernels it queues.

On CUDA a kernel returns before it has run: a step's KV writes are complete only once the
stream that queued them has drained. Whoever hands that KV to another process (a streamed
prompt's chunks, read by a decode worker over NIXL while the prompt still computes) waits
for them here first (``wait_for_writes``). And every blocking copy is a host sync: a step's
inputs go up in copies that nothing waits for (``to_device``), and its results come back in
one copy (``to_host``), the one host sync a decode step makes. Nothing else in a step reads
a device tensor's values on the host (``tolist``, ``item``, ``bool``, indexing with a Python
list, ``torch.tensor(..., device=...)``): each would be a sync of its own. On the CPU every
op has finished when it returns, and these are no-ops.
"""

from __future__ import annotations

from typing import Sequence

import torch


def wait_for_writes(device: torch.device) -> None:
    """Block until everything this thread queued on ``device``'s current stream has run (the
    engine thread runs every step on that stream); nothing to wait for off CUDA."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


# Every tensor in a staged copy starts at a multiple of this many bytes: each can be viewed as
# its own dtype (int64 and float64 need 8), and every one is 16-byte aligned on the device,
# whatever the step's mix. Triton compiles a kernel once per pattern of its pointers' 16-byte
# alignment, so with 8 a served H200 decode worker met new patterns mid-run and stalled
# about 1 s a compile (BENCHMARKS.md, GPU run 8).
_ALIGN = 16


def to_device(tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host tensors -> the same tensors on ``device``, in one copy that the host does not
    wait for (the step's inputs: a blocking copy each would be a host sync each).

    On CUDA they are packed, byte for byte, into one pinned staging buffer (torch's caching
    host allocator keeps a buffer until the copy that reads it has run), copied
    ``non_blocking``, and viewed back as their dtypes and shapes. On the CPU they are
    returned as they are: no copy at all."""
    if device.type == "cpu":
        return list(tensors)
    staging, layout = pack(tensors, pin=device.type == "cuda")
    return unpack(staging.to(device, non_blocking=True), layout)


def pack(tensors: Sequence[torch.Tensor], pin: bool = False) -> tuple[torch.Tensor, list]:
    """One uint8 host buffer holding every tensor's bytes (each at an aligned offset), and
    the layout ``unpack`` reads them back with."""
    layout, offset = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        layout.append((offset, nbytes, t.dtype, tuple(t.shape)))
        offset += -(-nbytes // _ALIGN) * _ALIGN
    staging = torch.empty(offset, dtype=torch.uint8, pin_memory=pin)
    for t, (start, nbytes, _, _) in zip(tensors, layout):
        if nbytes:
            staging[start:start + nbytes] = t.contiguous().view(-1).view(torch.uint8)
    return staging, layout


def unpack(buffer: torch.Tensor, layout: list) -> list[torch.Tensor]:
    """``pack``'s tensors, as views into ``buffer`` (wherever it now lives)."""
    return [buffer[start:start + nbytes].view(dtype).view(shape) if nbytes
            else torch.empty(shape, dtype=dtype, device=buffer.device)
            for start, nbytes, dtype, shape in layout]


def to_host(tensors: Sequence[torch.Tensor], pack: bool | None = None) -> list[torch.Tensor]:
    """Device tensors -> the same values on the host, in one copy: a step's one host sync.

    ``pack`` (None: off the CPU) joins their bytes on the device first (one kernel), so the
    copy and the wait happen once whatever their number; each comes back as a view of the
    one host buffer, in its dtype and shape. Tensors go in by falling element size, so every
    one starts aligned for its dtype. On the CPU (``pack`` False) they are returned as
    they are."""
    if pack is None:
        pack = bool(tensors) and tensors[0].device.type != "cpu"
    if not pack:
        return list(tensors)
    order = sorted(range(len(tensors)), key=lambda i: -tensors[i].element_size())
    layout, pieces, offset = [None] * len(tensors), [], 0
    for i in order:
        t = tensors[i]
        nbytes = t.numel() * t.element_size()
        layout[i] = (offset, nbytes, t.dtype, tuple(t.shape))
        pieces.append(t.contiguous().view(-1).view(torch.uint8))
        offset += nbytes
    return unpack(torch.cat(pieces).cpu(), layout)
