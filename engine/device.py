"""What the engine's host side must know about its device beyond the kernels it queues.

On CUDA a kernel returns before it has run: a step's KV writes are complete only once the
stream that queued them has drained. Whoever hands that KV to another process (a streamed
prompt's chunks, read by a decode worker over NIXL while the prompt still computes) waits
for them here first. On the CPU every op has finished when it returns, and these are no-ops.
"""

from __future__ import annotations

import torch


def wait_for_writes(device: torch.device) -> None:
    """Block until everything this thread queued on ``device``'s current stream has run (the
    engine thread runs every step on that stream); nothing to wait for off CUDA."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
